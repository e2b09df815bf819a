"""The samples a filter leaves out, as a lazy mask over the plan's global ids (like a resume's or a mixture's
masks): asking about some samples evaluates the filter on their shards only, once per shard."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .lengths import LazyMask, by_shard


class LeftOut(LazyMask):
    """``mask[gids]``, ``mask[lo:hi]`` and ``mask[gid]`` are True for samples the filter does not keep.
    ``keep_of(shard)`` gives a shard's kept samples in tar order; ``offsets`` each shard's first global id."""

    def __init__(self, keep_of: Callable[[int], np.ndarray], offsets: np.ndarray):
        self.keep_of, self.offsets = keep_of, np.asarray(offsets, dtype=np.int64)

    def _mask(self, gids: np.ndarray) -> np.ndarray:
        out = np.zeros(gids.size, dtype=bool)
        for s, sel in by_shard(gids, self.offsets):
            out[sel] = ~np.asarray(self.keep_of(s), dtype=bool)[gids[sel] - self.offsets[s]]
        return out
