"""Group keys for ``batch_by``: samples that may share a batch carry the same key (under ``batch_by="dataset"``,
their dataset's number in the mixture, from their shard).

The batcher then keeps its window sorted by (key, length longest first): each key's samples form one run of the
window, and a run boundary acts as a bucket boundary (no batch crosses it; a batch reaching it is not complete
yet). With a single key everything is as without ``batch_by``.
"""

from __future__ import annotations

import numpy as np

from .select import LengthHistogram


def group_ends(g: np.ndarray) -> np.ndarray:
    """For a window sorted by group key ``g``: where each position's group run ends."""
    return np.searchsorted(g, g, side="right")


def group_runs(g: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each group's run of a window sorted by group key ``g``."""
    cuts = np.flatnonzero(np.diff(g)) + 1
    bounds = [0, *cuts.tolist(), len(g)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class GroupHistograms:
    """A `LengthHistogram` per group key: how common a length is among the
    samples that may share its batch (a rare group's samples wait as long for neighbours as rare lengths do)."""

    def __init__(self) -> None:
        self.by_key: dict[int, LengthHistogram] = {}

    def _of(self, key: int) -> LengthHistogram:
        return self.by_key.setdefault(int(key), LengthHistogram())

    def add(self, lengths: np.ndarray, groups: np.ndarray) -> None:
        for k in np.unique(groups).tolist():
            self._of(k).add(lengths[groups == k])

    def add_one(self, length: float, group: int) -> None:
        self._of(group).add_one(length)

    def of_sorted(self, lengths: np.ndarray, g: np.ndarray) -> np.ndarray:
        """How many pushed lengths of the same group share each length's bin (the window sorted by key, then
        longest first)."""
        parts = [self._of(int(g[a])).of_sorted(lengths[a:b]) for a, b in group_runs(g)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
