"""What a short head shared by different prompts costs ZoRRo, shared vs repeated (issue 15 goal 4).

The long-context QA recipe's prompts all start with the chat template's ~11 tokens, so with
maximal sharing each micro-batch's prefix forest is one tree: those tokens, then the prompt
groups, then the responses. On the split path every token below a shared span gets one more
attention partial (one more call, one more merge term, forward and backward). ZoRRo's layout
now repeats such a head per prompt (``polynya.zorro.tree.MIN_SHARED_TOKENS``). This probe runs
the same batch, 8 groups of P/R/G with a ``--head``-token common head, as one micro-batch
(``compute_logprobs`` + backward, compiled layers, gradient checkpointing, bf16), both ways, and
the batch without any common head for reference; arms interleaved per round, medians::

    python benchmarks/probe_shared_head.py --shape 6400/128/8 --groups 8 --head 11 --out $OUT

Correctness on the device: the two layouts' log-probs and parameter gradients against the
packed naive layout of the same batch (the bf16 rule of ``tests/core/test_logprobs_gpu.py``:
no further from each other than bf16 noise, asserted loosely here and reported exactly).
Each arm is also profiled once (``common.profile_call``: wall vs GPU-busy, kernels).
Written on 2026-12-07 and smoke-run on the CPU (``--model tiny:qwen3 --device cpu --shape
40/4/2 --groups 3 --head 5``); first GPU run: 2026-12-07 on an H100 (BENCHMARKS, recipe section).
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import polynya
from common import environment, profile_call, save
from polynya.compiled_layers import compile_layers
from polynya.models import load_model
from polynya.zorro import pack_rows, tree


def make_batch(P: int, R: int, G: int, groups: int, head: int, vocab: int, seed: int) -> polynya.RolloutBatch:
    rng = random.Random(seed)
    common = [rng.randrange(vocab) for _ in range(head)]
    prompts, responses = [], []
    for _ in range(groups):
        prompt = common + [rng.randrange(vocab) for _ in range(P - head)]
        for _ in range(G):
            prompts.append(prompt)
            responses.append([rng.randrange(vocab) for _ in range(R)])
    return polynya.RolloutBatch(prompts, responses, advantages=torch.randn(len(prompts)))


def run(model, batch, min_shared: int, zorro: bool = True, grads: bool = False):
    tree.MIN_SHARED_TOKENS = min_shared
    model.zero_grad(set_to_none=True)
    stats = polynya.compute_logprobs(model, batch, zorro=zorro)
    loss = -(stats.logprobs * batch.advantages.to(stats.logprobs.device)[:, None]).sum() / stats.mask.sum()
    loss.backward()
    if not grads:
        return None
    return stats.logprobs[stats.mask].float(), {k: p.grad.float().clone() for k, p in model.named_parameters()
                                                  if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--shape", default="6400/128/8")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--head", type=int, default=11)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script only")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    P, R, G = map(int, args.shape.split("/"))
    cuda = args.device == "cuda"
    model = load_model(args.model, dtype="bfloat16" if cuda else "float32", device=args.device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if cuda:
        compile_layers(model)
    default = tree.MIN_SHARED_TOKENS
    vocab = model.config.vocab_size
    headed = make_batch(P, R, G, args.groups, args.head, vocab, seed=1)
    plain = make_batch(P, R, G, args.groups, 0, vocab, seed=1)
    arms = {"head shared (old)": (headed, 1), f"head repeated (MIN_SHARED_TOKENS={default})": (headed, default),
            "no common head": (plain, default)}

    # correctness first: both layouts of the headed batch against its packed naive layout
    naive_lp, naive_g = run(model, headed, default, zorro=False, grads=True)
    check = {}
    for name, (batch, k) in list(arms.items())[:2]:
        lp, g = run(model, batch, k, grads=True)
        check[name] = {"logprob_max_abs_vs_naive": round((lp - naive_lp).abs().max().item(), 5),
                       "grad_rel_err_vs_naive_max": round(max(((g[n] - naive_g[n]).norm() / naive_g[n].norm().clamp_min(1e-12)).item()
                                                              for n in naive_g), 5)}
        print(name, check[name], flush=True)
    ok = all(c["logprob_max_abs_vs_naive"] < 0.1 and c["grad_rel_err_vs_naive_max"] < 0.05 for c in check.values())

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for batch, k in arms.values():  # warm-up: compiles, plans, cuDNN graphs
        run(model, batch, k), run(model, batch, k)
    times = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (batch, k) in arms.items():
            sync()
            t0 = time.perf_counter()
            run(model, batch, k)
            sync()
            times[name].append(round((time.perf_counter() - t0) * 1e3, 1))
    rows = []
    for name, (batch, k) in arms.items():
        _, prof = profile_call(lambda b=batch, m=k: run(model, b, m), top=8)
        tree.MIN_SHARED_TOKENS = k
        rows_ = pack_rows(batch)
        inner = int((rows_.nodes[:, 2] > rows_.nodes[:, 1]).sum())
        rows.append({"arm": name, "median_ms": statistics.median(times[name]), "ms": times[name],
                     "tokens": rows_.num_real_tokens, "shared_nodes": inner, "profile": prof})
        print({k2: v for k2, v in rows[-1].items() if k2 != "profile"},
              {k2: prof[k2] for k2 in ("wall_ms", "gpu_busy_ms", "kernels")}, flush=True)
        del rows_
    tree.MIN_SHARED_TOKENS = default
    base = rows[0]["median_ms"]
    for r in rows:
        r["speedup_vs_shared"] = round(base / r["median_ms"], 3)
    save(dict(environment(), **vars(args), correctness=check, correct=ok, rows=rows), args.out, "probe_shared_head")
    print("correct:", ok, "| speedup of repeating the head:", rows[1]["speedup_vs_shared"], flush=True)
    if not ok:
        raise SystemExit("layouts disagree with the naive layout beyond bf16 noise")


if __name__ == "__main__":
    main()
