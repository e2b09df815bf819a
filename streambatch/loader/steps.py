"""Which samples were in step k, and skipping steps after a loss spike.

The plan knows every step before a byte is read: `step_samples()` names the samples of any step of an epoch,
past or future, on every rank (their keys from the index's sample table, their datasets in a mixture), and a resume
can skip a range of steps (``loader.load_state_dict(state, skip_steps=range(a, b))``): every rank skips the same
steps, their samples are not read, and every other step comes as it would have. Step numbers count from the
epoch's start, as ``len()`` and ``consumed`` do (a skipped step still counts: ``consumed`` jumps over it).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OptionError, int_option
from ..format.members import shard_keys
from ..plan.epoch import EpochPlan, make_epoch_plan, plan_rank, rank_raw_slots
from ..plan.resume import Resumed
from ..plan.skips import SkippedBatch, SkippedSteps, merged, step_ranges
from ..plan.slot import interleave
from ..select.mixture import MixedIndex
from ..select.where import left_out
from .planning import epoch_arg
from .state import LoaderState

log = logging.getLogger("streambatch")
# the functions here take the StreamBatchLoader they serve (typed Any: the loader's module imports this one)


@dataclass(frozen=True)
class StepSample:
    """One sample of a planned batch: its key (None where the index stores no keys: a version 1 index), its
    dataset's name in a mixture (else None), and where it lies: its shard's number in its dataset's index and
    its place in that shard (tar order)."""

    key: str | None
    dataset: str | None
    shard: int
    sample: int


@dataclass(frozen=True)
class StepBatch:
    """One rank's batch at one step: its samples in the order the batch holds them, and whether it repeats the
    batch before it (``even_batches="pad"``)."""

    rank: int
    samples: tuple[StepSample, ...]
    repeat: bool = False

    @property
    def keys(self) -> list[str | None]:
        """The samples' keys, as ``batch["keys"]`` lists them."""
        return [s.key for s in self.samples]

    def line(self) -> str:
        """One line: the rank, its sample count and each sample (``dataset/key`` in a mixture)."""
        names = [f"{s.dataset}/{s.key}" if s.dataset else str(s.key) for s in self.samples]
        return f"rank {self.rank}: {len(names)} samples{' (a repeat)' if self.repeat else ''}: " + " ".join(names)


@dataclass(frozen=True)
class StepSamples:
    """The samples of step ``step`` of epoch ``epoch``: each rank's batch (``batches[rank]``)."""

    epoch: int
    step: int
    batches: dict[int, StepBatch]

    def keys(self) -> dict[int, list[str | None]]:
        """Each rank's keys."""
        return {r: b.keys for r, b in self.batches.items()}

    def lines(self) -> list[str]:
        """One line per rank (what ``shardify inspect --step`` prints)."""
        return [b.line() for _, b in sorted(self.batches.items())]


def step_samples(loader: Any, step: int, rank: int | None = None, epoch: int | None = None) -> StepSamples:
    """The samples of global step ``step`` of ``epoch`` (default: the current one), from the plan alone (no shard
    is read): every rank's batch, or only ``rank``'s. Steps count from the epoch's start, as ``len()`` and
    ``consumed`` do; after a resume on another layout, the steps before it are those the earlier layouts ran.
    Plans the whole epoch, O(N), once per epoch (like `plan()`); needs an index. A step, rank or epoch that
    is not a whole number from 0, a step outside the epoch or a rank outside the job is an
    `OptionError` naming it."""
    if loader.index is None:
        raise TypeError("step_samples needs an index (index.json): without one the steps are not planned")
    step = int_option("step", step, 0)
    rank = None if rank is None else int_option("rank", rank, 0)
    e = epoch_arg(loader, epoch)
    plan, first = _plan_of_step(loader, e, step)
    if rank is not None and rank >= plan.world_size:
        raise OptionError(f"rank={rank}: step {step} of epoch {e} ran on {plan.world_size} ranks")
    ranks = range(plan.world_size) if rank is None else [rank]
    offsets = loader._lengths(e).offsets
    return StepSamples(e, step, {r: _batch(loader, plan, r, step - first, offsets) for r in ranks})


#: each loader's last planned epoch: (epoch, the resume it was planned after, layout number, plan)
_PLANS: weakref.WeakKeyDictionary[Any, tuple[int, Any, int, EpochPlan]] = weakref.WeakKeyDictionary()


def _plan_of_step(loader: Any, epoch: int, step: int) -> tuple[EpochPlan, int]:
    """The whole plan of the layout that ran (or runs) ``step`` of the epoch, and the epoch step its step 0 is."""
    resumed = loader._resumed if loader._resumed is not None and loader._resumed.epoch == epoch else None
    runs = resumed.layouts if resumed is not None else ()
    first = 0
    for i, run in enumerate(runs):
        if first <= step < first + run.consumed:
            return _cached(loader, epoch, resumed, i), first
        first += run.consumed
    plan = _cached(loader, epoch, resumed, len(runs))
    if not first <= step < first + plan.steps:
        raise OptionError(f"step {step}: epoch {epoch} has {first + plan.steps} steps (0 to {first + plan.steps - 1})")
    return plan, first


def _cached(loader: Any, epoch: int, resumed: Resumed | None, i: int) -> EpochPlan:
    """Layout ``i``'s plan of the epoch (the earlier layouts' first, then this loader's), kept for the next ask."""
    got = _PLANS.get(loader)
    if got is not None and got[0] == epoch and got[1] is resumed and got[2] == i:
        return got[3]
    lengths = loader._lengths(epoch)
    if resumed is None or i == len(resumed.layouts):
        plan = loader._whole_plan(epoch, lengths)
    else:  # an earlier layout, planned around what the ones before it consumed
        before = Resumed(epoch, resumed.layouts[:i], resumed.base)
        selection = left_out(loader.index, loader.filter, epoch, loader._seed, lengths.offsets)
        excluded = before.consumed(lengths, loader.config, selection)
        plan = make_epoch_plan(lengths, loader.config, epoch, resumed.layouts[i].layout, excluded)
    _PLANS[loader] = (epoch, resumed, i, plan)
    return plan


def _batch(loader: Any, plan: EpochPlan, rank: int, k: int, offsets: np.ndarray) -> StepBatch:
    """Rank ``rank``'s batch at step ``k`` of ``plan``: worker and batch number in the DataLoader's order."""
    w, i = plan.rank_order(rank)[k]
    slot = plan.slots[rank * plan.num_workers + w]
    gids = np.asarray(slot.gids[slot.batches[i]], dtype=np.int64)
    return StepBatch(rank, tuple(_samples(loader.index, offsets, gids)), bool(slot.repeat[i]))


def _samples(index: Any, offsets: np.ndarray, gids: np.ndarray) -> Iterator[StepSample]:
    """Each global id as its key, dataset, shard and place in the shard (keys read once per shard)."""
    shards = np.searchsorted(offsets, gids, side="right") - 1
    keys: dict[int, list[str] | None] = {}
    for v, gid in zip(shards.tolist(), gids.tolist()):
        ix, s, name = index, v, None
        if isinstance(index, MixedIndex):
            d, s = index.real_shard(v)
            ix, name = index.indexes[d], index.names[d]
        if v not in keys:
            keys[v] = shard_keys(ix, s)
        pos = gid - int(offsets[v])
        got = keys[v]
        yield StepSample(got[pos] if got is not None else None, name, s, pos)


# ---- skipping steps on resume ----------------------------------------------------------------------
def skipping(loader: Any, items: Iterable[Any]) -> Iterator[Any]:
    """Stage (main process): a worker's `SkippedBatch` counts its step as consumed
    and is not passed on; every other item is."""
    for item in items:
        if isinstance(item, SkippedBatch):
            loader._consumed += 1
            continue
        yield item


def skip_state(skips: SkippedSteps | None, epoch: int) -> list[list[int]]:
    """What a checkpoint of ``epoch`` records of the skipped steps (``LoaderState.skip_steps``)."""
    return skips.state() if skips is not None and skips.epoch == epoch else []


def resume_skips(loader: Any, saved: LoaderState, skip_steps: Iterable[int]) -> SkippedSteps | None:
    """The steps a resume skips: those the state recorded and ``skip_steps`` (checked against the epoch, logged
    with their sample count on this rank); None when there are none."""
    new = step_ranges(skip_steps)
    if new:
        _check_and_log(loader, new)
    ranges = merged([*(saved.skip_steps or []), *new])
    return SkippedSteps(loader.epoch, tuple(ranges), loader._earlier(loader.epoch)) if ranges else None


def _check_and_log(loader: Any, ranges: list[tuple[int, int]]) -> None:
    """Refuse steps already consumed or beyond the epoch; warn what is skipped."""
    if loader.index is None:
        raise OptionError("skip_steps needs an index (index.json): without one the steps are not planned")
    e, total, done = loader.epoch, len(loader), loader.consumed
    a, b = ranges[0][0], ranges[-1][1]
    if a < done:
        raise OptionError(
            f"skip_steps: step {a} of epoch {e} was consumed before the state was saved (it resumes at step "
            f"{done}); skip steps from {done} on"
        )
    if b > total:
        raise OptionError(f"skip_steps: epoch {e} has {total} steps (0 to {total - 1}); step {b - 1} is beyond it")
    said = ", ".join(f"{x}" if y == x + 1 else f"{x}-{y - 1}" for x, y in ranges)
    n = sum(y - x for x, y in ranges)
    log.warning(
        f"rank {loader.rank}: skipping steps {said} of epoch {e} ({n} steps, {_samples_in(loader, ranges):,} "
        f"samples on this rank, not read); every rank skips them and yields the epoch's other {total - n} steps"
    )


def _samples_in(loader: Any, ranges: list[tuple[int, int]]) -> int:
    """Samples this rank's batches hold at the epoch steps ``ranges``: its own slots re-planned (batch sizes only,
    O(N / world_size)), equalised to the agreed step count."""
    e, layout, config = loader.epoch, loader.layout, loader.config
    lengths = loader._lengths(e)
    excluded = loader._excluded_in(e, lengths)
    # batch sizes alone order the batches unless the hardest comes first or the steps are balanced (by time)
    counted = not layout.hardest_first and config.balance is None
    raw = rank_raw_slots(lengths, config, e, loader.rank, layout, excluded, counted=counted)
    rp = plan_rank(raw, loader.schedule(e).steps, layout, config, e, loader.rank, lengths)
    order = interleave([len(s.batches) for s in rp.slots], rp.first_worker)
    earlier = loader._earlier(e)
    return sum(len(rp.slots[w].batches[i]) for a, b in ranges for w, i in order[a - earlier : b - earlier])
