"""The prefill's decoder layers as two compiled regions each (``SamplerConfig.compile_prefill``).

A prefill step runs every new prompt token of the step through the model in one packed row
(up to ``max_num_batched_tokens``): at long prompts it is GPU-bound, and in an eager HF layer a
large share of its kernels are element-wise (RMSNorms, Qwen3's q/k norms, RoPE on transposed
views, SiLU * mul, residuals, casts) that Inductor fuses around the GEMMs. Each decoder layer of
a prefill then runs as ``polynya.compiled_layers``' two regions — *before* (input norm, q/k/v
projections, q/k norms, RoPE) and *after* (output projection, residual, post-attention norm,
MLP, residual) — around the sampler's own attention (``attention.paged_attention``: cache write
and varlen attention), which is called eagerly with the arguments the class's forward passes
it (sliding window included). So:

- shapes are dynamic: one compile per region for every prompt length (a one-token prefill
  specialises once more, as torch does for size 1), on the first prefill of the runner
  (``compiles`` / ``compile_s``; Inductor's on-disk cache makes a later process cheaper);
- the runner's regions are its own (fresh code objects: ``layer_regions(shared=False)``), so a
  colocated trainer's ``compile_layers`` graphs and recompile budget are not shared with them;
- only the families ``compiled_layers`` verifies (dense Llama, Qwen2, Qwen3, Mistral) run
  compiled; any other decodes with an eager prefill and ``reason`` says why;
- a call the regions do not cover (``compiled_layers.covered_kwargs``) runs the layer's own
  forward, and a failure to compile (a Dynamo / Inductor error, or any error raised by a call
  that compiled) makes this runner prefill eagerly from then on, with a ``RuntimeWarning``
  saying why — the failed layer call re-runs eagerly (a cache write it made is rewritten with
  the same values), never different numbers. Other errors (out of memory, the attention's own
  checks) are raised as the eager layer raises them, and the regions stay on;
- scoring passes (prompt log-probs, a prefill without cache writes) run the same regions;
  decode steps are untouched (``compiled.Routes``).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from polynya.compiled_layers import covered_kwargs, family_reason, layer_regions, run_regions

from .compiled import _DYNAMO_SETTINGS, COMPILE_ERRORS, describe_failure


def prefill_compile_reason(layers: torch.nn.ModuleList | None, why: str | None) -> str | None:
    """Why a model's prefill cannot run compiled (``decoder_layers``' answer ``layers, why``
    and the layers' family), or None when it can."""
    if layers is None:
        return why or "the decoder layers were not found"
    return family_reason(type(layers[0]))


class CompiledPrefill:
    """A runner's compiled prefill layers (module docstring); ``Routes.prefill`` calls it.

    Args:
        name: how warnings name the model.
        backend: ``torch.compile`` backend; None: Inductor, each compile counted.
    """

    def __init__(self, name: str, backend: str | Callable | None = None) -> None:
        self.name = name
        self.backend = backend if backend is not None else self._inductor
        self.compiles = 0
        self.compile_s = 0.0
        self.error: str | None = None  # why prefill runs eagerly now
        self._regions: dict[type, Any] = {}

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        return compile_fx(gm, example_inputs)

    def __call__(self, layer: torch.nn.Module, forward: Callable, args: tuple,
                 kwargs: dict) -> Any:
        """One decoder layer's prefill call: the compiled regions when they cover it, else
        ``forward`` (the layer's own). A failure to compile (a Dynamo / Inductor error, or any
        error of a call that compiled) makes this runner prefill eagerly from then on; any
        other error — out of memory, bad inputs, the attention's own checks — is raised as the
        eager layer would raise it, and the regions stay on."""
        covered = None if self.error is not None else covered_kwargs(layer, args, kwargs)
        if covered is None:
            return forward(*args, **kwargs)
        before, start = self.compiles, time.perf_counter()
        try:
            regions = self._regions.get(type(layer))
            if regions is None:
                regions = self._regions[type(layer)] = layer_regions(
                    type(layer), self.backend, dynamic=True, shared=False)
            with _DYNAMO_SETTINGS:
                return run_regions(regions, layer, *args, **covered)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if not isinstance(exc, COMPILE_ERRORS) and self.compiles == before:
                raise
            failure = describe_failure(exc)  # the message only: the traceback's tensors are freed
        finally:
            if self.compiles != before:
                self.compile_s += time.perf_counter() - start
        self._fail(failure)
        return forward(*args, **kwargs)  # the failed call again, eagerly (cache writes repeat)

    def _fail(self, failure: str) -> None:
        self.error = failure
        warnings.warn(f"{self.name}: the prefill's layers cannot be compiled ({self.error}); "
                      "prefilling with the eager model from now on (set compile_prefill=False "
                      "to silence)", RuntimeWarning, stacklevel=4)
