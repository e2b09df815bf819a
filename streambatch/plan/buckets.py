"""Bucket boundaries and a starting budget, estimated from a dataset's lengths."""

from __future__ import annotations

import math

import numpy as np

from .stats import LengthStats


def estimate_boundaries(lengths: np.ndarray | LengthStats, budget: float, num_buckets: int | None = None) -> np.ndarray:
    """Bucket boundaries for ``lengths`` under ``budget``: the upper edges of all buckets but the last.

    Boundaries sit at the lengths where a batch's capacity ``floor(budget / max_len)`` changes
    (``budget / k``), so every sample of a bucket fits the same number of times in a batch and a full
    bucket batch wastes no capacity. Where those classes are narrower than the data needs (short samples,
    many per batch), neighbouring classes are merged so that each bucket holds about ``1/num_buckets`` of
    the samples. The default ``num_buckets`` grows with the capacity spread, capped at 64.
    """
    lengths = LengthStats.of(lengths).within(0, budget)
    if lengths.count == 0:
        return np.zeros(0)
    lo, hi = lengths.min, lengths.max
    kmax = int(budget // lo)  # most samples per batch
    kmin = max(1, int(budget // hi))
    if num_buckets is None:
        num_buckets = int(min(64, max(8, 4 * math.log2(max(2, kmax / kmin)) + 8)))
    num_buckets = max(1, int(num_buckets))
    if num_buckets == 1:
        return np.zeros(0)
    # Candidate edges: capacity thresholds budget/k inside the data range (at most a few thousand).
    ks = np.arange(kmin, min(kmax, kmin + 4096) + 1, dtype=np.float64)
    edges = np.sort(budget / ks)
    edges = edges[(edges > lo) & (edges < hi)]
    # Equal-count targets; snap each to the capacity threshold just above it, so buckets stay whole classes.
    targets = lengths.quantile(np.linspace(0, 1, num_buckets + 1)[1:-1])
    if edges.size:
        pos = np.searchsorted(edges, targets, side="left")
        snapped = edges[np.minimum(pos, edges.size - 1)]
        # keep a target un-snapped where the nearest threshold is far (very short samples, huge capacity)
        far = np.abs(snapped - targets) > 0.05 * targets
        bounds = np.where(far, targets, snapped)
    else:
        bounds = targets
    return np.unique(bounds)


def suggest_budget(lengths: np.ndarray | LengthStats, unit: str = "samples", sample_rate: int | None = None) -> float:
    """A starting budget: room for about 32 median samples, and never less than the longest sample."""
    lengths = LengthStats.of(lengths)
    if lengths.count == 0:
        return 0.0
    b = max(lengths.percentile(50) * 32, lengths.max)
    step = sample_rate if (unit == "samples" and sample_rate) else 1
    return float(math.ceil(b / step) * step)
