"""Packed batches (no padding, ``packed=True``): a sorted window cut into batches whose lengths sum to at most
the budget, filled best-fit so the short samples are kept for the small gaps."""

from __future__ import annotations

import bisect

import numpy as np


def pack_by_sum(t: list[float], budget: float, cap: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Cut the lengths ``t`` (sorted longest first) into batches of at most ``cap`` samples summing to at most
    ``budget``: each batch takes the longest samples left that fit, then fills what remains of the budget
    best-fit (the longest sample that still fits, again and again). Returns each batch's positions and whether
    it is complete (not even the shortest sample of ``t`` would fit; the others wait for new samples)."""
    n = len(t)
    neg = [-x for x in t]  # ascending, for bisect
    parent = list(range(n + 1))  # next unused position at or after i (union-find with path halving)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    shortest = t[-1] if n else 0.0
    members, full = [], []
    i = find(0)
    while i < n:
        batch: list[int] = []
        tot = 0.0
        while i < n and len(batch) < cap and tot + t[i] <= budget:
            batch.append(i)
            tot += t[i]
            parent[i] = i + 1
            i = find(i + 1)
        while len(batch) < cap and budget - tot >= shortest:
            j = find(bisect.bisect_left(neg, tot - budget))  # first unused sample ≤ what is left
            if j >= n:
                break
            batch.append(j)
            tot += t[j]
            parent[j] = j + 1
        i = find(i)
        members.append(np.array(sorted(batch), dtype=np.int64))
        full.append(len(batch) >= cap or budget - tot < shortest)
    return members, np.asarray(full, dtype=bool)
