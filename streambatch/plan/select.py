"""Which batches leave the batcher's window mid-stream: the tightest runs of the length-sorted window.

A batch is a run of the sorted window that starts at some sample and takes as many samples as the budget allows
for that sample's length. Every start gives one candidate; a candidate's *spread* is how much its samples pad on
average (longest padded length minus mean length). The window sends out the candidates with the least spread,
weighed by how common their length is in the stream so far, without overlap, until enough samples have left;
the others wait for samples of near lengths to arrive. This is what lets a 10k window pack text (a batch of a few
hundred short sequences) nearly as tightly as a global sort. All of it is a function of the pushed stream and
the batcher's seeded generator, so the planner and the workers form the same batches.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

#: resolution of the running length histogram: bins per doubling of length
BINS_PER_OCTAVE = 8
_OFFSET = 128 * BINS_PER_OCTAVE  # bin of length 1; covers lengths 2^-128 .. 2^128
_NUM_BINS = 2 * _OFFSET
_ROOT = math.sqrt(math.sqrt(math.sqrt(2.0)))  # 2 ** (1 / 8) from correctly rounded steps: alike everywhere
_STEPS_LIST = [_ROOT]  # mantissa thresholds in [1, 2): powers of the root by repeated products
for _ in range(BINS_PER_OCTAVE - 2):
    _STEPS_LIST.append(_STEPS_LIST[-1] * _ROOT)
_STEPS = np.array(_STEPS_LIST)
_STEPS_FULL = np.array([1.0] + _STEPS_LIST)

#: How much of each round the tightest runs fill (the rest leaves as random complete batches of the greedy cut,
#: as without them). Choosing the tightest runs makes rare lengths (the long tail, the very short) wait longer
#: for close neighbours: that pads less, but delays them, and the delayed ones all leave at the end of the
#: stream, where they show as order correlation unless the stream is many windows long. So the share depends
#: on how many windows long the stream is: none up to ``LONG_STREAM[0]`` windows, all of ``refill`` from
#: ``LONG_STREAM[1]`` (in between in proportion), eased in over the first ``TIGHT_RAMP`` windows pushed; none
#: where the stream's length is unknown (the online path without an index batches as before).
LONG_STREAM = (5, 20)
TIGHT_RAMP = 5


def tight_share(pushed: int, stream_length: int | None, buffer_size: int, refill: int) -> int:
    """Samples a round sends out as the tightest runs, once ``pushed`` of ``stream_length`` samples have
    entered a window of ``buffer_size`` (integer arithmetic: the same everywhere)."""
    if stream_length is None:
        return 0
    lo, hi = LONG_STREAM
    long_part = min(max(stream_length - lo * buffer_size, 0), (hi - lo) * buffer_size)
    ramp = TIGHT_RAMP * buffer_size
    return refill * long_part * min(pushed, ramp) // ((hi - lo) * buffer_size * ramp)


class LengthHistogram:
    """Counts of the lengths pushed so far, in logarithmic bins (how common a length is in the stream).

    Bins come from the exact binary exponent and a comparison of the mantissa with fixed thresholds, so a
    length falls in the same bin whether it is pushed alone or in an array (no rounding of a logarithm).
    """

    def __init__(self) -> None:
        self.counts = np.zeros(_NUM_BINS, dtype=np.int64)

    @staticmethod
    def bins(lengths: np.ndarray) -> np.ndarray:
        mantissa, exponent = np.frexp(np.asarray(lengths, dtype=np.float64))
        b = exponent.astype(np.int64) * BINS_PER_OCTAVE + np.searchsorted(_STEPS, 2 * mantissa, side="right")
        return np.minimum(np.maximum(b + _OFFSET, 0), _NUM_BINS - 1)

    def add(self, lengths: np.ndarray, groups: np.ndarray | None = None) -> None:
        """Count ``lengths``; ``groups`` is ignored (one histogram for every key: the interface of
        `GroupHistograms`, which keeps one per key)."""
        if len(lengths):
            self.counts += np.bincount(self.bins(lengths), minlength=_NUM_BINS)

    @staticmethod
    def bin_of(length: float) -> int:
        """`bins()` of one length."""
        mantissa, exponent = math.frexp(length)
        b = exponent * BINS_PER_OCTAVE + bisect.bisect_right(_STEPS_LIST, 2 * mantissa)
        return min(max(b + _OFFSET, 0), _NUM_BINS - 1)

    def add_one(self, length: float, group: int = 0) -> None:
        """`add()` of one length."""
        self.counts[self.bin_of(length)] += 1

    def of(self, lengths: np.ndarray) -> np.ndarray:
        """How many pushed lengths share each length's bin."""
        return self.counts[self.bins(lengths)]

    def of_sorted(self, lengths: np.ndarray) -> np.ndarray:
        """`of()` for lengths sorted longest first, from the few bin edges they span."""
        if len(lengths) == 0:
            return np.zeros(0, dtype=np.int64)
        lo, hi = self.bin_of(float(lengths[-1])), self.bin_of(float(lengths[0]))
        b = np.arange(lo + 1, hi + 1, dtype=np.int64) - _OFFSET  # bins whose lower edge lies inside
        edges = np.ldexp(_STEPS_FULL[b % BINS_PER_OCTAVE], (b // BINS_PER_OCTAVE - 1).astype(np.int32))
        first = np.searchsorted(lengths[::-1], edges, side="left")  # ascending: first at or above each edge
        per_bin = np.diff(np.concatenate([[0], first, [len(lengths)]]))
        return np.repeat(self.counts[lo : hi + 1], per_bin)[::-1]


#: key of a position where no complete batch starts
NO_RUN = np.iinfo(np.int64).max


def run_keys(
    lens: np.ndarray,
    padded: np.ndarray,
    ends: np.ndarray,
    ok: np.ndarray,
    frequency: np.ndarray,
    rng: np.random.Generator | None,
) -> np.ndarray:
    """A distinct key for each candidate run ``[i, ends[i])`` of the window (``lens`` sorted longest first;
    ``padded`` the lengths as the tensor pads them; ``frequency`` how common each length is), lower for
    tighter; `NO_RUN` where ``ok`` is False (no complete batch starts there).

    Tighter means a smaller spread (longest padded length minus mean length) times ``frequency ** 0.75``: a
    common length is held to a tighter spread than a rare one, for which close neighbours take longer to come.

    The key packs the weighed spread (15 bits, about 0.4 % apart), a random tie-break (16 bits; without
    ``rng`` none) and the position, so keys are distinct and compare in that order. Only correctly rounded
    arithmetic (no logarithm or power), so every machine computes the same keys."""
    n = len(lens)
    csum = np.concatenate([[0.0], np.cumsum(lens)])
    e = np.minimum(ends, n)
    idx = np.arange(n, dtype=np.int64)
    spread = padded - (csum[e] - csum[:-1]) / np.maximum(e - idx, 1)
    c = frequency.astype(np.float64)
    weight = np.sqrt(c * np.sqrt(c))  # c ** 0.75
    key = _quantize(np.maximum(spread, 0.0) * weight) << 48
    if rng is not None:
        key |= rng.integers(0, 1 << 16, n, dtype=np.int64) << 32
    key |= idx
    key[~ok] = NO_RUN
    return key


def _quantize(x: np.ndarray) -> np.ndarray:
    """Non-negative values as levels 0 .. 2^15 - 1 in the same order, from their exponent and first 8 bits of
    mantissa (exact: read off the float's bits); values below 2^-64 are 0, above 2^64 the top level."""
    bits = (x.view(np.int64) >> 44) - ((1023 - 64) << 8)  # sign 0, exponent (11 bits), 8 mantissa bits
    return np.minimum(np.maximum(bits, 0), (1 << 15) - 1)


def select_runs(key: np.ndarray, ends: np.ndarray, need: int) -> np.ndarray:
    """Starts of disjoint runs ``[i, ends[i])``, lowest ``key`` first, until they hold at least ``need`` samples
    (fewer if the candidates run out). ``key`` holds distinct keys, `NO_RUN` for no candidate; ``ends``
    never decreases (a batch starting further down the sorted window reaches no less far).

    Vectorised: a candidate is taken when its key is the least among all candidates it overlaps (those start
    from the first run that reaches past it up to its own end); the winners of a pass are disjoint. Passes
    repeat on what is left until enough samples are chosen.
    """
    n = len(key)
    idx = np.arange(n, dtype=np.int64)
    ends = np.minimum(ends, n)
    lo = np.cumsum(np.bincount(ends, minlength=n + 1))[:n]  # first run that reaches past i
    live = key < NO_RUN
    taken = np.zeros(n, dtype=bool)
    chosen: list[np.ndarray] = []
    freed = 0
    while freed < need and live.any():
        r = np.where(live, key, NO_RUN)
        li = np.flatnonzero(live)
        win = li[r[li] == range_min(r, lo[li], ends[li])]
        win = win[np.argsort(key[win])]
        got = freed + np.cumsum(ends[win] - win)
        win = win[: int(np.searchsorted(got, need, side="left")) + 1]
        freed = int(got[len(win) - 1])
        chosen.append(win)
        taken[run_positions(win, ends[win])] = True
        c = np.concatenate([[0], np.cumsum(taken)])
        live &= c[ends] == c[idx]
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)


def range_min(r: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(r[lo[q]:hi[q]])`` for every query (each range non-empty), from a sparse table of ``r`` (int64)."""
    if len(lo) == 0:
        return np.zeros(0, dtype=r.dtype)
    level = np.frexp((hi - lo).astype(np.float64))[1] - 1  # floor(log2(width))
    top = int(level.max())
    table = np.full((top + 1, len(r)), NO_RUN, dtype=np.int64)
    table[0] = r
    for j in range(top):  # row j + 1: min over [i, i + 2^(j+1))
        w = 1 << j
        np.minimum(table[j, :-w], table[j, w:], out=table[j + 1, :-w])
    return np.minimum(table[level, lo], table[level, hi - (1 << level)])


def run_positions(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The positions of runs ``[starts[k], ends[k])``, concatenated in the given order."""
    k = ends - starts
    return np.arange(int(k.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(k) - k), k)


def batch_members(batches: Any) -> tuple[Any, np.ndarray]:
    """For packed batches — runs ``(starts, ends)`` of the sorted window, or a list of position arrays — a
    function giving the window positions of chosen batches (concatenated in the given order), and the sizes."""
    if isinstance(batches, tuple):
        starts, ends = batches
        sizes = ends - starts

        def runs(chosen: np.ndarray) -> np.ndarray:
            return run_positions(starts[chosen], ends[chosen])

        return runs, sizes
    sizes = np.array([len(m) for m in batches], dtype=np.int64)

    def lists(chosen: np.ndarray) -> np.ndarray:
        return np.concatenate([batches[b] for b in chosen]) if len(chosen) else np.zeros(0, dtype=np.int64)

    return lists, sizes
