"""Fused decode projections: q/k/v (and gate/up) as one GEMM each in the compiled decode step.

A decode step multiplies a few rows by every weight matrix, and each GEMM then costs a few
microseconds whatever its size (``benchmarks/probe_decode_gemms.py``: seven GEMMs per layer of
the Qwen3-0.6B shape take 1.20 ms at 64 rows on an H200, the same weights in four GEMMs
0.99 ms). ``SamplerConfig.fuse_projections`` runs the projections that read the same input as
one GEMM, without changing a single parameter name, shape or value:

* ``ProjectionGroups.fuse(model)``: in every module with ``q_proj``/``k_proj``/``v_proj`` or
  ``gate_proj``/``up_proj`` linears of one input width, dtype and device (and biases on all
  or none), the weights (and biases) move into one flat buffer, rows back to back in that
  order; each parameter stays the same ``Parameter`` object, now a view of the buffer, so
  ``named_parameters``, weight loads (in place), checksums and the eager forward see nothing
  new. ``to(device)`` moves each buffer whole (``Module.to`` would split it into one tensor
  per parameter); the runner calls it before moving the model.
* ``fuse_linear_calls(gm)``: a pass over the compiled step's FX graph (the backend runs it
  before Inductor). Linear calls on the same input whose weights (and biases) are graph inputs
  become one ``polynya::fused_linear`` call and a ``narrow`` per original output.
* ``fused_linear(x, weights, biases)``: one ``F.linear`` over the weights' rows when they are
  back to back in one storage (checked on every call, i.e. at every CUDA-graph capture), else
  one ``F.linear`` per weight, concatenated — never a wrong number when the layout changed.

Where nothing is found (other families' names, mixed dtypes) nothing changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def adjacent_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (2-D, or 1-D biases) as one tensor over their rows when they lie back to
    back, contiguous, in one storage (a view, nothing copied); else None (also for none)."""
    if not tensors:
        return None
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
               and t.dim() == first.dim() and t.shape[1:] == first.shape[1:] for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


@torch.library.custom_op("polynya::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, weights: list[torch.Tensor],
                 biases: list[torch.Tensor]) -> torch.Tensor:
    """``cat([F.linear(x, w, b) for ...], -1)`` (``biases``: one per weight, or empty), as one
    GEMM when the weights (and biases) are adjacent. ``ValueError`` for no weights or a bias
    list of another length."""
    if not weights or (biases and len(biases) != len(weights)):
        raise ValueError(f"fused_linear needs one or more weights and one bias per weight or "
                         f"none; got {len(weights)} weights, {len(biases)} biases")
    w = adjacent_rows(weights)
    b = adjacent_rows(biases) if biases else None
    if w is not None and (not biases or b is not None):
        return F.linear(x, w, b)
    bs = biases if biases else [None] * len(weights)
    return torch.cat([F.linear(x, wi, bi) for wi, bi in zip(weights, bs)], dim=-1)


@fused_linear.register_fake
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


class ProjectionGroups:
    """The fused groups of a model: ``(members, flat weight, flat bias or None)`` each."""

    def __init__(self) -> None:
        self.groups: list[tuple[list[torch.nn.Linear], torch.Tensor, torch.Tensor | None]] = []

    @classmethod
    def fuse(cls, model: torch.nn.Module) -> ProjectionGroups:
        out = cls()
        for module in model.modules():
            for names in GROUPS:
                members = [getattr(module, n, None) for n in names]
                if all(isinstance(m, torch.nn.Linear) for m in members) and _fusable(members):
                    out.groups.append(_fuse(members))
        return out

    def __len__(self) -> int:
        return len(self.groups)

    @torch.no_grad()
    def to(self, device: torch.device | str) -> None:
        """Move every group's buffers whole and re-point its members (before ``Module.to``,
        which then leaves them where they are)."""
        for i, (members, w, b) in enumerate(self.groups):
            w = w.to(device)
            b = None if b is None else b.to(device)
            _point(members, w, b)
            self.groups[i] = (members, w, b)

    def intact(self) -> bool:
        """Whether every member is still a view of its group's buffer (nothing moved them)."""
        return all(adjacent_rows([m.weight for m in members]) is not None
                   and members[0].weight.data_ptr() == w.data_ptr()
                   for members, w, _ in self.groups)


def _fusable(members: list[torch.nn.Linear]) -> bool:
    w0 = members[0].weight
    has_bias = [m.bias is not None for m in members]
    return (all(m.weight.dim() == 2 and m.weight.shape[1] == w0.shape[1]
                and m.weight.dtype == w0.dtype and m.weight.device == w0.device for m in members)
            and (all(has_bias) or not any(has_bias))
            and len({id(m.weight) for m in members}) == len(members))


@torch.no_grad()
def _fuse(members: list[torch.nn.Linear]):
    ws = [m.weight for m in members]
    w = torch.cat([t.detach() for t in ws], dim=0)
    b = None
    if members[0].bias is not None:
        b = torch.cat([m.bias.detach() for m in members], dim=0)
    _point(members, w, b)
    return members, w, b


def _point(members: list[torch.nn.Linear], w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Each member's weight (bias) becomes the view of its rows of ``w`` (``b``); the same
    ``Parameter`` objects (``.data`` re-pointed)."""
    start = 0
    for m in members:
        n = m.weight.shape[0]
        m.weight.data = w[start:start + n]
        if b is not None:
            m.bias.data = b[start:start + n]
        start += n


def fuse_linear_calls(gm: torch.fx.GraphModule) -> int:
    """Replace linear calls that share their input and whose weights (and biases: all or
    none) are graph inputs by one ``polynya::fused_linear`` and a ``narrow`` each, in graph
    order; returns the number of fused calls made. The graph is recompiled when changed."""
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if isinstance(w, torch.fx.Node) and w.op == "placeholder" and (
                b is None or (isinstance(b, torch.fx.Node) and b.op == "placeholder")):
            by_input.setdefault(x, []).append(node)
    made = 0
    for x, calls in by_input.items():
        calls = [c for c in calls if _width(c) is not None]
        with_bias = [c for c in calls if _bias(c) is not None]
        if len(with_bias) not in (0, len(calls)) or len(calls) < 2:
            continue
        widths = [_width(c) for c in calls]
        with gm.graph.inserting_before(calls[0]):  # graph order: every weight and x exist here
            fused = gm.graph.call_function(
                torch.ops.polynya.fused_linear.default,
                (x, [c.args[1] for c in calls], [_bias(c) for c in calls] if with_bias else []))
            start = 0
            for c, n in zip(calls, widths):
                part = gm.graph.call_function(torch.narrow, (fused, -1, start, n))
                c.replace_all_uses_with(part)
                start += n
        for c in calls:
            gm.graph.erase_node(c)
        made += 1
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _bias(node: torch.fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _width(node: torch.fx.Node) -> int | None:
    """The output width of a linear call (its weight's rows), from the traced example."""
    w = node.args[1].meta.get("example_value")
    if w is None or w.dim() != 2 or isinstance(w.shape[0], torch.SymInt):
        return None
    return int(w.shape[0])


__all__ = ["GROUPS", "ProjectionGroups", "adjacent_rows", "fuse_linear_calls", "fused_linear"]
