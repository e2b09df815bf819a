"""The lengths the planner sees: per-shard counts and totals for all shards, per-sample lengths on demand.

A rank plans from the shard table alone and loads the per-sample lengths of only the shards its slots touch
(from a columnar index: only their row groups), so planning costs O(N / world), not O(N).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np

from ..errors import IndexFormatError, OptionError

Loader = Callable[[Sequence[int]], Sequence[np.ndarray]]


class LengthIndex(Protocol):
    """What the planner reads of an index: its shard table and, per shard, the lengths in tar order. A dataset's
    `ShardIndex` and a mixture's `MixedIndex`
    both are one; the planner never imports them (``plan/`` takes lengths, not files)."""

    @property
    def num_shards(self) -> int: ...

    @property
    def has_output_lengths(self) -> bool: ...

    def shard_table(self, columns: Sequence[str] = ...) -> dict[str, np.ndarray]: ...

    def shard_lengths(self, shards: Sequence[int]) -> list[np.ndarray]: ...

    def shard_output_lengths(self, shards: Sequence[int]) -> list[np.ndarray]: ...


class Lengths:
    """Per-shard sample counts and length totals, and per-sample lengths loaded (and kept) per shard.

    ``load(shards)`` returns the length arrays of those shards; it is called once per shard at most.
    ``scale`` (a mixture's): per shard, the expected share of it an epoch takes; shards are dealt to slots by
    ``totals × scale`` and each sample by its length times its shard's scale. ``groups`` (a mixture's): per shard,
    the group key its samples carry under ``batch_by="dataset"`` (the dataset's number)."""

    def __init__(self, counts: np.ndarray, totals: np.ndarray, load: Loader, scale: np.ndarray | None = None):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.scale = None if scale is None else np.asarray(scale, dtype=np.float64)
        self.totals = np.asarray(totals, dtype=np.float64) * (1.0 if self.scale is None else self.scale)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._load = load
        self._arrays: dict[int, np.ndarray] = {}
        self.load_outputs: Loader | None = None  # each shard's output lengths (two-length budgets), if known
        self._outputs: dict[int, np.ndarray] = {}
        self.groups: np.ndarray | None = None  # per shard: its samples' group key (batch_by), if known

    @classmethod
    def of(cls, shard_lengths: Sequence[np.ndarray], groups: Sequence[int] | None = None) -> Lengths:
        """All lengths already in memory (the global plan, tests, benchmarks); ``groups``: each shard's group
        key (``batch_by``)."""
        arrays = [np.asarray(x) for x in shard_lengths]
        totals = [float(a.sum()) if a.size else 0.0 for a in arrays]
        out = cls(
            np.array([a.size for a in arrays], dtype=np.int64), np.array(totals), lambda ids: [arrays[i] for i in ids]
        )
        out._arrays = dict(enumerate(arrays))
        out.groups = None if groups is None else np.asarray(groups, dtype=np.int64)
        return out

    @property
    def num_shards(self) -> int:
        return len(self.counts)

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    @property
    def loaded(self) -> int:
        """Samples whose lengths are in memory (what planning cost this process)."""
        return int(sum(a.size for a in self._arrays.values()))

    def prefetch(self, shards: Iterable[int]) -> None:
        """Load the lengths of these shards in one call (one read per row group on a columnar index)."""
        missing = sorted({int(s) for s in shards} - set(self._arrays))
        if missing:
            for s, a in zip(missing, self._load(missing)):
                if len(a) != self.counts[s]:
                    raise IndexFormatError(f"shard {s}: {len(a)} lengths, the shard table says {self.counts[s]}")
                self._arrays[s] = np.asarray(a)

    def shard(self, s: int) -> np.ndarray:
        """The lengths of shard ``s`` in tar order."""
        s = int(s)
        if s not in self._arrays:
            self.prefetch([s])
        return self._arrays[s]

    def outputs(self, s: int) -> np.ndarray:
        """The output lengths of shard ``s`` in tar order (the second length of two-length budgets)."""
        s = int(s)
        if s not in self._outputs:
            if self.load_outputs is None:
                raise OptionError(
                    "output_budget needs each sample's output length: write the dataset with "
                    "`shardify write --output-length chars|tokens:NAME`"
                )
            self._outputs[s] = np.asarray(self.load_outputs([s])[0])
        return self._outputs[s]

    def __getitem__(self, gids: np.ndarray) -> np.ndarray:
        """Lengths of samples by global id (shards in index order, samples in tar order)."""
        gids = np.asarray(gids, dtype=np.int64)
        if gids.size == 0:
            return np.zeros(0, dtype=np.float64)
        groups = by_shard(gids, self.offsets)
        self.prefetch([s for s, _ in groups])
        out = np.empty(gids.size, dtype=np.result_type(*[self.shard(s).dtype for s, _ in groups]))
        for s, g in groups:
            out[g] = self.shard(s)[gids[g] - self.offsets[s]]
        return out

    def all(self) -> np.ndarray:
        """Every length (O(N): the global plan only)."""
        self.prefetch(range(self.num_shards))
        if not self.num_shards:
            return np.zeros(0)
        return np.concatenate([self._arrays[s] for s in range(self.num_shards)])


class LazyMask:
    """A mask over the plan's global ids, computed for the ids asked about: ``mask[gids]``, ``mask[lo:hi]`` and
    ``mask[gid]`` give booleans (True: the sample is left out). Subclasses compute `_mask()` for an id array;
    resume, mixture and filter masks are all of this kind, so the planner and the readers take any of them."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self._mask(np.arange(key.start, key.stop, dtype=np.int64))
        if np.ndim(key) == 0:
            return bool(self._mask(np.array([int(key)], dtype=np.int64))[0])
        return self._mask(np.asarray(key, dtype=np.int64))

    def _mask(self, gids: np.ndarray) -> np.ndarray:
        raise NotImplementedError


#: what an epoch leaves out, over the plan's global ids: a boolean array (True: left out) or a lazy mask
Mask: TypeAlias = LazyMask | np.ndarray


def by_shard(gids: np.ndarray, offsets: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(shard, positions in ``gids``) for each shard the global ids fall in, shards in order."""
    if not gids.size:
        return []
    shard_of = np.searchsorted(offsets, gids, side="right") - 1
    order = np.argsort(shard_of, kind="stable")
    cuts = np.flatnonzero(np.diff(shard_of[order])) + 1
    return [(int(shard_of[g[0]]), g) for g in np.split(order, cuts)]


def index_lengths(index: LengthIndex, kept_share: np.ndarray | None = None) -> Lengths:
    """`Lengths` over an index (`LengthIndex`): counts and totals from its shard table, per-sample
    lengths read per shard when asked for (only their row groups on a columnar index).
    ``kept_share`` (a filter's): per shard, the share of its length kept; shards are dealt by the kept length
    (times a mixture's expected share)."""
    table = index.shard_table(("count", "total_length"))
    scale: np.ndarray | None = index.deal_scale() if hasattr(index, "deal_scale") else None
    if kept_share is not None:
        scale = kept_share if scale is None else scale * kept_share
    out = Lengths(table["count"], table["total_length"], index.shard_lengths, scale)
    if index.has_output_lengths:
        out.load_outputs = index.shard_output_lengths
    if hasattr(index, "dataset_of_shard"):  # a mixture: each virtual shard's dataset, the key of batch_by="dataset"
        out.groups = np.asarray(index.dataset_of_shard(np.arange(out.num_shards)), dtype=np.int64)
    return out
