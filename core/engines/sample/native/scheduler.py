"""Continuous batching: pick each step's sequences, preempting by recompute when pages run out.

Every step is either a *prefill* (waiting sequences whose prompt — or, after preemption, prompt
plus completion so far — is computed, minus what the prefix cache holds) or a *decode* (every
running sequence advances one token). Waiting sequences go first whenever they fit, so new
requests join the running batch as soon as there is room (continuous batching).

When a decode step needs a page (a new page at a block boundary, or a copy-on-write of a shared
partial page) and none is free, the most recently admitted running sequence is preempted: its
pages are released and it goes back to the front of the waiting queue, keeping its tokens,
log-probs and generator, to be recomputed later (its full pages are often still cached). No
sequence is ever dropped; a lone sequence always fits because ``max_model_len`` is capped by
the cache size.

A step's sequences whose KV is not certain until the engine reads the step back are *pending*:
a prefill's sequences (and the forks made from them) and a decode's rows given a copy-on-write
page (the copy runs with the step). ``confirm`` clears them once the step is read back; if the
step fails before, ``recover`` sends them back to waiting to be recomputed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Batch:
    """One step's work. ``copies`` are ``(src, dst)`` page copies to run before the forward."""

    seqs: list[Sequence]
    is_prefill: bool
    copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue and the running list; see the module docstring."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.pending: list[Sequence] = []  # see the module docstring
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        assert not self.pending, "the step before was neither confirmed nor recovered"
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> Batch:
        seqs: list[Sequence] = []
        rows = len(self.running)
        tokens = 0
        while self.waiting:
            seq = self.waiting[0]
            if seqs and tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self._admits(seq, rows, alone=not seqs and not self.running):
                break
            self.pending.append(seq)
            self.bm.allocate(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seqs.append(seq)
            self.running.append(seq)
            rows += 1 + seq.pending_forks
            tokens += len(seq) - seq.num_cached_tokens
        return Batch(seqs, is_prefill=True)

    def _admits(self, seq: Sequence, rows: int, alone: bool) -> bool:
        """Whether a prefill may take ``seq`` next to ``rows`` rows (its forks join them after
        the prefill; a sequence alone always fits the batch) and its pages."""
        return (rows + 1 + seq.pending_forks <= self.max_num_seqs or alone) and self.bm.can_allocate(seq)

    def _schedule_decode(self) -> Batch:
        scheduled: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        while self.running:
            seq = self.running.popleft()
            while self.bm.needs_block(seq) and self.bm.num_free == 0:
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                copy = self.bm.append_slot(seq)
                if copy is not None:
                    copies.append(copy)
                    self.pending.append(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        assert scheduled or self.waiting, "nothing to run: the cache cannot hold a single sequence"
        return Batch(scheduled, is_prefill=False, copies=copies)

    def can_plan_ahead(self, pages: list[int]) -> bool:
        """Whether the decode step after the running one may be planned before that step's
        tokens are booked (async scheduling), writing to ``pages`` (rows at a page boundary
        aside). The caller vouches that booking will free nothing when a sequence is waiting
        (no row finishes); then ``schedule`` would start a prefill after booking exactly when
        it would now. It may unless ``schedule`` would start a prefill or one of those pages is
        shared (copy-on-write) — then ``schedule`` decides after booking. The planned step's
        rows are the running list in order, less those finished by length or a stop token;
        ``take_pages_ahead`` gives the rows at a boundary their pages."""
        rc = self.bm.ref_count
        if any(rc[p] != 1 for p in pages):
            return False
        return not (self.waiting and self._admits(self.waiting[0], len(self.running), not self.running))

    def take_pages_ahead(self, seqs: list[Sequence]) -> list[int] | None:
        """A new page each for ``seqs`` (running, in order, at a page boundary one token ahead),
        the pages ``_schedule_decode`` would give them after booking: the front of the free
        list, which booking only appends to. ``None`` (nothing taken) when they do not all fit:
        that step may preempt, which only ``schedule`` decides."""
        if len(seqs) > self.bm.num_free:
            return None
        for seq in seqs:
            copy = self.bm.append_slot(seq, ahead=1)
            assert copy is None, "a page was shared"
        return [seq.block_table[-1] for seq in seqs]

    def preempt(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def add_running(self, seq: Sequence) -> None:
        """A fork made after its parent's prefill joins the running batch (pending with it)."""
        seq.status = Status.RUNNING
        self.pending.append(seq)
        self.running.append(seq)

    def confirm(self) -> None:
        """The step scheduled last was read back: its pending sequences' KV is computed."""
        if self.pending:
            self.pending = []

    def recover(self) -> None:
        """The step scheduled last failed before it was read back: its pending sequences go back
        to the front of the waiting queue (pages released, to be recomputed; their tokens,
        log-probs and generators are untouched, nothing of the step was booked). Forks made
        by its prefill are dropped and their parent is pending its ``n - 1`` forks again."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        ids = {id(s) for s in pending}  # (an interrupted schedule may have left one waiting)
        self.running = deque(s for s in self.running if id(s) not in ids)
        self.waiting = deque(s for s in self.waiting if id(s) not in ids)
        back = []
        for seq in pending:
            if seq.status is Status.FINISHED:
                continue
            self.bm.deallocate(seq)
            if not seq.completion:  # its first prefill: nothing sampled yet
                if seq.sample_index:
                    seq.status = Status.FINISHED  # a fork made from it: made again
                    continue
                seq.pending_forks = seq.params.n - 1
            seq.status = Status.WAITING
            back.append(seq)
        self.waiting.extendleft(reversed(back))

    def abort(self, request_ids: set[int]) -> list[Sequence]:
        """Drop every sequence of these requests, waiting or running, releasing its pages;
        returns the dropped sequences (status ``FINISHED``, tokens and log-probs kept)."""
        dropped = [s for s in self.waiting if s.request_id in request_ids]
        self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
        keep = deque()
        for seq in self.running:
            if seq.request_id in request_ids:
                self.bm.deallocate(seq)
                dropped.append(seq)
            else:
                keep.append(seq)
        self.running = keep
        for seq in dropped:
            seq.status = Status.FINISHED
        return dropped

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.bm.deallocate(seq)
