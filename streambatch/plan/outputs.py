"""The second length budget: ``n × max(output_length) ≤ output_budget`` on top of the input budget, for
encoder-decoder batches that must bound their transcript tokens as well as their audio.

The batcher sorts its window by input length; output lengths are in no order there, so how far a batch
starting at each position may reach is found by binary search over a sparse table of range maxima."""

from __future__ import annotations

import numpy as np


def output_reach(outs: np.ndarray, budget: float, limit: np.ndarray) -> np.ndarray:
    """For each start ``i`` of the window, the end ``i + k`` of the longest run ``[i, i + k)`` with
    ``k × max(outs[i:i + k]) ≤ budget`` and ``i + k ≤ limit[i]`` (``limit[i] ≤ len(outs)``)."""
    outs = np.asarray(outs, dtype=np.float64)
    n = len(outs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    levels = max(1, int(n).bit_length())
    table = np.full((levels, n), np.inf)
    table[0] = outs
    for j in range(levels - 1):  # row j + 1: max over [i, i + 2^(j+1))
        w = 1 << j
        if w >= n:
            break
        np.maximum(table[j, :-w], table[j, w:], out=table[j + 1, :-w])
    start = np.arange(n, dtype=np.int64)
    lo = np.zeros(n, dtype=np.int64)
    hi = np.asarray(limit, dtype=np.int64) - start
    while True:
        act = np.flatnonzero(lo < hi)
        if not act.size:
            return start + lo
        mid = (lo[act] + hi[act] + 1) // 2  # at least 1
        level = np.frexp(mid.astype(np.float64))[1] - 1  # floor(log2(mid))
        i = start[act]
        longest = np.maximum(table[level, i], table[level, i + mid - (1 << level)])
        ok = mid * longest <= budget
        lo[act] = np.where(ok, mid, lo[act])
        hi[act] = np.where(ok, hi[act], mid - 1)


def bound_reach(
    reach: np.ndarray, outs: np.ndarray, budget: float, multiple: int, end: np.ndarray | None = None
) -> np.ndarray:
    """``reach`` (where each batch of the sorted window ends under the input budget; beyond the window, or
    beyond ``end``, where each position's group ends under ``batch_by``: not complete yet) shortened where the
    output budget binds first (in multiples of ``multiple`` where possible), then made non-decreasing (a suffix
    minimum: a later start never reaches less far, which the greedy cut and the run selection rely on; a
    shortened run is still within both budgets)."""
    n = len(outs)
    limit = np.minimum(reach, n if end is None else end)
    out_end = output_reach(outs, budget, limit)
    binds = out_end < limit
    if multiple > 1:
        k = out_end - np.arange(n)
        out_end = np.where(k >= multiple, out_end - k % multiple, out_end)
    reach = np.where(binds, out_end, reach)
    return np.minimum.accumulate(reach[::-1])[::-1]
