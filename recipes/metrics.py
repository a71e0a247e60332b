"""Where a recipe's per-step metrics go: a JSONL file, stdout (under a progress bar), and
optionally TensorBoard."""
from __future__ import annotations

import json
import os
import sys

from .checkpoint import METRICS


class MetricsLogger:
    """``log(step, metrics)`` appends one JSON line to ``<out_dir>/metrics.jsonl``.

    A fresh run (``start_step == 0``) starts the file anew; a resumed run keeps the rows of the
    steps before ``start_step`` and drops any that the interrupted run logged after its last
    checkpoint, so every step appears once.
    """

    def __init__(self, out_dir: str, *, total_steps: int, start_step: int, progress: bool,
                 tensorboard: bool):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, METRICS)
        kept = _rows_before(self.path, start_step) if start_step > 0 else []
        self._file = open(self.path, "w")
        self._file.writelines(kept)
        self._file.flush()
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step",
                             file=sys.stderr, dynamic_ncols=True)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError("run.tensorboard=true needs the tensorboard package: "
                                 "pip install tensorboard") from exc
            self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def phase(self, step: int, text: str) -> None:
        """Show what step ``step`` is doing now (a CPU step can take minutes)."""
        if self._bar is not None:
            self._bar.set_description_str(f"step {step}: {text}")
            self._bar.refresh()
        else:
            print(f"step {step}: {text}", flush=True)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        line = " ".join(f"{k}={_short(v)}" for k, v in row.items())
        if self._bar is not None:
            self._bar.write(line)
            self._bar.set_postfix(reward=f"{metrics.get('reward_mean', 0):.3f}")
            self._bar.update(1)
        else:
            print(line, flush=True)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def _rows_before(path: str, step: int) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip() and json.loads(line).get("step", step) < step]


def _plain(v):
    return float(v) if hasattr(v, "item") else v


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
