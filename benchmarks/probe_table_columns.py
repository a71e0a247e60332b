"""Decode steps that send the device only their block tables' used columns, against the whole width.

The native sampler's CUDA graphs take block tables as wide as ``max_model_len / page`` (2560
columns for Qwen3-0.6B's 40,960 positions), whatever the step's lengths. Each decode step used
to stage every column (``[rows, 4 + 2560]`` int64 through pinned memory, then an int64 -> int32
copy on the device); it now stages the columns its rows use and keeps the rest of the device
buffer zero. This probe runs one engine with the sampler's defaults (tables 2560 wide) at the
goal-1 shape (8 prompts x G8, P256, 128 new tokens, temperature 1) and swaps
``DecodeGraphs._stage`` between runs for ``whole_width_stage`` below — the staging of main at
``82d2e01``, kept here as the baseline, line for line, on the same pinned buffers — (ABBA,
``--repeat`` runs each, fresh prompts per run): decode ms per step and bytes staged per step,
medians and the ratio::

    python benchmarks/probe_table_columns.py --out $OUT          # H200, ~1 min
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_sampler import run_case  # noqa: E402
from common import environment, make_prompts, median, save  # noqa: E402
from polynya.config import SamplerConfig  # noqa: E402
from polynya.engines import SamplingEngine  # noqa: E402
from polynya.engines.sample.native.cuda_graph import PINNED_TURNS, DecodeGraphs  # noqa: E402

def whole_width_stage(self, b, ids, pos, slots, tables, lens, device_ids):
    """``DecodeGraphs``' staging as it was (main at ``82d2e01``): every step stages all
    ``width`` columns (rows of id, position, slot, table, length, on the same pinned memory)
    and copies them all on the device."""
    batch, w = len(ids), self.width
    host = self.hosts[self._turn][:b * (4 + w)].view(b, 4 + w)
    self._turn = (self._turn + 1) % PINNED_TURNS
    host.zero_()
    h = host.numpy()
    h[:batch, 0], h[:batch, 1], h[:batch, 2] = ids, pos, slots
    h[batch:, 2] = self.scratch * self.block_size
    h[:batch, 3:3 + tables.shape[1]] = tables
    h[batch:, 3] = self.scratch
    h[:batch, 3 + w] = lens
    h[batch:, 3 + w] = 1
    dev = host.to(self.device, non_blocking=True)
    self.staged_bytes = host.numel() * host.element_size()
    self._fill(b, batch, dev[:, 0], dev[:, 1], dev[:, 2], dev[:, 3 + w], dev[:, 3:3 + w], device_ids)
    self._zero_from = w  # nothing is known zero now: the next narrower step clears it all


MODES = {"used columns": DecodeGraphs._stage, "whole width": whole_width_stage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-gb", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    engine = SamplingEngine(SamplerConfig(args.model, dtype="bfloat16", kv_cache_memory_gb=args.kv_gb,
                                          max_num_seqs=args.groups * args.G))
    runner = engine.backend.runner
    if runner.graphs is None:
        raise SystemExit("this engine decodes without CUDA graphs: nothing to probe")
    vocab = runner.vocab_size
    for seed in (1, 2):  # captures, compiles
        run_case(engine, make_prompts(args.groups, args.prompt_len, vocab, seed=seed), args.G, 8)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    order = list(MODES)
    for rep in range(args.repeat):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            runner.graphs._stage = MODES[mode].__get__(runner.graphs)
            r = run_case(engine, make_prompts(args.groups, args.prompt_len, vocab, seed=100 + 2 * rep
                                              + order.index(mode)), args.G, args.new_tokens)
            r["staged_bytes_per_step"] = runner.graphs.staged_bytes
            runs[mode].append(r)
            print(f"{mode:13}: {r['ms_per_step']:.3f} ms/step, {r['staged_bytes_per_step']} B staged "
                  f"per step, captures {r['graph_captures']} compiles {r['compiles']}", flush=True)
    del runner.graphs._stage  # the class's own again
    rows = {m: {"ms_per_step": median([r["ms_per_step"] for r in rs]),
                "runs_ms_per_step": [round(r["ms_per_step"], 4) for r in rs],
                "staged_bytes_per_step": rs[-1]["staged_bytes_per_step"]} for m, rs in runs.items()}
    ratio = rows["whole width"]["ms_per_step"] / rows["used columns"]["ms_per_step"]
    print(f"table width {runner.graphs.width} columns; used columns {ratio:.3f}x as fast per decode "
          f"step ({rows['used columns']['ms_per_step']:.3f} vs {rows['whole width']['ms_per_step']:.3f} ms)")
    result = {"env": environment(), "args": vars(args), "table_width": runner.graphs.width,
              "rows": rows, "speedup": ratio}
    save(result, args.out, "probe_table_columns")
    plot(result, os.path.join(args.out, "probe_table_columns.png"))


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, a = result["rows"], result["args"]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(rows)
    ax.bar(names, [rows[n]["ms_per_step"] for n in names], color=["tab:blue", "tab:gray"])
    for i, n in enumerate(names):
        ax.text(i, rows[n]["ms_per_step"], f"{rows[n]['ms_per_step']:.3f} ms\n"
                f"{rows[n]['staged_bytes_per_step'] / 1e3:.0f} kB staged", ha="center", va="bottom")
    ax.set_ylabel("decode step (ms, median of runs)")
    ax.set_title(f"decode step, block tables {result['table_width']} columns wide\n"
                 f"{a['groups']} prompts x G{a['G']}, P{a['prompt_len']}, {a['new_tokens']} new — "
                 f"{result['env'].get('gpu', '')}", fontsize=9)
    ax.set_ylim(0, max(rows[n]["ms_per_step"] for n in names) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
