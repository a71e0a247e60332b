"""``python -m polynya.demo``: ZoRRo vs naive log-probs and gradients on a tiny random model.

A quick end-to-end check that needs nothing but the CPU: builds a GRPO-shaped batch (groups of
responses behind shared prompts, a shared system prompt), runs ``compute_logprobs`` both ways,
and prints the largest differences and the tokens ZoRRo saved.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from . import RolloutBatch, compute_logprobs
from .models import load_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:qwen3")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    model = load_model(args.model, seed=args.seed)
    vocab = model.config.vocab_size
    system = [rng.randrange(2, vocab) for _ in range(32)]
    prompts, responses = [], []
    for _ in range(args.groups):
        prompt = system + [rng.randrange(2, vocab) for _ in range(args.prompt_len - len(system))]
        for _ in range(args.group_size):
            prompts.append(prompt)
            responses.append([rng.randrange(2, vocab) for _ in range(rng.randint(1, args.response_len))])
    batch = RolloutBatch(prompts, responses)

    results = {}
    for zorro in (False, True):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        stats = compute_logprobs(model, batch, zorro=zorro, entropy=True)
        (stats.logprobs.sum() + stats.entropy[stats.mask].sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[zorro] = (stats, grads, time.perf_counter() - t0)
    (n, gn, tn), (z, gz, tz) = results[False], results[True]
    from .zorro import pack_rows

    dedup = pack_rows(batch).num_real_tokens
    print(f"model {args.model}: {len(batch)} samples, {batch.num_tokens()} tokens naive -> "
          f"{dedup} with ZoRRo ({batch.num_tokens() / dedup:.2f}x fewer)")
    print(f"max |logprob diff| {(z.logprobs - n.logprobs).abs().max().item():.2e}   "
          f"max |entropy diff| {(z.entropy - n.entropy).abs().max().item():.2e}   "
          f"grad rel diff {((gz - gn).norm() / gn.norm()).item():.2e}")
    print(f"forward+backward: naive {tn * 1e3:.0f} ms, ZoRRo {tz * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
