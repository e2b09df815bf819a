"""The epoch plan: deal → batch → equalise → hardest first, for every (rank, worker) slot.

A pure function of the index lengths, ``(seed, epoch)`` and the layout (world size × workers), so every rank
computes the same plan, ``len(loader)`` is known before the epoch starts and a restart skips exactly what was
consumed. Equalising needs only two numbers per rank (`RankSummary`); the rest is rank-local.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import EmptyEpochError, StateError
from .config import PLAN_VERSION, BatchingConfig
from .layout import Layout
from .lengths import Lengths, Mask
from .shards import plan_slots
from .slot import (
    Adjust,
    KeptSlots,
    SlotEpoch,
    apply_adjust,
    batch_costs,
    cut_largest,
    hardest_batch,
    interleave,
    per_worker,
    plan_slot,
)


@dataclass
class EpochPlan:
    """The whole epoch for every rank: slots, steps per rank, and what was left out or repeated."""

    epoch: int
    world_size: int
    num_workers: int
    slots: list[SlotEpoch]
    adjust: list[Adjust]
    steps: int
    first_worker: list[int] = field(default_factory=list)  # per rank: the worker its first batch comes from
    surplus_samples: int = 0
    repeated_samples: int = 0
    split_batches: int = 0
    skipped_samples: int = 0
    dropped_samples: int = 0
    datasets: dict | None = None  # a mixture's per-dataset samples, length, hours and share (loader.plan())
    equalised: list[RankEqualised] = field(default_factory=list)  # per rank (what a checkpoint holds)

    def rank_slots(self, rank: int) -> range:
        return range(rank * self.num_workers, (rank + 1) * self.num_workers)

    def worker_counts(self, rank: int) -> list[int]:
        """Batches each of the rank's workers yields this epoch (after equalisation)."""
        return [len(self.slots[s].batches) for s in self.rank_slots(rank)]

    def start(self, rank: int) -> int:
        return self.first_worker[rank] if self.first_worker else 0

    def rank_order(self, rank: int) -> list[tuple[int, int]]:
        """(worker, batch number) of the rank's batches in the order its DataLoader yields them."""
        return interleave(self.worker_counts(rank), self.start(rank))


@dataclass(frozen=True)
class RankSummary:
    """What the ranks must agree on: a rank's batch count and how many more splits it could make."""

    batches: int
    spare: int

    @classmethod
    def of(cls, slots: Sequence[SlotEpoch]) -> RankSummary:
        return cls(sum(len(s.batches) for s in slots), sum(len(b) - 1 for s in slots for b in s.batches))


@dataclass(frozen=True)
class SlotEqualised:
    """How one slot's batches were equalised, in a few integers: enough to list the first batches it yielded from
    the first batches its batcher formed, without batching the whole slot again (`resume`)."""

    batches: int = 0
    """Batches after the splits (what the pad picks are drawn from)."""
    cut_size: int = 0
    """The size of the last batch split (`split_rule()`); every larger batch or half was split too."""
    cut_ties: int = 0
    """How many batches or halves of exactly ``cut_size`` were split: the first ones in stream order (0: none)."""
    pad: int = 0
    """Repeated batches (`Adjust.pad`)."""
    hardest: int = -1
    """The batch moved to the front (its index after splits and repeats), or -1."""
    take: int = 0
    """Batches the slot yields (`Adjust.take`)."""


@dataclass(frozen=True)
class RankEqualised:
    """One rank's equalisation: the worker its round starts with and each slot's `SlotEqualised`. A
    checkpoint holds every rank's, so a resume on another layout learns what an old rank consumed from the
    batches it consumed alone."""

    start: int
    slots: tuple[SlotEqualised, ...]

    def to_ints(self) -> list[int]:
        """Flat integers (what an all_gather carries and a checkpoint stores)."""
        return [self.start] + [getattr(s, f) for s in self.slots for f in _SLOT_FIELDS]

    @classmethod
    def of_ints(cls, values: Sequence[int]) -> RankEqualised:
        """Inverse of `to_ints()`."""
        k = len(_SLOT_FIELDS)
        if not values or (len(values) - 1) % k:
            raise StateError(f"loader state: an equalisation of {len(values)} integers is not 1 + {k} per worker")
        rows = [values[i : i + k] for i in range(1, len(values), k)]
        return cls(int(values[0]), tuple(SlotEqualised(*(int(v) for v in row)) for row in rows))


_SLOT_FIELDS = tuple(f.name for f in dataclasses.fields(SlotEqualised))


def split_rule(sizes: np.ndarray, times: int) -> tuple[int, int]:
    """The ``times`` cuts of `cut_largest()` on batch ``sizes`` as two numbers: the size of the last cut and
    how many cuts had that size. Cuts never grow, so every batch or half larger than it is cut, and of those of
    exactly that size the first ones in stream order; (0, 0) for no cut."""
    last, ties = 0, 0
    for _ in range(times):
        n = int(sizes.max())
        sizes, _ = cut_largest(sizes)
        last, ties = n, (ties + 1 if n == last else 1)
    return last, ties


@dataclass
class RankEpoch:
    """One rank's equalised slots, with the first worker of its round and its counts."""

    slots: list[SlotEpoch]
    adjust: list[Adjust]
    first_worker: int = 0
    surplus: int = 0
    repeated: int = 0
    splits: int = 0
    equalised: RankEqualised | None = None


def agreed_steps(summaries: Sequence[RankSummary], even_batches: str, plan_version: int = PLAN_VERSION) -> int:
    """Batches every rank yields: the longest rank's count (``pad``; ``split``, none if a rank has no batch), or
    the shortest's (``drop``). ``split`` by rules 1 to 3 went only as far as splits could reach, leaving the
    longer ranks' other batches out (an epoch of a few samples per slot, a tight filter)."""
    counts = [s.batches for s in summaries]
    if even_batches == "split" and plan_version < 4:
        return min(max(counts), min(s.batches + s.spare for s in summaries))
    if even_batches == "split":
        return max(counts) if min(counts) else 0
    return max(counts) if even_batches == "pad" else min(counts)


def plan_rank(
    raw: Sequence[SlotEpoch],
    steps: int,
    layout: Layout,
    config: BatchingConfig,
    epoch: int,
    rank: int,
    lengths: Lengths,
) -> RankEpoch:
    """Equalise one rank's slots to ``steps`` batches: split (repeating what splits cannot reach) or pad, then
    hardest first, then take."""
    nw = len(raw)
    adjust = [Adjust() for _ in range(nw)]
    need = steps - sum(len(s.batches) for s in raw)
    splits = 0
    if layout.even_batches == "split" and need > 0:
        splits = _split_counts(raw, min(need, RankSummary.of(raw).spare), adjust)
    if layout.even_batches in ("split", "pad") and need > splits:
        _pad_counts(raw, need - splits, adjust, rank, lengths.num_samples)
    first = rank * nw
    slots = [apply_adjust(raw[w], adjust[w], config.epoch_seed, epoch, first + w) for w in range(nw)]
    start, moved = 0, -1
    if layout.hardest_first and steps:
        start = _hardest_worker(slots, lengths, config)
        adjust[start].hardest = True
        s = slots[start]
        if s.batches:
            moved = hardest_batch(s.batches, s.repeat, lengths[s.gids], config.cost)
        slots[start] = apply_adjust(
            s, Adjust(hardest=True), config.epoch_seed, epoch, first + start, lengths[s.gids], config.cost
        )
    out = RankEpoch(slots, adjust, start, splits=splits)
    for w, t in enumerate(per_worker([len(s.batches) for s in slots], steps, start)):
        s = slots[w]
        out.surplus += int(sum(len(b) for b, rep in zip(s.batches[t:], s.repeat[t:]) if not rep))
        adjust[w].take = t
        lens = lengths[s.gids] if config.balance is not None and s.rounds is not None else None
        slots[w] = s = apply_adjust(
            s,
            Adjust(take=t),
            config.epoch_seed,
            epoch,
            first + w,
            lens,
            None,
            config.balance,
            w == start and moved >= 0,
        )
        out.repeated += int(sum(len(b) for b, rep in zip(s.batches, s.repeat) if rep))
    out.equalised = _equalised(raw, adjust, start, moved)
    return out


def _equalised(raw: Sequence[SlotEpoch], adjust: Sequence[Adjust], start: int, moved: int) -> RankEqualised:
    """The rank's equalisation as `RankEqualised` (``moved``: the index of the start worker's batch that
    hardest-first moved to the front, -1 for none)."""
    slots = []
    for s, a in zip(raw, adjust):
        sizes = np.fromiter((len(b) for b in s.batches), dtype=np.int64, count=len(s.batches))
        cut = split_rule(sizes, a.split) if a.split else (0, 0)
        hardest = moved if a.hardest else -1
        slots.append(SlotEqualised(len(s.batches) + a.split, *cut, a.pad, hardest, a.take))
    return RankEqualised(start, tuple(slots))


def _split_counts(raw: Sequence[SlotEpoch], need: int, adjust: list[Adjust]) -> int:
    """Decide which workers split how often: each time the worker holding the largest batch (the first on
    ties) cuts it by `cut_largest()`, the rule that worker applies to its real batches."""
    sizes = [np.fromiter((len(b) for b in s.batches), dtype=np.int64, count=len(s.batches)) for s in raw]
    for _ in range(need):
        w = max(range(len(raw)), key=lambda w: (int(sizes[w].max()) if sizes[w].size else 0, -w))
        sizes[w], _ = cut_largest(sizes[w])
        adjust[w].split += 1
    return need


def _pad_counts(raw: Sequence[SlotEpoch], need: int, adjust: list[Adjust], rank: int, num_samples: int) -> None:
    """Spread ``need`` repeated batches over the workers that have any, round robin."""
    have = [w for w, s in enumerate(raw) if s.batches]
    if not have:
        raise EmptyEpochError(
            f"rank {rank} gets no data this epoch ({num_samples} samples over this layout); use fewer "
            "ranks/workers, a smaller budget, or even_batches='drop'"
        )
    for i in range(need):
        adjust[have[i % len(have)]].pad += 1


def _hardest_worker(slots: Sequence[SlotEpoch], lengths: Lengths, config: BatchingConfig) -> int:
    """The worker holding the rank's most expensive batch (the first on ties)."""
    best = (-1.0, 0)
    for w, sp in enumerate(slots):
        if sp.batches:
            lens = lengths[sp.gids]
            h = hardest_batch(sp.batches, sp.repeat, lens, config.cost)
            c = batch_costs([sp.batches[h]], lens, config.cost)[0]
            if c > best[0]:
                best = (c, w)
    return best[1]


def make_epoch_plan(
    shard_lengths: Lengths | Sequence[np.ndarray],
    config: BatchingConfig,
    epoch: int,
    layout: Layout,
    excluded: Mask | None = None,
    keep: KeptSlots | None = None,
) -> EpochPlan:
    """Plan every slot of the epoch and equalise the ranks' step counts (``keep``: slots kept whole for the
    process that streams them)."""
    lengths = shard_lengths if isinstance(shard_lengths, Lengths) else Lengths.of(shard_lengths)
    dealt = plan_slots(lengths, layout.num_slots, config.epoch_seed, epoch, config.shuffle, excluded=excluded)
    plan = keep.plan if keep is not None else plan_slot
    raw = [plan(dealt[s], lengths, lengths.offsets, config, epoch, s, excluded) for s in range(layout.num_slots)]
    by_rank = [raw[s.start : s.stop] for s in map(layout.rank_slots, range(layout.world_size))]
    steps = agreed_steps([RankSummary.of(slots) for slots in by_rank], layout.even_batches, config.plan_version)
    ranks = [plan_rank(by_rank[r], steps, layout, config, epoch, r, lengths) for r in range(layout.world_size)]
    return EpochPlan(
        epoch=epoch,
        world_size=layout.world_size,
        num_workers=layout.num_workers,
        slots=[s for rp in ranks for s in rp.slots],
        adjust=[a for rp in ranks for a in rp.adjust],
        steps=steps,
        first_worker=[rp.first_worker for rp in ranks],
        surplus_samples=sum(rp.surplus for rp in ranks),
        repeated_samples=sum(rp.repeated for rp in ranks),
        split_batches=sum(rp.splits for rp in ranks),
        skipped_samples=sum(s.skipped for s in raw),
        dropped_samples=sum(s.dropped for s in raw),
        equalised=[rp.equalised for rp in ranks if rp.equalised is not None],
    )


@dataclass
class RankSchedule:
    """What one rank yields in an epoch: ``steps`` batches; per worker its `Adjust` (``take``: its
    batch count), the worker the round starts with, and what this rank left out, repeated, split or skipped."""

    epoch: int
    steps: int
    adjust: list[Adjust]
    start: int = 0
    surplus: int = 0
    repeated: int = 0
    splits: int = 0
    skipped: int = 0
    dropped: int = 0
    planned_samples: int = 0
    equalised: RankEqualised | None = None
    """This rank's equalisation."""
    every_rank: tuple[RankEqualised, ...] = ()
    """Every rank's (what a checkpoint holds: `every_rank()`), once the ranks have shared them."""
    kept: dict[int, SlotEpoch] = field(default_factory=dict, repr=False, compare=False)
    """Slot plans kept whole for this process's stream (`KeptSlots`), by slot number."""
    lengths: Lengths | None = field(default=None, repr=False, compare=False)
    """The lengths the schedule was planned on (with the per-sample lengths of the shards it read)."""

    def worker_counts(self) -> list[int]:
        return [a.take for a in self.adjust]

    def order(self) -> list[tuple[int, int]]:
        """(worker, batch number) of the rank's batches in the order its DataLoader yields them."""
        return interleave(self.worker_counts(), self.start)

    @classmethod
    def of(cls, plan: EpochPlan, rank: int) -> RankSchedule:
        """The rank's part of a global plan (counts are then the whole epoch's)."""
        adjust = [plan.adjust[s] for s in plan.rank_slots(rank)]  # take = each worker's batch count
        return cls(
            plan.epoch,
            plan.steps,
            adjust,
            plan.start(rank),
            plan.surplus_samples,
            plan.repeated_samples,
            plan.split_batches,
            plan.skipped_samples,
            plan.dropped_samples,
            sum(len(plan.slots[s].gids) for s in plan.rank_slots(rank)),
            plan.equalised[rank] if plan.equalised else None,
            tuple(plan.equalised),
        )


def share_equalised(sched: RankSchedule, gather: Callable[[list[int]], list[list[int]]]) -> RankSchedule:
    """``sched`` with every rank's equalisation, shared through ``gather`` (an all_gather of a few integers per
    worker): a checkpoint holds them all, so a resume on another layout need not re-plan the old ranks in full."""
    if sched.equalised is None:
        return sched
    rows = gather(sched.equalised.to_ints())
    return dataclasses.replace(sched, every_rank=tuple(RankEqualised.of_ints(r) for r in rows))


def every_rank(sched: RankSchedule) -> list[list[int]] | None:
    """Every rank's equalisation as a checkpoint stores it (lists of integers), or None where not shared."""
    return [r.to_ints() for r in sched.every_rank] if sched.every_rank else None


def rank_raw_slots(
    lengths: Lengths,
    config: BatchingConfig,
    epoch: int,
    rank: int,
    layout: Layout,
    excluded: Mask | None = None,
    counted: bool = False,
    keep: KeptSlots | None = None,
) -> list[SlotEpoch]:
    """A rank's slots before equalisation, dealt and batched from the shard table and its own shards
    (``excluded``: samples consumed before a resume, a mask over global ids or a lazy one). ``counted``: keep
    only what counting steps needs (`SlotEpoch.counted()`), one slot's full plan in memory at a time; ``keep``:
    slots kept whole for the process that streams them."""
    slots = layout.rank_slots(rank)
    dealt = plan_slots(lengths, layout.num_slots, config.epoch_seed, epoch, config.shuffle, excluded, slots)
    plan = keep.plan if keep is not None else plan_slot
    return [plan(dealt[s], lengths, lengths.offsets, config, epoch, s, excluded, counted=counted) for s in slots]


def plan_rank_local(
    lengths: Lengths,
    config: BatchingConfig,
    epoch: int,
    rank: int,
    layout: Layout,
    gather: Callable[[list[int]], list[list[int]]],
    excluded: Mask | None = None,
    keep: KeptSlots | None = None,
) -> RankSchedule:
    """One rank's schedule from its own slots only: deal them from the shard table, batch them, agree on the
    step count through ``gather`` (every rank's two summary integers), equalise. O(N / world_size)."""
    # the hardest-first rule weighs real batches; otherwise counting needs batch sizes only
    raw = rank_raw_slots(lengths, config, epoch, rank, layout, excluded, not layout.hardest_first, keep)
    mine = RankSummary.of(raw)
    summaries = [RankSummary(b, k) for b, k in gather([mine.batches, mine.spare])]
    steps = agreed_steps(summaries, layout.even_batches, config.plan_version)
    rp = plan_rank(raw, steps, layout, config, epoch, rank, lengths)
    return RankSchedule(
        epoch,
        steps,
        rp.adjust,
        rp.first_worker,
        rp.surplus,
        rp.repeated,
        rp.splits,
        sum(s.skipped for s in raw),
        sum(s.dropped for s in raw),
        sum(s.num_samples for s in raw),
        rp.equalised,
    )


def consumed_ids(plan: EpochPlan, consumed: int) -> np.ndarray:
    """Global ids of the samples every rank has consumed after ``consumed`` steps (for re-planning)."""
    out = []
    for r in range(plan.world_size):
        done = per_worker(plan.worker_counts(r), consumed, plan.start(r))
        for w, k in enumerate(done):
            sp = plan.slots[r * plan.num_workers + w]
            for b in sp.batches[:k]:
                out.append(sp.gids[b])
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)
