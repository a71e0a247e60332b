"""Hand-built verl actor batches, made the way verl's trainer makes them: a padded ``DataProto``
(left-padded prompts, right-padded responses) -> ``to_tensordict`` -> ``left_right_2_no_padding``."""
from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

VOCAB = 512
PAD = 0


def samples(seed: int, per_group: int = 3):
    """Two prompt groups sharing a system prompt and a third without it, ragged responses
    (lengths 2..9)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, VOCAB, (6,), generator=g).tolist()
    prompts, responses, uids = [], [], []
    for k, n_q in enumerate((4, 7, 5)):
        prompt = (system if k < 2 else []) + torch.randint(2, VOCAB, (n_q,), generator=g).tolist()
        for _ in range(per_group):
            n = int(torch.randint(2, 10, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, VOCAB, (n,), generator=g).tolist())
            uids.append(f"prompt-{k}")
    return prompts, responses, uids


def verl_batch(prompts, responses, uids, *, old_log_probs, advantages, temperature: float,
               response_mask=None, **meta) -> TensorDict:
    b = len(prompts)
    p_max, r_max = max(map(len, prompts)), max(map(len, responses))
    prompt_t = torch.full((b, p_max), PAD)
    resp_t = torch.full((b, r_max), PAD)
    attn = torch.zeros(b, p_max + r_max, dtype=torch.long)
    mask = torch.zeros(b, r_max, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_t[i, p_max - len(p):] = torch.tensor(p)
        resp_t[i, :len(r)] = torch.tensor(r)
        attn[i, p_max - len(p):p_max + len(r)] = 1
        mask[i, :len(r)] = 1
    if response_mask is not None:
        mask = response_mask
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    proto = DataProto.from_dict(
        tensors={"prompts": prompt_t, "responses": resp_t, "input_ids": torch.cat([prompt_t, resp_t], 1),
                 "attention_mask": attn, "position_ids": position_ids, "response_mask": mask,
                 "old_log_probs": old_log_probs, "advantages": advantages},
        non_tensors={"uid": np.array(uids, dtype=object)},
        meta_info={"temperature": temperature},
    )
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=b, use_dynamic_bsz=True, **meta)
    return td
