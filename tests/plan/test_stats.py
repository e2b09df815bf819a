"""Length statistics streamed in bounded memory: exact while small, every percentile within the stated
accuracy once summarised, and bucket boundaries / suggested budgets that agree with the exact ones."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch.plan.buckets import estimate_boundaries, suggest_budget
from streambatch.stats import LengthStats, stream_stats


def chunks_of(x: np.ndarray, n: int) -> list[np.ndarray]:
    return np.array_split(x, max(1, n))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 3_000), st.sampled_from(["int", "lognormal", "zeros"]), st.integers(1, 9))
def test_summarised_percentiles_stay_within_the_accuracy(seed, n, kind, pieces):
    rng = np.random.default_rng(seed)
    if kind == "int":
        x = rng.integers(1, 200_000, n).astype(np.float64)
    elif kind == "lognormal":
        x = rng.lognormal(3, 1.5, n)
    else:
        x = np.where(rng.random(n) < 0.3, 0.0, rng.integers(1, 50, n)).astype(np.float64)
    sketch = stream_stats(chunks_of(x, pieces), exact_limit=n // 2)
    exact = stream_stats(chunks_of(x, pieces))
    assert exact.exact and not sketch.exact
    assert (sketch.count, sketch.min, sketch.max) == (n, x.min(), x.max())
    assert np.isclose(sketch.total, x.sum())
    for q in np.linspace(0, 1, 21):
        # the value at rank q·(n-1) lies between the order statistics around it; the sketch returns a value
        # within `accuracy` of one of the lengths there
        got = sketch.quantile(q)[0]
        lo, hi = np.sort(x)[int(np.floor(q * (n - 1)))], np.sort(x)[int(np.ceil(q * (n - 1)))]
        tol = sketch.accuracy * max(abs(lo), abs(hi)) + 1e-9
        assert lo - tol <= got <= hi + tol, (q, lo, got, hi)
        assert np.isclose(exact.quantile(q)[0], np.quantile(x, q))


def test_exact_mode_matches_numpy_and_restricts():
    x = np.random.default_rng(0).integers(1, 1_000, 5_000).astype(np.float64)
    s = LengthStats.of(x)
    assert s.exact
    assert s.percentile(37) == np.percentile(x, 37)
    w = s.within(100, 500)
    kept = x[(x > 100) & (x <= 500)]
    assert (w.count, w.min, w.max) == (kept.size, kept.min(), kept.max())


def test_boundaries_and_budget_from_a_summary_agree_with_the_exact_ones():
    rng = np.random.default_rng(3)
    x = rng.lognormal(np.log(8 * 16_000), 0.6, 200_000).clip(16_000, 35 * 16_000)
    exact = estimate_boundaries(x, 200 * 16_000, 16)
    sketch = stream_stats(chunks_of(x, 50), exact_limit=10_000)
    approx = estimate_boundaries(sketch, 200 * 16_000, 16)
    assert len(approx) == len(exact)
    assert np.allclose(approx, exact, rtol=0.01)  # snapped to the same capacity classes, to the bin width
    assert abs(suggest_budget(sketch, "samples", 16_000) - suggest_budget(x, "samples", 16_000)) <= 16_000


def test_memory_of_a_summary_does_not_grow_with_the_lengths():
    s = LengthStats(exact_limit=1_000)
    rng = np.random.default_rng(1)
    for _ in range(50):
        s.add(rng.integers(1, 10**6, 20_000))
    size = s._bins.nbytes
    for _ in range(50):
        s.add(rng.integers(1, 10**6, 20_000))
    assert s.count == 2_000_000 and s._bins.nbytes == size < 200_000
