"""StreamBatchLoader: options in (sorted into their typed groups once, `options`), padded batches out. It
plans each epoch from the index (`streambatch.plan.epoch`), publishes the epoch and resume point to its
DataLoader workers (`streambatch.read.worker`), and owns ``len()``, epochs and ``state_dict()``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from ..errors import EmptyEpochError, OptionError, StateError, int_option
from ..format.index import ShardIndex
from ..io.prefetch import lengths_ahead
from ..io.ranges import warm_up
from ..plan.budget import parse_budget
from ..plan.epoch import (
    EpochPlan,
    RankSchedule,
    every_rank,
    make_epoch_plan,
    plan_rank,
    plan_rank_local,
    rank_raw_slots,
    share_equalised,
)
from ..plan.layout import Layout
from ..plan.lengths import Lengths, index_lengths
from ..plan.perturb import planned_lengths
from ..plan.resume import Resumed, excluded_in
from ..plan.skips import SkippedBatch, merged, step_ranges
from ..plan.slot import Adjust, KeptSlots, interleave, per_worker
from ..read.collate import Decode
from ..read.reader import ReadOptions
from ..read.ring import BatchRing, batch_ring
from ..read.worker import EpochState, EpochStream, SharedEpochState, SlotContext, fault_tensors, raised_in_workers
from ..select.mixture import AnyIndex, MixedIndex, dataset_names, draw_rows
from ..select.schedule import WeightSchedule
from ..select.source import ShardURLs
from ..select.where import left_out, open_filter
from .mesh import data_parallel
from .messages import (
    check_shortest_fits,
    empty_epoch_message,
    mixture_report,
    plan_line,
    resume_line,
    split_repeat_line,
    unindexed_empty_message,
)
from .metrics import EpochMeter, fault_summary, fault_warning, metered, metrics_line, planned_figures, storage_figures
from .mixing import began, open_scheduled
from .options import (
    GROUP_DEFAULT,
    BatchingOptions,
    RunOptions,
    SampleOptions,
    batching_config,
    check_epoch_length,
    check_plain,
    collate_options,
    sample_plan,
    sort_options,
    worker_callables,
)
from .state import MAX_EPOCH, LoaderState, batching_record, dataset_digest, pack_mask
from .steps import SkippedSteps, StepBatch, StepSamples, samples_of, skip_state
from .workers import check_sendable, make_dataloader, progress_bar, start_method

log = logging.getLogger("streambatch")

#: the most per-sample lengths a loader holds from its planning to its next epoch's, for its own stream and for the
#: workers it forks after planning, which then read no lengths from the index (above it, and in workers started by
#: forkserver or kept from an earlier epoch, each worker reads its own shards' lengths)
KEEP_LENGTHS_MAX = 1 << 26

#: the loader's attributes that depend on how a scheduled mixture is laid out (what `_at_epoch()` puts back)
MIXTURE_LAYOUT = ("index", "urls", "filter", "collate_options", "_bad_shards", "_schedules", "_dataloader")


class StreamBatchLoader:
    """Stream length-annotated shards and yield padded batches with ``n × max_len ≤ budget``.

    A dozen everyday keywords are named here; every other option belongs to one of four typed groups, where its
    default and meaning are written once, and it is checked once: ``batching=`` `BatchingOptions`,
    ``reading=`` `ReadOptions`, ``per_sample=`` `SampleOptions` and ``run=`` `RunOptions`. Pass a group as an
    object (``batching=BatchingOptions(num_buckets=8, drop_last=True)``) or its options flat by field name
    (``num_buckets=8, drop_last=True``): both give the same loader. An unknown name, or one option given both flat
    and in its group, is an `OptionError` naming it; a bad value is an `OptionError` naming the option.

    :param source: a dataset folder or URL written by ``shardify write`` (holding ``index.json``), an index file,
        a brace-expanded shard pattern or a list of shard URLs (10⁷ at most; without an index, lengths come from
        each sample's ``.json``; no ``len()``); or several datasets mixed by ``weights``: a ``{name: folder}``
        mapping, a list of folders, or a mixture file.
    :param budget: the largest padded size of a batch, ``n × max_len``, in the dataset's unit, or a duration like
        ``"60s"`` for audio with an index; None only with a calibration file as ``cost``.
    :param weights: per-dataset weights when ``source`` names several datasets, or a schedule of them: a list per
        epoch (the last holds for later epochs) or a deterministic callable ``epoch -> weights``, run in this
        process.
    :param index: an index file or `ShardIndex` to plan from and read: its shard URLs are the ones read
        (``source`` then names the dataset in messages); not with a mixture.
    :param where: keep only the samples for which this SQL expression over the sample table's columns is true
        (``"language = 'de' AND snr > 10"``; DuckDB).
    :param storage_options: passed to fsspec (credentials, ``client_kwargs={"endpoint_url": ...}``); for the range
        reads of ``s3://`` shards mapped to obstore's store options (see `streambatch.io.objstore`), so the same
        dictionary serves both.
    :param num_workers: DataLoader worker processes per rank (`RunOptions.num_workers`).
    :param shuffle: shard and batch order follow ``(seed, epoch)`` (`BatchingOptions.shuffle`).
    :param seed: the seed of every random choice (`BatchingOptions.seed`).
    :param buffer_size: the window each worker's batches are formed from (`BatchingOptions.buffer_size`).
    :param max_batch_size: at most this many samples per batch (`BatchingOptions.max_batch_size`).
    :param decode: how a sample becomes an array (`SampleOptions.decode`).
    :param batching: which batches form (`BatchingOptions`).
    :param reading: how shards are read: range requests, retries, verification, the node cache (`ReadOptions`).
    :param per_sample: transforms, speed perturbation and features in the workers (`SampleOptions`).
    :param run: ranks, data parallelism, how the ranks step together, the DataLoader's knobs (`RunOptions`).
    :param options: any field of the four groups by name (``drop_last=True``, ``rank=0``, ``chunk_size="16M"``).
    """

    _ring: BatchRing | None = None  # the workers' reused batch buffers, made with the first DataLoader
    _open_passes = 0  # passes begun and not ended: the ring is reclaimed only between passes
    _skips: SkippedSteps | None = None  # steps a resume skips (loader/steps.py)
    _step_plan: tuple[int, Resumed | None, int, EpochPlan] | None = None  # `_layout_plan()`'s last plan

    def __init__(
        self,
        source: str | Sequence[str] | dict[str, str] | ShardIndex,
        budget: float | str | None = None,
        *,
        weights: dict[str, float] | Sequence[float] | Callable[[int], Any] | None = None,
        index: str | ShardIndex | None = None,
        where: str | None = None,
        storage_options: dict | None = None,
        num_workers: int = GROUP_DEFAULT.num_workers,
        shuffle: bool = GROUP_DEFAULT.shuffle,
        seed: int = GROUP_DEFAULT.seed,
        buffer_size: int | None = GROUP_DEFAULT.buffer_size,
        max_batch_size: int | None = GROUP_DEFAULT.max_batch_size,
        decode: Decode = GROUP_DEFAULT.decode,
        batching: BatchingOptions | None = None,
        reading: ReadOptions | None = None,
        per_sample: SampleOptions | None = None,
        run: RunOptions | None = None,
        **options: Any,
    ):
        everyday = dict(
            num_workers=num_workers,
            shuffle=shuffle,
            seed=seed,
            buffer_size=buffer_size,
            max_batch_size=max_batch_size,
            decode=decode,
        )
        groups = dict(batching=batching, reading=reading, per_sample=per_sample, run=run)
        check_plain(where, storage_options)
        sorted_ = sort_options({**everyday, **options}, groups)
        self.batching_options, self.read_options = sorted_.batching, sorted_.reading
        self.sample_options, self.run = sorted_.per_sample, sorted_.run
        self.data_parallel = data_parallel(self.run)  # the plan's ranks: the data-parallel ones (loader/mesh.py)
        self.rank, self.layout = self.data_parallel.rank, self.run.layout(self.data_parallel.size)
        # a number is checked (and taken) before reading anything; a string may need the dataset's unit
        taken = parse_budget(budget) if budget is not None and not isinstance(budget, str) else budget
        self._open(source, weights, index, storage_options)
        self._configure(taken, where)

    def _open(self, source: Any, weights: Any, index: str | ShardIndex | None, storage_options: dict | None) -> None:
        """Resolve what to read: one dataset (index and shard URLs) or a mixture of several."""
        self.storage_options = storage_options
        self.index: AnyIndex | None
        self.urls: Sequence[str]
        roots, limit, node = self.read_options.shard_roots, int(self.run.max_plan_bytes), self.read_options.cache_dir
        with lengths_ahead():  # the first epoch's lengths are fetched while the index and loader are built
            opened = open_scheduled(source, weights, index, storage_options, roots, limit, node)  # weights: per epoch?
        self.index, self.urls, self.name, self.weight_schedule = opened
        if self.run.num_workers == 0:  # this process reads: its store client is made while the loader is built
            warm_up(self.urls, storage_options, self.read_options.timeout)

    def _configure(self, budget: float | str | None, where: str | None) -> None:
        """The plan's configuration from the options and the index: lengths, batching, filter, layout, workers."""
        ix, run, sample = self.index, self.run, self.sample_options
        self.length_transform, ops = sample_plan(sample, ix, self.batching_options.seed)
        if isinstance(budget, str):  # parsed here, once, in the dataset's unit (frames when planning in them)
            frames = (
                self.length_transform.frames
                if self.length_transform is not None and self.length_transform.in_frames
                else None
            )
            unit, rate = (ix.unit, ix.sample_rate) if ix is not None else (None, None)
            budget = parse_budget(budget, unit, rate, frames)
        batching = self.batching_options.as_make_options()
        self.config = batching_config(budget, ix, batching, self.length_transform, self.storage_options)
        check_shortest_fits(self.config, ix, self.length_transform, self.name)
        self.filter = open_filter(ix, where)  # evaluated once, in DuckDB's child process; workers read its bits
        self._digest = dataset_digest(ix)  # what a checkpoint names the dataset by
        self.collate_options = collate_options(sample, run, self.config, ix, ops)
        check_sendable(worker_callables(sample, run, self.config), run)
        check_epoch_length(run, ix, self.world_size)
        self._meter: EpochMeter | None = None
        self.epoch = 0
        self._consumed = 0  # batches of the current epoch already yielded (or restored)
        self._schedules: dict[int, RankSchedule] = {}
        self._resumed: Resumed | None = None  # the layouts this epoch ran on before a resume on another one
        self._saved_steps: int | None = None  # the steps of a restored epoch, until it is planned here
        self._saved_equalised: list[list[int]] | None = None  # and its ranks' equalisation
        self._state = SharedEpochState(self.num_workers)
        self._fault_counts, self._bad_shards = fault_tensors(self.num_workers, len(self.urls))
        self._dataloader: DataLoader | None = None

    # ---- the options as attributes -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The plan's ranks: the job's (given, or detected), or its data-parallel ranks (``dp_size``)."""
        return self.layout.world_size

    @property
    def num_workers(self) -> int:
        """DataLoader workers of this rank (0: reading in this process)."""
        return self.run.num_workers

    @property
    def even_batches(self) -> str:
        return self.layout.even_batches

    @property
    def planning(self) -> str:
        return self.run.planning

    @property
    def _seed(self) -> int:
        """The batching seed, a whole number here (only ``plan_batches`` seeds one stream with a sequence)."""
        return self.config.epoch_seed

    @property
    def persistent_workers(self) -> bool:
        """Whether the workers outlive a pass (only with workers)."""
        return self.run.persistent_workers and self.num_workers > 0

    # ---- epochs and planning ----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shard and batch order follow ``(seed, epoch)``). After a full pass the loader
        moves to the next epoch by itself, so calling this is optional; calling it with the epoch a restored
        state is in keeps the resume point. Another epoch during a pass (an iterator partly consumed) is a
        `StateError`: call it before ``iter(loader)``."""
        epoch = int_option("epoch", epoch, 0, MAX_EPOCH)
        if epoch != self.epoch:
            self._between_passes(f"set_epoch({epoch})")
            self._consumed = 0
        self.epoch = int(epoch)
        self._follow(self.epoch)  # a weight schedule: the mixture of this epoch's weights

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch's plan for every rank and worker (requires an index). O(N): it reads every length; for
        inspection and tests. Iteration and ``len()`` use `schedule()`."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = self._epoch_arg(epoch)
        with self._at_epoch(e):
            lengths = self._lengths(e)
            plan = self._whole_plan(e, lengths)
            if isinstance(self.index, MixedIndex):
                plan.datasets = mixture_report(self.index, plan, lengths)
        return plan

    def step_samples(self, step: int, rank: int | None = None, epoch: int | None = None) -> StepSamples:
        """The samples of global step ``step`` of ``epoch`` (default: the current one), from the plan alone (no
        shard is read): every rank's batch, or only ``rank``'s (`streambatch.loader.steps`). Steps count from
        the epoch's start, as ``len()`` and ``consumed`` do; after a resume on another layout, the steps before it
        are those the earlier layouts ran. Plans the whole epoch, O(N), once per epoch (like `plan()`); needs an
        index. A step, rank or epoch that is not a whole number from 0, a step outside the epoch or a rank outside
        the job is an `OptionError` naming it."""
        if self.index is None:
            raise TypeError("step_samples needs an index (index.json): without one the steps are not planned")
        step = int_option("step", step, 0)
        rank = None if rank is None else int_option("rank", rank, 0)
        e = self._epoch_arg(epoch)
        plan, first = self._plan_of_step(e, step)
        if rank is not None and rank >= plan.world_size:
            raise OptionError(f"rank={rank}: step {step} of epoch {e} ran on {plan.world_size} ranks")
        ranks = range(plan.world_size) if rank is None else [rank]
        offsets = self._lengths(e).offsets
        return StepSamples(e, step, {r: self._step_batch(plan, r, step - first, offsets) for r in ranks})

    def _lengths(self, epoch: int) -> Lengths:
        """The lengths ``epoch`` is planned on: the index's, or as speed perturbation and features make them."""
        assert self.index is not None, "planned epochs come from an index"
        kept = self.filter.scale if self.filter is not None else None  # where=: shards dealt by kept length
        return planned_lengths(
            index_lengths(self._epoch_index(epoch), kept), self.length_transform, self.config.seed, epoch
        )

    def _whole_plan(self, epoch: int, lengths: Lengths, keep: KeptSlots | None = None) -> EpochPlan:
        return make_epoch_plan(lengths, self.config, epoch, self.layout, self._excluded_in(epoch, lengths), keep)

    def schedule(self, epoch: int | None = None) -> RankSchedule:
        """This rank's batches in the epoch (requires an index). With an initialised process group of this
        layout, each rank plans only its own slots and the ranks agree on the step count with one all_gather
        (every rank must call it, as every DDP step does); else the whole epoch is planned on this rank, O(N)."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = self._epoch_arg(epoch)
        if e not in self._schedules:
            self._schedules = {e: self._plan_schedule(e)}
        return self._schedules[e]

    def _excluded_in(self, epoch: int, lengths: Lengths) -> Any:
        selection = left_out(self.index, self.filter, epoch, self._seed, lengths.offsets)
        return excluded_in(self._resumed, epoch, lengths, self.config, selection)

    def _earlier(self, epoch: int) -> int:
        """Batches of ``epoch`` consumed on earlier layouts before a resume on this one, as they counted them."""
        r = self._resumed
        return sum(layout.consumed for layout in r.layouts) if r is not None and r.epoch == epoch else 0

    def __len__(self) -> int:
        """The current epoch's steps as this run counts them, the same on every rank: after a resume, the
        batches consumed before it (on this or another layout) plus those still to come, so a progress bar
        or schedule built from ``len()`` and `consumed` is right. With a process group this is a
        collective: ask on every rank."""
        if self.index is None:
            if self.run.batches_per_epoch:
                return self.run.batches_per_epoch
            raise TypeError("len() needs an index: without one the number of batches is unknown until the end")
        return self._earlier(self.epoch) + self.schedule().steps

    @property
    def consumed(self) -> int:
        """Batches of the current epoch already yielded, before a resume included (``len(self) - remaining``)."""
        return self._earlier(self.epoch) + self._consumed

    @property
    def remaining(self) -> int:
        """Batches the current epoch still yields (all of them before it starts; after a resume, those not yet
        consumed). A collective with a process group, like ``len()``."""
        return len(self) - self.consumed

    # ---- iteration ----------------------------------------------------------------------------------
    def _make_dataloader(self) -> DataLoader:
        if self.num_workers > 0 and self._ring is None:  # the workers' reused batch buffers (read/ring.py), made once
            self._ring = batch_ring(
                self.num_workers, self.config.budget, self.collate_options.decode, self.run.prefetch_factor
            )
        callables = worker_callables(self.sample_options, self.run, self.config)
        return make_dataloader(EpochStream(self._context()), self.run, self._ring, callables)

    def _context(self) -> SlotContext:
        """What every DataLoader worker of this loader gets once."""
        return SlotContext(
            urls=self.urls,
            index=self.index,  # a mixture serves as one index
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=self.layout.num_workers,
            collate=self.collate_options,
            read=self.read_options,
            storage_options=self.storage_options,
            state=self._state,
            faults=self._fault_counts,
            bad=self._bad_shards,
            resumed=self._resumed,
            length_transform=self.length_transform,
            filter=self.filter,
            ring=self._ring,
            skips=self._skips,
        )

    def _publish(self, epoch: int) -> int | None:
        """Put the epoch, the resume point and each worker's equalisation where the workers read them."""
        nw = self.layout.num_workers
        state = EpochState(epoch=epoch, consumed=self._consumed, adjust=[Adjust() for _ in range(nw)])
        steps = None
        if self.index is not None:
            sched = self.schedule(epoch)
            steps = sched.steps
            order = sched.order()
            state.rotation = order[self._consumed][0] if self._consumed < len(order) else 0
            state.start = sched.start
            state.adjust = list(sched.adjust)
            self._state.take_plans(epoch, sched, self.index)  # for the stream and forked workers
        elif self.run.batches_per_epoch:
            steps = self.run.batches_per_epoch
            for w, t in enumerate(per_worker([steps] * nw, steps)):
                state.adjust[w].take = t
        self._state.publish(state)
        return steps

    def fault_stats(self) -> dict[str, Any]:
        """What storage faults cost this rank in the current (or last) pass: ``bad_shards`` skipped (and their
        URLs in ``bad_shard_urls``), planned samples lost with them, samples re-drawn in their place, batches
        that came out smaller, request retries, bytes read from remote storage, cache downloads and hits."""
        return fault_summary(self._fault_counts, self._bad_shards, self.urls)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._between_passes("a second iter(loader)")  # two passes at once would yield the same batches twice
        if self.index is not None and self.consumed > 0 and self.remaining == 0:
            # the last pass yielded every batch of its epoch but its iterator was dropped before its end (Lightning's
            # Trainer, islice(loader, len(loader))): that pass is over, and this one is the next epoch's
            self._move_on(self.epoch)
        epoch = self.epoch
        self._fault_counts.zero_()
        self._bad_shards.zero_()
        steps = self._publish(epoch)
        if self._dataloader is None or not self.persistent_workers:
            self._dataloader = self._make_dataloader()
            if self._ring is not None and self._open_passes == 0:  # no worker of an earlier pass runs
                self._ring.reclaim()
        self._meter = EpochMeter(epoch, self.config.budget, self.config.cost, self._unit_per_element())
        self._open_passes += 1
        try:
            for item in self._progress(
                metered(self._skipping(raised_in_workers(self._dataloader)), self._meter), epoch, steps
            ):
                if isinstance(item, list):  # the micro-batches of one batch: the batch counts as consumed once
                    yield from item[:-1]  # the last one is out (a state saved mid-batch resumes at its first)
                    self._consumed += 1
                    yield item[-1]
                else:
                    self._consumed += 1
                    yield item
        finally:
            self._open_passes -= 1
        if steps is not None and self._consumed != steps:
            raise RuntimeError(f"rank {self.rank} yielded {self._consumed} batches but {steps} were planned")
        if steps is None and self._consumed == 0:
            raise EmptyEpochError(
                unindexed_empty_message(
                    self.name or self.urls[0], len(self.urls), self.config, epoch, int(self._bad_shards.sum())
                )
            )
        lost = fault_warning(self.fault_stats(), epoch, self.rank, self.read_options.max_bad_shards)
        if lost is not None:
            log.warning(lost)  # one line per pass, not one per shard
        log.info(metrics_line(self.metrics()))
        self._move_on(epoch)

    def _move_on(self, epoch: int) -> None:
        """A finished pass of ``epoch`` moves on: ``state_dict()`` now points at the next epoch."""
        self._consumed = 0
        self._resumed, self._saved_steps, self._saved_equalised = None, None, None
        self.set_epoch(epoch + 1)

    def _progress(self, items: Iterator[Any], epoch: int, steps: int | None) -> Iterable[Any]:
        """With ``progress=True``, a tqdm bar over the pass (from the batches already consumed)."""
        if not self.run.progress:
            return items
        return progress_bar(items, epoch, None if steps is None else self._earlier(epoch) + steps, self.consumed)

    def _unit_per_element(self) -> float:
        """Dataset length units per element of a padded tensor along T (a budget in seconds: 1 / rate)."""
        ix = self.index
        if ix is not None and ix.unit == "seconds":
            return 1.0 / float(ix.sample_rate) if ix.sample_rate else 0.0
        return 1.0

    def metrics(self, planned: bool = False) -> dict[str, Any]:
        """How the current (or last) pass fed the training loop: padding %, budget utilisation %, batches and
        samples per second, time to first batch, seconds the loop waited on the loader and the readers waited on
        storage (all workers, and per worker), a mixture's dataset shares, and the storage counters of
        `fault_stats()`. ``planned=True`` adds the planned epoch's padding and budget use for this rank
        (plans the whole epoch: O(N))."""
        out = self._meter.summary() if self._meter is not None else {}
        out.update(storage_figures(self._fault_counts, self.fault_stats()))
        if planned and self.index is not None:
            epoch = self._meter.epoch if self._meter is not None else self.epoch
            with self._at_epoch(epoch):  # a weight schedule: that epoch's mixture
                out["planned"] = planned_figures(
                    self.plan(epoch), self.rank, self._lengths(epoch), self.config.budget, self.config.cost
                )
        return out

    # ---- resumption ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch, the batches of it already yielded, and the layouts it ran on, as a plain
        dict (save it with the model: ``torch.save`` or JSON). Small: no per-sample data, whatever the dataset's
        size. `LoaderState` describes each key."""
        return self._own_state().to_dict()

    def _own_state(self) -> LoaderState:
        resumed = self._resumed if self._resumed is not None and self._resumed.epoch == self.epoch else None
        sched = self._schedules.get(self.epoch)
        return LoaderState.current(
            epoch=self.epoch,
            batches_consumed=self._consumed,
            steps=sched.steps if sched is not None else self._saved_steps,
            seed=self.config.seed,
            **dataclasses.asdict(self.layout),
            num_samples=self.index.num_samples if self.index is not None else None,
            mixture=_mixture_state(self.index) if self.index is not None else None,
            where=self.filter.expr if self.filter is not None else None,
            dataset=self._digest,
            batching=batching_record(self.config, self.length_transform),
            earlier_layouts=[run.state_dict() for run in resumed.layouts] if resumed else [],
            excluded=pack_mask(resumed.base) if resumed is not None and resumed.base is not None else None,
            skip_steps=skip_state(self._skips, self.epoch),
            plan_version=self.config.plan_version,
            equalised=every_rank(sched) if sched is not None else self._saved_equalised,
        )

    def load_state_dict(self, state: dict[str, Any], skip_steps: Iterable[int] = ()) -> None:
        """Continue from a `state_dict()` (of this version or an earlier one): the next iteration yields the
        epoch's remaining batches (`remaining`), while ``len()`` still counts the whole epoch, consumed
        batches included.

        With the same world size and workers, the remaining batches are exactly those the uninterrupted run
        would have yielded. With another layout (a job restarted on more or fewer nodes), the samples not
        yet consumed are planned again over the new layout: none is seen twice, none is lost. Each rank works
        out what was consumed by batching only the old slots that held its own shards, each up to the batches it
        yielded (about the price of a fresh plan). ``skip_steps``: epoch steps to skip after a loss spike, e.g.
        ``range(1200, 1300)`` (`steps`). Between passes only: during one (an iterator partly consumed) it is a
        `StateError`."""
        self._between_passes("load_state_dict()")
        saved = LoaderState.from_dict(state)
        self._to_saved_epoch(saved)  # a weight schedule: the epoch's weights, checked against the saved ones
        saved.check(self._own_state())
        self.config = saved.keep_plan_version(self.config)
        self._schedules = {}
        self._dataloader = None  # workers must see the new plan
        n = self.index.num_samples if self.index is not None else 0
        self._resumed, self._consumed, self._saved_steps = saved.resume_on(self.layout, n, self._old_steps)
        self._saved_equalised = saved.equalised_on(self.layout)
        if self._consumed == 0 and self._resumed is not None and self._resumed.layouts:
            log.info(resume_line(self.epoch, self.layout, self._resumed.layouts[-1]))
        self._skips = self._resume_skips(saved, skip_steps)

    # ---- planning an epoch ------------------------------------------------------------------------------
    def _plan_schedule(self, epoch: int) -> RankSchedule:
        """This rank's batches in ``epoch``, planned as ``planning`` says (rank-locally with one small collective
        over the data-parallel ranks when a process group allows it, else the whole epoch on this rank, O(N)) and
        logged in one line; an epoch that gives no batch (and none before a resume) is an `EmptyEpochError`."""
        t0 = time.perf_counter()
        lengths = self._lengths(epoch)
        local = self._rank_local()
        # without workers this process streams its slot: it takes the plan made here instead of planning it again
        keep = KeptSlots(self.layout.rank_slots(self.rank)) if self.num_workers == 0 else None
        if local:
            excluded = self._excluded_in(epoch, lengths)
            agree = self.data_parallel.gather  # one all_gather over the data-parallel ranks
            sched = plan_rank_local(lengths, self.config, epoch, self.rank, self.layout, agree, excluded, keep)
            sched = share_equalised(sched, agree)  # a second all_gather: every rank's equalisation, for the checkpoint
        else:
            sched = RankSchedule.of(self._whole_plan(epoch, lengths, keep), self.rank)
        sched.kept = keep.plans if keep is not None else {}
        sched.lengths = lengths if lengths.loaded <= KEEP_LENGTHS_MAX and self._lengths_taken() else None
        log.info(plan_line(sched, self.layout, self.rank, local, lengths.loaded, time.perf_counter() - t0))
        if sched.repeated and self.layout.even_batches == "split":
            log.warning(split_repeat_line(sched, self.layout, local))
        if sched.steps == 0 and self._earlier(epoch) == 0:
            raise EmptyEpochError(empty_epoch_message(self, sched, local))
        return sched

    def _lengths_taken(self) -> bool:
        """Whether anything takes the lengths an epoch is planned on: this process's own stream (no workers) or
        workers forked after the planning (workers started by spawn or forkserver read their own, and so do
        ``persistent_workers`` forked in an earlier pass)."""
        if self.num_workers == 0:
            return True
        running = self.persistent_workers and self._dataloader is not None
        return not running and start_method(self.urls, self.storage_options) == "fork"

    def _rank_local(self) -> bool:
        """Whether the epoch is planned rank-locally (the ``planning`` option and a process group of this layout)."""
        possible = self.data_parallel.can_agree()
        if self.planning == "local" and not possible:
            raise OptionError(
                f"planning='local' needs an initialised torch.distributed group of rank {self.rank} in "
                f"{self.world_size}; without one use planning='auto' (plans the whole epoch on each rank)"
            )
        return self.planning != "global" and possible

    def _epoch_arg(self, epoch: int | None) -> int:
        """The epoch a planning call names (None: the current one), else an `OptionError` naming it."""
        return self.epoch if epoch is None else int_option("epoch", epoch, 0, MAX_EPOCH)

    def _between_passes(self, call: str) -> None:
        """Refuse ``call`` (a move to another epoch or resume point) while a pass is under way: its iterator would go
        on yielding the old epoch's batches while ``state_dict()`` named the new place (lost or repeated samples)."""
        if self._open_passes:
            raise StateError(
                f"{call} during a pass of epoch {self.epoch} ({self._consumed} batches of it yielded): call it "
                "between passes, before iter(loader) or once the pass has ended (or its iterator is closed: "
                "it.close(), or del it)"
            )

    def _old_steps(self, layout: Layout, before: Resumed) -> int:
        """The steps an old layout planned for the current epoch (a state saved before it recorded them): O(N),
        once."""
        e = self.epoch
        lengths = self._lengths(e)
        selection = left_out(self.index, self.filter, e, self._seed, lengths.offsets)
        return make_epoch_plan(lengths, self.config, e, layout, before.consumed(lengths, self.config, selection)).steps

    # ---- which samples were in step k (loader/steps.py) ---------------------------------------------------
    def _plan_of_step(self, epoch: int, step: int) -> tuple[EpochPlan, int]:
        """The whole plan of the layout that ran (or runs) ``step`` of the epoch, and the epoch step its step 0 is."""
        resumed = self._resumed if self._resumed is not None and self._resumed.epoch == epoch else None
        runs = resumed.layouts if resumed is not None else ()
        first = 0
        for i, run in enumerate(runs):
            if first <= step < first + run.consumed:
                return self._layout_plan(epoch, resumed, i), first
            first += run.consumed
        plan = self._layout_plan(epoch, resumed, len(runs))
        if not first <= step < first + plan.steps:
            raise OptionError(
                f"step {step}: epoch {epoch} has {first + plan.steps} steps (0 to {first + plan.steps - 1})"
            )
        return plan, first

    def _layout_plan(self, epoch: int, resumed: Resumed | None, i: int) -> EpochPlan:
        """Layout ``i``'s plan of the epoch (the earlier layouts' first, then this loader's), kept for the next ask."""
        got = self._step_plan
        if got is not None and got[0] == epoch and got[1] is resumed and got[2] == i:
            return got[3]
        lengths = self._lengths(epoch)
        if resumed is None or i == len(resumed.layouts):
            plan = self._whole_plan(epoch, lengths)
        else:  # an earlier layout, planned around what the ones before it consumed
            before = Resumed(epoch, resumed.layouts[:i], resumed.base)
            selection = left_out(self.index, self.filter, epoch, self._seed, lengths.offsets)
            excluded = before.consumed(lengths, self.config, selection)
            plan = make_epoch_plan(lengths, self.config, epoch, resumed.layouts[i].layout, excluded)
        self._step_plan = (epoch, resumed, i, plan)
        return plan

    def _step_batch(self, plan: EpochPlan, rank: int, k: int, offsets: np.ndarray) -> StepBatch:
        """Rank ``rank``'s batch at step ``k`` of ``plan``: worker and batch number in the DataLoader's order."""
        assert self.index is not None, "steps are planned from an index"
        w, i = plan.rank_order(rank)[k]
        slot = plan.slots[rank * plan.num_workers + w]
        gids = np.asarray(slot.gids[slot.batches[i]], dtype=np.int64)
        return StepBatch(rank, tuple(samples_of(self.index, offsets, gids)), bool(slot.repeat[i]))

    # ---- skipping steps on resume (loader/steps.py) -------------------------------------------------------
    def _skipping(self, items: Iterable[Any]) -> Iterator[Any]:
        """Stage (main process): a worker's `SkippedBatch` counts its step as consumed and is not passed on;
        every other item is."""
        for item in items:
            if isinstance(item, SkippedBatch):
                self._consumed += 1
                continue
            yield item

    def _resume_skips(self, saved: LoaderState, skip_steps: Iterable[int]) -> SkippedSteps | None:
        """The steps a resume skips: those the state recorded and ``skip_steps`` (checked against the epoch, logged
        with their sample count on this rank); None when there are none."""
        new = step_ranges(skip_steps)
        if new:
            self._check_and_log_skips(new)
        ranges = merged([*(saved.skip_steps or []), *new])
        return SkippedSteps(self.epoch, tuple(ranges), self._earlier(self.epoch)) if ranges else None

    def _check_and_log_skips(self, ranges: list[tuple[int, int]]) -> None:
        """Refuse steps already consumed or beyond the epoch; warn what is skipped."""
        if self.index is None:
            raise OptionError("skip_steps needs an index (index.json): without one the steps are not planned")
        e, total, done = self.epoch, len(self), self.consumed
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
            f"rank {self.rank}: skipping steps {said} of epoch {e} ({n} steps, {self._samples_at(ranges):,} "
            f"samples on this rank, not read); every rank skips them and yields the epoch's other {total - n} steps"
        )

    def _samples_at(self, ranges: list[tuple[int, int]]) -> int:
        """Samples this rank's batches hold at the epoch steps ``ranges``: its own slots re-planned (batch sizes
        only, O(N / world_size)), equalised to the agreed step count."""
        e, layout, config = self.epoch, self.layout, self.config
        lengths = self._lengths(e)
        excluded = self._excluded_in(e, lengths)
        # batch sizes alone order the batches unless the hardest comes first or the steps are balanced (by time)
        counted = not layout.hardest_first and config.balance is None
        raw = rank_raw_slots(lengths, config, e, self.rank, layout, excluded, counted=counted)
        rp = plan_rank(raw, self.schedule(e).steps, layout, config, e, self.rank, lengths)
        order = interleave([len(s.batches) for s in rp.slots], rp.first_worker)
        earlier = self._earlier(e)
        return sum(len(rp.slots[w].batches[i]) for a, b in ranges for w, i in order[a - earlier : b - earlier])

    # ---- a weight schedule: the mixture follows the epoch (loader/mixing.py) ------------------------------
    def _follow(self, epoch: int) -> None:
        """Lay the mixture out for ``epoch``'s weights (nothing without a schedule, or when it already is): the
        epoch's plan, its workers and its bad-shard flags start afresh; the fault counters are kept."""
        schedule: WeightSchedule | None = self.weight_schedule
        if schedule is None:
            return
        ix = schedule.index_for(epoch)
        assert isinstance(self.index, MixedIndex), "a weight schedule lays out a mixture"
        if ix.state() == self.index.state():  # already laid out for these weights and windows
            return
        self.index, self.urls = ix, ShardURLs(ix)
        if self.filter is not None:
            self.filter = self.filter.relaid(ix)
        self.collate_options = dataclasses.replace(self.collate_options, datasets=dataset_names(ix))
        self._bad_shards = fault_tensors(self.num_workers, len(self.urls))[1]
        self._schedules, self._dataloader = {}, None  # persistent workers too: they hold the old mixture

    @contextmanager
    def _at_epoch(self, epoch: int) -> Iterator[None]:
        """The mixture laid out for ``epoch`` while the block runs (``plan(epoch)`` of another epoch than the
        current one, ``metrics(planned=True)`` after a pass), then as it was."""
        if self.weight_schedule is None or epoch == self.epoch:
            yield
            return
        saved = {name: getattr(self, name) for name in MIXTURE_LAYOUT}
        self._follow(epoch)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def _epoch_index(self, epoch: int) -> AnyIndex:
        """The index ``epoch`` is planned from; under a weight schedule it must be laid out for that epoch
        (``schedule(epoch)`` of another epoch: set the epoch first)."""
        assert self.index is not None, "planned epochs come from an index"
        schedule: WeightSchedule | None = self.weight_schedule
        if schedule is not None and schedule.index_for(epoch).state() != _mixture_state(self.index):
            raise OptionError(
                f"the mixture's weights follow a schedule and this loader is at epoch {self.epoch}: call "
                f"set_epoch({epoch}) before planning epoch {epoch}"
            )
        return self.index

    def _to_saved_epoch(self, saved: LoaderState) -> None:
        """Move to the epoch of a state being loaded and, under a weight schedule, refuse a state whose epoch began
        elsewhere in the datasets (earlier epochs took other samples) or, saved mid-epoch, ran on other weights
        than the schedule gives it now (the samples it took would be lost or repeated), naming both. Other
        mixtures are `mixture_problem()`'s to name."""
        self.set_epoch(saved.epoch)
        if self.weight_schedule is None or not saved.knows("mixture") or not saved.mixture:
            return
        assert isinstance(self.index, MixedIndex), "a weight schedule lays out a mixture"
        then, now = draw_rows(saved.mixture, saved.epoch), draw_rows(self.index.state(), saved.epoch)
        if [r[::2] for r in then] != [r[::2] for r in now]:  # other datasets (mixture_problem), or the same draw
            return
        if then == now or (not saved.mid_epoch and began(then) == began(now)):  # between epochs: where it begins
            return
        weights = {r[0]: r[1] for r in then}, {r[0]: r[1] for r in now}
        what = f"the weights {weights[1]}"
        if weights[0] == weights[1]:
            what = "the same weights after other weights before it"
        raise StateError(
            f"state was saved at epoch {saved.epoch} with weights {weights[0]} (mixture {saved.mixture}); this "
            f"loader's weight schedule gives epoch {saved.epoch} {what} (mixture {self.index.state()}): resume with "
            "the schedule the state was saved with"
        )


def _mixture_state(index: AnyIndex) -> list | None:
    """What a checkpoint records of a mixture's layout (None: one dataset)."""
    return index.state() if isinstance(index, MixedIndex) else None
