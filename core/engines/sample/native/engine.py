"""The native engine: requests in, samples out — scheduler → model runner → sampler, per step.

``generate`` validates every request first (a bad one raises ``ValueError`` naming its index
before anything is scheduled, so nothing else is touched), queues one sequence per prompt, and
steps the engine until its requests are done. Several threads may call ``generate`` at once
(the async API does): steps are serialised by a lock and each step advances every queued
request, so concurrent calls batch together. Queuing does not take that lock (a step holds it
for its whole forward, and callers waiting on it would join one per step): requests go to an
intake list, and the next step admits all of them at once.

After a prompt's prefill its ``n - 1`` forks are created: they share the prompt's pages and
sample their first token from the same logits, so ``n`` samples cost one prefill.

``abort`` (any thread) stops requests between two steps: their pages are released and their
``generate`` call returns what was sampled so far (tokens and log-probs, ``finish_reason``
``"abort"``; a sample not yet started is empty) instead of raising. The other requests of the
batch go on as if the aborted ones had never been there (each sample draws from its own
generator, so seeded samples do not depend on their neighbours).

A step is launched (forward and sampling queued on the device, its tokens and log-probs on
their way back by one async copy), then booked (tokens appended, stop and length checks, pages
keyed or freed). With ``SamplerConfig.async_scheduling`` the next decode step is prepared while
one runs and launched before it is booked, most steps even before its tokens are back
(``ahead.py`` says how, and why the results stay the synchronous engine's). A step launched
ahead is in flight when ``step`` returns; anything that must see the engine between two steps
(``abort``, ``load_weights``, ``prompt_logprobs``, ``sleep``) books it first.

A step that fails (a device error, an interrupt) leaves the engine as if it had never been
launched (``_recover``): what it did not book is forgotten, prefix-cache keys given ahead of KV
it never computed are dropped, and every caller's sequences whose KV it was to compute go back
to waiting, to be recomputed; only the stepping caller's requests are dropped. A step counts in
``stats`` once it is read back.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from polynya.config.sampler import SamplerConfig
from polynya.types import Sample, SamplingParams, TokenSeq

from ..requests import unstarted_sample, validate_requests
from ..scoring import PromptLogprobs, validate_scoring
from ..step_lock import StepLock
from .ahead import LaunchAhead, Launched
from .block_manager import BlockManager
from .decode_inputs import DecodeInputs
from .model_runner import ModelRunner, WeightPieces
from .readback import Readback
from .sampler import SamplingTensors, sample
from .scheduler import Batch, Scheduler
from .sequence import Sequence


@dataclass
class _AbortOrder:
    """An ``abort`` call waiting for the next step boundary (``None``: every request)."""

    request_ids: frozenset[int] | None
    applied: threading.Event = field(default_factory=threading.Event)
    count: int = 0


@dataclass
class _Request:
    params: SamplingParams
    finished: list[Sequence] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.params.n

    def samples(self) -> list[Sample]:
        out = sorted(self.finished, key=lambda s: s.sample_index)
        return [Sample(token_ids=s.completion, logprobs=list(s.logprobs) if self.params.logprobs else None,
                       finish_reason=s.finish_reason) for s in out]


def _mix(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request seeded with ``seed`` (deterministic, 63 bits)."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class NativeEngine(LaunchAhead):
    """Embedded sampling engine (CPU or one GPU); see the package docstring for the API."""

    def __init__(self, config: SamplerConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = self.runner.max_model_len
        self.default_stop_ids = self.runner.eos_token_ids()
        self.weight_version = 0
        self.asleep = False
        self._master = torch.Generator().manual_seed(config.seed)
        # one step at a time; callers between steps go before the stepping loops (step_lock.py)
        self._steps = StepLock()
        self._lock = self._steps.lock
        self._requests: dict[int, _Request] = {}
        self._next_request = 0
        # new requests queue here without waiting for a step (a step holds the lock for its
        # whole forward); the next step admits all of them at once (_admit)
        self._intake: list[tuple[int, Sequence, _Request]] = []
        self._intake_lock = threading.Lock()  # taken after _lock, never before it
        self._aborts: list[_AbortOrder] = []
        self._aborts_lock = threading.Lock()  # orders are queued without waiting for a step
        self._counts = {"prefill_tokens": 0, "decode_tokens": 0, "cache_hit_tokens": 0,
                        "prefill_steps": 0, "decode_steps": 0, "fca_steps": 0, "requests": 0,
                        "scored_tokens": 0, "aborted_requests": 0, "ahead_steps": 0,
                        "early_steps": 0, "ahead_rows_dropped": 0, "early_steps_dropped": 0,
                        "peak_decode_rows": 0}
        self._times = {"prefill_time_s": 0.0, "decode_time_s": 0.0}
        # requests aborted by ``on_submit`` before they were queued: counted under _intake_lock,
        # apart from ``_counts`` (under _lock), so that no count is lost to the two locks
        self._unqueued_aborts = 0
        self._st_cache: tuple[list[SamplingParams], SamplingTensors] | None = None
        self._st_min_tokens = 0  # the largest min_tokens of the cached settings' rows
        self.async_scheduling = config.async_scheduling
        self._readback = Readback(self.runner.device)
        self._inflight: Launched | None = None  # launched ahead, not booked (async scheduling)
        # async scheduling launches a decode step before the previous one's tokens are back
        # when nothing can change its rows but a stop token (benchmarks switch it off)
        self.launch_before_readback = True

    # ---------------------------------------------------------------- requests
    def validate(self, prompts: Seq[TokenSeq], params: SamplingParams | Seq[SamplingParams]
                 ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Check every request; raise ``ValueError`` naming the first bad one (nothing queued)."""
        return validate_requests(prompts, params, vocab_size=self.runner.vocab_size,
                                 max_model_len=self.max_model_len, max_n=self.config.max_num_seqs)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        if params.seed is not None:
            seed = _mix(params.seed, index)
        else:
            seed = int(torch.randint(0, 1 << 62, (), generator=self._master))
        return torch.Generator().manual_seed(seed)

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue a request checked by ``validate`` (its params: the copy ``validate`` returns);
        returns its id (for ``wait`` / ``abort``). Does not wait for a step in progress: the
        next step admits it."""
        with self._intake_lock:
            entry = self._new_request(prompt, params)
            self._intake.append(entry)
            return entry[0]

    def _new_request(self, prompt: list[int], params: SamplingParams) -> tuple[int, Sequence, _Request]:
        rid = self._next_request  # caller holds _intake_lock
        self._next_request += 1
        stop = params.stop_ids(self.default_stop_ids)
        seq = Sequence(token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                       stop_ids=stop, generator=self._generator(params, 0), request_id=rid,
                       pending_forks=params.n - 1)
        self._counts["requests"] += 1
        return rid, seq, _Request(params)

    def _admit(self) -> None:
        """Hand the queued requests to the scheduler, in arrival order (caller holds _lock).

        Interrupt-safe (SIGINT lands in whichever thread steps the engine): a request leaves
        the intake only after it is in the scheduler and then in ``_requests`` (which marks it
        admitted), so an interrupt anywhere leaves every request queued or admitted, and the
        next call admits the rest. One the scheduler got just before an interrupt is its last
        waiting sequence (nothing is scheduled before the next ``_admit`` succeeds): not added
        twice."""
        if not self._intake:
            return
        admitted = 0
        try:
            for rid, seq, request in self._intake:  # requests queued meanwhile join at the end
                if rid not in self._requests:
                    waiting = self.scheduler.waiting
                    if not (waiting and waiting[-1] is seq):
                        self.scheduler.add(seq)
                    self._requests[rid] = request
                admitted += 1
        finally:
            with self._intake_lock:
                del self._intake[:admitted]

    def generate(self, prompts: Seq[TokenSeq], params: SamplingParams | Seq[SamplingParams], *,
                 on_submit: Callable[[list[int]], bool] | None = None) -> list[list[Sample]]:
        """``n`` samples per prompt, in prompt order; see ``SamplingEngine.generate``.

        ``on_submit(request_ids)`` (must not raise) is called as the requests are queued,
        before any step can run them: it learns their ids (for ``abort``: an abort ordered once
        it has returned finds them), and a True answer aborts them there (their caller gave up
        before they were queued): they are never queued, and each sample comes back empty with
        ``finish_reason="abort"``."""
        toks, plist = self.validate(prompts, params)
        with self._intake_lock:  # not the step lock: concurrent callers join the next step
            if self.asleep:
                raise RuntimeError("the sampling engine is asleep; call wake() first")
            entries = [self._new_request(t, p) for t, p in zip(toks, plist)]
            rids = [rid for rid, _, _ in entries]
            if on_submit is not None and on_submit(list(rids)):
                self._unqueued_aborts += len(rids)
                return [[unstarted_sample(p) for _ in range(p.n)] for p in plist]
            self._intake.extend(entries)
        return self.wait(rids)

    def wait(self, request_ids: list[int]) -> list[list[Sample]]:
        """Step the engine until these requests are done (finished or aborted); returns their
        samples in the given order and forgets them. A failed step drops them and re-raises."""
        rids = list(request_ids)
        turn = self._steps.stepper()
        try:
            while True:
                with turn, self._lock:
                    if not turn.go():
                        continue  # a caller between steps goes first
                    self._admit()
                    if all(self._requests[r].done for r in rids):
                        return [self._requests.pop(r).samples() for r in rids]
                    self.step()
        except BaseException:  # a failed step (or an interrupt): drop this call's requests
            with self._steps.plain(), self._lock:
                self._admit()
                self._recover()  # done by a failed step already; not if it came between steps
                self.scheduler.abort(set(rids))
                for r in rids:
                    self._requests.pop(r, None)
            raise

    def prompt_logprobs(self, sequences: Seq[TokenSeq], *, top_k: int = 0,
                        temperature: float = 1.0) -> list[PromptLogprobs]:
        """Score whole sequences on the served weights (``polynya.engines.sample.scoring``).
        Runs between engine steps; uses no KV pages (the prefix cache is neither read nor
        filled). ``ValueError`` for a bad request, ``RuntimeError`` when asleep."""
        toks, k, temp = validate_scoring(sequences, top_k, temperature, vocab_size=self.runner.vocab_size,
                                         max_model_len=self.max_model_len)
        with self._steps.plain(), self._lock:
            if self.asleep:
                raise RuntimeError("the sampling engine is asleep; call wake() first")
            self._finish_inflight()
            out = self.runner.score(toks, k, temp)
            self._counts["scored_tokens"] += sum(map(len, toks))
            return out

    def abort(self, request_ids: Iterable[int] | None = None) -> int:
        """Stop these requests (``None``: every request in flight) at the next step boundary
        (with async scheduling: after the step on the device, if any).

        Their pages are released and their ``generate`` / ``wait`` returns the partial samples
        (``finish_reason="abort"``). Returns once applied, with the number of requests that were
        still running; ids unknown or already finished are ignored. Call it from any thread,
        not from inside a step."""
        order = _AbortOrder(None if request_ids is None else frozenset(int(r) for r in request_ids))
        with self._aborts_lock:
            self._aborts.append(order)
        # in at the next step boundary (a step may have applied it by then)
        with self._steps.plain(), self._lock:
            if not order.applied.is_set():
                self._apply_aborts()
        return order.count

    def _apply_aborts(self) -> None:
        self._finish_inflight()  # an abort lands after the step already on the device
        with self._aborts_lock:
            orders, self._aborts = self._aborts, []
        try:
            self._admit()  # after taking the orders: every request queued before one is in reach
        except BaseException:  # an interrupt in _admit: the orders wait for the next step
            with self._aborts_lock:
                self._aborts[:0] = orders
            raise
        for order in orders:
            wanted = self._requests.keys() if order.request_ids is None else order.request_ids
            live = {r for r in wanted if r in self._requests and not self._requests[r].done}
            for seq in self.scheduler.abort(live):
                self._abort_sequence(seq)
            order.count = len(live)
            self._counts["aborted_requests"] += len(live)
            order.applied.set()

    def _abort_sequence(self, seq: Sequence) -> None:
        """Book a dropped sequence as an aborted sample; a prompt never prefilled also stands
        for its ``n - 1`` forks (empty samples)."""
        request = self._requests[seq.request_id]
        for j in range(1, seq.pending_forks + 1):
            child = seq.fork(j, seq.generator)  # never sampled: the generator is not drawn from
            child.finish_reason = "abort"
            request.finished.append(child)
        seq.pending_forks = 0
        seq.finish_reason = "abort"
        request.finished.append(seq)

    # ---------------------------------------------------------------- one step
    def step(self) -> None:
        """Book one engine step: schedule, forward and sample it (unless async scheduling
        already launched it), read its tokens back, and book them (tokens, stop checks, pages).

        With ``async_scheduling`` the next decode step is launched as soon as this one's tokens
        are back and before they are booked, from inputs prepared while this step ran on the
        device; it stays in flight when ``step`` returns, and the next ``step`` books it.

        A step that raises (or is interrupted) recovers first (``_recover``), then re-raises."""
        start = time.perf_counter()
        try:
            if self._aborts:
                self._apply_aborts()
            self._admit()
            cur, self._inflight = self._inflight, None
            if cur is None:
                if not self.scheduler.has_work():
                    return
                batch = self.scheduler.schedule()
                if not batch.seqs:
                    return
                cur = self._launch(batch)
            ahead = self._prepare_ahead(cur) if self.async_scheduling else None
            early = self._launch_early(cur, ahead) if ahead is not None else None
            rows, tokens, logprobs = self._read_back(cur)
            if early is not None:
                self._inflight = self._settle_early(cur, early, ahead, tokens)
            elif ahead is not None:
                self._inflight = self._launch_ahead(cur, ahead, tokens)
            self._postprocess(rows, tokens, logprobs)
        except BaseException:
            self._recover()
            raise
        self._times["prefill_time_s" if cur.is_prefill else "decode_time_s"] += time.perf_counter() - start

    def _read_back(self, cur: Launched) -> tuple[list[Sequence], list[int], list[float]]:
        """Wait for ``cur``'s tokens: its live rows, their tokens and log-probs. The KV it
        computes is then in the cache: the provisional keys and pending sequences of its
        scheduling are confirmed, and it counts in ``stats``."""
        rows, tokens, logprobs = cur.booked(*self._readback.result())
        self.block_manager.confirm()
        self.scheduler.confirm()
        self._count(cur, len(rows))
        return rows, tokens, logprobs

    def _recover(self) -> None:
        """After a step failed anywhere (caller holds _lock): the steps launched and not booked
        are forgotten (their rows run them again; a decode row's token list and draws are as
        before them), keys given to pages ahead of KV never read back are dropped, and the
        sequences that step was to compute KV for — prefills (forks merged back into their
        parent) and rows given a copy-on-write page, whoever's they are — go back to waiting to
        be recomputed (``Scheduler.recover``). Does nothing more when called again."""
        self._inflight = None
        self._readback.clear()
        self.block_manager.drop_provisional()
        self.scheduler.recover()

    def _finish_inflight(self) -> None:
        """Book the step in flight, if any (before anything that must see the engine between
        two steps: aborts, weight loads, sleep, scoring)."""
        cur, self._inflight = self._inflight, None
        if cur is not None:
            start = time.perf_counter()
            self._postprocess(*self._read_back(cur))
            self._times["decode_time_s"] += time.perf_counter() - start

    def _launch(self, batch: Batch) -> Launched:
        """Forward and sample a scheduled step; its tokens are on their way to the host."""
        if batch.copies:
            self.runner.copy_blocks(batch.copies)
        inputs = None if batch.is_prefill else DecodeInputs.build(batch.seqs, self.block_manager.block_size)
        logits = self.runner.run(batch.seqs, batch.is_prefill, inputs)
        fca = not batch.is_prefill and self.runner.last_step_fca
        hits = sum(s.num_cached_tokens for s in batch.seqs) if batch.is_prefill else 0
        computed = sum(map(len, batch.seqs)) - hits if batch.is_prefill else 0
        rows, parents = self._expand_forks(batch)
        if len(rows) != len(batch.seqs):
            logits = logits[torch.tensor(parents, device=logits.device)]
        return Launched(rows, batch.is_prefill, inputs,
                        self._sample(rows, logits, prefill=batch.is_prefill), fca=fca,
                        computed=computed, hits=hits)

    @staticmethod
    def _uniforms(rows: list[Sequence], ahead: int = 0) -> list[float]:
        """Each row's draw for its next token (``ahead=1``: for the token after it)."""
        return [0.0 if s.params.temperature == 0 else s.uniform(ahead) for s in rows]

    def _sample(self, rows: list[Sequence], logits: torch.Tensor, uniforms: list[float] | None = None,
                ahead: int = 0, prefill: bool = False) -> torch.Tensor:
        """Sample every row and start reading the tokens back; the tokens on the device.
        ``ahead``: tokens each row will have booked before this step's (1 for a step launched
        before the previous one is booked). The rows' completion lengths are looked at for
        ``min_tokens`` only when some row's exceeds what every row already has (a decode row
        has a token at least: SkyRL sends ``min_tokens=1`` with every request, and only its
        prefills pay)."""
        if uniforms is None:
            uniforms = self._uniforms(rows)
        st = self._sampling_tensors(rows, uniforms, logits)
        has = ahead + (0 if prefill else 1)  # completion tokens every row has before this one
        ban = (self._min_tokens_ban(rows, ahead, logits.shape[-1], logits.device)
               if self._st_min_tokens > has else None)
        tokens, logprobs = sample(logits, st, ban)
        self._readback.start(tokens, logprobs)
        return tokens

    @staticmethod
    def _min_tokens_ban(rows: list[Sequence], ahead: int, vocab: int,
                        device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rows, stop ids)`` to remove from this step's logits: every stop id of each row
        whose completion is still shorter than its ``min_tokens`` (``sampler.sample``'s ban).
        Ids outside the ``vocab`` logits are never sampled, so there is nothing to remove (an
        index past the logits would fail the step, on a GPU as a device-side assert)."""
        r, t = [], []
        for i, s in enumerate(rows):
            if len(s) - s.num_prompt_tokens + ahead < s.params.min_tokens:
                ids = [x for x in s.stop_ids if x < vocab]
                r += [i] * len(ids)
                t += ids
        if not r:
            return None
        pair = torch.tensor([r, t], dtype=torch.int64)
        if str(device).startswith("cuda"):
            pair = pair.pin_memory()
        pair = pair.to(device, non_blocking=True)
        return pair[0], pair[1]

    def _sampling_tensors(self, rows: list[Sequence], uniforms: list[float],
                          logits: torch.Tensor) -> SamplingTensors:
        """Row settings on the device, rebuilt only when the rows' parameters changed (most
        decode steps run the same rows as the step before: only the uniforms are new).
        Compared by value (a row's params are its request's private copy, so when the rows
        are the last step's each comparison is an identity check)."""
        params = [s.params for s in rows]
        cached = self._st_cache
        if cached is not None and cached[0] == params:
            return cached[1].with_uniforms(uniforms)
        st = SamplingTensors.build(params, uniforms, logits.shape[-1], logits.device)
        self._st_cache = (params, st)
        self._st_min_tokens = max(p.min_tokens for p in params)
        return st

    def _expand_forks(self, batch: Batch) -> tuple[list[Sequence], list[int]]:
        """After a prefill, fork every prompt with ``n > 1``: rows to sample and their logit row."""
        rows, parents = [], []
        for i, seq in enumerate(batch.seqs):
            rows.append(seq)
            parents.append(i)
            for j in range(1, seq.pending_forks + 1):
                child = seq.fork(j, self._generator(seq.params, j))
                self.scheduler.add_running(child)  # first: pending before it holds pages
                self.block_manager.fork(seq, child)
                rows.append(child)
                parents.append(i)
            seq.pending_forks = 0
        return rows, parents

    def _postprocess(self, rows: list[Sequence], tokens: list[int], logprobs: list[float]) -> None:
        for seq, tok, lp in zip(rows, tokens, logprobs):
            self.block_manager.commit(seq, len(seq))
            if seq.params.temperature != 0:
                seq.advance_uniform()
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            reason = None
            if tok in seq.stop_ids:
                reason = "stop"
            elif self._at_length(len(seq), seq.num_prompt_tokens, seq.params.max_tokens):
                reason = "length"
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._requests[seq.request_id].finished.append(seq)

    def _at_length(self, length, prompt, max_tokens):
        """Whether a sequence of ``length`` tokens (``prompt`` of them the prompt) is finished
        (``"length"``); scalars, or arrays of rows."""
        return (length - prompt >= max_tokens) | (length >= self.max_model_len)

    def _count(self, cur: Launched, rows: int) -> None:
        """Count a step read back, with ``rows`` live rows."""
        c = self._counts
        if cur.is_prefill:
            c["prefill_steps"] += 1
            c["prefill_tokens"] += cur.computed
            c["cache_hit_tokens"] += cur.hits
            return
        c["decode_steps"] += 1
        c["decode_tokens"] += rows
        c["peak_decode_rows"] = max(c["peak_decode_rows"], rows)
        c["fca_steps"] += cur.fca
        c["ahead_steps"] += cur.ahead
        c["early_steps"] += cur.early

    # ---------------------------------------------------------------- weights, memory, stats
    def load_weights(self, weights: WeightPieces, version: int | None = None, *,
                     checksum: str | None = None) -> int:
        """Copy new weights in place (all pieces checked first, ``checksum`` too when given);
        drops the prefix cache. Returns the new weight version (``version`` or the previous
        one + 1); ``ValueError`` and nothing changed when ``version`` is not newer."""
        with self._steps.plain(), self._lock:
            if version is not None and int(version) <= self.weight_version:
                raise ValueError(f"weight version {version} is not newer than the served "
                                 f"{self.weight_version}")
            self._finish_inflight()  # it ran on the old weights: book it before they change
            self.runner.load_weights(weights, checksum=checksum)
            self.block_manager.reset_prefix_cache()  # running sequences key no page from now on
            self.weight_version = self.weight_version + 1 if version is None else int(version)
            return self.weight_version

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache, between two steps (the step in flight is booked first);
        the sequences running now key none of their pages from now on."""
        with self._steps.plain(), self._lock:
            self._finish_inflight()
            self.block_manager.reset_prefix_cache()

    def weight_checksum(self) -> str:
        with self._steps.plain(), self._lock:
            return self.runner.weight_checksum()

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.runner.weight_specs()

    def room_bytes(self, level: int) -> int:
        """``ModelRunner.room_bytes``: device bytes waking from ``level`` and generating take."""
        return self.runner.room_bytes(level)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1), and move the weights off the GPU too (level 2)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        # no request queued while it falls asleep
        with self._steps.plain(), self._lock, self._intake_lock:
            self._finish_inflight()
            if self.scheduler.has_work() or self._intake:
                raise RuntimeError("cannot sleep with requests in flight")
            self.runner.free_kv()
            self.block_manager.reset_prefix_cache()
            if level == 2:
                self.runner.offload_weights()
            self.asleep = True

    def wake(self) -> None:
        """Restore what ``sleep`` released (empty KV cache, weights on the device)."""
        with self._steps.plain(), self._lock, self._intake_lock:
            self.runner.onload_weights()
            if self.runner.kv is None:
                self.runner.allocate_kv()
            self.asleep = False

    def stats(self) -> dict[str, float | str | None]:
        """Counters since start: ``prefill_tokens`` (computed, cache hits excluded),
        ``decode_tokens``, ``scored_tokens`` (``prompt_logprobs``), ``cache_hit_tokens`` /
        ``cache_hit_blocks``, ``aborted_requests`` (requests ``abort`` stopped), ``fca_steps``
        (decode steps that took FCA: pages shared and ``fca_min_shared_tokens`` reached),
        ``ahead_steps`` (decode steps async scheduling launched before the previous step was
        booked), ``early_steps`` (those of them launched before the previous step's tokens were
        back), ``ahead_rows_dropped`` (rows such a step decoded once more after they stopped:
        their token was dropped; not in ``decode_tokens``), ``early_steps_dropped`` (such steps
        dropped whole and launched again: without the stopped rows they would have run in
        another shape; not in the step counts), ``peak_decode_rows`` (the most sequences one decode step carried: concurrent
        requests decoded together show here),
        ``blocks_in_use`` of ``num_blocks``, ``preemptions``, step counts, ``weight_version``,
        and wall time spent
        in prefill / decode steps (``prefill_time_s`` / ``decode_time_s``), CUDA-graph captures
        and their wall time (``graph_captures`` / ``graph_capture_s``, inside the step times),
        compiles of the decode step (``compile_decode``) and the wall time of the steps that
        compiled (``compiles`` / ``compile_s``, inside the step and capture times), and what
        was compiled (``compile_scope``: ``"layers"`` / ``"model"``, None when nothing is;
        ``compile_scope_reason``: why not the configured ``compile_scope``, else None), and the
        same for the prefill's compiled layers (``compile_prefill``: ``prefill_compiles`` /
        ``prefill_compile_s``, inside the prefill times; ``prefill_compile_reason``: why
        prefill runs eagerly, None while it runs compiled)."""
        with self._steps.plain(), self._lock:
            captures, capture_s = self.runner.graph_stats()
            hit_blocks = self._counts["cache_hit_tokens"] // self.block_manager.block_size
            with self._intake_lock:  # ("requests" is counted under it too)
                counts = dict(self._counts)
                counts["aborted_requests"] += self._unqueued_aborts
            return dict(counts, **self._times, cache_hit_blocks=hit_blocks,
                        graph_captures=captures, graph_capture_s=capture_s,
                        **self.runner.compile_stats(),
                        blocks_in_use=self.block_manager.num_used, num_blocks=self.block_manager.num_blocks,
                        preemptions=self.scheduler.num_preemptions, weight_version=self.weight_version)
