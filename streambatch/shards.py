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


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order shards are dealt in this epoch."""
    if not shuffle:
        return np.arange(num_shards)
    return epoch_rng(seed, epoch).permutation(num_shards)


def split_into_pieces(counts: Sequence[int], order: np.ndarray, num_slots: int) -> list[Piece]:
    """Shards in ``order`` as pieces; shards are cut into equal sample ranges when there are fewer
    non-empty shards than slots, so that each slot can get work."""
    nonempty = [int(s) for s in order if counts[s] > 0]
    if not nonempty:
        return []
    parts = max(1, -(-num_slots // len(nonempty)))  # ceil
    pieces = []
    for s in nonempty:
        c = int(counts[s])
        k = min(parts, c)
        edges = np.linspace(0, c, k + 1).round().astype(int)
        pieces.extend(Piece(s, int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a)
    return pieces


def assign_slots(pieces: Sequence[Piece], weights: Sequence[float], num_slots: int) -> list[list[Piece]]:
    """Deal pieces (in order) to the slot with the least total weight so far; ties go to the lowest slot.

    ``weights[i]`` is piece i's total length. Each slot keeps its pieces in dealing order.
    """
    slots: list[list[Piece]] = [[] for _ in range(num_slots)]
    load = np.zeros(num_slots)
    for piece, w in zip(pieces, weights):
        j = int(np.argmin(load))
        slots[j].append(piece)
        load[j] += w
    return slots


def plan_slots(
    shard_lengths: Sequence[np.ndarray], num_slots: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[Piece]]:
    """The pieces each of ``num_slots`` slots streams this epoch, from the index's per-shard lengths."""
    counts = [len(x) for x in shard_lengths]
    order = shard_order(len(shard_lengths), seed, epoch, shuffle)
    pieces = split_into_pieces(counts, order, num_slots)
    weights = [float(shard_lengths[p.shard][p.start:p.stop].sum()) for p in pieces]
    return assign_slots(pieces, weights, num_slots)


def slot_lengths(shard_lengths: Sequence[np.ndarray], pieces: Sequence[Piece]) -> np.ndarray:
    """The lengths of a slot's sample stream, in stream order."""
    if not pieces:
        return np.zeros(0)
    return np.concatenate([shard_lengths[p.shard][p.start:p.stop] for p in pieces])
