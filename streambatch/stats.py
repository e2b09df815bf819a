"""Length statistics in bounded memory: counts, totals, extremes and percentiles of any number of lengths.

``shardify inspect``, suggested budgets and bucket boundaries need percentiles of every length in the dataset.
`LengthStats` streams them shard by shard: exact while they fit in ``exact_limit`` values, then a
histogram of log-spaced bins (each ``accuracy`` wide relative to its value, as in DDSketch), so a 10⁹-sample
index is summarised in a few MB with every percentile within 0.1 % of the exact one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import OptionError, shown

#: smallest and largest positive length the histogram tells apart (smaller ones share the first bin)
_LOW, _HIGH = 1e-6, 1e15


class LengthStats:
    """Lengths added in chunks; ``count``, ``total``, ``min``, ``max`` exact, percentiles exact or within
    ``accuracy`` (relative) once more than ``exact_limit`` lengths were added."""

    def __init__(self, exact_limit: int = 1 << 22, accuracy: float = 1e-3):
        self.exact_limit, self.accuracy = int(exact_limit), float(accuracy)
        self.gamma = (1 + accuracy) / (1 - accuracy)
        self.count, self.total = 0, 0.0
        self.min, self.max = math.inf, -math.inf
        self._chunks: list[np.ndarray] | None = []
        self._zeros = 0
        self._first = math.floor(math.log(_LOW) / math.log(self.gamma))
        self._bins = np.zeros(0, dtype=np.int64)

    @classmethod
    def of(cls, lengths: Any, **kw: Any) -> LengthStats:
        """Statistics of an array of lengths (a `LengthStats` is returned as it is)."""
        if isinstance(lengths, LengthStats):
            return lengths
        out = cls(**kw)
        out.add(lengths)
        return out

    @property
    def exact(self) -> bool:
        """Whether every length is still held (percentiles are then exact)."""
        return self._chunks is not None

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def add(self, lengths: Any) -> None:
        """Add a chunk of lengths (one shard's, say)."""
        x = np.asarray(lengths, dtype=np.float64).ravel()
        if not x.size:
            return
        self.count += int(x.size)
        self.total += float(x.sum())
        self.min, self.max = min(self.min, float(x.min())), max(self.max, float(x.max()))
        if self._chunks is not None:
            self._chunks.append(x)
            if self.count > self.exact_limit:
                self._fold()
        else:
            self._bin(x)

    def _fold(self) -> None:
        chunks, self._chunks = self._chunks or [], None
        for x in chunks:
            self._bin(x)

    def _bin(self, x: np.ndarray) -> None:
        positive = x[x > 0]
        self._zeros += int(x.size - positive.size)
        keys = np.floor(np.log(np.clip(positive, _LOW, _HIGH)) / math.log(self.gamma)).astype(np.int64) - self._first
        counts = np.bincount(keys)
        if counts.size > self._bins.size:
            counts[: self._bins.size] += self._bins
            self._bins = counts
        else:
            self._bins[: counts.size] += counts

    def values(self) -> np.ndarray:
        """Every length (exact mode only)."""
        if self._chunks is None:
            raise OptionError("the lengths were summarised into a histogram; use quantile() or histogram()")
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0)

    def quantile(self, q: Any) -> np.ndarray:
        """Quantiles ``q`` in [0, 1] (as ``numpy.quantile``; from the histogram, the value of the bin holding
        that rank, within ``accuracy``)."""
        q = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if self.count == 0:
            return np.full(q.shape, math.nan)
        if self._chunks is not None:
            return np.quantile(self.values(), q)
        cum = np.cumsum(np.concatenate([[self._zeros], self._bins]))
        pos = np.searchsorted(cum, q * (self.count - 1), side="right")
        # bin k holds [γ^k, γ^(k+1)); 2·γ^(k+1)/(1+γ) is within `accuracy` of every value in it
        mid = 2 * self.gamma ** (pos + self._first) / (1 + self.gamma)
        value = np.where(pos == 0, 0.0, mid)
        return np.clip(value, self.min, self.max)

    def percentile(self, p: float) -> float:
        return float(self.quantile(p / 100)[0])

    def within(self, lo: float, hi: float) -> LengthStats:
        """The lengths in ``(lo, hi]`` (to the histogram's resolution once summarised)."""
        out = LengthStats(self.exact_limit, self.accuracy)
        if self._chunks is not None:
            x = self.values()
            out.add(x[(x > lo) & (x <= hi)])
            return out
        edges = self._edges()
        keep = (edges[1:] > lo) & (edges[:-1] <= hi)
        out._chunks, out._bins = None, np.where(keep, self._bins, 0)
        out.count = int(out._bins.sum())
        if out.count:
            used = np.flatnonzero(out._bins)
            out.min, out.max = max(lo, float(edges[used[0]]), self.min), min(hi, float(edges[used[-1] + 1]), self.max)
            centres = (edges[:-1] + edges[1:]) / 2
            out.total = float((out._bins * centres).sum())
        return out

    def _edges(self) -> np.ndarray:
        return self.gamma ** (np.arange(self._bins.size + 1) + self._first)

    def histogram(self, bins: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """``bins`` equal-width counts over [min, max] × ``scale`` (for plots)."""
        if self._chunks is not None:
            return np.histogram(self.values() * scale, bins=bins)
        edges = np.linspace(self.min * scale, self.max * scale, bins + 1)
        own = self._edges()
        mids = (own[:-1] + own[1:]) / 2 * scale
        counts, _ = np.histogram(np.clip(mids, edges[0], edges[-1]), bins=edges, weights=self._bins)
        counts[0] += self._zeros
        return counts.astype(np.int64), edges

    def summary(
        self, unit: str, seconds_per_unit: float | None = None, num_shards: int | None = None
    ) -> dict[str, Any]:
        """Counts, totals and length percentiles (and hours for audio units), as ``shardify inspect`` prints."""
        out: dict[str, Any] = {"num_samples": self.count, "unit": unit}
        if num_shards is not None:
            out["num_shards"] = num_shards
        if not self.count:
            return out
        out["total_length"] = json_number(self.total)
        out["mean"] = self.mean
        out["min"], out["max"] = json_number(self.min), json_number(self.max)
        out["percentiles"] = {p: self.percentile(p) for p in (1, 5, 25, 50, 75, 95, 99)}
        if not self.exact:
            out["percentiles_within"] = self.accuracy
        if seconds_per_unit:
            out["total_hours"] = self.total * seconds_per_unit / 3600.0
        return out


def json_number(x: float) -> int | float:
    x = float(x)
    return int(x) if x.is_integer() else x


def stream_stats(chunks: Iterable[Any], **kw: Any) -> LengthStats:
    """`LengthStats` of lengths streamed in chunks (one in memory at a time)."""
    out = LengthStats(**kw)
    for chunk in chunks:
        out.add(chunk)
    return out


def stream_array(name: str, values: Any, n: int | None = None, whole: bool = False) -> np.ndarray:
    """``values`` as a 1-D numeric array (of ``n`` entries when given) of finite numbers from 0 (``whole``: whole
    numbers, any sign: group keys), else an `OptionError` naming ``name``."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):  # ragged nesting
        array = np.asarray(None)
    kind = "whole numbers" if whole else "finite numbers from 0"
    types = (np.integer,) if whole else (np.integer, np.floating)
    if array.ndim != 1 or not any(np.issubdtype(array.dtype, t) for t in types):
        got = f"an array of shape {array.shape}, {array.dtype}" if isinstance(values, np.ndarray) else shown(values)
        raise OptionError(f"{name} must be a 1-D array or list of {kind}, got {got}")
    if n is not None and len(array) != n:
        raise OptionError(f"{name} must give one value per sample: {len(array):,} values for {n:,} lengths")
    if not whole:
        bad = array[~(np.isfinite(array) & (array >= 0))]
        if len(bad):
            raise OptionError(f"{name} must be {kind}, got {shown(bad[0].item())} among them")
    return array
