"""Fresh batch-mates: the batches a window round sends out trade members among batches of near length.

A batch is a run of the length-sorted window, so two samples of neighbouring lengths that share a window (those
of one shard always do) would be batch-mates again in every epoch. Before a round's batches leave, those whose
longest samples share a length `level()` (`LEVELS` per doubling, about 1 % apart, the edges shifted
by a seeded random phase each round) pool their samples, the pool is shuffled, and each batch takes back as many
as it had. A batch joins only if its size still fits the budget at the pool's longest length, and never with a
batch of another bucket or ``batch_by`` key. So every batch keeps its size and place in the emission order and
stays within the budget, every sample still leaves once, the batch count is that of the plain cut, and padding
grows by at most a level; the partners change with the batcher's seed, that is with the epoch.

A short stream (at most `LEVEL_CUT_WINDOWS` windows: a small dataset, whose worker streams the same
samples into one window every epoch) would still be cut into nearly the same runs each epoch. There
`LevelCut` also cuts the window at each sample's level top (levels shifted by a seeded phase per epoch)
with the samples of a level in a seeded random order, so where the runs begin and end moves from epoch to epoch.
A batch stays within the budget at its longest level top, so padding grows by at most a level again.

``level_width`` (`BatchingConfig`) cuts every stream so, at levels of that many length units instead of `LEVELS`
per doubling: the dial between batch count and fresh batch-mates. A level of fixed width spans many short samples'
lengths (whose large batches hold most of the pairs, ``k (k - 1) / 2`` in a batch of ``k``) and few long ones'
(whose padding weighs most), so it frees the most pairs for the least padding; wider levels keep fewer pairs and
cost more batches (`tools/bench_freshness.py` prints the curve).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .select import run_positions

#: levels per doubling of length: runs whose longest samples share a level trade members (about 1 % apart)
LEVELS = 64
#: a stream of at most this many windows is cut at level tops in a random order within each level (`LevelCut`)
LEVEL_CUT_WINDOWS = 2


def mix_runs(
    out: np.ndarray,
    sizes: np.ndarray,
    lens: np.ndarray,
    capacity: Callable[[np.ndarray], np.ndarray],
    rng: np.random.Generator,
    keys: np.ndarray | None = None,
) -> np.ndarray:
    """The window positions ``out`` (batches of ``sizes``, flat in emission order; each batch ascending, so its
    first position is its longest) with members traded inside groups of near runs; ``lens`` the window's
    lengths by position, ``capacity`` the most samples a batch of each longest length may hold, ``keys`` (by
    position) what a batch must keep to, its bucket and group key: runs of two keys never trade."""
    nb = len(sizes)
    if nb < 2:
        return out
    first = np.cumsum(sizes) - sizes
    top = lens[out[first]]
    group = level(top, rng.random())
    if keys is not None:  # levels and keys as one label, in the order of (key, level)
        _, key = np.unique(keys[out[first]], return_inverse=True)
        group = key.astype(np.int64) * (int(group.max()) + 1) + group
    order = np.argsort(group, kind="stable")  # the batches grouped by level
    g = group[order]
    new_group = np.empty(nb, dtype=bool)
    new_group[0] = True
    np.not_equal(g[1:], g[:-1], out=new_group[1:])
    if new_group.all():  # no two batches share a level: nothing to trade
        return out
    gid = np.cumsum(new_group) - 1
    gtop = np.maximum.reduceat(top[order], np.flatnonzero(new_group))
    fits = sizes[order] <= capacity(gtop)[gid]  # still within the budget with the group's longest sample
    many = np.bincount(gid[fits], minlength=len(gtop))[gid] >= 2
    take = fits & many
    mb = order[take]  # the batches that trade, grouped
    if not len(mb):
        return out
    src = run_positions(first[mb], first[mb] + sizes[mb])
    shuffle = np.argsort(np.repeat(gid[take], sizes[mb]) + rng.random(len(src)))  # within each group
    new = out.copy()
    new[src] = out[src[shuffle]]  # each batch takes back its size of its group's shuffled pool
    return new


def level(lengths: np.ndarray, phase: float) -> np.ndarray:
    """Each length's level: `LEVELS` per doubling, evenly spaced, shifted by ``phase`` (in [0, 1)) of a
    level; from the float's exponent and a scaled mantissa (exact arithmetic, the same on every machine)."""
    mantissa, exponent = np.frexp(np.asarray(lengths, dtype=np.float64))
    return exponent.astype(np.int64) * (LEVELS + 1) + np.floor((2 * mantissa - 1) * LEVELS + phase).astype(np.int64)


def width_top(lengths: np.ndarray, width: float, phase: float) -> np.ndarray:
    """The upper edge of each length's level when levels are ``width`` apart (edges at ``(j - phase) × width``,
    ``phase`` in [0, 1)); never below the length."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return np.maximum((np.floor(lengths / width + phase) + 1 - phase) * width, lengths)


def level_top(lengths: np.ndarray, phase: float) -> np.ndarray:
    """The upper edge of each length's `level()` (never below the length, never past the next power of two,
    where the next doubling's levels begin); exact arithmetic like `level()`."""
    lengths = np.asarray(lengths, dtype=np.float64)
    mantissa, exponent = np.frexp(lengths)
    step = np.floor((2 * mantissa - 1) * LEVELS + phase)
    top = np.minimum(((step + 1 - phase) / LEVELS + 1) / 2, 1.0)
    return np.maximum(np.ldexp(top, exponent), lengths)


class LevelCut:
    """A short stream's cut (or every stream's, at levels ``width`` apart: `width_top()`), fresh every epoch: the
    lengths the window is sorted and cut by are the samples'
    level tops (`level_top()`, at a phase drawn once per batcher, that is per epoch and slot), and the samples
    of one level are sorted in a random order, by a seeded hash of their own lengths (so the order does not depend
    on the order they arrived in; samples of one length keep it). A sample keeps its own length where its level
    top would fit no batch (``capacity`` below 1)."""

    def __init__(
        self, rng: np.random.Generator, capacity: Callable[[np.ndarray], np.ndarray], width: float | None = None
    ):
        self.phase = float(rng.random())
        self.key = np.uint64(rng.integers(0, 1 << 63))
        self.capacity = capacity
        self.width = None if width is None else float(width)

    def lengths(self, lengths: np.ndarray) -> np.ndarray:
        """The lengths to sort and cut by: each sample's level top where a batch can hold it."""
        top = level_top(lengths, self.phase) if self.width is None else width_top(lengths, self.width, self.phase)
        return np.where(self.capacity(top) >= 1, top, lengths)

    def ties(self, lengths: np.ndarray) -> np.ndarray:
        """The keys that order the samples of one level: a seeded hash of each sample's own length."""
        return mix64(np.ascontiguousarray(lengths, dtype=np.float64).view(np.uint64) ^ self.key)

    @staticmethod
    def order(lengths: np.ndarray, ties: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
        """The positions of ``lengths`` longest first (within each group key of ``groups``), then by ``ties``
        (equal ones in the order they are in)."""
        return np.lexsort((ties, -lengths) if groups is None else (ties, -lengths, groups))


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a fixed, well-spread 64-bit hash of each value (unsigned arithmetic wraps)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
