"""Freshness: how much of one epoch's batch composition comes back in the next.

Two samples are *batch-mates* when one batch holds both. Of the batch-mate pairs of one epoch, the share that are
batch-mates again in another epoch says how fresh the batches are: a sampler that reshuffles fully keeps about
(batch size / samples); one that cuts the same sorted runs every epoch keeps most of them. Computed from two
epochs' batches of global sample ids, without listing the pairs (a batch of ``k`` holds ``k (k - 1) / 2``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def batch_labels(batches: Sequence[np.ndarray], num_samples: int) -> np.ndarray:
    """The batch number of every sample id (``-1`` for a sample no batch holds; a repeated sample keeps its
    first batch)."""
    label = np.full(num_samples, -1, dtype=np.int64)
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    if not len(sizes):
        return label
    flat = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    which = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    label[flat[::-1]] = which[::-1]  # the first batch of a repeated id wins
    return label


def pairs(labels: np.ndarray) -> int:
    """Pairs of samples that share a label (labels ``< 0`` belong to no batch)."""
    _, counts = np.unique(labels[labels >= 0], return_counts=True)
    return int((counts * (counts - 1) // 2).sum())


def pairs_kept(first: Sequence[np.ndarray], second: Sequence[np.ndarray], num_samples: int) -> float:
    """The share of the batch-mate pairs of ``first`` that are batch-mates again in ``second`` (batches of global
    sample ids below ``num_samples``); 0.0 when ``first`` has no pairs."""
    a = batch_labels(first, num_samples)
    b = batch_labels(second, num_samples)
    total = pairs(a)
    if not total:
        return 0.0
    both = (a >= 0) & (b >= 0)
    joint = a[both] * (int(b.max()) + 1) + b[both]  # one label per (first batch, second batch)
    return pairs(joint) / total


def epoch_batches(plan: object) -> list[np.ndarray]:
    """The batches of an `EpochPlan` as arrays of global sample ids."""
    return [sp.gids[b] for sp in plan.slots for b, rep in zip(sp.batches, sp.repeat) if not rep]  # type: ignore[attr-defined]
