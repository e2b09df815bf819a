"""How the loader plans one epoch of its rank: rank-locally with one small collective over the data-parallel
ranks when a process group allows it, else the whole epoch on this rank (O(N)); the ``planning`` option decides."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import EmptyEpochError, OptionError, StateError, int_option
from ..plan.epoch import RankSchedule, make_epoch_plan, plan_rank_local, share_equalised
from ..plan.layout import Layout
from ..plan.resume import Resumed
from ..plan.slot import KeptSlots
from ..select.where import left_out
from .messages import empty_epoch_message, plan_line, split_repeat_line
from .state import MAX_EPOCH
from .workers import start_method

log = logging.getLogger("streambatch")

#: the most per-sample lengths a loader holds from its planning to its next epoch's, for its own stream and for the
#: workers it forks after planning, which then read no lengths from the index (above it, and in workers started by
#: forkserver or kept from an earlier epoch, each worker reads its own shards' lengths)
KEEP_LENGTHS_MAX = 1 << 26


def plan_schedule(loader: Any, epoch: int) -> RankSchedule:
    """This rank's batches in ``epoch`` (``loader``: a `StreamBatchLoader`),
    planned as ``loader.planning`` says and logged in one line; an epoch that gives no batch (and none before a
    resume) is an `EmptyEpochError`."""
    t0 = time.perf_counter()
    lengths = loader._lengths(epoch)
    local = rank_local(loader)
    # without workers this process streams its slot: it takes the plan made here instead of planning it again
    keep = KeptSlots(loader.layout.rank_slots(loader.rank)) if loader.num_workers == 0 else None
    if local:
        excluded = loader._excluded_in(epoch, lengths)
        agree = loader.data_parallel.gather  # one all_gather over the data-parallel ranks
        sched = plan_rank_local(lengths, loader.config, epoch, loader.rank, loader.layout, agree, excluded, keep)
        sched = share_equalised(sched, agree)  # a second all_gather: every rank's equalisation, for the checkpoint
    else:
        sched = RankSchedule.of(loader._whole_plan(epoch, lengths, keep), loader.rank)
    sched.kept = keep.plans if keep is not None else {}
    sched.lengths = lengths if lengths.loaded <= KEEP_LENGTHS_MAX and lengths_taken(loader) else None
    log.info(plan_line(sched, loader.layout, loader.rank, local, lengths.loaded, time.perf_counter() - t0))
    if sched.repeated and loader.layout.even_batches == "split":
        log.warning(split_repeat_line(sched, loader.layout, local))
    if sched.steps == 0 and loader._earlier(epoch) == 0:
        raise EmptyEpochError(empty_epoch_message(loader, sched, local))
    return sched


def lengths_taken(loader: Any) -> bool:
    """Whether anything takes the lengths an epoch is planned on: the loader's own stream (no workers) or workers
    forked after the planning (workers started by forkserver, behind a filter, or spawn read their own, and so do
    ``persistent_workers`` forked in an earlier pass)."""
    if loader.num_workers == 0:
        return True
    running = loader.persistent_workers and loader._dataloader is not None
    return not running and start_method(loader.filter is not None, loader.urls, loader.storage_options) == "fork"


def rank_local(loader: Any) -> bool:
    """Whether the epoch is planned rank-locally (the ``planning`` option and a process group of this layout)."""
    possible = loader.data_parallel.can_agree()
    if loader.planning == "local" and not possible:
        raise OptionError(
            f"planning='local' needs an initialised torch.distributed group of rank {loader.rank} in "
            f"{loader.world_size}; without one use planning='auto' (plans the whole epoch on each rank)"
        )
    return loader.planning != "global" and possible


def epoch_arg(loader: Any, epoch: Any) -> int:
    """The epoch a planning call names (None: the loader's current one), else an `OptionError` naming it."""
    return loader.epoch if epoch is None else int_option("epoch", epoch, 0, MAX_EPOCH)


def between_passes(loader: Any, call: str) -> None:
    """Refuse ``call`` (a move to another epoch or resume point) while a pass is under way: its iterator would go
    on yielding the old epoch's batches while ``state_dict()`` named the new place (lost or repeated samples)."""
    if loader._open_passes:
        raise StateError(
            f"{call} during a pass of epoch {loader.epoch} ({loader._consumed} batches of it yielded): call it "
            "between passes, before iter(loader) or once the pass has ended (or its iterator is closed: it.close(), "
            "or del it)"
        )


def old_steps(loader: Any, layout: Layout, before: Resumed) -> int:
    """The steps an old layout planned for the loader's epoch (a state saved before it recorded them): O(N), once."""
    e = loader.epoch
    lengths = loader._lengths(e)
    selection = left_out(loader.index, loader.filter, e, loader._seed, lengths.offsets)
    return make_epoch_plan(lengths, loader.config, e, layout, before.consumed(lengths, loader.config, selection)).steps
