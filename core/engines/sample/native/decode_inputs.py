"""The host arrays of one decode step — token ids, positions, cache slots, block tables, lengths.

Built from the rows' sequences (``DecodeInputs.build``), or from the previous step's arrays one
position further (``advanced``): the engine's async scheduling prepares step ``n + 1`` while the
device still runs step ``n``, before step ``n``'s tokens are known; ``select`` drops rows that
finished, ``with_pages`` gives rows at a page boundary their new page, ``with_ids`` fills in
step ``n``'s tokens once they are back — giving exactly the arrays ``build`` would give after
step ``n`` is booked.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .sequence import Sequence


@dataclass
class DecodeInputs:
    """``ids``, ``pos``, ``slots``, ``lens`` int64 ``[B]``; ``tables`` int32 ``[B, width]`` with
    ``width`` the longest row's table; ``widths`` ``[B]`` each row's table length."""

    ids: np.ndarray
    pos: np.ndarray
    slots: np.ndarray
    tables: np.ndarray
    lens: np.ndarray
    widths: np.ndarray

    @classmethod
    def build(cls, seqs: list[Sequence], block_size: int) -> DecodeInputs:
        """Arrays of the decode step of ``seqs`` that writes the KV of each row's last token."""
        n = len(seqs)
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        ids = np.fromiter((s.last_token for s in seqs), dtype=np.int64, count=n)
        arrays = [s.table_np() for s in seqs]
        widths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=n)
        tables = np.zeros((n, int(widths.max())), dtype=np.int32)
        for i, a in enumerate(arrays):
            tables[i, :len(a)] = a
        out = cls._at(ids, lens, tables, widths, block_size)
        assert (out.slots >= 0).all(), "a row's block table does not hold its decode position"
        return out

    @classmethod
    def _at(cls, ids: np.ndarray, lens: np.ndarray, tables: np.ndarray, widths: np.ndarray,
            block_size: int) -> DecodeInputs:
        """Positions and slots for rows of these lengths; slot -1 where the table lacks the page
        (a row at a page boundary, one step ahead: ``with_pages`` gives it)."""
        pos = lens - 1
        page = pos // block_size
        slots = tables[np.arange(len(lens)), np.minimum(page, widths - 1)].astype(np.int64) * block_size
        slots = np.where(page < widths, slots + pos % block_size, -1)
        return cls(ids, pos, slots, tables, lens, widths)

    def advanced(self, block_size: int) -> DecodeInputs:
        """The decode step after this one for the same rows, whose tables have not changed
        since; ids left at 0 (``with_ids``), slot -1 for rows at a page boundary
        (``with_pages``)."""
        return self._at(np.zeros_like(self.ids), self.lens + 1, self.tables, self.widths, block_size)

    def select(self, keep: np.ndarray) -> DecodeInputs:
        """The rows ``keep`` (indices, in order), table columns trimmed to their longest table."""
        widths = self.widths[keep]
        width = int(widths.max())
        return DecodeInputs(self.ids[keep], self.pos[keep], self.slots[keep],
                            np.ascontiguousarray(self.tables[keep, :width]), self.lens[keep], widths)

    def with_pages(self, rows: list[int], pages: list[int], block_size: int) -> DecodeInputs:
        """Rows ``rows`` (at a page boundary) write their token to the first slot of the new
        page ``pages[i]``, appended to their tables."""
        idx = np.asarray(rows)
        widths = self.widths.copy()
        widths[idx] += 1
        tables = self.tables
        if widths.max() > tables.shape[1]:
            tables = np.pad(tables, ((0, 0), (0, int(widths.max()) - tables.shape[1])))
        else:
            tables = tables.copy()
        tables[idx, widths[idx] - 1] = pages
        slots = self.slots.copy()
        slots[idx] = np.asarray(pages, dtype=np.int64) * block_size + self.pos[idx] % block_size
        return dataclasses.replace(self, slots=slots, tables=tables, widths=widths)

    def with_ids(self, ids: np.ndarray) -> DecodeInputs:
        """The same step with its token ids filled in."""
        return dataclasses.replace(self, ids=np.asarray(ids, dtype=np.int64))

    def astuple(self) -> tuple[np.ndarray, ...]:
        assert (self.slots >= 0).all(), "a row has no page for its token (with_pages)"
        return self.ids, self.pos, self.slots, self.tables, self.lens
