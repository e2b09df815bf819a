"""StreamBatchLoader: options in (sorted into their typed groups once, `options`), padded batches out. It
plans each epoch from the index (`streambatch.plan.epoch`), publishes the epoch and resume point to its
DataLoader workers (`streambatch.read.worker`), and owns ``len()``, epochs and ``state_dict()``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

from torch.utils.data import DataLoader

from ..errors import EmptyEpochError, int_option
from ..format.index import ShardIndex
from ..io.prefetch import lengths_ahead
from ..io.ranges import warm_up
from ..plan.budget import parse_budget
from ..plan.epoch import EpochPlan, RankSchedule, every_rank, make_epoch_plan
from ..plan.lengths import Lengths, index_lengths
from ..plan.perturb import planned_lengths
from ..plan.resume import Resumed, excluded_in
from ..plan.slot import Adjust, KeptSlots, per_worker
from ..read.collate import Decode
from ..read.ring import BatchRing, batch_ring
from ..read.worker import EpochState, EpochStream, SharedEpochState, SlotContext, fault_tensors, raised_in_workers
from ..select.mixture import MixedIndex
from ..select.where import left_out, open_filter
from .mesh import data_parallel
from .messages import check_shortest_fits, mixture_report, resume_line, unindexed_empty_message
from .metrics import EpochMeter, fault_summary, fault_warning, metered, metrics_line, planned_figures, storage_figures
from .mixing import at_epoch, epoch_index, follow, open_scheduled, to_saved_epoch
from .options import (
    Index,
    batching_config,
    check_epoch_length,
    collate_options,
    option_groups,
    sample_plan,
    worker_callables,
)
from .planning import between_passes, epoch_arg, old_steps, plan_schedule
from .state import MAX_EPOCH, LoaderState, batching_record, dataset_digest, pack_mask
from .steps import SkippedSteps, StepSamples, resume_skips, skip_state, skipping, step_samples
from .workers import check_sendable, make_dataloader, progress_bar

log = logging.getLogger("streambatch")


class StreamBatchLoader:
    """Stream length-annotated shards and yield padded batches with ``n × max_len ≤ budget``.

    Every option is a keyword of this constructor; each belongs to one typed group, where it is checked once and
    documented in full: `BatchingConfig` (batching),
    `ReadOptions` (reading), `SampleOptions`
    (per sample) and `RunOptions` (the run). A bad value is an
    `OptionError` naming the option.

    What to read:

    * ``source``: a dataset folder or URL written by ``shardify write`` (holding ``index.json``), an index file, a
      brace-expanded shard pattern or a list of shard URLs (10⁷ at most; without an index, lengths come from each
      sample's ``.json``; no ``len()``); or several datasets mixed by ``weights``: a ``{name: folder}`` mapping, a
      list of folders, or a mixture file.
    * ``budget``: the largest padded size of a batch, ``n × max_len``, in the dataset's unit, or a duration like
      ``"60s"`` for audio with an index; None only with a calibration file as ``cost``.
    * ``weights``: per-dataset weights when ``source`` names several datasets, or a schedule of them: a list per
      epoch (the last holds for later epochs) or a deterministic callable ``epoch -> weights``, run in this process.
    * ``index``: an index file or `ShardIndex` to plan from and read: its shard
      URLs are the ones read (``source`` then names the dataset in messages); not with a mixture.
    * ``where``: keep only the samples for which this SQL expression over the sample table's columns is true
      (``"language = 'de' AND snr > 10"``; DuckDB).
    * ``storage_options``: passed to fsspec (credentials, ``client_kwargs={"endpoint_url": ...}``); for the range
      reads of ``s3://`` shards mapped to obstore's store options (see `streambatch.io.objstore`), so the same
      dictionary serves both.

    Batching (`BatchingConfig`'s fields; ``num_buckets``, ``bucket_spacing``,
    ``cost``, ``quadratic_factor`` and ``packed`` as `make()` takes
    them): ``buffer_size``, ``refill``, ``bucket_boundaries``, ``num_buckets``, ``bucket_spacing``,
    ``max_batch_size``, ``batch_size_multiple_of``, ``min_length``, ``max_length``, ``drop_last``, ``strict``,
    ``shuffle``, ``seed``, ``pad_to_multiple_of``, ``batch_order``, ``output_budget``, ``batch_by``, ``cost``
    (``"padded"``, ``"quadratic"``, a callable ``cost(n, max_len)`` or a calibration file), ``quadratic_factor``,
    ``packed``, ``interleave``, ``step_balance``.

    Reading (`ReadOptions`): ``chunk_size``, ``read_ahead``, ``read_concurrency``,
    ``max_read_concurrency``, ``retries``, ``backoff``, ``timeout``, ``verify``, ``max_bad_shards``, ``cache_dir``,
    ``cache_size``, ``shard_roots``.

    Per sample (`SampleOptions`): ``decode``, ``transform``,
    ``speed_perturb``, ``features``.

    The run (`RunOptions`): ``rank``, ``world_size``, ``dp_rank``,
    ``dp_size``, ``dp_mesh`` (data parallelism inside a model-parallel mesh), ``num_workers``,
    ``even_batches``, ``hardest_first``, ``planning``, ``batches_per_epoch``, ``micro_batches``,
    ``loss_weight_by``, ``prefetch_factor``, ``persistent_workers``, ``pin_memory``, ``worker_init_fn``,
    ``progress``, ``max_plan_bytes``.
    """

    _ring: BatchRing | None = None  # the workers' reused batch buffers, made with the first DataLoader
    _open_passes = 0  # passes begun and not ended: the ring is reclaimed only between passes
    _skips: SkippedSteps | None = None  # steps a resume skips (loader/steps.py)

    def __init__(
        self,
        source: str | Sequence[str] | dict[str, str] | ShardIndex,
        budget: float | str | None = None,
        *,
        weights: dict[str, float] | Sequence[float] | None = None,
        index: str | ShardIndex | None = None,
        where: str | None = None,
        storage_options: dict | None = None,
        # batching: BatchingConfig
        buffer_size: int | None = None,
        refill: int | None = None,
        bucket_boundaries: Sequence[float] | None = None,
        num_buckets: int | None = None,
        bucket_spacing: str = "quantile",
        max_batch_size: int | None = None,
        batch_size_multiple_of: int = 1,
        min_length: float = 0,
        max_length: float | None = None,
        drop_last: bool = False,
        strict: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        pad_to_multiple_of: int | None = None,
        batch_order: str = "random",
        output_budget: float | None = None,
        batch_by: str | None = None,
        cost: Any = "padded",
        quadratic_factor: float | None = None,
        packed: bool = False,
        interleave: int = 8,
        step_balance: Any = "attention",
        # reading: ReadOptions
        chunk_size: int | str = "8M",
        read_ahead: int | str = "64M",
        read_concurrency: int = 4,
        max_read_concurrency: int = 16,
        retries: int = 8,
        backoff: float = 0.25,
        timeout: float = 60.0,
        verify: str = "sha256",
        max_bad_shards: int = 0,
        cache_dir: str | None = None,
        cache_size: int | str | None = None,
        shard_roots: Sequence[str] = (),
        # per sample: SampleOptions
        decode: Decode = "auto",
        transform: Callable[..., Any] | None = None,
        speed_perturb: Any = None,
        features: Any = None,
        # the run: RunOptions
        rank: int | None = None,
        world_size: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        dp_mesh: Any = None,
        num_workers: int = 0,
        even_batches: str = "split",
        hardest_first: bool = False,
        planning: str = "auto",
        batches_per_epoch: int | None = None,
        micro_batches: int = 1,
        loss_weight_by: str = "samples",
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], Any] | None = None,
        progress: bool = False,
        max_plan_bytes: int | str = "16G",
    ):
        batching, self.read_options, self.sample_options, self.run = option_groups(locals())
        self.data_parallel = data_parallel(self.run)  # the plan's ranks: the data-parallel ones (loader/mesh.py)
        self.rank, self.layout = self.data_parallel.rank, self.run.layout(self.data_parallel.size)
        self._open(source, budget, weights, index, storage_options)
        self._configure(budget, batching, where)

    def _open(self, source: Any, budget: Any, weights: Any, index: Any, storage_options: dict | None) -> None:
        """Resolve what to read: one dataset (index and shard URLs) or a mixture of several."""
        if budget is not None and not isinstance(budget, str):
            parse_budget(budget)  # a number is checked before reading anything
        self.storage_options = storage_options
        self.index: Index | None
        self.urls: Sequence[str]
        roots, limit, node = self.read_options.shard_roots, int(self.run.max_plan_bytes), self.read_options.cache_dir
        with lengths_ahead():  # the first epoch's lengths are fetched while the index and loader are built
            opened = open_scheduled(source, weights, index, storage_options, roots, limit, node)  # weights: per epoch?
        self.index, self.urls, self.name, self.weight_schedule = opened
        if self.run.num_workers == 0:  # this process reads: its store client is made while the loader is built
            warm_up(self.urls, storage_options, self.read_options.timeout)

    def _configure(self, budget: Any, batching: dict[str, Any], where: str | None) -> None:
        """The plan's configuration from the options and the index: lengths, batching, filter, layout, workers."""
        ix, run, sample = self.index, self.run, self.sample_options
        self.length_plan, ops = sample_plan(sample, ix, batching["seed"])
        frames = self.length_plan.frames if self.length_plan is not None and self.length_plan.in_frames else None
        unit, rate = (ix.unit, ix.sample_rate) if ix is not None else (None, None)
        budget = None if budget is None else parse_budget(budget, unit, rate, frames)
        self.config = batching_config(budget, ix, batching, self.length_plan, self.storage_options)
        check_shortest_fits(self.config, ix, self.length_plan, self.name)
        self.filter = open_filter(ix, where)  # evaluated by DuckDB over the sample table's columns
        self._digest = dataset_digest(ix)  # what a checkpoint names the dataset by
        self.collate_options = collate_options(sample, run, self.config, ix, ops)
        check_sendable(worker_callables(sample, run, self.config), run, self.filter is not None)
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
            between_passes(self, f"set_epoch({epoch})")
            self._consumed = 0
        self.epoch = int(epoch)
        follow(self, self.epoch)  # a weight schedule: the mixture of this epoch's weights

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch's plan for every rank and worker (requires an index). O(N): it reads every length; for
        inspection and tests. Iteration and ``len()`` use `schedule()`."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = epoch_arg(self, epoch)
        with at_epoch(self, e):
            lengths = self._lengths(e)
            plan = self._whole_plan(e, lengths)
            if isinstance(self.index, MixedIndex):
                plan.datasets = mixture_report(self.index, plan, lengths)
        return plan

    def step_samples(self, step: int, rank: int | None = None, epoch: int | None = None) -> StepSamples:
        """Which samples were (or will be) in ``step``, every rank's or ``rank``'s (`steps.step_samples()`)."""
        return step_samples(self, step, rank, epoch)

    def _lengths(self, epoch: int) -> Lengths:
        """The lengths ``epoch`` is planned on: the index's, or as speed perturbation and features make them."""
        assert self.index is not None, "planned epochs come from an index"
        kept = self.filter.scale if self.filter is not None else None  # where=: shards dealt by kept length
        return planned_lengths(index_lengths(epoch_index(self, epoch), kept), self.length_plan, self.config.seed, epoch)

    def _whole_plan(self, epoch: int, lengths: Lengths, keep: KeptSlots | None = None) -> EpochPlan:
        return make_epoch_plan(lengths, self.config, epoch, self.layout, self._excluded_in(epoch, lengths), keep)

    def schedule(self, epoch: int | None = None) -> RankSchedule:
        """This rank's batches in the epoch (requires an index). With an initialised process group of this
        layout, each rank plans only its own slots and the ranks agree on the step count with one all_gather
        (every rank must call it, as every DDP step does); else the whole epoch is planned on this rank, O(N)."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = epoch_arg(self, epoch)
        if e not in self._schedules:
            self._schedules = {e: plan_schedule(self, e)}
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
        return make_dataloader(EpochStream(self._context()), self.run, self._ring, self.filter is not None, callables)

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
            length_plan=self.length_plan,
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
        between_passes(self, "a second iter(loader)")  # two passes at once would yield the same batches twice
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
                metered(skipping(self, raised_in_workers(self._dataloader)), self._meter), epoch, steps
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
            with at_epoch(self, epoch):  # a weight schedule: that epoch's mixture
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
            mixture=self.index.state() if isinstance(self.index, MixedIndex) else None,
            where=self.filter.expr if self.filter is not None else None,
            dataset=self._digest,
            batching=batching_record(self.config, self.length_plan),
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
        out what was consumed by re-planning only the old ranks that held its own shards. ``skip_steps``: epoch
        steps to skip after a loss spike, e.g. ``range(1200, 1300)`` (`steps`). Between
        passes only: during one (an iterator partly consumed) it is a `StateError`."""
        between_passes(self, "load_state_dict()")
        saved = LoaderState.from_dict(state)
        to_saved_epoch(self, saved)  # a weight schedule: the epoch's weights, checked against the saved ones
        saved.check(self._own_state())
        self.config = saved.keep_plan_version(self.config)
        self._schedules = {}
        self._dataloader = None  # workers must see the new plan
        n = self.index.num_samples if self.index is not None else 0
        self._resumed, self._consumed, self._saved_steps = saved.resume_on(self.layout, n, partial(old_steps, self))
        self._saved_equalised = saved.equalised_on(self.layout)
        if self._consumed == 0 and self._resumed is not None and self._resumed.layouts:
            log.info(resume_line(self.epoch, self.layout, self._resumed.layouts[-1]))
        self._skips = resume_skips(self, saved, skip_steps)
