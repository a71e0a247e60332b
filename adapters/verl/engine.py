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

Checkpoints (``save_checkpoint`` / ``load_checkpoint``, what verl's trainer calls with
``<default_local_dir>/global_step_N/actor``): ``TrainingEngine.save`` / ``load`` of weights,
AdamW state, LR schedule and step count together, so ``checkpoint.save_contents`` and
``load_contents`` must hold all of ``model``, ``optimizer`` and ``extra`` (``check_checkpoint``
refuses anything else when the engine is built). ``hf_model`` in ``save_contents`` adds a Hugging
Face export (``TrainingEngine.save_pretrained``: config, safetensors in the engine's dtype,
tokenizer) in ``<local_path>/huggingface``, where verl's FSDP engine writes it, listed in the
checkpoint's manifest (``TrainingEngine.save(hf_export=...)``). ``max_ckpt_to_keep``
(``trainer.max_actor_ckpt_to_keep``) keeps the newest N checkpoints this engine saved, as verl's
checkpoint managers do, but removes older ones only once the new one is complete (verl's make room
first); ``None`` or 0 keeps all, and only the files a retired checkpoint's manifest lists are
removed (then its folders, once empty). ``hdfs_path`` is refused; ``del_local_after_load`` has
nothing to do (verl deletes only local copies of remote files, and polynya loads local paths
only). With ``param_offload`` the states come back for a save or load and go out again after.
"""
from __future__ import annotations

from . import _module_done

import os
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from polynya.files import clear_checkpoint
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx

from .batch import jagged_logprobs, read_batch
from .settings import check_checkpoint, check_loss_function, train_config

BUCKET_BYTES = 1 << 28
HF_MODEL_DIR = "huggingface"  # where verl's FSDP checkpoint manager writes save_contents' hf_model


class DeepSpeedLMEngine(BaseEngine):
    """verl ``BaseEngine`` over ``polynya.engines.TrainingEngine`` (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config=None):
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = None if engine_config.forward_only else optimizer_config
        self.checkpoint_config = checkpoint_config
        self.config = train_config(model_config, engine_config, self.optimizer_config)  # ValueError early
        save = () if engine_config.forward_only else check_checkpoint(checkpoint_config)
        self._save_hf = "hf_model" in save
        self._saved: list[str] = []  # checkpoints this engine saved, oldest first (max_ckpt_to_keep)
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
        """``TrainingEngine.save(local_path)``, the ``huggingface`` export with ``hf_model``, then
        the retirement of this engine's checkpoints beyond ``max_ckpt_to_keep`` (module docstring).
        Bad arguments are a ``ValueError`` before anything is written."""
        if hdfs_path is not None:
            raise ValueError("polynya's deepspeed engine saves to local_path only (hdfs_path unsupported)")
        keep = _keep(max_ckpt_to_keep)
        with self._resident():
            self.trainer.save(local_path, hf_export=HF_MODEL_DIR if self._save_hf else None)
        self._retire_beyond(os.path.realpath(local_path), keep)

    def load_checkpoint(self, local_path: str, hdfs_path=None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        """``TrainingEngine.load(local_path)``: manifest verified, then weights, optimizer state,
        LR schedule and step count. ``del_local_after_load``: nothing to delete (module docstring)."""
        if hdfs_path is not None:
            raise ValueError("polynya's deepspeed engine loads from local_path only (hdfs_path unsupported)")
        with self._resident():
            self.trainer.load(local_path)

    @contextmanager
    def _resident(self):
        """With ``param_offload``: the states on the device for a save or load, offloaded after
        (verl's FSDP engine does the same around its checkpoints)."""
        if not self.is_param_offload_enabled:
            yield
            return
        self.trainer.onload()
        try:
            yield
        finally:
            self.trainer.offload()

    def _retire_beyond(self, path: str, keep: int) -> None:
        """Record ``path`` as this engine's newest checkpoint; with ``keep`` > 0 rank 0 removes the
        older ones beyond the newest ``keep`` (verl's ``register_checkpoint``; a path saved again
        counts once, as its newest save)."""
        self._saved = [p for p in self._saved if p != path] + [path]
        if not keep or len(self._saved) <= keep:
            return
        old, self._saved = self._saved[:-keep], self._saved[-keep:]
        if dist.get_rank() != 0:
            return
        for folder in old:
            try:
                clear_checkpoint(folder)  # the files its manifest lists, and the folders they empty
                if os.path.isdir(folder) and not os.listdir(folder):
                    os.rmdir(folder)
            except OSError as exc:  # verl ignores a failed removal too: the new checkpoint is complete
                warnings.warn(f"could not remove the old checkpoint {folder!r} (max_ckpt_to_keep): {exc}",
                              stacklevel=2)


def _keep(value) -> int:
    """verl's ``max_ckpt_to_keep``: ``None`` or 0 keeps every checkpoint, N > 0 the newest N."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_ckpt_to_keep (trainer.max_actor_ckpt_to_keep) must be None, 0 (keep every "
                         f"checkpoint) or a positive int, got {value!r}")
    return value


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
