"""Which samples of each dataset of a mixture an epoch takes: exact counts from the weights, no replacement
before every sample has been seen, computed per sample without listing the dataset.

A dataset of ``N`` samples with weight ``w`` contributes ``take = round(w·N)`` samples to every epoch. Its
samples are laid out in an endless sequence of *cycles*, each a seeded permutation of the dataset, and epoch
``e`` takes the positions ``[e·take, (e+1)·take)`` of that sequence. So ``w = 1`` takes every sample once,
``w = 2`` every sample exactly twice, ``w = 0.5`` a seeded half — the other half next epoch — and no sample
repeats before the whole dataset was taken. The permutations are stateless bijections (a Feistel network
with cycle walking), so a rank finds the occurrence counts of just its own samples: O(samples asked), never
O(N).

In the plan a dataset appears as ``copies`` virtual copies of its shards; copy ``r`` holds, in tar order, the
samples the epoch takes more than ``r`` times (`DatasetDraw.occurrences()`). The rest are excluded, as
samples consumed before a resume are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import OptionError
from .lengths import LazyMask, Mask

#: what the plan holds per sample id of a mixture's epoch (lengths, ids, order, masks), in bytes, rounded up
PLAN_BYTES_PER_SAMPLE = 48
#: what the plan holds per virtual shard (its block, offsets, its row of the shard table)
PLAN_BYTES_PER_SHARD = 256
#: the most a mixture's plan may take unless the loader's ``max_plan_bytes`` says otherwise
MAX_PLAN_BYTES = 16 << 30

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash (the splitmix64 finaliser), elementwise."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class CyclePermutation:
    """A seeded bijection of ``[0, n)`` evaluated per element: a 4-round Feistel network on the smallest
    even number of bits that holds ``n``, walked until the value falls inside ``[0, n)``."""

    def __init__(self, n: int, key: Sequence[int]):
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits & 1
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]).generate_state(4, dtype=np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """The position of each id in the permutation."""
        x = self._feistel(np.asarray(ids, dtype=np.uint64))
        out = x >= self.n
        while out.any():
            x[out] = self._feistel(x[out])
            out = x >= self.n
        return x.astype(np.int64)


@dataclass(frozen=True)
class DatasetDraw:
    """How many times each epoch takes each sample of one dataset of ``size`` samples (``take`` per epoch)."""

    size: int
    take: int
    seed: int
    dataset: int  # the dataset's number in the mixture: its permutations differ from the others'
    start: int | None = None
    """Where the epoch's window begins in the cycle sequence; None: ``epoch · take`` (fixed weights). A weight
    schedule starts each epoch where the one before ended (the sum of the earlier epochs' takes)."""

    @classmethod
    def of(cls, size: int, weight: float, seed: int, dataset: int, start: int | None = None) -> DatasetDraw:
        if not np.isfinite(weight) or weight < 0:
            raise OptionError(f"dataset weight must be a finite number >= 0, got {weight}")
        return cls(int(size), int(round(weight * size)), int(seed), int(dataset), None if start is None else int(start))

    @property
    def copies(self) -> int:
        """Most times an epoch can take one sample: ``take // size``, plus two where an epoch's window starts
        or ends inside a cycle (a sample may then be in the end of one cycle and the start of the next); with
        a known ``start``, exactly the cycles the window touches."""
        if self.size == 0 or self.take == 0:
            return 0
        if self.start is not None:
            return (self.start + self.take - 1) // self.size - self.start // self.size + 1
        q, m = divmod(self.take, self.size)
        return q + 2 if m else q

    def expected_share(self, copy: int) -> float:
        """The expected fraction of a copy's samples an epoch takes (to deal copies by their expected length)."""
        if self.size == 0:
            return 0.0
        return float(min(1.0, max(0.0, self.take / self.size - copy)))

    def occurrences(self, ids: np.ndarray, epoch: int) -> np.ndarray:
        """How many times epoch ``epoch`` takes each of these samples (ids within the dataset)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(ids.size, dtype=np.int64)
        if self.take == 0 or ids.size == 0:
            return out
        lo = epoch * self.take if self.start is None else self.start
        hi, n = lo + self.take, self.size
        first, last = lo // n, (hi - 1) // n
        out += max(0, last - first - 1)  # the cycles strictly inside the window: every sample once each
        for cycle in sorted({first, last}):  # the cycles at its ends may be cut: each sample's place decides
            start = cycle * n
            if lo <= start and start + n <= hi:  # the whole cycle is in the window: every sample once
                out += 1
                continue
            pos = CyclePermutation(n, (self.seed, self.dataset, cycle))(ids) + start
            out += (pos >= lo) & (pos < hi)
        return out


class GidLayout(Protocol):
    """Where the plan's global ids come from: (dataset, copy, sample id within the dataset) of each."""

    def locate(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class Selection(LazyMask):
    """The samples of a mixture an epoch leaves out, as a lazy mask over the plan's global ids (like the
    resume masks): ``sel[gids]``, ``sel[lo:hi]`` and ``sel[gid]`` are True for samples not taken.

    ``layout`` maps global ids to (dataset, copy, sample id within the dataset); see
    `MixedIndex`."""

    def __init__(self, layout: GidLayout, draws: Sequence[DatasetDraw], epoch: int):
        self.layout, self.draws, self.epoch = layout, list(draws), int(epoch)

    def _mask(self, gids: np.ndarray) -> np.ndarray:
        dataset, copy, ids = self.layout.locate(gids)
        out = np.zeros(gids.size, dtype=bool)
        for d in np.unique(dataset).tolist():
            sel = dataset == d
            out[sel] = self.draws[d].occurrences(ids[sel], self.epoch) <= copy[sel]
        return out


class AnyOf(LazyMask):
    """Two masks over global ids (lazy ones or arrays) as one: True where either is (a selection and an old
    resume mask)."""

    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def _mask(self, gids: np.ndarray) -> np.ndarray:
        return np.asarray(self.a[gids], dtype=bool) | np.asarray(self.b[gids], dtype=bool)


def any_of(a: Mask | None, b: Mask | None) -> Mask | None:
    """The union of two masks, either of which may be None."""
    if a is None:
        return b
    return a if b is None else AnyOf(a, b)


def plan_bytes(draw: DatasetDraw, shards: int) -> int:
    """What planning one dataset of a mixture costs in memory: every copy of its samples and shards."""
    return draw.copies * (draw.size * PLAN_BYTES_PER_SAMPLE + shards * PLAN_BYTES_PER_SHARD)


def check_plan_size(
    weights: Sequence[tuple[str, float]], draws: Sequence[DatasetDraw], shards: Sequence[int], most: int
) -> None:
    """Refuse a mixture whose weights imply a plan of more than ``most`` bytes, before any of it is allocated:
    an `OptionError` naming the dataset that costs most, its weight, and the size it implies."""
    costs = [plan_bytes(d, n) for d, n in zip(draws, shards)]
    if sum(costs) <= most:
        return
    worst = max(range(len(costs)), key=costs.__getitem__)
    (name, weight), draw = weights[worst], draws[worst]
    raise OptionError(
        f"weights[{name!r}]={weight:g} implies {draw.take:.3g} samples per epoch: the mixture's plan would take "
        f"≈ {size_text(sum(costs))}, at most {size_text(most)} allowed (max_plan_bytes): lower the weight or "
        "raise max_plan_bytes"
    )


def size_text(n: float) -> str:
    """Bytes as a short figure in the units sizes are written in (powers of 1024): ``16 GiB``, ``2.42 TiB``."""
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
