"""polynya's DeepSpeed ``TrainingEngine`` as verl's ``deepspeed`` backend (``language_model``).

verl's worker builds it through ``EngineRegistry.new(model_type, backend=strategy, ...)`` and
drives it with ``train_batch`` / ``infer_batch`` (inherited from verl's ``BaseEngine``), which
call ``forward_backward_batch`` below. That method only translates:

1. verl's batch -> ``RolloutBatch`` with groups from ``uid`` (``polynya.adapters.verl.batch``);
2. the global normalisers verl's losses read (``batch_num_tokens`` over ranks, ``dp_size``), as
   verl's own engines set them;
3. ``TrainingEngine.forward_backward_local``: micro-batches of whole prompt groups, log-probs by
   ``compute_logprobs`` (ZoRRo when ``zorro``), and for each micro-batch verl's own
   ``loss_function`` on those log-probs / entropies in verl's jagged layout, then its backward;
4. the result in verl's format: ``{"model_output": {"log_probs", "entropy"}, "loss": [per
   micro-batch], "metrics": {...}}``.

Offload moves weights and optimizer state together (``TrainingEngine.offload``).
"""
from __future__ import annotations

from . import _module_done

from contextlib import nullcontext

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx

from .batch import jagged_logprobs, read_batch
from .settings import check_checkpoint, check_loss_function, train_config

BUCKET_BYTES = 1 << 28


class DeepSpeedLMEngine(BaseEngine):
    """verl ``BaseEngine`` over ``polynya.engines.TrainingEngine`` (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config=None):
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = None if engine_config.forward_only else optimizer_config
        self.checkpoint_config = checkpoint_config
        self.config = train_config(model_config, engine_config, self.optimizer_config)  # ValueError early
        if not engine_config.forward_only and checkpoint_config is not None:
            check_checkpoint(checkpoint_config)
        if engine_config.param_offload and self.config.zero_stage == 0:
            raise ValueError("param_offload needs deepspeed.zero_stage >= 1 (DeepSpeed's offload_states)")
        self.mode = None
        self.trainer = None
        self._lr = self.config.lr  # the rate of the last update

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> None:
        from polynya.engines import TrainingEngine

        if self.trainer is None:
            self.trainer = TrainingEngine(self.config)
        if self.engine_config.param_offload:
            self.trainer.offload()

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload)

    def train_mode(self, **kwargs):
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if not (model or optimizer):
            return
        if device == "cpu":
            self.trainer.offload()
        else:
            self.trainer.onload()

    # ------------------------------------------------------------------ parallelism
    def get_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_size(self) -> int:
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return dist.group.WORLD

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    # ------------------------------------------------------------------ training
    def optimizer_zero_grad(self) -> None:
        self.trainer.zero_grad()

    def optimizer_step(self) -> float:
        """One AdamW update; returns the global gradient norm before clipping."""
        info = self.trainer.step()
        self._lr = info["lr"]
        return info["grad_norm"]

    def lr_scheduler_step(self) -> float:
        """The rate of the last update (polynya's rate is constant: see ``settings``)."""
        return self._lr

    def forward_backward_batch(self, data, loss_function, forward_only: bool = False) -> dict:
        check_loss_function(loss_function)
        rows = read_batch(data)
        device = self.trainer.device
        num_tokens = data["loss_mask"].sum().to(device) if "loss_mask" in data else \
            data["response_mask"].sum().to(device)
        dist.all_reduce(num_tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=num_tokens.item(), dp_size=self.get_data_parallel_size())
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        losses, metrics = [], {}

        def loss_fn(idx: list[int], stats):
            sub = tu.index_select_tensor_dict(data, idx).to(device)
            out = {"log_probs": jagged_logprobs(stats.logprobs, idx, rows)}
            if stats.entropy is not None:
                out["entropy"] = jagged_logprobs(stats.entropy, idx, rows)
            loss, m = loss_function(model_output=out, data=sub, dp_group=self.get_data_parallel_group())
            losses.append(float(loss.detach()))
            append_to_dict(metrics, m)
            return loss

        ctx = torch.no_grad() if forward_only else nullcontext()
        with ctx:
            parts = self.trainer.forward_backward_local(
                rows.batch, loss_fn if loss_function is not None else None, backward=not forward_only,
                entropy=entropy, temperature=rows.temperature)
        output = {"loss": losses, "metrics": metrics}
        if forward_only or tu.get_non_tensor_data(data, "return_model_output", False):
            output["model_output"] = _model_output(parts, rows, entropy)
        return output

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(self, **kwargs):
        """``(name, tensor)`` of the full weights (HF names), bucket by bucket; no PEFT config."""
        from polynya.sync import build_manifest

        manifest = build_manifest(self.trainer, version=0, bucket_bytes=BUCKET_BYTES, checksum="")

        def tensors():
            for spec, (_, flat) in zip(manifest.buckets, self.trainer.export_weights(BUCKET_BYTES)):
                yield from spec.views(flat)

        return tensors(), None

    def save_checkpoint(self, local_path: str, hdfs_path=None, global_step: int = 0,
                        max_ckpt_to_keep=None, **kwargs) -> None:
        if hdfs_path is not None:
            raise ValueError("polynya's deepspeed engine saves to local_path only (hdfs_path unsupported)")
        self.trainer.save(local_path)

    def load_checkpoint(self, local_path: str, hdfs_path=None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        self.trainer.load(local_path)


def _model_output(parts, rows, entropy: bool) -> dict[str, torch.Tensor]:
    """Per-row results of every micro-batch, back in the batch's order, in verl's layout."""
    b, r = len(rows.batch), rows.batch.max_response_len
    first = parts[0][1].logprobs
    lp = first.new_zeros(b, r)
    ent = first.new_zeros(b, r) if entropy else None
    for idx, stats in parts:
        width = stats.logprobs.shape[1]
        lp[idx, :width] = stats.logprobs
        if entropy:
            ent[idx, :width] = stats.entropy
    everyone = list(range(b))
    out = {"log_probs": jagged_logprobs(lp, everyone, rows)}
    if entropy:
        out["entropy"] = jagged_logprobs(ent, everyone, rows)
    return out


_module_done()  # verl imported first by this module? finish the plugin's registration
