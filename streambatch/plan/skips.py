"""Steps a resume skips (after a loss spike): the epoch's step ranges, which of a worker's batches they are, and
what a worker yields in a skipped batch's place, so the ranks still step together and nothing else moves.

A rank's step ``k`` is batch ``i`` of worker ``w`` in the DataLoader's round-robin order (`slot.interleave()`);
the batches of worker ``w`` among steps ``[a, b)`` are its batches ``[per_worker(a)[w], per_worker(b)[w])``. A
worker yields a `SkippedBatch` for each of them (no sample read), so the round robin keeps its order and
the main process counts the step as consumed without yielding it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import OptionError, int_option, shown
from .slot import per_worker


@dataclass(frozen=True)
class SkippedBatch:
    """What a worker yields in place of a skipped batch: its sample count, no data."""

    samples: int


@dataclass(frozen=True)
class SkippedSteps:
    """The steps of epoch ``epoch`` a resume skips: ``ranges`` of epoch step numbers ``[a, b)`` (counted from the
    epoch's start, as ``len()`` and ``consumed`` count them), sorted and disjoint. ``earlier``: steps of the epoch
    run on earlier layouts before a resume on this one (this layout's step ``k`` is epoch step ``earlier + k``)."""

    epoch: int
    ranges: tuple[tuple[int, int], ...]
    earlier: int = 0

    def worker_batches(self, epoch: int, counts: Sequence[int], start: int, worker: int) -> list[tuple[int, int]]:
        """The ranges of ``worker``'s batch numbers the skipped steps are (``counts``: each worker's batches this
        epoch, ``start``: the worker the round begins with); none in another epoch."""
        if epoch != self.epoch:
            return []
        out = []
        for a, b in self.ranges:
            lo = per_worker(counts, a - self.earlier, start)[worker]
            hi = per_worker(counts, b - self.earlier, start)[worker]
            if hi > lo:
                out.append((lo, hi))
        return out

    def state(self) -> list[list[int]]:
        """As a checkpoint holds them: ``[[a, b], ...]``."""
        return [[a, b] for a, b in self.ranges]

    def count(self) -> int:
        """Steps skipped in all."""
        return sum(b - a for a, b in self.ranges)


def step_ranges(steps: Iterable[int] | range) -> list[tuple[int, int]]:
    """Step numbers (a ``range`` or any whole numbers) as sorted, disjoint ``[a, b)`` ranges."""
    if isinstance(steps, range) and steps.step == 1:
        int_option("skip_steps", steps.start, 0)
        return [(steps.start, steps.stop)] if steps.stop > steps.start else []
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise OptionError(f"skip_steps={shown(steps)}: give step numbers, e.g. range(1200, 1300)")
    numbers = sorted({int_option("skip_steps", s, 0) for s in steps})  # 3.5 or "3" is no step number
    return merged([(s, s + 1) for s in numbers])


def merged(ranges: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` sorted, with overlapping and adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(r[0]), int(r[1])) for r in ranges if int(r[1]) > int(r[0])):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def batch_runs(first: int, count: int, skipped: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """A worker's batches ``[first, count)`` as consecutive runs ``(lo, hi, kept)``: kept runs are read and
    yielded, the others (``skipped`` batch ranges) yielded as `SkippedBatch` markers."""
    out, pos = [], first
    for lo, hi in skipped:
        lo, hi = max(lo, pos), min(hi, count)
        if hi <= lo:
            continue
        if lo > pos:
            out.append((pos, lo, True))
        out.append((lo, hi, False))
        pos = hi
    if pos < count:
        out.append((pos, count, True))
    return out
