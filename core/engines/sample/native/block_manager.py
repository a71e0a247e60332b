"""Paged KV-cache bookkeeping: block allocation, prefix caching, forks and copy-on-write.

The cache is ``num_blocks`` pages of ``block_size`` tokens. Each sequence holds a block table
(physical page ids, in order). Rules:

- **Prefix caching.** A *full* block is keyed by a chained content hash
  ``hash((hash_of_previous_block, its token ids))``; a new sequence whose leading full blocks
  match reuses those pages (ref count + 1) and skips their prefill. Freed pages keep their
  content and key until reused (LRU), so a later request or a recomputed preempted sequence can
  still hit them. Hits are verified against the stored token ids, so a hash collision is a miss.
- **Forks.** ``fork`` gives a child the parent's whole table (ref counts + 1): ``n`` samples of
  one prompt share its prefill.
- **Copy-on-write.** A partially filled last page is never written while shared: before a
  decode step writes into a page with ref count > 1, the sequence gets a fresh page and the
  caller copies the old page's KV into it (``append_slot`` returns the ``(src, dst)`` pair).
  So requests that decode together share only full pages — what FCA's forest planner needs.
- **Keys ahead of their KV are provisional.** A prefill keys its full pages when it allocates
  them (so a prompt later in the same prefill batch shares them), and async scheduling keys the
  page a decode step fills before that step is booked: such keys are *provisional* until the
  engine has read that step back (``confirm``). A step that fails before then leaves pages whose
  KV may never have been computed: ``drop_provisional`` forgets their keys (the sequences that
  used them are sent back to be recomputed by the scheduler), so no later request hits them.
- **Epochs.** ``reset_prefix_cache`` (new weights, sleep) bumps ``epoch``; a sequence records
  the epoch its pages were allocated in, and ``commit`` keys no page of an older one: a sequence
  running across a weight update holds KV computed (partly) with the old weights.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class BlockManager:
    """Allocates KV pages to sequences; see the module docstring for the sharing rules.

    Per-page state costs no Python object per page (a cache of 500k pages is built in
    milliseconds): ``ref_count`` is a list of ints, and only keyed pages have an entry in
    ``key`` (page -> (chained hash, token ids)).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.epoch = 0  # bumped by reset_prefix_cache
        self.provisional: list[int] = []  # pages keyed before their KV was read back

    @property
    def num_blocks(self) -> int:
        return len(self.ref_count)

    def _hash(self, bid: int) -> int | None:
        k = self.key.get(bid)
        return None if k is None else k[0]

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.ref_count) - len(self.free)

    # ---------------------------------------------------------------- prefix cache
    @staticmethod
    def chain_hash(prev: int | None, tokens: list[int] | tuple[int, ...]) -> int:
        return hash((prev, tuple(tokens)))

    def _lookup(self, h: int, tokens: list[int]) -> int | None:
        bid = self.hash_to_block.get(h)
        if bid is None or self.key[bid][1] != tuple(tokens):
            return None
        return bid

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Page ids of the cached leading full blocks. The block holding the last token is never
        taken from the cache: that token must be computed to produce the next-token logits."""
        found, prev = [], None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            prev = self.chain_hash(prev, tokens)
            bid = self._lookup(prev, tokens)
            if bid is None:
                break
            found.append(bid)
        return found

    def reset_prefix_cache(self) -> None:
        """Forget every content key (after a weight update the cached KV is stale), and key no
        page of a sequence allocated before now (a new epoch)."""
        self.key.clear()
        self.hash_to_block.clear()
        self.provisional = []
        self.epoch += 1

    def confirm(self) -> None:
        """The step that computes the KV of the provisional keys' pages was read back: they are
        keys like any other."""
        if self.provisional:
            self.provisional = []

    def drop_provisional(self) -> None:
        """Forget the provisional keys (their step failed: the KV may never have been computed)."""
        for bid in self.provisional:
            k = self.key.pop(bid, None)
            if k is not None and self.hash_to_block.get(k[0]) == bid:
                del self.hash_to_block[k[0]]
        self.provisional = []

    # ---------------------------------------------------------------- allocation
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        k = self.key.pop(bid, None)
        if k is not None and self.hash_to_block.get(k[0]) == bid:
            del self.hash_to_block[k[0]]
        self.ref_count[bid] = 1
        return bid

    def _ref(self, bid: int) -> None:
        if self.ref_count[bid] == 0:
            del self.free[bid]
        self.ref_count[bid] += 1

    def _unref(self, bid: int) -> None:
        assert self.ref_count[bid] > 0, f"block {bid} freed twice"
        self.ref_count[bid] -= 1
        if self.ref_count[bid] == 0:
            self.free[bid] = None  # most recently freed: reused last

    def _register(self, bid: int, prev: int | None, tokens: list[int]) -> int:
        h = self.chain_hash(prev, tokens)
        self.key[bid] = (h, tuple(tokens))
        self.hash_to_block[h] = bid
        return h

    def blocks_needed(self, seq: Sequence) -> int:
        """Fresh pages a prefill of ``seq`` would take (cached ones excluded)."""
        cached = self._cached_prefix(seq)
        revived = sum(1 for b in cached if self.ref_count[b] == 0)
        return seq.num_blocks(self.block_size) - len(cached) + revived

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` a table for all its tokens; sets ``seq.num_cached_tokens``. Its fresh
        full pages are keyed provisionally (module docstring)."""
        assert not seq.block_table, "sequence already holds blocks"
        bs = self.block_size
        cached = self._cached_prefix(seq)
        for bid in cached:
            self._ref(bid)
        table, prev = list(cached), None
        if cached:
            prev = self._hash(cached[-1])
        for i in range(len(cached), seq.num_blocks(bs)):
            bid = self._take_free()
            tokens = seq.block_tokens(i, bs)
            if len(tokens) == bs:  # full: its KV is computed by this prefill, key it now
                prev = self._register(bid, prev, tokens)
                self.provisional.append(bid)
            table.append(bid)
        seq.block_table, seq.table_array = table, None
        seq.num_cached_tokens = len(cached) * bs
        seq.cache_epoch = self.epoch

    def deallocate(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            self._unref(bid)
        seq.block_table, seq.table_array = [], None
        seq.num_cached_tokens = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every page of ``parent`` (the partial last one until written)."""
        for bid in parent.block_table:
            self._ref(bid)
        child.block_table, child.table_array = list(parent.block_table), parent.table_array
        child.cache_epoch = parent.cache_epoch

    # ---------------------------------------------------------------- decode
    def needs_block(self, seq: Sequence) -> bool:
        """Whether writing the KV of ``seq``'s last token takes a fresh page (new or CoW)."""
        pos = len(seq) - 1
        if pos % self.block_size == 0 and pos // self.block_size == len(seq.block_table):
            return True
        return self.ref_count[seq.block_table[pos // self.block_size]] > 1

    def append_slot(self, seq: Sequence, ahead: int = 0) -> tuple[int, int] | None:
        """Make the page for the last token (``ahead=1``: the token after it) writable; returns
        a ``(src, dst)`` page copy to do before the step when the page was shared
        (copy-on-write), else ``None``."""
        pos = len(seq) - 1 + ahead
        idx = pos // self.block_size
        if idx == len(seq.block_table):
            seq.block_table.append(self._take_free())
            seq.table_array = None
            return None
        old = seq.block_table[idx]
        if self.ref_count[old] == 1:
            return None
        new = self._take_free()
        self._unref(old)
        seq.block_table[idx] = new
        seq.table_array = None
        return old, new

    def commit(self, seq: Sequence, num_kv_tokens: int, provisional: bool = False) -> None:
        """After a step computed KV up to ``num_kv_tokens`` (``provisional``: a step not read
        back yet will compute it): key the page it filled, if any."""
        bs = self.block_size
        if num_kv_tokens % bs or num_kv_tokens == 0 or seq.cache_epoch != self.epoch:
            return  # no page filled, or the sequence's KV predates a cache reset
        idx = num_kv_tokens // bs - 1
        bid = seq.block_table[idx]
        if bid in self.key:
            return
        prev = self._hash(seq.block_table[idx - 1]) if idx > 0 else None
        if idx > 0 and prev is None:
            return  # the page before is not keyed (its key was dropped): a chain needs every link
        self._register(bid, prev, seq.block_tokens(idx, bs))
        if provisional:
            self.provisional.append(bid)
