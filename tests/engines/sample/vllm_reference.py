"""vLLM's greedy decoding with ``min_tokens`` restated on a Hugging Face model (plain torch, no
polynya): the oracle of the native sampler's and the servers' ``min_tokens`` tests."""
from __future__ import annotations

import torch


def masked_greedy(model, prompt: list[int], max_tokens: int, stop: set[int], min_tokens: int):
    """Greedy tokens with the stop ids at -inf for the first ``min_tokens`` tokens (vLLM's
    min-tokens logits processor), and each token's log-prob under the distribution it was
    taken from (vLLM's ``processed_logprobs``, what polynya's sampler returns)."""
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for step in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if step < min_tokens:
                logits[list(stop)] = float("-inf")
            lp = logits.log_softmax(-1)
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(float(lp[tok]))
            ids.append(tok)
            if tok in stop:
                break
    return out, lps
