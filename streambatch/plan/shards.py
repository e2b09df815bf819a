"""Per-epoch shard order and the cut of the shard stream into (rank, worker) slots of equal total length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .lengths import Lengths


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


#: shards are shuffled in blocks of this many consecutive sample ids (the columnar index's row-group size),
#: so the shards of one rank's slots sit in few row groups and a rank reads little beyond its own lengths
BLOCK_SAMPLES = 1 << 16


def shard_order(
    num_shards: int, seed: int, epoch: int, shuffle: bool = True, rep: int = 0, blocks: np.ndarray | None = None
) -> np.ndarray:
    """The order shards are dealt in this epoch (``rep``: the pass, when shards are cycled).

    With ``blocks`` (a block number per shard, non-decreasing), the blocks come in a random order and the
    shards of each block together, in a random order within it; with one block this is a plain permutation."""
    if not shuffle:
        return np.arange(num_shards)
    rng = epoch_rng(seed, epoch, rep) if rep else epoch_rng(seed, epoch)
    order = rng.permutation(num_shards)
    if blocks is None or num_shards == 0 or blocks[-1] == blocks[0]:
        return order
    _, block = np.unique(blocks, return_inverse=True)
    rank = rng.permutation(int(block.max()) + 1)
    return order[np.argsort(rank[block[order]], kind="stable")]


def shard_blocks(offsets: np.ndarray) -> np.ndarray:
    """Each shard's shuffle block: the window of :data:`BLOCK_SAMPLES` sample ids its first sample falls in."""
    return np.asarray(offsets[:-1], dtype=np.int64) // BLOCK_SAMPLES


def plan_slots(
    lengths: Lengths | Sequence[np.ndarray],
    num_slots: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    excluded: np.ndarray | None = None,
    slots: range | None = None,
) -> list[list[Piece]]:
    """The pieces each of ``num_slots`` slots streams this epoch (only ``slots`` are filled when given).

    The shards, in the epoch's order, form one long stream of samples; it is cut into ``num_slots``
    consecutive runs of equal total length (a sample goes where the midpoint of its running total falls).
    So every slot gets the same amount of audio or tokens to within one sample, reads a few whole shards plus
    at most two partial ones, and with fewer shards than slots the shards are shared. The running total is
    the shard table's prefix sum plus a sum inside the shard, so a rank finds its own slots' pieces from the
    shard table and the lengths of just the shards they touch. ``excluded`` (a mask over global ids) leaves
    out samples consumed before a resume (that needs every shard's lengths).
    """
    lengths = lengths if isinstance(lengths, Lengths) else Lengths.of(lengths)
    wanted = slots if slots is not None else range(num_slots)
    out: list[list[Piece]] = [[] for _ in range(num_slots)]
    order = shard_order(lengths.num_shards, seed, epoch, shuffle, blocks=shard_blocks(lengths.offsets))
    totals = _kept_totals(lengths, excluded)[order]
    prefix = np.concatenate([[0.0], np.cumsum(totals)])
    total = prefix[-1]
    if not len(wanted) or total <= 0:
        return out
    lo, hi = wanted.start * total / num_slots, wanted.stop * total / num_slots
    # the shards whose span can hold a midpoint in [lo, hi), one more on each side for rounding
    first = max(0, int(np.searchsorted(prefix[1:], lo, side="left")) - 1)
    last = min(len(order), int(np.searchsorted(prefix[:-1], hi, side="right")) + 1)
    lengths.prefetch(order[first:last])
    for i in range(first, last):
        shard = int(order[i])
        idx, x = _kept(lengths, shard, excluded)
        if not idx.size:
            continue
        mid = prefix[i] + np.cumsum(x) - x / 2
        slot_of = np.minimum((mid * num_slots / total).astype(np.int64), num_slots - 1)
        cuts = np.flatnonzero(np.diff(slot_of)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), idx.size]):
            k = int(slot_of[a])
            if k in wanted:
                out[k].append(Piece(shard, int(idx[a]), int(idx[b - 1]) + 1))
    return out


def _kept(lengths: Lengths, shard: int, excluded: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(tar positions, float lengths) of a shard's samples that are not excluded."""
    x = np.asarray(lengths.shard(shard), dtype=np.float64)
    idx = np.arange(x.size)
    if excluded is not None:
        keep = ~excluded[lengths.offsets[shard]:lengths.offsets[shard + 1]]
        idx, x = idx[keep], x[keep]
    return idx, x


def _kept_totals(lengths: Lengths, excluded: np.ndarray | None) -> np.ndarray:
    """Each shard's total length, without excluded samples (the shard table's totals when none are)."""
    if excluded is None:
        return lengths.totals
    return np.array([float(_kept(lengths, s, excluded)[1].sum()) for s in range(lengths.num_shards)])
