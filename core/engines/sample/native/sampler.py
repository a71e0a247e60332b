"""Batched next-token sampling on the device: temperature, top-k, top-p, min-p, greedy.

One call samples one token for every row of a ``[B, V]`` logits tensor, each row with its own
settings. The filters follow vLLM V1's sampler (``vllm/v1/sample/sampler.py``,
``ops/topk_topp_sampler.py``) in its order: temperature → min-p (a token is removed when its
probability after temperature is below ``min_p`` times the most likely token's) → top-k (every
token whose logit ties the k-th largest is kept) → top-p (on the distribution left after min-p
and top-k, renormalised; the token whose probability crosses ``top_p`` is kept). Sampling is by
inverse CDF: each row
brings one uniform number drawn from its own ``torch.Generator`` (CPU; ``Sequence.next_uniform``)
and the inverse CDF always runs in vocabulary order (top-k / top-p sort only to decide what to
remove), so a seeded request gives the same tokens whatever else is in the batch — neighbours
with other filters included — on CPU and GPU alike.

Returned log-probs are those of the sampled tokens under the distribution actually sampled
from (after temperature and filters): vLLM's ``logprobs_mode="processed_logprobs"``, NOT vLLM's
default ``"raw_logprobs"`` (``log_softmax`` of the model's logits before temperature and
filters). They differ whenever ``temperature != 1`` or a filter removed a token: a caller that
compares them with a trainer's ``log_softmax(logits / temperature)`` (importance ratios, TIS)
gets the matching numbers without filters; under a filter they are of the renormalised
distribution. Greedy rows (``temperature == 0``) sample the first argmax (``torch.argmax``, as
vLLM) and ignore top-k / top-p / min-p; their log-prob is taken under the model distribution
at temperature 1 without filters, as vLLM's processed and raw log-probs of a greedy row both
are. A ``min_tokens`` ban (``sample``'s ``ban``) comes before all of this, greedy rows included:
the log-probs of those tokens are of the distribution without the banned ids, as vLLM's
processed log-probs are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from polynya.types import SamplingParams

from .readback import PINNED_TURNS

FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest top_p the device filter can keep a token with


@dataclass
class SamplingTensors:
    """Per-row settings as device tensors (built once per step). ``temperature`` is 1 for
    greedy rows; ``greedy`` marks them. ``top_k`` is ``V`` where off."""

    temperature: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    uniform: torch.Tensor  # [B] float32 in [0, 1)
    needs_sort: bool  # any row uses top-k or top-p
    needs_min_p: bool
    all_greedy: bool
    any_greedy: bool
    _pinned: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # see with_uniforms
    _turn: int = dataclasses.field(default=0, repr=False)

    @classmethod
    def build(cls, params: list[SamplingParams], uniforms: list[float], vocab_size: int,
              device: torch.device | str) -> SamplingTensors:
        """Gather row settings. ``uniforms``: one U[0, 1) draw per row from the row's own
        generator (ignored for greedy rows)."""
        greedy = [p.temperature == 0 for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [vocab_size if (g or p.top_k < 0) else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        # a positive top_p that is 0 in float32 (below ~1.4e-45) would drop the top token too:
        # the smallest normal float32 keeps exactly it, as any top_p below its probability does
        top_p = [1.0 if g else max(float(p.top_p), FP32_TINY) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        host = torch.tensor([temps, top_p, min_p, list(uniforms)], dtype=torch.float32)
        host_k = torch.tensor(top_k, dtype=torch.int64)
        if str(device).startswith("cuda"):
            host, host_k = host.pin_memory(), host_k.pin_memory()
        dev = host.to(device, non_blocking=True)
        return cls(temperature=dev[0], top_p=dev[1], min_p=dev[2], uniform=dev[3],
                   greedy=torch.tensor(greedy).to(device, non_blocking=True),
                   top_k=host_k.to(device, non_blocking=True),
                   needs_sort=any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p),
                   needs_min_p=any(m > 0 for m in min_p), all_greedy=all(greedy),
                   any_greedy=any(greedy))

    def with_uniforms(self, uniforms: list[float]) -> SamplingTensors:
        """The same row settings with new uniform draws, written in place (one small host-to-
        device copy from pinned buffers taken in turn, ``readback.PINNED_TURNS``): a decode
        step whose rows are the previous step's rows reuses everything else. A step may be
        launched before the previous steps' copies ran; the copy out of a buffer has finished
        when its turn comes again."""
        if self.uniform.is_cuda:
            if self._pinned is None:
                self._pinned = torch.empty((PINNED_TURNS, len(uniforms)),
                                           dtype=torch.float32).pin_memory()
                self._turn = 0
            buf = self._pinned[self._turn]
            self._turn = (self._turn + 1) % PINNED_TURNS
            buf.numpy()[:] = uniforms
            self.uniform.copy_(buf, non_blocking=True)
        else:
            self.uniform.copy_(torch.tensor(uniforms, dtype=torch.float32))
        return self


def filter_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Apply temperature and filters.

    Args:
        logits: ``[B, V]`` float32.
    Returns:
        ``[B, V]`` logits in vocabulary order with removed tokens at ``-inf``. A row without
        filters comes back exactly as ``logits / temperature`` whatever its neighbours ask for
        (so its sample does not depend on the batch).
    """
    x = logits / st.temperature[:, None]
    if st.needs_min_p:  # vLLM: an argmax-invariant logits processor, before top-k / top-p
        probs = x.softmax(dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < st.min_p[:, None] * top, float("-inf"))
    if st.needs_sort:
        xs, order = x.sort(dim=-1, descending=True)
        # top-k by value, not by rank: a token tied with the k-th largest logit stays (vLLM's
        # ``logits_sort < kth``); a row without top-k (k = V) compares with its minimum
        drop = xs < xs.gather(-1, (st.top_k - 1)[:, None])
        probs = xs.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # rank 0 always kept (top_p > 0)
        drop |= (mass_before >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
        x = x.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
    return x


CDF_CHUNK = 2048  # vocabulary chunk of the two-level inverse CDF


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, chunk: int = CDF_CHUNK) -> torch.Tensor:
    """Per row, the first index whose cumulative probability exceeds ``uniform * total``.

    Two levels instead of one scan over the vocabulary: chunk sums, a scan over the chunks to
    find the chunk holding the target, then a scan inside that chunk only. A full-vocabulary
    ``cumsum`` of ``[64, 151936]`` costs ~0.25 ms on an H200 (the scan kernel parallelises over
    rows); this costs a reduction and two small scans. Same inverse CDF; sums are ordered
    differently, so a draw within float rounding of a boundary may pick the neighbour.

    Args:
        probs: ``[B, V]`` float32, non-negative. uniform: ``[B]`` in [0, 1).
    Returns:
        ``[B]`` int64 indices in ``[0, V)``.
    """
    b, v = probs.shape
    if v <= 2 * chunk:
        cdf = probs.cumsum(dim=-1)
        target = (uniform * cdf[:, -1])[:, None]
        return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=v - 1)
    pad = (-v) % chunk
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(b, -1, chunk)
    sums = blocks.sum(dim=-1)  # [B, n]
    ccdf = sums.cumsum(dim=-1)
    target = uniform * ccdf[:, -1]
    ci = torch.searchsorted(ccdf, target[:, None], right=True).clamp_(max=ccdf.shape[1] - 1)  # [B, 1]
    before = (ccdf.gather(1, ci) - sums.gather(1, ci))[:, 0]
    inner = blocks.gather(1, ci[:, :, None].expand(b, 1, chunk))[:, 0].cumsum(dim=-1)  # [B, chunk]
    local = torch.searchsorted(inner, (target - before)[:, None], right=True).clamp_(max=chunk - 1)
    return (ci[:, 0] * chunk + local[:, 0]).clamp_(max=v - 1)


def sample(logits: torch.Tensor, st: SamplingTensors,
           ban: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` (any float dtype; computed in float32; never written).
        ban: ``(rows, token ids)``, equally long int64 tensors on the logits' device: those
            tokens are removed from those rows before anything else (``SamplingParams.
            min_tokens``: vLLM's min-tokens logits processor), greedy rows included, and the
            log-probs are of what is left.
    Returns:
        ``(tokens [B] int64, logprobs [B] float32)`` on the logits' device.
    """
    logits = logits.float()
    if ban is not None:
        # (a fill on the device: torch.tensor(..., device=cuda) would copy from the host)
        logits = logits.index_put(ban, logits.new_full((), float("-inf")))
    if st.any_greedy:
        greedy_tok = logits.argmax(dim=-1)
        greedy_lp = logits.log_softmax(dim=-1).gather(-1, greedy_tok[:, None])[:, 0]
        if st.all_greedy:
            return greedy_tok, greedy_lp
    x = filter_logits(logits, st)
    logp = x.log_softmax(dim=-1)
    probs = logp.exp()
    pos = inverse_cdf(probs, st.uniform)[:, None]
    # float rounding at the very top of the CDF can land on a removed token: take the mode then
    mode = x.argmax(dim=-1, keepdim=True)
    pos = torch.where(probs.gather(-1, pos) > 0, pos, mode)
    lp = logp.gather(-1, pos)[:, 0]
    tok = pos[:, 0]
    if st.any_greedy:
        tok = torch.where(st.greedy, greedy_tok, tok)
        lp = torch.where(st.greedy, greedy_lp, lp)
    return tok, lp
