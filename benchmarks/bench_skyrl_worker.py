"""The SkyRL policy worker's step (``polynya.adapters.skyrl.PolicyWorker``: SkyRL's
``TrainingInputBatch`` layout -> DeepSpeed ``TrainingEngine``) with ZoRRo on vs off.

Random-init Qwen3-0.6B shape, bf16, ZeRO-2, gradient checkpointing, SkyRL's default algorithm
(clipped PPO, ``token_mean`` pre-scaled advantages, k3 KL loss 0.001). For each P/R/G shape the
batch is laid out as SkyRL's trainer hands it to its workers (left-padded ``sequences``,
right-aligned masks / advantages / log-probs, as
``skyrl.train.dataset.preprocess.convert_prompts_responses_to_batch_tensors`` builds them) and
one step = ``forward_backward`` + ``optim_step``; the batch translation alone is timed too.
SkyRL itself is not imported (its ``TrainingInputBatch`` is a dict of these tensors), so the
script needs only polynya and DeepSpeed (``../shared/gpu/carry-wheels.sh`` on the GPU machine).

    python benchmarks/bench_skyrl_worker.py --out benchmarks/results
    python benchmarks/bench_skyrl_worker.py --smoke    # CPU: tiny model, small shapes, no numbers
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_zorro import make_batch
from common import environment, markdown_table, paired_bars, save, wall_median_ms
from polynya.logprobs import naive_layout_for
from polynya.model_features import attention_features
from polynya.adapters.skyrl import (
    PolicyWorker,
    rollout_from_training_batch,
    train_config_from_skyrl,
)

SHAPES = [(4096, 512, 8), (256, 512, 8)]
ALGO = {"policy_loss_type": "regular", "eps_clip_low": 0.2, "eps_clip_high": 0.2,
        "use_kl_loss": True, "kl_loss_coef": 0.001, "kl_estimator_type": "k3", "temperature": 1.0}
PAD = 0


def skyrl_layout(P: int, R: int, G: int, groups: int, vocab: int, seed: int) -> dict:
    """SkyRL's training-input tensors for ``groups`` prompts x ``G`` responses (one mini-batch)."""
    rb = make_batch(P, R, G, groups, vocab, seed)
    g = torch.Generator().manual_seed(seed)
    b = len(rb.prompt_ids)
    rlens = [int(torch.randint(R // 2, R + 1, (), generator=g)) for _ in range(b)]
    width = max(rlens)
    total = max(len(p) + n for p, n in zip(rb.prompt_ids, rlens))
    seqs = torch.full((b, total), PAD, dtype=torch.long)
    attn = torch.zeros(b, total, dtype=torch.long)
    resp = torch.zeros(b, width)
    for i, (p, r, n) in enumerate(zip(rb.prompt_ids, rb.response_ids, rlens)):
        row = list(p) + list(r[:n])
        seqs[i, total - len(row):] = torch.as_tensor(row)
        attn[i, total - len(row):] = 1
        resp[i, width - n:] = 1
    adv = torch.randn(b, generator=g)[:, None] * resp / resp.sum()  # token_mean pre-scaling
    noise = lambda s: s * torch.randn(b, width, generator=g) * resp
    data = {"sequences": seqs, "attention_mask": attn, "response_mask": resp, "loss_mask": resp,
            "advantages": adv, "action_log_probs": noise(0.1) - resp,
            "base_action_log_probs": noise(0.1) - resp}
    return data



def plot(rows: list[dict], path: str) -> None:
    paired_bars(path, [r["shape"] for r in rows], [r["naive_ms"] for r in rows], "ZoRRo off",
                [r["zorro_ms"] for r in rows], "ZoRRo", "policy worker step (ms)",
                title="SkyRL PolicyWorker step (forward_backward + optim_step), bf16 ZeRO-2, 4 groups")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model")
    a = ap.parse_args()
    if not (torch.cuda.is_available() or a.smoke):
        raise SystemExit("bench_skyrl_worker.py needs a CUDA GPU (or --smoke for a CPU check)")
    model, dtype, shapes = (("tiny:qwen3", "float32", [(24, 12, 4)]) if a.smoke
                            else (a.model, "bfloat16", SHAPES))
    trainer = {"algorithm": ALGO, "policy": {"optimizer_config": {"lr": 1e-6}}}
    rows = []
    workers = {}
    for zorro in (False, True):
        cfg = train_config_from_skyrl(trainer, model, dtype=dtype, zero_stage=2, zorro=zorro,
                                      gradient_checkpointing=True, micro_batch_tokens=1 << 20)
        workers[zorro] = PolicyWorker(cfg)
    vocab = workers[True].engine.module.config.vocab_size
    off = workers[False].engine
    layout = naive_layout_for(attention_features(off.module), off.config.naive_layout)
    for P, R, G in shapes:
        data = skyrl_layout(P, R, G, a.groups, vocab, seed=P + R + G)
        translate_ms = wall_median_ms(lambda: rollout_from_training_batch(data, with_ref=True),
                                      iters=a.iters)
        ms = {}
        for zorro, w in workers.items():
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            ms[zorro] = wall_median_ms(lambda: (w.forward_backward(data), w.optim_step()), iters=a.iters)
            ms[f"mem{zorro}"] = (torch.cuda.max_memory_allocated() / 2**30
                                 if torch.cuda.is_available() else 0.0)
        rows.append(dict(shape=f"P{P}/R{R}/G{G}x{a.groups}", naive_layout=layout,
                         naive_ms=round(ms[False], 1),
                         zorro_ms=round(ms[True], 1), speedup=round(ms[False] / ms[True], 2),
                         translate_ms=round(translate_ms, 1),
                         naive_peak_gb=round(ms["memFalse"], 2), zorro_peak_gb=round(ms["memTrue"], 2)))
        print(rows[-1], flush=True)
    print(markdown_table(rows, [("shape", "shape"), ("naive_layout", "naive layout"), ("naive_ms", "naive ms"), ("zorro_ms", "ZoRRo ms"),
                                ("speedup", "speedup"), ("translate_ms", "batch translation ms"),
                                ("naive_peak_gb", "naive peak GB"), ("zorro_peak_gb", "ZoRRo peak GB")]))
    if a.smoke:
        return
    path = save({"env": environment(), "model": model, "rows": rows}, a.out, "skyrl_worker")
    plot(rows, path.replace(".json", ".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
