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


def split_into_pieces(
    counts: Sequence[int], order: np.ndarray, num_slots: int, excluded: np.ndarray | None = None
) -> list[Piece]:
    """Shards in ``order`` as pieces. When there are fewer shards than slots, each shard is cut into equal
    sample ranges so that every slot can get work. ``excluded`` (a mask over global sample ids) removes
    already-consumed samples: shards with none left are skipped and cuts divide what remains."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    remaining = []
    for s in order:
        s = int(s)
        idx = np.arange(int(counts[s]))
        if excluded is not None:
            idx = idx[~excluded[offsets[s]:offsets[s + 1]]]
        if idx.size:
            remaining.append((s, idx))
    if not remaining:
        return []
    parts = max(1, -(-num_slots // len(remaining)))  # ceil
    pieces = []
    for s, idx in remaining:
        k = min(parts, idx.size)
        edges = np.linspace(0, idx.size, k + 1).round().astype(int)
        for a, b in zip(edges[:-1], edges[1:]):
            if b > a:
                pieces.append(Piece(s, int(idx[a]), int(idx[b - 1]) + 1))
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
    shard_lengths: Sequence[np.ndarray],
    num_slots: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    excluded: np.ndarray | None = None,
) -> list[list[Piece]]:
    """The pieces each of ``num_slots`` slots streams this epoch, from the index's per-shard lengths."""
    counts = [len(x) for x in shard_lengths]
    order = shard_order(len(shard_lengths), seed, epoch, shuffle)
    pieces = split_into_pieces(counts, order, num_slots, excluded)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    weights = []
    for p in pieces:
        x = shard_lengths[p.shard][p.start:p.stop]
        if excluded is not None:
            x = x[~excluded[offsets[p.shard] + p.start:offsets[p.shard] + p.stop]]
        weights.append(float(x.sum()))
    return assign_slots(pieces, weights, num_slots)
