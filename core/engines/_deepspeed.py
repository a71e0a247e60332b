"""DeepSpeed plumbing shared by the training and log-prob engines.

- ``import_deepspeed()``: the lazy import (``ImportError`` naming ``polynya[deepspeed]``).
- ``init_deepspeed(device)``: a process group (``polynya.distributed.ensure_process_group``: one
  rank in a plain process, the launcher's ranks under torchrun / Ray) handed to
  ``deepspeed.init_distributed``. On CPU DeepSpeed would JIT-build its shared-memory all-reduce
  op (38-70 s cold) that only speeds up ``inference_all_reduce``; it is skipped unless
  ``POLYNYA_DS_SHM=1`` (collectives then run on gloo, which is what the engines use anyway).
- ``ds_config(...)``: the DeepSpeed config dict (ZeRO stage, bf16, clipping) merged with the
  user's raw overrides.
- ``named_buckets`` / ``export_buckets`` / ``load_pieces``: move full weights out of and into a
  module under every ZeRO stage; under ZeRO-3 parameters are gathered one bucket at a time, so a
  second full copy of the model never exists. ``load_pieces`` checks everything first.
- ``weights_checksum``: ``polynya.checksum`` of a module's full weights.
- ``load_checkpoint``: DeepSpeed's load, after every pickle is read weights-only and the
  checkpoint is checked against the engine (ZeRO stage, dtype, world size, parameter names and
  shapes, the model's configuration, optimizer settings): a mismatch is refused before anything
  changes. ``MODEL_CONFIG`` / ``model_config_json``: the configuration a checkpoint records.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import zipfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..checksum import checksum_packed
from ..distributed import ensure_process_group
from ..spans import span_layout
from ..weights import check_tied, checked_pairs, full_shape, is_zero3

WeightPiece = tuple[list[str], torch.Tensor]


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError("the DeepSpeed engines need DeepSpeed: pip install 'polynya[deepspeed]'") from exc
    _quiet_logger(deepspeed)
    return deepspeed


def _quiet_logger(deepspeed) -> None:
    """DeepSpeed logs its config and memory snapshots at INFO on every engine it builds; keep
    warnings and errors only, unless the user chose a level (``POLYNYA_DEEPSPEED_LOG=info``)."""
    import logging

    level = os.environ.get("POLYNYA_DEEPSPEED_LOG", "warning").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"POLYNYA_DEEPSPEED_LOG={level.lower()!r} is not a logging level "
                         "(debug, info, warning, error)")
    deepspeed.utils.logger.setLevel(level)


def _skip_cpu_shm_op(deepspeed) -> None:
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or os.environ.get("POLYNYA_DS_SHM") == "1":
        return
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def init_deepspeed(device: torch.device) -> tuple[int, int]:
    """Process group + DeepSpeed comm backend; returns ``(rank, world_size)``."""
    deepspeed = import_deepspeed()
    import torch._dynamo  # noqa: F401  (ZeRO-3 patches torch; dynamo must be imported first)

    _skip_cpu_shm_op(deepspeed)
    rank, world = ensure_process_group(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               auto_mpi_discovery=False, verbose=False)
    return rank, world


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge (``override`` wins)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ds_config(*, zero_stage: int, dtype: torch.dtype, train: bool, grad_clip: float = 0.0,
              overrides: dict[str, Any] | None = None, num_params: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config for an engine.

    Gradient accumulation is *unmanaged*: ``backward`` only accumulates, ``step`` reduces and
    updates, so any number of micro-batches (the engine decides per batch) make one step.
    Communication buckets hold at most 5e7 elements and never more than the model
    (``num_params``): DeepSpeed's defaults (5e8 for ZeRO-3's reduce bucket) reserve gigabytes
    even for a tiny model.
    """
    bucket = int(5e7) if num_params is None else int(min(5e7, max(num_params, 1e5)))
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage in (1, 2):
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_bucket_size=bucket,
                    allgather_bucket_size=bucket)
    if zero_stage == 3:
        # memory_efficient_linear would replace torch.nn.functional.linear process-wide (every
        # model, the sampler's too) with an autograd Function that costs host time per call.
        zero.update(overlap_comm=False, reduce_bucket_size=bucket, stage3_prefetch_bucket_size=bucket,
                    stage3_param_persistence_threshold=int(1e4), memory_efficient_linear=False)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if train:
        cfg.update(managed_gradient_accumulation=False, gradient_clipping=grad_clip,
                   zero_allow_untested_optimizer=True)
    return merge(cfg, overrides or {})


@contextlib.contextmanager
def engine_forward(engine):
    """What ``DeepSpeedEngine.forward`` does around the module call, for callers that run
    submodules directly (``compute_logprobs`` runs the base model and the LM head separately).

    Without it ZeRO-3 never advances its micro-step counter and each micro-batch's gradient
    *replaces* the previous one instead of adding to it.
    """
    clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
    if clear is not None:
        clear()
    engine._forward_prologue((), {})
    try:
        yield
    finally:
        engine._forward_epilogue()


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter], modifier_rank: int | None = None):
    """Full ``.data`` for ZeRO-3 parameters inside the block (no-op for other stages)."""
    z3 = [p for p in params if is_zero3(p)]
    if not z3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(z3, modifier_rank=modifier_rank):
        yield


def named_buckets(named: Iterable[tuple[str, torch.nn.Parameter]], bucket_bytes: int
                  ) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters grouped up to ``bucket_bytes`` (a larger one is alone)."""
    bucket, size = [], 0
    for name, p in named:
        nbytes = full_shape(p).numel() * p.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield bucket


def export_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[WeightPiece]:
    """``(names, flat)`` pieces of the full weights, in ``named_parameters`` order.

    ``flat`` is a new 1-D tensor (the weights' dtype and device) holding each named parameter
    flattened, in order; shapes are the model's (``named_parameters``). Under ZeRO-3 every rank
    must consume the generator (each bucket is an all-gather).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    for bucket in named_buckets(module.named_parameters(), bucket_bytes):
        params = [p for _, p in bucket]
        with gathered(params):
            flat = torch.cat([p.data.reshape(-1) for p in params])
        yield [n for n, _ in bucket], flat


def weights_checksum(module: torch.nn.Module, bucket_bytes: int = 1 << 28) -> str:
    """``polynya.checksum`` of the module's full weights (every rank calls it under ZeRO-3).

    Weights that are views of a few flat storages (ZeRO-1/2) are digested in place
    (``polynya.spans``); otherwise bucket by bucket (``export_buckets``). On CUDA the digests
    come from the Triton kernels with one device -> host transfer at the end.
    """
    found = span_layout(module)
    if found is not None:
        layout, spans = found
        return layout.checksum(spans)
    shapes = {n: full_shape(p) for n, p in module.named_parameters()}
    return checksum_packed(export_buckets(module, bucket_bytes), shapes)


def load_pieces(module: torch.nn.Module, pieces: Iterable, *, checksum: str | None = None) -> int:
    """Copy weights into ``module``; returns the number of tensors loaded.

    Every piece is checked first (``polynya.weights.checked_pairs``: names, shapes, dtypes,
    finite values, ``checksum`` when given); only then is anything copied, so a bad piece
    leaves the module untouched. Under ZeRO-3 every rank must pass the same pieces (rank 0's
    values are the ones partitioned back); tensors are gathered a bucket at a time.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    shapes = {n: full_shape(p) for n, p in params.items()}
    pairs = checked_pairs(pieces, shapes, checksum=checksum)
    check_tied(pairs, params)
    start = 0
    for bucket in named_buckets([(n, params[n]) for n, _ in pairs], 1 << 28):
        chunk = pairs[start:start + len(bucket)]
        start += len(bucket)
        unique = list({id(p): p for _, p in bucket}.values())  # tied names share a parameter
        with gathered(unique, modifier_rank=0), torch.no_grad():
            for (_, p), (_, t) in zip(bucket, chunk):
                p.data.copy_(t.to(device=p.device, dtype=p.dtype))
    return len(pairs)


@contextlib.contextmanager
def _young_gc_only():
    """Make ``gc.collect()`` walk only objects created from here on.

    DeepSpeed's ``offload_states`` runs three full collections as a precaution (its buffers are
    released by reference counting already); in a process holding a model, a tokenizer and a
    data set each full pass costs ~0.35 s, which the colocated hand-over pays before every
    generate. Older objects are frozen for the duration (``gc.freeze``) and handed back to the
    collector afterwards, so nothing is leaked: a cycle that was already garbage is collected
    by the next regular full collection instead.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def barrier() -> None:
    """All ranks of the default group meet here (no-op on one rank)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def checkpoint_types() -> list:
    """The non-tensor types a DeepSpeed checkpoint of our engines holds: the only ones its
    pickles may contain (``polynya.files.safe_torch_load``)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _kind(stage, bf16, ranks) -> str:
    return f"ZeRO-{stage} {'bfloat16' if bf16 else 'float32'} engine on {ranks} rank(s)"


def _check_saved_by_same_kind(engine, state: dict, path: str) -> None:
    """``CheckpointError`` unless ``state`` (the checkpoint's model states) was saved by an
    engine of ``engine``'s ZeRO stage, dtype and data-parallel size: DeepSpeed would otherwise
    load the weights and then fail on the optimizer files, the engine half loaded."""
    from ..files import CheckpointError

    cfg = state.get("ds_config")
    if not isinstance(cfg, dict):
        return  # not ours to judge: DeepSpeed checks the rest
    saved = _kind((cfg.get("zero_optimization") or {}).get("stage", 0),
                  bool((cfg.get("bf16") or {}).get("enabled")), state.get("dp_world_size"))
    here = _kind(engine.zero_optimization_stage(), engine.bfloat16_enabled(), engine.dp_world_size)
    if saved != here:
        raise CheckpointError(f"{path!r} was saved by a {saved}; this is a {here}: load it into an "
                              "engine of the same ZeRO stage, dtype and world size")


def _saved_shapes(state: dict) -> dict[str, tuple[int, ...]] | None:
    """Name -> full shape of every parameter the model states hold (ZeRO 1-3 record them in
    ``param_shapes``; ZeRO-0 saves the module's full ``state_dict``)."""
    groups = [*(state.get("param_shapes") or []), *([state["frozen_param_shapes"]]
                                                    if state.get("frozen_param_shapes") else [])]
    if groups:
        return {n: tuple(s) for g in groups for n, s in g.items()}
    module = state.get("module")
    if isinstance(module, dict) and module:
        return {n: tuple(t.shape) for n, t in module.items() if torch.is_tensor(t)}
    return None


def _check_same_parameters(engine, state: dict, path: str) -> None:
    """``CheckpointError`` unless the checkpoint holds this model's parameters, by name and
    full shape: DeepSpeed would copy the ones that fit before failing on the rest."""
    from ..files import CheckpointError

    saved = _saved_shapes(state)
    if saved is None:
        return
    if state.get("param_shapes"):
        here = {n: tuple(full_shape(p)) for n, p in engine.module.named_parameters()}
    else:
        here = {n: tuple(t.shape) for n, t in engine.module.state_dict().items()}
    missing, extra = sorted(here.keys() - saved.keys()), sorted(saved.keys() - here.keys())
    shapes = [f"{n} {saved[n]} there, {here[n]} here" for n in here.keys() & saved.keys() if saved[n] != here[n]]
    if missing or extra or shapes:
        parts = [f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for what, names in (("missing", missing), ("not in this model", extra),
                                     ("other shapes", sorted(shapes))) if names]
        raise CheckpointError(f"{path!r} holds another model's parameters ({'; '.join(parts)}): load it "
                              "into an engine of the model it was saved from")


MODEL_CONFIG = "polynya_model_config"  # checkpoint client state: the model's configuration (JSON)
# Fields of a transformers config that say how it was loaded or what a forward returns, not
# what the model computes (keys starting with "_" are skipped too).
_LOADING_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "use_cache", "return_dict",
                           "output_attentions", "output_hidden_states", "name_or_path",
                           "architectures"})


def _computation_fields(value):
    if isinstance(value, dict):
        return {k: _computation_fields(v) for k, v in value.items()
                if not str(k).startswith("_") and k not in _LOADING_KEYS}
    return value


def model_config_json(module) -> str | None:
    """The module's transformers configuration as sorted JSON, without the loading-only fields
    (``None`` for a module without one): what a checkpoint records so that a model of the same
    parameter shapes but another configuration (RoPE base or scaling, norm epsilon, sliding
    window, activation, ...) is not resumed as if it were the same."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return json.dumps(_computation_fields(config.to_dict()), sort_keys=True, default=str)


def _config_differences(there, here, prefix: str = "") -> list[str]:
    if isinstance(there, dict) and isinstance(here, dict):
        return [d for k in sorted(there.keys() | here.keys(), key=str)
                for d in _config_differences(there.get(k, "(unset)"), here.get(k, "(unset)"),
                                             f"{prefix}{k}.")]
    return [] if there == here else [f"{prefix[:-1]}: {there!r} there, {here!r} here"]


def _check_same_config(engine, state: dict, path: str) -> None:
    """``CheckpointError`` unless the checkpoint was saved from a model of this engine's
    configuration (checkpoints written before it was recorded are not checked)."""
    from ..files import CheckpointError

    saved, here = state.get(MODEL_CONFIG), model_config_json(engine.module)
    if not isinstance(saved, str) or here is None or saved == here:
        return
    diffs = _config_differences(json.loads(saved), json.loads(here))
    if diffs:
        raise CheckpointError(f"{path!r} was saved from a model of another configuration ("
                              + "; ".join(diffs[:5]) + (" ..." if len(diffs) > 5 else "")
                              + "): the same parameter shapes would load and compute something "
                              "else. Load it into an engine of the model it was saved from")


def _saved_param_groups(state, depth: int = 3) -> list | None:
    """The torch optimizer's ``param_groups`` inside a DeepSpeed optimizer state (each ZeRO
    wrapper nests it under its own key)."""
    if not isinstance(state, dict) or depth < 0:
        return None
    if isinstance(state.get("param_groups"), list):
        return state["param_groups"]
    for value in state.values():
        found = _saved_param_groups(value, depth - 1)
        if found is not None:
            return found
    return None


_OPTIM_KEYS = ("betas", "eps", "weight_decay")


def _optimizer_differences(engine, state: dict) -> dict[str, tuple]:
    """What of the checkpoint's optimizer settings DeepSpeed would restore over this engine's
    own: ``{setting: (checkpoint's, this engine's)}``.

    Loading replaces the AdamW settings (``param_groups``) and the LR schedule's base rates and
    position, and ZeRO-1/2 take the checkpoint's clipping; the schedule's *function* stays this
    engine's. So the lr the next step would use must be what this engine's schedule gives at
    the checkpoint's position.
    """
    sched = engine.lr_scheduler
    out: dict[str, tuple] = {}
    saved = state.get("lr_scheduler")
    if isinstance(saved, dict) and sched is not None:
        if list(saved.get("base_lrs", [])) != list(sched.base_lrs):
            out["lr"] = (saved.get("base_lrs"), sched.base_lrs)
        elif hasattr(sched, "lr_lambdas") and "last_epoch" in saved and "_last_lr" in saved:
            want = [base * f(saved["last_epoch"]) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
            if list(saved["_last_lr"]) != want:
                out[f"lr of step {saved['last_epoch']} (the schedule)"] = (saved["_last_lr"], want)
    groups = _saved_param_groups(state.get("optimizer"))
    if groups is not None and sched is not None:
        setting = lambda g, key: tuple(g[key]) if isinstance(g.get(key), (list, tuple)) else g.get(key)
        for key in _OPTIM_KEYS:
            there = [setting(g, key) for g in groups]
            here = [setting(g, key) for g in sched.optimizer.param_groups]
            if there != here:
                out[key] = (there, here)
    clip = (state.get("ds_config") or {}).get("gradient_clipping")
    if clip is not None and float(clip) != float(engine.gradient_clipping() or 0.0):
        out["gradient_clipping"] = (clip, engine.gradient_clipping())
    return out


def load_checkpoint(engine, path: str, tag: str, began=None) -> dict:
    """``engine.load_checkpoint`` with every pickle restricted to ``checkpoint_types``; returns
    the checkpoint's client state (what ``save_checkpoint(client_state=...)`` stored).

    Each file of the tag is unpickled (weights-only) once before DeepSpeed loads any of them,
    and the checkpoint is checked against the engine: the same ZeRO stage, dtype and world size
    (``_check_saved_by_same_kind``), the same parameters (``_check_same_parameters``), the same
    model configuration (``_check_same_config``) and the same optimizer settings (``_optimizer_differences``: DeepSpeed would restore the
    checkpoint's over the engine's config). A file holding anything else, or a checkpoint that
    fails a check, raises ``CheckpointError`` before the engine changes; ``began()`` is called
    just before DeepSpeed starts changing it.
    """
    from ..files import CheckpointError, safe_torch_load

    folder = os.path.join(path, tag)
    if not os.path.isdir(folder):
        raise CheckpointError(f"no {tag!r} checkpoint under {path!r}")
    allowed = checkpoint_types()
    model_states, differences = [], {}
    with safe_torch_load(allowed):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".pt"):
                file = os.path.join(folder, name)
                try:  # zip checkpoints are mapped, not read: the check costs the pickles only
                    state = torch.load(file, map_location="cpu", weights_only=True,
                                       mmap=zipfile.is_zipfile(file))
                except Exception as exc:  # an unpickling error, or bytes torch cannot read
                    raise CheckpointError(f"{file!r} cannot be loaded as "
                                          f"weights only: {exc}") from None
                if not isinstance(state, dict):
                    raise CheckpointError(f"{file!r} is not a DeepSpeed checkpoint file")
                if name.endswith("model_states.pt"):  # ZeRO-3 names one per rank
                    model_states.append(state)
                else:  # the optimizer files of ZeRO 1-3
                    differences.update(_optimizer_differences(engine, {"optimizer": state}))
        for state in model_states:
            _check_saved_by_same_kind(engine, state, path)
        for state in model_states:
            _check_same_parameters(engine, state, path)
            _check_same_config(engine, state, path)
            differences.update(_optimizer_differences(engine, state))
        if differences:
            raise CheckpointError(
                f"{path!r} was saved with other optimizer settings ("
                + "; ".join(f"{k}: {a} there, {b} here" for k, (a, b) in sorted(differences.items()))
                + "): DeepSpeed would restore the checkpoint's AdamW settings, LR schedule and "
                "(ZeRO-1/2) clipping over this engine's config. Build the engine with the settings "
                "the checkpoint was saved with")
        del model_states
        if began is not None:
            began()
        load_path, client_state = engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
    if load_path is None:
        raise CheckpointError(f"no polynya checkpoint under {path!r}")
    return client_state or {}


def offload_engine(engine, *, pin_memory: bool, host: list | None = None) -> list | None:
    """Move a ZeRO 1-3 training engine's weights, gradients, fp32 master weights and Adam moments
    to host memory (``engine.offload_states``, with DeepSpeed's precautionary full garbage
    collections limited to new objects: ``_young_gc_only``).

    ZeRO-3's ``offload_states`` refuses master weights and optimizer state unless the optimizer
    is DeepSpeed's FusedAdam; ``torch.optim.AdamW`` keeps the same state (``exp_avg``,
    ``exp_avg_sq`` per fp32 partition), so those two are moved here the way DeepSpeed moves them.
    ``host``: the host buffers of a previous offload (ZeRO-3 master weights), reused; returns
    the buffers for the next one (the caller keeps them: nothing is stored on DeepSpeed's objects).
    """
    from deepspeed.runtime.utils import offload_adam_states
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    opt = engine.optimizer
    if not hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO 1/2: DeepSpeed moves everything
        with _young_gc_only():
            engine.offload_states(pin_memory=pin_memory)
        return None
    with _young_gc_only():
        engine.offload_states(include=[S.lp_params, S.lp_grads, S.contiguous_grad_buffer],
                              pin_memory=pin_memory)
    if host is None:
        host = [torch.empty_like(t, device="cpu", pin_memory=pin_memory)
                for t in opt.fp32_partitioned_groups_flat]
    for t, buf in zip(opt.fp32_partitioned_groups_flat, host):
        buf.copy_(t)
        t.data = buf
    offload_adam_states(opt.optimizer, "cpu", pin_memory=pin_memory)
    free_accelerator_cache()
    return host


def reload_engine(engine, device: torch.device) -> None:
    """Undo ``offload_engine``."""
    from deepspeed.runtime.utils import reload_adam_states

    opt = engine.optimizer
    engine.reload_states()
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        for t in opt.fp32_partitioned_groups_flat:
            t.data = t.data.to(device)
        reload_adam_states(opt.optimizer, device)


def free_accelerator_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
