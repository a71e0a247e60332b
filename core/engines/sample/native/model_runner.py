"""Runs the HF model over the paged KV cache: packs a step's inputs, plans, forwards, copies pages.

The model is loaded with ``attn_implementation="polynya_paged"`` (see ``attention.py``); each
step it gets one packed row of new tokens with their true positions and a ``StepContext`` in
its ``**kwargs``. The cache is one tensor ``[layers, 2, num_blocks, block_size, Hkv, D]``.

Decode with FCA builds the forest plan (``polynya.kernels.fca.plan_forest``) once per step from
the block tables; every layer reuses it. With ``SamplerConfig.compile_decode`` the decode step's
model runs through ``torch.compile`` (``compiled.py``), and with ``compile_prefill`` each
prefill layer runs as compiled regions around its attention (``compiled_prefill.py``); either
way CUDA graphs (``cuda_graph.py``) capture the whole decode step.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch
from polynya.checksum import checksum_views
from polynya.config.common import resolve_dtype
from polynya.config.sampler import SamplerConfig
from polynya.kernels.fca import plan_forest
from polynya.model_features import attention_features, decoder_layers
from polynya.models import load_model
from polynya.verified_copy import VerifiedBucketCopy, load_verified, verified_plan
from polynya.weights import BucketCopyPlan, FlatBuckets, WeightPieces, check_tied, checked_pairs

from ..scoring import PromptLogprobs, score_hidden
from . import attention
from .compiled import CompiledDecode, routes_of
from .compiled_prefill import CompiledPrefill, prefill_compile_reason
from .cuda_graph import DecodeGraphs, GraphCaptureError
from .decode_inputs import DecodeInputs
from .fused_projections import ProjectionGroups
from .kv_memory import KVMemory
from .sequence import Sequence

KV_AUTO_FRACTION = {"cpu": 0.1, "cuda": 0.4}  # share of free memory a default-sized cache may take
ROOM_RESERVE = 1 << 29  # room_bytes: CUDA-graph pools, compile workspaces, fragmentation


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device``: ``cudaMemGetInfo`` on CUDA, the OS's available RAM on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    """Owns the model and the KV cache of a native sampling engine."""

    def __init__(self, config: SamplerConfig) -> None:
        attention.register()
        self.config = config
        self.device = torch.device(config.torch_device)
        self.dtype = resolve_dtype(config.dtype)
        self.model = load_model(config.model, dtype=self.dtype, device=self.device, seed=config.seed,
                                attn_implementation=attention.NAME)
        hf = self.model.config
        self.features = attention_features(self.model)
        self.features.require("the native sampler", config.model, supported=attention.SUPPORTS,
                              alternative="use SamplerConfig(backend='vllm') for this model")
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf.num_key_value_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.vocab_size = hf.vocab_size
        self.max_positions = getattr(hf, "max_position_embeddings", None)
        self.block_size = config.block_size
        longest = min(x for x in (self.max_positions, config.max_model_len, 1 << 62) if x)
        if config.num_blocks is not None:
            self.num_blocks = config.num_blocks
        elif config.kv_cache_memory_gb is not None:
            self.num_blocks = self._blocks_for_budget(config.kv_cache_memory_gb)
        else:
            self.num_blocks = self._blocks_auto(longest)
        self.max_model_len = min(longest, self.num_blocks * self.block_size)
        self._check_max_model_len()
        # FCA serves full-attention layers only (windowed ones decode paged): no plan without one
        self.use_fca = config.fca and None in self.features.layer_windows
        self.last_step_fca = False  # whether the last decode step took the FCA path
        self._fca_key: tuple[int, ...] = ()
        self._fca_saved = 0
        self.weights_offloaded = False
        self._copy_plans: dict = {}  # FlatBuckets layout -> BucketCopyPlan (dropped when weights move)
        self.kv: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.graphs_error: str | None = None  # why decode runs without CUDA graphs
        self._graphs_kv_ptr = 0
        self._retired_captures = [0, 0.0]  # captures / seconds of graphs since dropped
        self.compiled = None  # the compiled decode step (compiled.py), when compile_decode is on
        # q/k/v and gate/up weights in one buffer each (fused_projections.py), when asked for
        self.projections: ProjectionGroups | None = None
        if config.decode_compiled(self.device.type):
            if config.projections_fused(self.device.type):
                self.projections = ProjectionGroups.fuse(self.model)
            self.compiled = CompiledDecode(self.model, self._decode_context, self._decode_eager,
                                           self.num_blocks, self.block_size, config.model,
                                           scope=config.compile_scope,
                                           fuse_projections=bool(self.projections))
        # prefill layers as compiled regions (compiled_prefill.py), when asked for and verified
        self.prefill_compiled: CompiledPrefill | None = None
        self.prefill_compile_reason: str | None = "compile_prefill is off"
        if config.prefill_compiled(self.device.type):
            layers, why = decoder_layers(self.model)
            self.prefill_compile_reason = prefill_compile_reason(layers, why)
            if self.prefill_compile_reason is None:
                self.prefill_compiled = CompiledPrefill(config.model)
                routes_of(layers).prefill = self.prefill_compiled
        shape = (self.num_layers, 2, self.num_blocks + 1, self.block_size, self.num_kv_heads,
                 self.head_dim)
        self._kv_memory = KVMemory(shape, self.dtype, self.device)
        self.allocate_kv()

    # ---------------------------------------------------------------- cache
    def _check_max_model_len(self) -> None:
        """``ValueError`` when an explicit ``SamplerConfig.max_model_len`` is longer than the
        model's window or than the KV cache holds: served shorter, its completions would end
        early with ``finish_reason="length"`` and no error. Unset, the window is the shorter
        of the two."""
        asked = self.config.max_model_len
        if asked is None or asked <= self.max_model_len:
            return
        if self.max_positions and self.max_positions < asked:
            why = f"the model's window is {self.max_positions} tokens"
        else:
            why = (f"the KV cache holds {self.num_blocks * self.block_size} tokens ({self.num_blocks} "
                   f"blocks of {self.block_size}); raise num_blocks / kv_cache_memory_gb")
        raise ValueError(f"SamplerConfig.max_model_len={asked} cannot be served: {why}, or lower "
                         "max_model_len")

    def _block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def kv_bytes(self) -> int:
        """Bytes of the KV cache (scratch page included)."""
        return self._kv_memory.nbytes

    def room_bytes(self, level: int) -> int:
        """Device bytes a generate needs beyond what stays on the device at sleep ``level``
        (0: awake, 1: KV cache freed, 2: weights off too): the KV cache and weights ``wake``
        brings back, plus an estimate of the working memory of the largest step (one prefill
        of ``max_num_batched_tokens`` through a layer, logits and sampling for
        ``max_num_seqs`` rows) and ``ROOM_RESERVE`` for graph pools and fragmentation."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        if self.device.type != "cuda":
            return 0
        hf = self.model.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        width = 6 * hf.hidden_size + 3 * (getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size) \
            + (hf.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim
        working = (self.config.max_num_batched_tokens * width * elem
                   + self.config.max_num_seqs * self.vocab_size * 4 * 3 + ROOM_RESERVE)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return working + (self.kv_bytes() if level >= 1 else 0) + (weights if level == 2 else 0)

    def _blocks_for_budget(self, gib: float) -> int:
        n = int(gib * 2**30) // self._block_bytes()
        if n < 1:
            raise ValueError(f"kv_cache_memory_gb={gib} holds no block of {self._block_bytes()} bytes")
        return n

    def _blocks_auto(self, longest: int) -> int:
        """Default cache size: what ``max_num_seqs`` sequences of the longest length can use,
        capped at ``KV_AUTO_FRACTION`` of the device's free memory (host RAM on the CPU)."""
        if longest >= 1 << 62:
            raise ValueError(f"{self.config.model}: no context length known; set SamplerConfig."
                             "max_model_len, num_blocks or kv_cache_memory_gb")
        want = self.config.max_num_seqs * -(-longest // self.block_size)
        free = available_memory(self.device)
        room = int(free * KV_AUTO_FRACTION[self.device.type]) // self._block_bytes()
        if room < 1:
            raise ValueError(f"{free / 2**30:.2f} GiB free on {self.device} holds no KV block of "
                             f"{self._block_bytes()} bytes; set SamplerConfig.num_blocks")
        return min(want, room)

    def allocate_kv(self) -> None:
        """The cache, plus one scratch page (id ``num_blocks``) that CUDA-graph padding rows
        write into; the block manager never hands it out. Decode graphs are kept across a
        ``free_kv`` / ``allocate_kv`` pair when the cache comes back at the address they were
        captured with (always, with ``KVMemory.stable``): a colocated sampler then captures
        each graph once per process, not once per wake."""
        self.kv = self._kv_memory.allocate()
        if self.graphs is not None and self._graphs_kv_ptr != self.kv.data_ptr():
            self._drop_graphs()  # captured against another cache address
        if (self.graphs is None and self.device.type == "cuda" and self.config.cuda_graphs
                and self.graphs_error is None):
            width = -(-self.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(self._decode_forward, self.config.max_num_seqs, width,
                                       self.block_size, self.num_blocks, self.device)
            self._graphs_kv_ptr = self.kv.data_ptr()

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self._retired_captures[0] += self.graphs.captures
            self._retired_captures[1] += self.graphs.capture_s
        self.graphs = None

    def graph_stats(self) -> tuple[int, float]:
        """CUDA-graph captures since start and the wall seconds they took."""
        n, s = self._retired_captures
        if self.graphs is not None:
            n, s = n + self.graphs.captures, s + self.graphs.capture_s
        return n, s

    def compile_stats(self) -> dict[str, int | float | str | None]:
        """``compiles`` of the decode step by this runner, ``compile_s`` (the wall seconds of
        the calls that compiled), ``compile_scope`` (the scope compiled: ``"layers"`` /
        ``"model"``; None with ``compile_decode`` off), ``compile_scope_reason`` (why it is
        not the configured one, else None), ``fused_groups`` (weight groups sharing a buffer,
        ``fuse_projections``) and ``fused_calls`` (linear groups the compiled graphs run as
        one GEMM); ``prefill_compiles`` / ``prefill_compile_s`` the same for the prefill's
        compiled layers (``compile_prefill``) and ``prefill_compile_reason`` why prefill runs
        eagerly (None while it runs compiled)."""
        c, p = self.compiled, self.prefill_compiled
        groups = len(self.projections) if self.projections is not None else 0
        stats = {"fused_groups": groups, "fused_calls": 0, "compiles": 0, "compile_s": 0.0,
                 "compile_scope": None, "compile_scope_reason": None,
                 "prefill_compiles": p.compiles if p is not None else 0,
                 "prefill_compile_s": p.compile_s if p is not None else 0.0,
                 "prefill_compile_reason": p.error if p is not None else self.prefill_compile_reason}
        if c is not None:
            stats.update(fused_calls=c.fused_calls, compiles=c.compiles, compile_s=c.compile_s,
                         compile_scope=c.scope, compile_scope_reason=c.scope_reason)
        return stats

    def _disable_graphs(self, exc: GraphCaptureError) -> None:
        """Decode eagerly from now on (the path every correctness test checks), and say why."""
        self._drop_graphs()
        self.graphs_error = str(exc)
        warnings.warn(f"{self.config.model}: the decode step cannot be captured as a CUDA graph "
                      f"({exc}); decoding without CUDA graphs (set cuda_graphs=False to silence)",
                      RuntimeWarning, stacklevel=3)

    def free_kv(self) -> None:
        """Release the cache's device memory (graphs are kept; see ``allocate_kv``)."""
        self.kv = None
        self._kv_memory.release()
        if self.device.type == "cuda" and not self._kv_memory.stable:
            torch.cuda.empty_cache()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: page ``src`` → page ``dst`` in every layer, keys and values."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv[:, :, dst] = self.kv[:, :, src]

    def eos_token_ids(self) -> frozenset[int]:
        """The model's EOS ids (config and generation config); empty when it has none."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (self.model.config, gen):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return frozenset(ids)

    # ---------------------------------------------------------------- one step
    def _to_device(self, arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(arr).to(dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prefill_inputs(self, seqs: list[Sequence]):
        ids, pos, slots, ranges, cached, tables, last = [], [], [], [], [], [], []
        start = 0
        for seq in seqs:
            c, n = seq.num_cached_tokens, len(seq)
            ids.extend(seq.token_ids[c:])
            pos.append(np.arange(c, n))
            slots.append(self._slots(seq, c, n))
            ranges.append((start, start + n - c))
            cached.append(c)
            tables.append(torch.tensor(seq.block_table, device=self.device) if c else None)
            start += n - c
            last.append(start - 1)
        ctx = attention.StepContext(self._caches(), self._to_device(np.concatenate(slots), torch.int64),
                                    is_prefill=True, q_ranges=ranges, cached_lens=cached,
                                    prefill_tables=tables, features=self.features,
                                    varlen=self._prefill_varlen(seqs, ranges, cached)
                                    if self.device.type == "cuda" else None)
        return (np.asarray(ids, dtype=np.int64), np.concatenate(pos), ctx,
                self._to_device(np.asarray(last, dtype=np.int64), torch.int64))

    def _prefill_varlen(self, seqs: list[Sequence], ranges: list[tuple[int, int]],
                        cached: list[int]) -> attention.PrefillVarlen | None:
        """The step's varlen segments (used on CUDA: one attention call per layer for every
        sequence; the CPU runs one SDPA call per sequence)."""
        return attention.prefill_varlen(
            [b - a for a, b in ranges], cached,
            lambda: np.concatenate([self._slots(s, 0, len(s)) for s in seqs]), self._to_device)

    @staticmethod
    def shares_pages(seqs: list[Sequence]) -> bool:
        """Whether any two sequences share KV pages. Shared prefixes start at page 0, so
        comparing first pages is exact; with nothing shared FCA has nothing to save and the
        step takes the plain paged path (no plan, no merge)."""
        return len({s.block_table[0] for s in seqs}) < len(seqs)

    def fca_pays(self, seqs: list[Sequence]) -> bool:
        """Whether FCA beats the paged kernel on this step: the KV reads it saves per layer
        (page reads beyond the first reader of each page, in tokens) reach
        ``config.fca_min_shared_tokens``. Decode steps add private pages only, so the count
        changes with the set of rows; it is computed once per row set."""
        key = tuple(s.seq_id for s in seqs)
        if key != self._fca_key:
            pages = np.concatenate([s.table_np() for s in seqs])
            saved = (len(pages) - len(np.unique(pages))) * self.block_size
            self._fca_key, self._fca_saved = key, saved
        return self._fca_saved >= self.config.fca_min_shared_tokens

    def _decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                        tables: torch.Tensor, lens: torch.Tensor, fca: bool) -> torch.Tensor:
        """One decode step on device tensors (eager or compiled, maybe being captured into a
        CUDA graph): ids / pos ``[1, B]``, slots ``[B]``, tables ``[B, width]`` int32, lens
        ``[B]`` int32; ``[B, V]`` logits."""
        if self.compiled is not None:
            return self.compiled(ids, pos, slots, tables, lens, fca)
        return self._decode_eager(ids, pos, slots, tables, lens, fca)

    def _decode_eager(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      tables: torch.Tensor, lens: torch.Tensor, fca: bool) -> torch.Tensor:
        ctx = self._decode_context(slots, tables, lens, fca, whole_cache=False)
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, **{attention.CTX_KWARG: ctx})
        return out.logits[0]

    def _decode_context(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                        fca: bool, whole_cache: bool = True) -> attention.StepContext:
        """A decode step's context; plans FCA (once per step, every layer reuses it). With
        ``whole_cache`` (the compiled step) layers get the cache as one tensor."""
        caches = [] if whole_cache and self.kv is not None else self._caches()
        plan = plan_forest(tables, lens, self.block_size, validate=False,
                           chunk_tokens=self.config.fca_chunk_tokens) if fca else None
        return attention.StepContext(caches, slots, is_prefill=False,
                                     block_tables=tables, seq_lens=lens, plan=plan,
                                     fca_shared_progs_per_sm=self.config.fca_shared_progs_per_sm,
                                     features=self.features, cache=self.kv if whole_cache else None)

    def _caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.kv is None:
            raise RuntimeError("the KV cache is released (engine asleep); call wake() first")
        return [(self.kv[i, 0], self.kv[i, 1]) for i in range(self.num_layers)]

    def use_fca_for(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of ``seqs`` takes FCA (on, pages shared, and it pays)."""
        return self.use_fca and self.shares_pages(seqs) and self.fca_pays(seqs)

    def decode_rows(self, rows: int) -> int:
        """The rows a decode step of ``rows`` sequences runs as: its CUDA-graph bucket (padding
        rows included) when a graph serves it, else ``rows``. Two paged steps of one such size
        give each row bit-identical numbers whatever the other rows hold (every kernel computes
        a row from that row alone, at a size fixed by the step's)."""
        bucket = self.graphs.bucket(rows) if self.graphs is not None else None
        return rows if bucket is None else bucket

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, inputs: DecodeInputs | None = None,
            device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one step. Returns ``[len(seqs), V]`` next-token logits (model dtype).
        ``inputs``: a decode step's arrays when the caller built them (async scheduling
        prepares them while the previous step runs); built from ``seqs`` otherwise.
        ``device_ids``: a decode step's token ids ``[B]`` on the device (the previous step's
        sampled tokens, launched before the host has them), instead of ``inputs.ids``."""
        if is_prefill:
            ids, pos, ctx, last = self._prefill_inputs(seqs)
            out = self.model(input_ids=self._to_device(ids, torch.int64)[None],
                             position_ids=self._to_device(pos, torch.int64)[None],
                             use_cache=False, logits_to_keep=last, **{attention.CTX_KWARG: ctx})
            return out.logits[0]
        if inputs is None:
            inputs = DecodeInputs.build(seqs, self.block_size)
        ids, pos, slots, tables, lens = inputs.astuple()
        fca = self.use_fca_for(seqs)
        self.last_step_fca = fca
        if self.graphs is not None and self.graphs.bucket(len(seqs)) is not None:
            try:
                return self.graphs.run(ids, pos, slots, tables, lens, fca, device_ids)
            except GraphCaptureError as exc:
                self._disable_graphs(exc)
        # a fresh inference tensor like the host path's (what the compiled step was traced on)
        ids_dev = (device_ids.clone() if device_ids is not None
                   else self._to_device(ids, torch.int64))
        return self._decode_forward(ids_dev[None],
                                    self._to_device(pos, torch.int64)[None],
                                    self._to_device(slots, torch.int64),
                                    self._to_device(tables, torch.int32),
                                    self._to_device(lens.astype(np.int32), torch.int32), fca)

    @torch.inference_mode()
    def score(self, seqs: list[list[int]], top_k: int, temperature: float) -> list[PromptLogprobs]:
        """Prompt log-probs of whole sequences (``polynya.engines.sample.scoring``): a prefill
        that keeps nothing (no pages read or written), packed up to ``max_num_batched_tokens``
        tokens per forward, through the model's base and then its head in chunks."""
        out: list[PromptLogprobs] = []
        group: list[list[int]] = []
        for i, seq in enumerate(seqs):
            group.append(seq)
            tokens = sum(map(len, group))
            nxt = len(seqs[i + 1]) if i + 1 < len(seqs) else None
            if nxt is None or tokens + nxt > self.config.max_num_batched_tokens:
                out.extend(self._score_packed(group, top_k, temperature))
                group = []
        return out

    def _score_packed(self, seqs: list[list[int]], top_k: int, temperature: float) -> list[PromptLogprobs]:
        ranges, start = [], 0
        for seq in seqs:
            ranges.append((start, start + len(seq)))
            start += len(seq)
        varlen = (attention.prefill_varlen([len(s) for s in seqs], [0] * len(seqs), None, self._to_device)
                  if self.device.type == "cuda" else None)
        ctx = attention.StepContext([], None, is_prefill=True, q_ranges=ranges, cached_lens=[0] * len(seqs),
                                    prefill_tables=[None] * len(seqs), features=self.features,
                                    varlen=varlen)
        ids = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=start)
        pos = np.concatenate([np.arange(len(s)) for s in seqs])
        hidden = self.model.base_model(input_ids=self._to_device(ids, torch.int64)[None],
                                       position_ids=self._to_device(pos, torch.int64)[None],
                                       use_cache=False, **{attention.CTX_KWARG: ctx}).last_hidden_state[0]
        pred = np.concatenate([np.arange(a, b - 1) for a, b in ranges])  # row j predicts token j + 1
        stats = score_hidden(self.model.get_output_embeddings(), hidden[self._to_device(pred, torch.int64)],
                             self._to_device(ids[pred + 1], torch.int64), top_k=top_k,
                             temperature=self.features.head_temperature(temperature),
                             softcap=self.features.final_softcap)
        stats = [t.cpu() for t in stats]
        out, at = [], 0
        for seq in seqs:
            n = len(seq) - 1
            out.append(PromptLogprobs(*(t[at:at + n] for t in stats)))
            at += n
        return out

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: WeightPieces, *, checksum: str | None = None) -> None:
        """Copy new weights in place (any form of ``polynya.weights``). Everything is checked
        before anything is copied (``checked_pairs``: names, shapes, dtypes, finite values and
        ``checksum`` when given): a bad piece changes nothing.

        ``FlatBuckets`` (a weight sync's staged buckets) with a ``checksum`` go through a
        ``VerifiedBucketCopy`` made once per layout: one read checks the checksum and finite
        values, then one launch per bucket copies them (``polynya.verified_copy``); without a
        checksum, or when the parameters' dtype or layout differ from the buckets', through a
        ``BucketCopyPlan`` with one ``_foreach_copy_`` after ``checked_pairs``."""
        if load_verified(self._copy_plans, weights, checksum, self._all_params):
            return
        params = self._all_params()
        pairs = checked_pairs(weights, {n: p.shape for n, p in params.items()}, checksum=checksum)
        check_tied(pairs, params)
        if isinstance(weights, FlatBuckets):
            plan = self._copy_plan(weights)
            dst, src = plan.dst, plan.sources(weights.flats)
        else:
            dst, src = [params[n] for n, _ in pairs], [t for _, t in pairs]
        if dst:
            with torch.no_grad():  # one multi-tensor copy (casts / moves where needed)
                torch._foreach_copy_(dst, src)

    def weight_checksum(self) -> str:
        """``polynya.checksum`` of the weights (in their dtype, wherever they are)."""
        return checksum_views(list(self.model.named_parameters()))

    def _all_params(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, tied aliases included."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    def _verified_plan(self, weights: FlatBuckets) -> VerifiedBucketCopy | None:
        """The layout's ``VerifiedBucketCopy`` (None when the parameters cannot take it)."""
        return verified_plan(self._copy_plans, weights, self._all_params)

    def _copy_plan(self, weights: FlatBuckets) -> BucketCopyPlan:
        plan = self._copy_plans.get(weights.key)
        if plan is None or not plan.current():
            params = self._all_params()
            plan = BucketCopyPlan(weights.specs, params)  # ValueError when it does not fit
            self._keep_plan(weights.key, plan)
        return plan

    def _keep_plan(self, key, plan) -> None:
        """Keep ``plan`` and the last plan of the other kind (a plan pins the weights)."""
        kept = {k: p for k, p in self._copy_plans.items() if type(p) is not type(plan)}
        self._copy_plans = {**kept, key: plan}

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of every weight ``load_weights`` accepts (tied aliases too)."""
        return {n: (tuple(p.shape), p.dtype)
                for n, p in self.model.named_parameters(remove_duplicate=False)}

    def offload_weights(self) -> None:
        self._copy_plans = {}  # its views would keep the device weights alive
        if self.device.type == "cuda" and not self.weights_offloaded:
            self._drop_graphs()  # captured against the weights' device addresses
            if self.projections is not None:
                self.projections.to("cpu")  # each fused buffer whole (Module.to splits it)
            self.model.to("cpu")
            self.weights_offloaded = True
            torch.cuda.empty_cache()

    def onload_weights(self) -> None:
        self._copy_plans = {}
        if self.weights_offloaded:
            if self.projections is not None:
                self.projections.to(self.device)
            self.model.to(self.device)
            self.weights_offloaded = False
