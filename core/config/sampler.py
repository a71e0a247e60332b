"""``SamplerConfig``: how to build a sampling engine (``polynya.engines.SamplingEngine``).

One dataclass for every backend; fields a backend does not use are ignored by it. Validated in
``__post_init__`` so a typo fails before a model is loaded::

    cfg = SamplerConfig("tiny:qwen3", dtype="float32", block_size=16, num_blocks=256)
    engine = SamplingEngine(cfg)

KV-cache size: ``num_blocks`` when given, else ``kv_cache_memory_gb`` split over the model's
layers (a block holds ``block_size`` tokens of keys and values for every layer), else (the
default) sized from the model and the machine: enough blocks for ``max_num_seqs`` sequences of
the longest length (``max_model_len`` or the model's window), capped at 10 % of the host's
available RAM on the CPU and 40 % of the GPU's free memory on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

from .common import check_model_spec, check_positive, resolve_dtype

BACKENDS = ("native", "vllm")
COMPILE_SCOPES = ("layers", "model")


@dataclass
class SamplerConfig:
    """Sampling-engine settings.

    Args:
        model: HF id, local path, ``tiny:<family>`` or ``random:<shape>`` (``polynya.models``).
        dtype: parameter and KV-cache dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        backend: ``"native"`` (embedded, runs anywhere) or ``"vllm"`` (``polynya[vllm]``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ... ; ``None`` picks CUDA when available.
        block_size: tokens per KV-cache block (page).
        num_blocks: KV-cache blocks; ``None`` sizes the cache from ``kv_cache_memory_gb``.
        kv_cache_memory_gb: KV-cache budget in GiB when ``num_blocks`` is ``None``; ``None``:
            sized from the model and the machine (module docstring).
        max_num_seqs: most sequences decoded together in one step (max batch size).
        max_num_batched_tokens: most prompt tokens computed in one prefill step.
        max_model_len: longest sequence (prompt + completion); ``None`` = the model's window.
        fca: decode with forest cascade attention (shared prefixes read once per group).
        fca_min_shared_tokens: a decode step takes FCA only when its sequences share at least
            this many KV tokens beyond the first reader of each page (the reads FCA saves per
            layer); below it the plain paged kernel is faster (FCA's plan, second pass and
            merge cost more than the saved reads — calibrated on an H200 with the Qwen3-0.6B
            shape: 0.9x at 14k saved tokens, 1.7x at 491k). 0 = whenever pages are shared.
        fca_chunk_tokens: (native backend) FCA's split-K granularity: a shared prefix is read
            in items of at most this many tokens (``plan_forest(chunk_tokens=)``), each item a
            unit of work of the shared pass. Smaller = more units (a long prefix spread over
            more SMs) and more partials to merge.
        fca_shared_progs_per_sm: (native backend) persistent programs per SM of FCA's shared pass,
            which runs on a side stream beside the private rows' paged kernel
            (``DecodeConfig.shared_progs_per_sm``). The defaults (1024, 2; the kernel's own are
            2048, 1) suit a generation's decode steps, whose private suffixes are short next to the
            prompt: on an H200 (Qwen3-0.6B shape) FCA's call at 8 prompts x G8, P6400, S16-128 takes
            0.107 ms against 0.154 ms with the kernel's defaults, the long-context QA recipe's
            decode step 5.07 against 6.3 ms; at 8 x G16, P4096 over 512 new tokens the sampler's
            step is the same (4.72 against 4.73-4.78 ms). ``benchmarks/probe_fca_suffix.py`` and
            ``bench_sampler.py --fca-profiles`` measure others.
        cuda_graphs: replay decode steps as CUDA graphs (CUDA only; captured per batch bucket).
        async_scheduling: prepare each decode step on the host while the device runs the one
            before it, and launch it as soon as that step's tokens are back — before they are
            booked (``polynya.engines.sample.native.engine``). Same tokens, log-probs and
            finish reasons as without; steps that need the scheduler (prefills, a row needing a
            page, preemption) run synchronously. False: every step is scheduled, run and booked
            in turn.
        compile_decode: run the decode step's model through ``torch.compile`` (Inductor fuses
            the norms, RoPE, activations and residuals around the GEMMs; the paged / FCA
            attention stays one opaque op per layer), captured into the same CUDA graphs.
            Compiles once per engine and attention path (FCA / paged) for every batch size, on
            the first decode steps (seconds to a minute; Inductor's on-disk cache makes later
            ones cheaper; ``stats()["compiles"]`` / ``["compile_s"]``); a model that cannot be
            compiled decodes eagerly with a ``RuntimeWarning``. ``None`` (default): on CUDA, off on the CPU
            (where the compile costs more than a short run saves); ``True`` / ``False`` force it.
        compile_scope: what ``compile_decode`` compiles. ``"layers"`` (default): one decoder
            layer's forward, whose graph every layer of the same kind reuses (its parameters are
            graph inputs), the embedding, rotary, final norm and LM head running eagerly around
            it (inside the same CUDA graphs): a compile costs one layer's trace, not the whole
            model's (about one per attention path and layer kind: 2 for Qwen3, 4 for Gemma 2's
            alternating windowed / full layers). ``"model"``: the whole model's forward, which
            may fuse across layer boundaries (slightly faster steps) at ~N times the compile
            cost. A model whose decoder layers cannot be found compiles as ``"model"``
            (``stats()["compile_scope"]`` says which ran and ``["compile_scope_reason"]`` why).
        compile_prefill: (native backend) run each decoder layer of a prefill (and of a
            prompt-log-prob scoring pass) as two ``torch.compile`` regions around its attention
            (``polynya.engines.sample.native.compiled_prefill``): Inductor fuses the norms,
            RoPE, activations and residuals around the GEMMs; shapes are dynamic, so one compile
            per region serves every prompt length (paid on the first prefill:
            ``stats()["prefill_compiles"]`` / ``["prefill_compile_s"]``). Families
            ``polynya.compiled_layers`` verifies only (dense Llama, Qwen2, Qwen3, Mistral);
            others, or a failed compile, prefill eagerly (``stats()["prefill_compile_reason"]``
            says why; a failure also warns). ``None`` (default): on whenever the decode step is
            compiled (``compile_decode``); ``True`` / ``False`` force it. On an H200 (Qwen3-0.6B
            shape, bf16) 1.65x the eager prefill at 8 prompts x 6.5k tokens, 1.22x at 8 x 256
            (``benchmarks/bench_prefill.py``).
        fuse_projections: in the compiled decode step, run the projections that read the same
            input (q/k/v, gate/up) as one GEMM each (``polynya.engines.sample.native.
            fused_projections``: their weights share one buffer, parameters unchanged). Native
            backend with ``compile_decode`` only (without a compiled step nothing is fused).
            ``None`` (default): on whenever the decode step is compiled (verified on an H200:
            equal fp32 logits and greedy tokens; 2.76 -> 2.45 ms per decode step at 64 rows of
            the Qwen3-0.6B shape); ``False`` keeps separate GEMMs.
        seed: engine seed (model init for random specs; default sampling seeds).
    """

    model: str
    dtype: str = "bfloat16"
    backend: str = "native"
    device: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 32768
    max_model_len: int | None = None
    fca: bool = True
    fca_min_shared_tokens: int = 32768
    fca_chunk_tokens: int = 1024
    fca_shared_progs_per_sm: int = 2
    cuda_graphs: bool = True
    async_scheduling: bool = True
    compile_decode: bool | None = None
    compile_scope: str = "layers"
    fuse_projections: bool | None = None
    compile_prefill: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_model_spec(self.model, "SamplerConfig")
        resolve_dtype(self.dtype)
        if self.backend not in BACKENDS:
            raise ValueError(f"SamplerConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device is not None and (not isinstance(self.device, str)
                                        or not self.device.split(":")[0] in ("cpu", "cuda")):
            raise ValueError(f"SamplerConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_positive(self.block_size, "SamplerConfig.block_size", integer=True)
        if self.num_blocks is not None:
            check_positive(self.num_blocks, "SamplerConfig.num_blocks", integer=True)
        if self.kv_cache_memory_gb is not None:
            check_positive(self.kv_cache_memory_gb, "SamplerConfig.kv_cache_memory_gb")
        check_positive(self.max_num_seqs, "SamplerConfig.max_num_seqs", integer=True)
        if isinstance(self.fca_min_shared_tokens, bool) or not isinstance(self.fca_min_shared_tokens, int) \
                or self.fca_min_shared_tokens < 0:
            raise ValueError("SamplerConfig.fca_min_shared_tokens must be an int >= 0, got "
                             f"{self.fca_min_shared_tokens!r}")
        check_positive(self.fca_chunk_tokens, "SamplerConfig.fca_chunk_tokens", integer=True)
        check_positive(self.fca_shared_progs_per_sm, "SamplerConfig.fca_shared_progs_per_sm",
                       integer=True)
        check_positive(self.max_num_batched_tokens, "SamplerConfig.max_num_batched_tokens", integer=True)
        if self.max_model_len is not None:
            check_positive(self.max_model_len, "SamplerConfig.max_model_len", integer=True)
        for name in ("fca", "cuda_graphs", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise ValueError("SamplerConfig.compile_decode must be True, False or None (on for "
                             f"CUDA, off on the CPU), got {self.compile_decode!r}")
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise ValueError("SamplerConfig.fuse_projections must be a bool or None (on whenever "
                             f"the decode step is compiled), got {self.fuse_projections!r}")
        if self.compile_prefill is not None and not isinstance(self.compile_prefill, bool):
            raise ValueError("SamplerConfig.compile_prefill must be a bool or None (on whenever "
                             f"the decode step is compiled), got {self.compile_prefill!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"SamplerConfig.compile_scope must be one of {COMPILE_SCOPES}, got "
                             f"{self.compile_scope!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"SamplerConfig.seed must be an int, got {self.seed!r}")

    def decode_compiled(self, device_type: str) -> bool:
        """Whether the decode step is compiled on a device of this type (``compile_decode``)."""
        return self.compile_decode if self.compile_decode is not None else device_type == "cuda"

    def prefill_compiled(self, device_type: str) -> bool:
        """Whether prefill layers run compiled on a device of this type (``compile_prefill``;
        by default whenever the decode step is compiled)."""
        if self.compile_prefill is not None:
            return self.compile_prefill
        return self.decode_compiled(device_type)

    def projections_fused(self, device_type: str) -> bool:
        """Whether the compiled decode step fuses its projections on a device of this type
        (``fuse_projections``; never without a compiled step)."""
        if not self.decode_compiled(device_type):
            return False
        return self.fuse_projections if self.fuse_projections is not None else True

    @property
    def call_slots(self) -> int:
        """How many ``generate`` calls one engine serves at once, each on a thread of its own
        (its async API, a client's, a Ray actor's): ``max_num_seqs``, the most sequences one
        decode step batches. Every call brings at least one sequence, so fewer slots would leave
        rows of the batch empty while concurrent callers (an HTTP server's requests) queue
        outside the engine; calls beyond it wait for a slot, as their sequences would wait in
        the scheduler."""
        return self.max_num_seqs

    @property
    def torch_device(self) -> str:
        """The device the engine runs on (resolves ``device=None``)."""
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
