"""Async scheduling: the engine's decode steps launched ahead of their booking (``engine.py``).

A step is launched (forward and sampling queued on the device, its tokens and log-probs on
their way back by one async copy), then booked (tokens appended, stop and length checks, pages
keyed or freed). With ``SamplerConfig.async_scheduling`` the decode step after it is prepared
while it runs (``_prepare_ahead``: rows not at their length limit, their positions, slots,
tables and random draws) and launched the moment its tokens are back (``_launch_ahead``: rows
that drew a stop token leave, rows at a page boundary get their page) — *before* it is booked,
so booking and preparing hide behind the device. Each launched step has exactly the rows,
pages and inputs the scheduler gives after booking (pages come from the front of the free
list, booking frees to its back, and a step launched ahead never preempts: when free pages
run short it waits for the booking and the scheduler; while sequences wait for room, a step is
launched ahead only when booking would admit none of them: no row finishes and the first
waiting sequence does not fit), so the results are the synchronous engine's.

Most decode steps go further (``launch_before_readback``, ``_launch_early``): when no sequence
waits and no row needs a new page, step ``n + 1`` is launched *before* step ``n``'s tokens are
back, its token ids taken on the device from step ``n``'s sampled tokens, so the device never
waits for the host between two steps. Rows that draw a stop token in step ``n`` are then
decoded once more in step ``n + 1`` (``_settle_early``): that token is dropped
(``ahead_rows_dropped``) and the row leaves the step after — when step ``n + 1`` runs in the
shape it would have without those rows (a paged step of the same CUDA-graph bucket,
``ModelRunner.decode_rows``; not FCA, whose forest changes with the rows: every row's numbers
are then the same). Otherwise step ``n + 1`` is dropped whole and launched again for
the live rows (``early_steps_dropped``). The extra step writes only the stopped rows' own tail
pages (private: ``can_plan_ahead``), at the slot after their last token, which no prefix-cache
key covers; pages, keys, counters and samples end up as the synchronous engine's. When a row
needs a new page or sequences wait, the step is launched once the tokens are back, as above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .decode_inputs import DecodeInputs
from .sequence import Sequence


@dataclass
class Launched:
    """A step on the device whose tokens are not booked yet (read back by ``Readback``).
    ``live``: the rows whose tokens are booked, ``None`` for all of them; a step launched
    before the previous one's tokens were back also carries the rows that stopped in that
    step (their extra token is dropped). ``tokens``: its sampled tokens on the device. The
    rest is what it counts in ``stats`` once read back."""

    rows: list[Sequence]
    is_prefill: bool
    inputs: DecodeInputs | None = None  # a decode step's arrays (the next step's basis)
    tokens: torch.Tensor | None = None
    live: np.ndarray | None = None
    fca: bool = False  # a decode step on FCA (fca_steps)
    ahead: bool = False  # launched before the previous step was booked (ahead_steps)
    early: bool = False  # ... and before its tokens were back (early_steps)
    computed: int = 0  # a prefill's tokens computed (prefill_tokens) ...
    hits: int = 0  # ... and taken from the prefix cache (cache_hit_tokens)

    def booked(self, tokens: list[int], logprobs: list[float]
               ) -> tuple[list[Sequence], list[int], list[float]]:
        """The live rows with their tokens and log-probs (read back for every row)."""
        if self.live is None:
            return self.rows, tokens, logprobs
        live = self.live.tolist()
        return [self.rows[i] for i in live], [tokens[i] for i in live], [logprobs[i] for i in live]

    def live_view(self) -> tuple[list[Sequence], DecodeInputs, np.ndarray | None]:
        """``(rows, inputs, index)`` of the live rows (``index`` into ``rows``; None: all)."""
        if self.live is None:
            return self.rows, self.inputs, None
        return [self.rows[i] for i in self.live.tolist()], self.inputs.select(self.live), self.live


@dataclass
class Ahead:
    """The next decode step, prepared while the current one runs: ``rows`` are the current
    step's rows ``keep`` (those not at their length limit); ``inputs`` lack the ids and, for
    the rows flagged in ``new_page``, the page their token goes to; ``uniforms`` their draws."""

    keep: np.ndarray
    rows: list[Sequence]
    inputs: DecodeInputs
    uniforms: list[float]
    new_page: list[bool]
    index: np.ndarray  # ``keep`` as rows of the current step's launch (its device tokens)

    def live(self, tokens: list[int]) -> list[int]:
        """Indices into ``rows`` of the rows whose token in the current step (``tokens``, one
        per booked row of it) is not a stop token: the rows the next step keeps."""
        return [j for j, i in enumerate(self.keep.tolist()) if tokens[i] not in self.rows[j].stop_ids]


class LaunchAhead:
    """The launch-ahead steps of ``NativeEngine`` (mixed in: they use its scheduler, block
    manager, runner, read-back, sampling and counters)."""

    def _prepare_ahead(self, cur: Launched) -> Ahead | None:
        """While ``cur`` runs on the device: the inputs of the decode step after it for the
        rows not finished by length, or ``None`` when that step is left to the scheduler after
        ``cur`` is booked (``Scheduler.can_plan_ahead``). Vectorised: ``cur``'s own inputs one
        position further (no page was taken between its launch and now)."""
        if cur.is_prefill:
            return None
        bs = self.block_manager.block_size
        rows, cur_inputs, index = cur.live_view()
        inputs = cur_inputs.advanced(bs)
        n = len(rows)
        prompt = np.fromiter((s.num_prompt_tokens for s in rows), dtype=np.int64, count=n)
        limit = np.fromiter((s.params.max_tokens for s in rows), dtype=np.int64, count=n)
        done = self._at_length(inputs.lens, prompt, limit)  # with this step's token
        keep = np.flatnonzero(~done)
        if not len(keep) or (self.scheduler.waiting and done.any()):
            return None  # with a sequence waiting, booking's freed rows and pages may admit it
        for i in np.flatnonzero(cur_inputs.lens % bs == 0):  # key the pages cur fills (as booking
            # would) before the check; provisional until cur is read back
            self.block_manager.commit(rows[i], int(cur_inputs.lens[i]), provisional=True)
        if len(keep) < n:
            rows, inputs = [rows[i] for i in keep], inputs.select(keep)
        new_page = inputs.slots < 0
        written = inputs.slots[~new_page] // bs  # the pages the step writes to that exist already
        if not self.scheduler.can_plan_ahead(written.tolist()):
            return None
        return Ahead(keep, rows, inputs, self._uniforms(rows, ahead=1), new_page.tolist(),
                      keep if index is None else index[keep])

    def _launch_early(self, cur: Launched, ahead: Ahead) -> Launched | None:
        """Launch the prepared step now, before ``cur``'s tokens are back (module docstring):
        its ids are ``cur``'s sampled tokens, gathered on the device. ``None`` (launched once
        the tokens are back) when a row needs a new page, a sequence waits (a stopped row's
        room may admit it) or it is switched off."""
        if not self.launch_before_readback or self.scheduler.waiting or any(ahead.new_page):
            return None
        ids = cur.tokens
        if len(ahead.index) != len(ids) or (ahead.index != np.arange(len(ids))).any():
            ids = ids[torch.from_numpy(ahead.index).to(ids.device, non_blocking=True)]
        logits = self.runner.run(ahead.rows, False, ahead.inputs, ids)
        fca = self.runner.last_step_fca
        return Launched(ahead.rows, False, ahead.inputs,
                        self._sample(ahead.rows, logits, ahead.uniforms, ahead=1), fca=fca, ahead=True,
                        early=True)

    def _settle_early(self, cur: Launched, early: Launched, ahead: Ahead,
                      tokens: list[int]) -> Launched | None:
        """``cur``'s tokens are back: the rows of ``early`` that drew a stop token there are
        not live in it (their extra token is dropped; it counts its live rows once read back).
        Without them the step would have run in another shape (a smaller CUDA-graph bucket,
        ``ModelRunner.decode_rows``; with FCA, another forest: a shared prefix may lose its
        last sharer), which may round the live rows' numbers differently: then it is dropped
        whole (its read-back discarded, never booked) and
        the step is launched again for the live rows, as if never launched early. A step with
        no live row is no step either."""
        rows = early.rows
        live = ahead.live(tokens)
        if len(live) == len(rows):
            return early
        self._counts["ahead_rows_dropped"] += len(rows) - len(live)
        # a paged step stays paged without rows (they only lower the reads FCA would save)
        same = bool(live) and not early.fca and (
            self.runner.decode_rows(len(live)) == self.runner.decode_rows(len(rows)))
        if same:
            early.live = np.asarray(live, dtype=np.int64)
            return early
        self._counts["early_steps_dropped"] += 1
        self._readback.discard()  # the early step's tokens: never read
        return self._launch_ahead(cur, ahead, tokens) if live else None

    def _launch_ahead(self, cur: Launched, ahead: Ahead, tokens: list[int]) -> Launched | None:
        """Launch the prepared step once ``cur``'s tokens are known: rows whose token was a
        stop token leave it, rows at a page boundary get their page now — exactly the rows,
        order, pages and arrays the scheduler would give after ``cur`` is booked. ``None``
        (the scheduler decides after booking) when the free pages do not cover every row."""
        rows, inputs, keep, uniforms = ahead.rows, ahead.inputs, ahead.keep, ahead.uniforms
        live = ahead.live(tokens)
        if not live or (len(live) < len(rows) and self.scheduler.waiting):
            return None  # no rows left, or stopped rows' room may admit a waiting sequence
        at_boundary = [k for k, j in enumerate(live) if ahead.new_page[j]]
        if len(live) < len(rows):
            rows, inputs, keep = [rows[j] for j in live], inputs.select(np.asarray(live)), keep[live]
            uniforms = [uniforms[j] for j in live]
        if at_boundary:
            pages = self.scheduler.take_pages_ahead([rows[k] for k in at_boundary])
            if pages is None:
                return None  # the scheduler preempts (after the stopped rows' pages are back)
            inputs = inputs.with_pages(at_boundary, pages, self.block_manager.block_size)
        inputs = inputs.with_ids(np.asarray(tokens, dtype=np.int64)[keep])
        logits = self.runner.run(rows, False, inputs)
        return Launched(rows, False, inputs, self._sample(rows, logits, uniforms, ahead=1),
                        fca=self.runner.last_step_fca, ahead=True)
