"""Per-epoch shard order and the split of shards over (rank, worker) slots, balanced by total length.

All ranks compute the same plan from ``(seed, epoch)``: one permutation of the shards, then each shard in
that order goes to the slot with the least total length so far. With fewer shards than slots, shards are
cut into sample ranges (pieces) first, so every slot gets data and no sample is dealt twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Piece:
    """Samples ``[start, stop)`` (tar order) of shard number ``shard`` in the index."""

    shard: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def epoch_rng(seed: int, epoch: int, *extra: int) -> np.random.Generator:
    """The random generator for one epoch (and optionally one slot): the same on every rank."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), *extra])


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True, rep: int = 0) -> np.ndarray:
    """The order shards are dealt in this epoch (``rep``: the pass, when shards are cycled)."""
    if not shuffle:
        return np.arange(num_shards)
    return (epoch_rng(seed, epoch, rep) if rep else epoch_rng(seed, epoch)).permutation(num_shards)


def plan_slots(
    shard_lengths: Sequence[np.ndarray],
    num_slots: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    excluded: np.ndarray | None = None,
) -> list[list[Piece]]:
    """The pieces each of ``num_slots`` slots streams this epoch.

    The shards, in the epoch's order, form one long stream of samples; it is cut into ``num_slots``
    consecutive runs of equal total length. So every slot gets the same amount of audio or tokens to within
    one sample, each slot reads a few whole shards plus at most two partial ones, and with fewer shards than
    slots the shards are simply shared. ``excluded`` (a mask over global sample ids, shards in index order)
    leaves out samples already consumed before a resume.
    """
    counts = np.array([len(x) for x in shard_lengths], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    order = shard_order(len(shard_lengths), seed, epoch, shuffle)
    shard_of, index_of, length_of = [], [], []
    for s in order:
        s = int(s)
        idx = np.arange(counts[s])
        if excluded is not None:
            idx = idx[~excluded[offsets[s]:offsets[s + 1]]]
        if idx.size:
            shard_of.append(np.full(idx.size, s))
            index_of.append(idx)
            length_of.append(np.asarray(shard_lengths[s], dtype=np.float64)[idx])
    slots: list[list[Piece]] = [[] for _ in range(num_slots)]
    if not shard_of:
        return slots
    shard_seq, index_seq = np.concatenate(shard_of), np.concatenate(index_of)
    cum = np.cumsum(np.concatenate(length_of))
    total = cum[-1]
    # slot k takes the samples whose running total (at their midpoint) falls in its k-th share
    mid = cum - np.concatenate(length_of) / 2
    slot_of = np.minimum((mid * num_slots / total).astype(np.int64), num_slots - 1)
    bounds = np.searchsorted(slot_of, np.arange(num_slots + 1), side="left")
    runs = np.flatnonzero(np.diff(shard_seq)) + 1  # where the stream passes to the next shard
    for k in range(num_slots):
        a, b = int(bounds[k]), int(bounds[k + 1])
        if a >= b:
            continue
        cuts = [a, *runs[(runs > a) & (runs < b)].tolist(), b]
        for x, y in zip(cuts[:-1], cuts[1:]):
            slots[k].append(Piece(int(shard_seq[x]), int(index_seq[x]), int(index_seq[y - 1]) + 1))
    return slots
