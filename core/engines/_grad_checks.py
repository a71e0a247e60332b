"""Multi-tensor gradient checks for DeepSpeed's ZeRO-1/2 optimizer step (issue 15 goal 4).

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer.step`` looks at the gradients twice, one tensor at a
time: ``has_overflow_partitioned_grads_serial`` runs ``has_inf_or_nan`` (``amax``, ``amin``, two
``isfinite``, an add) per gradient tensor, and ``get_grad_norm_direct`` copies each to the norm
dtype (fp64 on a GPU) and takes its ``vector_norm``. For Qwen3-0.6B's 310 tensors that is ~3,000
kernel launches; on the H200 the optimizer step measured 154 ms of host time for 30 ms of GPU work
(BENCHMARKS.md, "Long-context QA: one 65,536-token micro-batch").

``fuse_grad_checks(optimizer)`` replaces those two methods on one optimizer instance with
multi-tensor equivalents (``torch._foreach_norm``, a handful of launches) that give the same
answers:

- overflow: true iff some gradient element is NaN or infinite. The max-abs norm of a tensor is
  non-finite exactly then (NaN propagates through the maximum; DeepSpeed's ``amax``/``amin`` test
  is the same predicate), and no finite tensor's max-abs norm overflows;
- the global L2 norm: each tensor's norm accumulated in the norm dtype, squared and summed, the
  same filtering of padding, pipeline-replicated and model-parallel parameters, the same
  all-reduces and the same masking of a non-finite result to -1: equal up to the order of
  summation within a tensor.

Everything else keeps DeepSpeed's own methods: another DeepSpeed version, another optimizer class
(ZeRO-0 / ZeRO-3 / BF16_Optimizer), CPU offload, MoE layers, sparse gradients, an infinity norm.

``skip_fp32_overflow(optimizer)`` gives DeepSpeed's ZeRO-3 optimizer the overflow rule of the
other stages. ZeRO-1/2 sum the squared norms and cast the sum to fp32 before the root, and
torch's ``clip_grad_norm_`` (ZeRO-0 in fp32) works in fp32, so a global norm of
``FP32_NORM_LIMIT`` = sqrt(fp32 max) ~ 1.8e19 or more is infinite there and the step is
skipped; ZeRO-3 takes the root in fp64 and would apply such a step (and, without clipping,
square a gradient of that size into Adam's fp32 second moment, which then holds inf for good).
With the rule the ZeRO-3 step takes DeepSpeed's own overflow path: nothing is updated, the
schedule does not advance, ``skipped_steps`` counts it.
"""
from __future__ import annotations

import math
import types

import torch

#: The DeepSpeed release whose two methods these replace (pyproject pins it).
DEEPSPEED_VERSION = "0.19.8"
#: A global gradient norm at least this large overflows on ZeRO-0/1/2 (its square is not an fp32).
FP32_NORM_LIMIT = math.sqrt(torch.finfo(torch.float32).max)


def fuse_grad_checks(optimizer) -> bool:
    """Give ``optimizer`` (a DeepSpeed ZeRO-1/2 optimizer) the multi-tensor checks; returns
    whether it did. Anything it does not recognise is left as it is."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if deepspeed.__version__ != DEEPSPEED_VERSION or type(optimizer) is not DeepSpeedZeroOptimizer:
        return False
    if optimizer.cpu_offload or optimizer.has_moe_layers:
        return False
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(_has_overflow, optimizer)
    optimizer.get_grad_norm_direct = types.MethodType(_grad_norm, optimizer)
    return True


def _has_overflow(self) -> torch.Tensor:
    """``DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial``, multi-tensor: a ``[1]``
    bool tensor on the device, true when a partitioned gradient holds a NaN or an infinity."""
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i]
             if g is not None and g.numel() > 0]
    if any(g.is_sparse for g in grads):
        return type(self).has_overflow_partitioned_grads_serial(self)
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=device)
    peaks = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))
    return torch.isfinite(peaks).all().logical_not().reshape(1).to(device)


def _grad_norm(self, gradients, params, norm_type=2):
    """``DeepSpeedZeroOptimizer.get_grad_norm_direct`` for the L2 norm, multi-tensor; other norms
    and sparse gradients go to DeepSpeed's own."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import (
        is_model_parallel_parameter,
        mask_nan_or_inf_with_val_inplace,
    )
    from deepspeed.runtime.zero.utils import get_norm_dtype

    own = type(self).get_grad_norm_direct
    if float(norm_type) != 2.0:
        return own(self, gradients, params, norm_type)
    kept = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            kept.append(g.data.detach())
    if any(g.is_sparse for g in kept):
        return own(self, gradients, params, norm_type)
    if kept:
        norms = torch._foreach_norm(kept, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).to(self.device).pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total


def skip_fp32_overflow(optimizer) -> bool:
    """Give ``optimizer`` (DeepSpeed's ZeRO-3 optimizer) the other stages' overflow rule (module
    docstring); returns whether it did."""
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if deepspeed.__version__ != DEEPSPEED_VERSION or not isinstance(
            optimizer, DeepSpeedZeroOptimizer_Stage3):
        return False
    optimizer._get_norm_groups = types.MethodType(_norm_groups_fp32, optimizer)
    return True


def _norm_groups_fp32(self) -> list:
    """``DeepSpeedZeroOptimizer_Stage3._get_norm_groups``, with every group's norm made infinite
    when the global norm (combined as ``step()`` combines it, loss scale removed) reaches
    ``FP32_NORM_LIMIT``: ``step()`` then finds an invalid norm and skips the update."""
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm

    groups = type(self)._get_norm_groups(self)
    combined = combine_grad_norm_groups(groups)
    if is_invalid_grad_norm(combined) or float(combined) / self.loss_scale < FP32_NORM_LIMIT:
        return groups
    return [torch.full_like(g, math.inf) if torch.is_tensor(g) else math.inf for g in groups]
