"""Fresh batch-mates: the batches a window round sends out trade members among batches of near length.

A batch is a run of the length-sorted window, so two samples of neighbouring lengths that share a window (those
of one shard always do) would be batch-mates again in every epoch. Before a round's batches leave, those whose
longest samples share a length :func:`level` (:data:`LEVELS` per doubling, about 1 % apart, the edges shifted
by a seeded random phase each round) pool their samples, the pool is shuffled, and each batch takes back as many
as it had. A batch joins only if its size still fits the budget at the pool's longest length, and never with a
batch of another bucket or ``batch_by`` key. So every batch keeps its size and place in the emission order and
stays within the budget, every sample still leaves once, the batch count is that of the plain cut, and padding
grows by at most a level; the partners change with the batcher's seed, that is with the epoch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .select import run_positions

#: levels per doubling of length: runs whose longest samples share a level trade members (about 1 % apart)
LEVELS = 64


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
    """Each length's level: :data:`LEVELS` per doubling, evenly spaced, shifted by ``phase`` (in [0, 1)) of a
    level; from the float's exponent and a scaled mantissa (exact arithmetic, the same on every machine)."""
    mantissa, exponent = np.frexp(np.asarray(lengths, dtype=np.float64))
    return exponent.astype(np.int64) * (LEVELS + 1) + np.floor((2 * mantissa - 1) * LEVELS + phase).astype(np.int64)
