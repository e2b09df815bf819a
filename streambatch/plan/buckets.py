"""Bucket boundaries and a starting budget, estimated from a dataset's lengths."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import choice_option, int_option, number_option
from ..stats import LengthStats, stream_array
from ..units import Unit

#: the most buckets `estimate_boundaries()` is asked for: its boundaries snap to the batch capacity thresholds
#: ``budget / k``, of which it weighs 4,097 (more buckets than that cannot be told apart)
MAX_BUCKETS = 4096


def estimate_boundaries(
    lengths: np.ndarray | LengthStats, budget: float, num_buckets: int | None = None, spacing: str = "quantile"
) -> np.ndarray:
    """Bucket boundaries for ``lengths`` under ``budget``: the upper edges of all buckets but the last.

    ``spacing="quantile"`` (the default): boundaries sit at the lengths where a batch's capacity
    ``floor(budget / max_len)`` changes (``budget / k``), so every sample of a bucket fits the same number of
    times in a batch and a full bucket batch wastes no capacity. Where those classes are narrower than the data
    needs (short samples, many per batch), neighbouring classes are merged so that each bucket holds about
    ``1/num_buckets`` of the samples. ``spacing="exponential"``: edges that grow by a constant factor from the
    shortest to the longest length (each bucket as many times longer than the last). The default ``num_buckets`` is
    `default_num_buckets()`.
    """
    number_option("budget", budget, positive=True)
    if num_buckets is not None:
        int_option("num_buckets", num_buckets, 1, MAX_BUCKETS)
    choice_option("spacing", spacing, ("quantile", "exponential"))
    lengths = _stats("lengths", lengths).within(0, budget)
    if lengths.count == 0:
        return np.zeros(0)
    lo, hi = lengths.min, lengths.max
    if spacing == "exponential":
        return exponential_boundaries(lo, hi, num_buckets or default_num_buckets(lengths, budget))
    kmax = int(budget // lo)  # most samples per batch
    kmin = max(1, int(budget // hi))
    if num_buckets is None:
        num_buckets = default_num_buckets(lengths, budget)
    num_buckets = max(1, int(num_buckets))
    if num_buckets == 1:
        return np.zeros(0)
    # Candidate edges: capacity thresholds budget/k inside the data range (at most a few thousand).
    ks = np.arange(kmin, min(kmax, kmin + MAX_BUCKETS) + 1, dtype=np.float64)
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


def exponential_boundaries(lo: float, hi: float, num_buckets: int) -> np.ndarray:
    """``num_buckets - 1`` edges between ``lo`` and ``hi`` at a constant ratio, rounded to 6 significant digits
    (every rank computes the same edges even where its ``pow`` differs in the last bit)."""
    if num_buckets <= 1 or not 0 < lo < hi:
        return np.zeros(0)
    edges = lo * (hi / lo) ** (np.arange(1, num_buckets) / num_buckets)
    return np.unique([float(f"{e:.6g}") for e in edges])


#: a bucket should hold at least this many batches of median-length samples to be worth its own batches
MIN_BATCHES_PER_BUCKET = 2


def default_num_buckets(lengths: np.ndarray | LengthStats, budget: float) -> int:
    """Buckets when none are asked for: more where the batch capacity spreads wider (8 to 64), but no more
    than leave each bucket `MIN_BATCHES_PER_BUCKET` full batches of median samples (60 samples of
    which 32 fill a batch get one bucket)."""
    lengths = _stats("lengths", lengths).within(0, budget)
    if lengths.count == 0 or lengths.min <= 0:
        return 1
    kmax, kmin = int(budget // lengths.min), max(1, int(budget // lengths.max))
    by_spread = int(min(64, max(8, 4 * math.log2(max(2, kmax / kmin)) + 8)))
    per_batch = max(1, int(budget // max(lengths.percentile(50), 1e-12)))
    return max(1, min(by_spread, lengths.count // (MIN_BATCHES_PER_BUCKET * per_batch)))


def _stats(name: str, lengths: Any) -> LengthStats:
    """A public function's ``lengths`` as statistics: a `LengthStats` as it is, else checked as a 1-D
    array of finite lengths from 0 (an `OptionError` naming ``name``)."""
    return lengths if isinstance(lengths, LengthStats) else LengthStats.of(stream_array(name, lengths))


def suggest_budget(
    lengths: np.ndarray | LengthStats, unit: Unit | str = Unit.SAMPLES, sample_rate: int | None = None
) -> float:
    """A starting budget: room for about 32 median samples, and never less than the longest sample (whole
    seconds of audio where lengths are audio)."""
    lengths = _stats("lengths", lengths)
    if sample_rate is not None:
        int_option("sample_rate", sample_rate, 1)
    if lengths.count == 0:
        return 0.0
    b = max(lengths.percentile(50) * 32, lengths.max)
    step = Unit.parse(unit).from_seconds(1.0, sample_rate) or 1
    return float(math.ceil(b / step) * step)


#: ``buffer_size``'s floor and its value where nothing is known of the dataset
DEFAULT_BUFFER = 2_000
#: batches' worth of samples an automatic window holds: what text (hundreds of short sequences a batch) needs to
#: pack within 2 % of a global sort; speech (tens a batch) stays at the floor
WINDOW_BATCHES = 64
#: raw bytes an automatic window may hold beyond the floor (a streamed shard's samples wait in it compressed)
WINDOW_BYTES = 256 << 20


def default_buffer_size(capacity_at_mean: float, sample_bytes: float | None = None) -> int:
    """The window when ``buffer_size`` is not given: `WINDOW_BATCHES` batches of samples of the mean
    length (``capacity_at_mean`` a batch), at most `WINDOW_BYTES` of samples of ``sample_bytes`` each
    where that is known, and never fewer than `DEFAULT_BUFFER` samples."""
    want = WINDOW_BATCHES * max(float(capacity_at_mean), 0.0)
    if sample_bytes is not None and sample_bytes > 0:
        want = min(want, WINDOW_BYTES / float(sample_bytes))
    return max(DEFAULT_BUFFER, int(want)) if math.isfinite(want) else DEFAULT_BUFFER
