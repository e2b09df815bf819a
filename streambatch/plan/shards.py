"""Per-epoch shard order and the cut of the shard stream into (rank, worker) slots of equal total length."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .lengths import Lengths, Mask


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
    """Each shard's shuffle block: the window of `BLOCK_SAMPLES` sample ids its first sample falls in."""
    return np.asarray(offsets[:-1], dtype=np.int64) // BLOCK_SAMPLES


def plan_slots(
    lengths: Lengths | Sequence[np.ndarray],
    num_slots: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    excluded: Mask | None = None,
    slots: range | None = None,
    deal: Deal | None = None,
) -> list[list[Piece]]:
    """The pieces each of ``num_slots`` slots streams this epoch (only ``slots`` are filled when given).

    The shards, in the epoch's order, form one long stream of samples; it is cut into ``num_slots``
    consecutive runs of equal total length (a sample goes where the midpoint of its running total falls).
    So every slot gets the same amount of audio or tokens to within one sample, reads a few whole shards plus
    at most two partial ones, and with fewer shards than slots the shards are shared. The running total is
    the shard table's prefix sum plus a sum inside the shard, so a rank finds its own slots' pieces from the
    shard table and the lengths of just the shards they touch. ``excluded`` (a mask over global ids, or a
    `Consumed`) leaves out samples consumed before a resume: they are dealt
    as in a fresh epoch and then dropped, so a slot's share needs no other shard's lengths. ``deal``: the
    epoch's `Deal` of these lengths over ``num_slots`` slots, where the caller holds it (a resume dealing one old
    slot at a time shuffles the shard table once, not once a slot).
    """
    lengths = lengths if isinstance(lengths, Lengths) else Lengths.of(lengths)
    wanted = slots if slots is not None else range(num_slots)
    out: list[list[Piece]] = [[] for _ in range(num_slots)]
    deal = deal if deal is not None else Deal.of(lengths, num_slots, seed, epoch, shuffle)
    if not len(wanted) or deal.total <= 0:
        return out
    positions = deal.positions(wanted.start, wanted.stop)
    lengths.prefetch(deal.order[positions])
    for i in positions:
        shard = int(deal.order[i])
        slot_of = deal.slot_of(i)
        idx = np.flatnonzero((slot_of >= wanted.start) & (slot_of < wanted.stop))
        if excluded is not None and idx.size:
            # asked only about the samples these slots hold: a lazy mask re-plans just their old ranks
            keep = ~np.asarray(excluded[int(lengths.offsets[shard]) + idx], dtype=bool)
            idx = idx[keep]
        if not idx.size:
            continue
        slot_of = slot_of[idx]
        cuts = np.flatnonzero(np.diff(slot_of)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), idx.size]):
            out[int(slot_of[a])].append(Piece(shard, int(idx[a]), int(idx[b - 1]) + 1))
    return out


@dataclass
class Deal:
    """The epoch's shard order cut into ``num_slots`` slots of equal total length (see `plan_slots()`)."""

    lengths: Lengths
    num_slots: int
    order: np.ndarray
    prefix: np.ndarray  # running total before each position of ``order``

    @classmethod
    def of(cls, lengths: Lengths, num_slots: int, seed: int, epoch: int, shuffle: bool) -> Deal:
        """The deal over ``num_slots`` slots. The order and running total depend on the lengths and the epoch,
        not on the slot count: while a deal of the same lengths and epoch is alive (a resume's deal of the old
        layout, beside the new layout's), they are shared with it rather than shuffled and held twice."""
        key = (id(lengths), int(seed), int(epoch), bool(shuffle))
        held = _LIVE_DEALS.get(key)
        if held is not None and held.lengths is lengths:  # a live deal holds ``lengths``: its id is not reused
            return cls(lengths, num_slots, held.order, held.prefix)
        order = shard_order(lengths.num_shards, seed, epoch, shuffle, blocks=shard_blocks(lengths.offsets))
        order.flags.writeable = False
        prefix = np.concatenate([[0.0], np.cumsum(lengths.totals[order])])
        prefix.flags.writeable = False
        deal = cls(lengths, num_slots, order, prefix)
        _LIVE_DEALS[key] = deal
        return deal

    @property
    def total(self) -> float:
        return float(self.prefix[-1])

    def positions(self, first_slot: int, stop_slot: int) -> range:
        """Positions in ``order`` of the shards that can hold samples of slots ``[first_slot, stop_slot)``
        (one more on each side for rounding)."""
        lo, hi = first_slot * self.total / self.num_slots, stop_slot * self.total / self.num_slots
        first = max(0, int(np.searchsorted(self.prefix[1:], lo, side="left")) - 1)
        return range(first, min(len(self.order), int(np.searchsorted(self.prefix[:-1], hi, side="right")) + 1))

    def slot_of(self, position: int) -> np.ndarray:
        """The slot of each sample (tar order) of the shard at ``position`` in the order."""
        shard = int(self.order[position])
        x = np.asarray(self.lengths.shard(shard), dtype=np.float64)
        if self.lengths.scale is not None:
            x = x * self.lengths.scale[shard]
        mid = self.prefix[position] + np.cumsum(x) - x / 2
        return np.minimum((mid * self.num_slots / self.total).astype(np.int64), self.num_slots - 1)


#: the deals alive now, by (lengths, seed, epoch, shuffle): an entry goes with its deal, so sharing holds no memory
_LIVE_DEALS: weakref.WeakValueDictionary[tuple[int, int, int, bool], Deal] = weakref.WeakValueDictionary()
