"""The cost model's bounded memo (CostModel.memoised)."""

from __future__ import annotations

import contextlib


class MemoCache(dict):
    """The cost model's memo of pure functions of (cost model, batch): cost tables, bounds,
    fingerprints. Bounded, oldest entry evicted first: a training run plans a new batch every
    step with one CostModel, and an unbounded memo would keep every batch's tables for the
    whole run. Entries are recomputed when missing, so eviction never changes a result."""

    MAX_ENTRIES = 256  # ~6-10 entries per batch: the last few dozen batches stay memoised

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > self.MAX_ENTRIES:
            # another thread (AsyncPlanner) may evict the same entry first
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del self[next(iter(self))]
