"""The numbers behind calibration, with no device in sight: search one length's largest fitting batch from
a few measured trials, fit ``peak ≈ a + b·n·L + c·n·L²`` to all of them, and turn that fit into the cost
model and budget the loader reads. The measuring itself is `streambatch.fit.memory`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..plan.cost import PaddedCost, QuadraticCost
from .memory import CalibrationError, Trial

log = logging.getLogger("streambatch.calibrate")

#: share of the per-sample cost at the longest length above which the quadratic model is chosen
QUADRATIC_THRESHOLD = 0.05


# ---- the search ---------------------------------------------------------------------------------------
def search_max_batch(
    measure: Callable[[int, float], Trial],
    length: float,
    limit: float,
    *,
    max_batch_size: int = 4096,
    guess: int | None = None,
    slope: float | None = None,
    intercept: float | None = None,
    rel_tol: float = 0.01,
    max_trials: int = 40,
) -> tuple[int, int | None, list[Trial]]:
    """The largest ``n`` for which ``measure(n, length)`` fits, to ``rel_tol``.

    Returns ``(lo, hi, trials)``: ``lo`` fits (0: not even one sample), ``hi`` the smallest size seen not to
    fit (None: ``max_batch_size`` fits). ``guess`` (a first size), ``slope`` and ``intercept`` (a predicted
    ``peak ≈ intercept + slope·n``) come from the lengths measured before and only speed the search up.
    """
    trials: list[Trial] = []
    fits: dict[int, float | None] = {}  # n -> peak
    fails: dict[int, float | None] = {}
    lo, hi = 0, None
    n = int(min(max(1, guess or 1), max_batch_size))
    widths: list[int] = []
    while len(trials) < max_trials:
        t = measure(n, length)
        trials.append(t)
        log.debug("n=%d length=%g peak=%s fits=%s %s", n, length, t.peak, t.fits, t.note)
        if t.fits:
            fits[n] = t.peak
        else:
            fails[n] = t.peak
        hi = min(fails) if fails else None
        # the largest fit below every failure (noisy measurements can make a larger batch fit: distrust it)
        lo = max((k for k in fits if hi is None or k < hi), default=0)
        if hi is not None and hi <= 1:
            return 0, hi, trials
        if lo >= max_batch_size:
            return lo, None, trials
        if hi is None:
            n = _grow(fits, lo, limit, slope, intercept, rel_tol, max_batch_size)
        elif lo == 0:
            n = _shrink(fails.get(hi), hi, limit)
        else:
            tol = max(1, int(rel_tol * lo))
            if hi - lo <= tol:
                return lo, hi, trials
            widths.append(hi - lo)
            n = _narrow(lo, hi, fits.get(lo), fails.get(hi), limit, tol, widths)
    log.warning("length %g: search stopped after %d trials (largest fitting batch %d)", length, max_trials, lo)
    return lo, hi, trials


def _grow(
    fits: dict[int, float | None],
    lo: int,
    limit: float,
    slope: float | None,
    intercept: float | None,
    rel_tol: float,
    max_batch_size: int,
) -> int:
    """Nothing failed yet: aim at the limit along the measured line, at most ×8 per step."""
    pts = sorted((k, p) for k, p in fits.items() if p is not None)
    nxt = lo * 4
    line = None
    if len(pts) >= 2 and pts[-1][1] - pts[0][1] > 0.02 * limit:
        (n0, p0), (n1, p1) = pts[0], pts[-1]
        line = ((p1 - p0) / (n1 - n0), p1, n1)
    elif pts and slope and slope > 0:
        line = (slope, pts[-1][1], pts[-1][0])
    elif pts and intercept is not None and pts[-1][1] > intercept:
        line = ((pts[-1][1] - intercept) / pts[-1][0], pts[-1][1], pts[-1][0])
    if line is not None and line[0] > 0:
        nxt = int(line[2] + (limit - line[1]) / line[0])
    return int(min(max(nxt, lo + max(1, int(rel_tol * lo))), lo * 8, max_batch_size))


def _shrink(peak: float | None, hi: int, limit: float) -> int:
    """Even the first guess failed: scale down by its peak when known, else by 4."""
    nxt = hi // 4
    if peak is not None and peak > 0:
        nxt = int(hi * limit / peak * 0.98)
    return max(1, min(nxt, hi // 2 if peak is None else hi - 1))


def _narrow(lo: int, hi: int, pl: float | None, ph: float | None, limit: float, tol: int, widths: list[int]) -> int:
    """Bracketed: interpolate the measured peaks, with a bisection step whenever that stalls."""
    if pl is not None and ph is not None and ph > pl and not (len(widths) >= 3 and widths[-1] > widths[-3] / 2):
        cand = lo + (limit - pl) * (hi - lo) / (ph - pl)
    else:
        cand = (lo + hi) / 2  # bisection (no peak to interpolate, or interpolation stalls)
    cand = int(round(cand))
    cand = max(cand, lo + tol) if cand - lo < tol else cand
    cand = min(cand, hi - tol) if hi - cand < tol else cand
    return int(min(max(cand, lo + 1), hi - 1))


# ---- fitting ------------------------------------------------------------------------------------------
def fit_memory_model(trials: Sequence[Trial], limit: float) -> dict[str, float]:
    """Least squares ``peak ≈ a + b·n·L + c·n·L²`` over the completed trials, with ``b, c ≥ 0``.

    Residuals are relative (weights ``1 / max(peak, limit/20)``), so the many trials near the limit, which
    decide the budget, weigh as they should. Returns ``a``, ``b``, ``c`` and the largest relative error.
    """
    pts = [(t.n, float(t.length), float(t.peak)) for t in trials if t.peak is not None]
    if len(pts) < 2:
        raise CalibrationError(f"only {len(pts)} completed trials: not enough to fit a memory model")
    n = np.array([p[0] for p in pts], dtype=np.float64)
    length = np.array([p[1] for p in pts], dtype=np.float64)
    y = np.array([p[2] for p in pts], dtype=np.float64)
    x1, x2 = n * length, n * length * length
    w = 1.0 / np.maximum(y, limit / 20.0)
    # scale the columns so that the solve is well conditioned
    s1, s2 = max(x1.max(), 1.0), max(x2.max(), 1.0)
    cols = {"a": np.ones_like(y), "b": x1 / s1, "c": x2 / s2}
    best = None
    for active in (("a", "b", "c"), ("a", "b"), ("a", "c"), ("a",)):  # the non-negative least-squares candidates
        A = np.stack([cols[k] for k in active], axis=1) * w[:, None]
        coef, *_ = np.linalg.lstsq(A, y * w, rcond=None)
        sol = dict(zip(active, coef))
        if sol.get("b", 0.0) < 0 or sol.get("c", 0.0) < 0:
            continue
        res = float(np.sum((A @ coef - y * w) ** 2))
        if best is None or res < best[0] - 1e-15:
            best = (res, sol)
    assert best is not None  # the ("a",) candidate has no b or c to go negative: always admissible
    sol = best[1]
    a, b, c = float(sol.get("a", 0.0)), float(sol.get("b", 0.0)) / s1, float(sol.get("c", 0.0)) / s2
    pred = a + b * x1 + c * x2
    err = float(np.max(np.abs(pred - y) / np.maximum(y, limit / 20.0)))
    return {"a": a, "b": b, "c": c, "max_rel_error": err, "points": len(pts)}


def predict_max_batch(fit: dict[str, float], length: float, limit: float, max_batch_size: int) -> int:
    """The largest batch of ``length`` the fitted model puts under ``limit`` (capped at ``max_batch_size``)."""
    per = fit["b"] * length + fit["c"] * length * length
    if per <= 0:
        return max_batch_size
    return int(max(0, min(max_batch_size, (limit - fit["a"]) / per)))


def budget_from_fit(
    fit: dict[str, float],
    limit: float,
    max_length: float,
    per_length: Sequence[dict[str, Any]],
    *,
    margin: float = 0.02,
    quadratic_threshold: float = QUADRATIC_THRESHOLD,
    integer: bool = True,
) -> dict[str, Any]:
    """The cost model and budget from a fitted memory model (the guide "Fitting batches to the model").

    ``budget = (limit - a) / b`` with ``cost="quadratic"`` and ``quadratic_factor = b / c`` when the
    quadratic term's share at ``max_length`` reaches ``quadratic_threshold``, else ``cost="padded"`` with the
    per-sample cost taken at ``max_length``. ``per_length`` holds each probe length's ``length``,
    ``max_batch_size`` (measured to fit) and ``min_failing`` (measured not to fit, or None); the budget is
    lowered until no length admits more than its measured ``max_batch_size``, then by ``margin``.
    """
    a, b, c = fit["a"], fit["b"], fit["c"]
    share = c * max_length / (b + c * max_length) if (b + c * max_length) > 0 else 0.0
    if share >= quadratic_threshold and c > 0:
        if b <= 0:  # pure L²: keep a (tiny) linear term so that the factor is finite
            b = c * max_length * 1e-3
        model: Any = QuadraticCost(b / c)
        per_cost = b
    else:
        model = PaddedCost()
        per_cost = b + c * max_length  # the worst case over the dataset's lengths
    if per_cost <= 0:
        raise CalibrationError(
            "the measured memory does not grow with the batch: cannot fit a budget (is step_fn a no-op?)"
        )
    fitted = (limit - a) / per_cost
    budget = fitted
    for row in per_length:
        if row.get("max_batch_size") is None:
            continue
        lo, L = int(row["max_batch_size"]), float(row["length"])
        capped = row.get("min_failing") is None and lo > 0
        if not capped:  # n = lo + 1 was not seen to fit: keep its cost over the budget
            budget = min(budget, float(model.cost(lo + 1, L)) * (1 - 1e-9))
    budget *= 1 - margin
    if budget <= 0:
        raise CalibrationError(
            f"no budget fits the limit ({limit:.4g} bytes): the fixed memory a={a:.4g} leaves no room"
        )
    if integer:
        budget = float(math.floor(budget))
    out = {
        "cost": model.name,
        "quadratic_factor": getattr(model, "factor", None),
        "budget": budget,
        "fitted_budget": fitted,
        "quadratic_share": share,
    }
    return out
