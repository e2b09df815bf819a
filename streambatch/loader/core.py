"""StreamBatchLoader: the public face of the read side — options in, padded batches out.

It turns the user's options into a :class:`BatchingConfig` and :class:`ReadOptions` once, plans each epoch
from the index (:mod:`streambatch.plan.epoch`), publishes the epoch and resume point to its DataLoader workers
(:mod:`streambatch.read.worker`), and owns ``len()``, epochs and ``state_dict()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader

from ..dataset.index import ShardIndex
from ..dataset.mixture import MixedIndex, dataset_names, mixture_sources
from ..dataset.source import ShardURLs, resolve_source
from ..dataset.where import left_out, open_filter
from ..dist import all_gather_ints, process_group_matches, process_info
from ..errors import BudgetError, EmptyEpochError
from ..plan.batcher import BucketBatcher
from ..plan.config import check_budget
from ..plan.epoch import EVEN_BATCHES, EpochPlan, RankSchedule, make_epoch_plan, plan_rank_local
from ..plan.lengths import Lengths, index_lengths
from ..plan.perturb import planned_lengths
from ..plan.resume import Layout, Resumed, excluded_in
from ..plan.slot import Adjust, per_worker
from ..read.collate import Decode
from ..read.faults import FAULT_FIELDS, STORAGE_WAIT
from ..read.ring import BatchRing, batch_ring
from ..read.worker import CollateOptions, EpochState, EpochStream, SharedEpochState, SlotContext, fault_tensors
from ..summary import length_text
from .messages import empty_epoch_message, mixture_report, unindexed_empty_message
from .metrics import EpochMeter, metered, metrics_line, planned_figures, storage_waits
from .options import batching_config, plan_budget, pop_sample_options, read_options, sample_plan, split_options
from .state import batching_record, check_state, old_layout, pack_mask, unpack_mask

log = logging.getLogger("streambatch")

#: how an epoch is planned: "auto" (rank-local with a process group, else whole), "local", "global"
PLANNING = ("auto", "local", "global")


def _identity(x: Any) -> Any:
    return x


class _WorkerInit:
    """DataLoader workers ignore SIGUSR1: a scheduler's warning signal (SLURM ``--signal=USR1@T``) may reach the
    whole process group, and its default action would kill the workers while the training process is saving
    its checkpoint. SIGTERM keeps its default: torch ends workers with it. Then the user's ``worker_init_fn``."""

    def __init__(self, user: Any = None):
        self.user = user

    def __call__(self, worker_id: int) -> None:
        import signal

        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)


class StreamBatchLoader:
    """Stream length-annotated shards and yield padded batches with ``n × max_len ≤ budget``.

    ``source``: a dataset folder or URL written by ``shardify write`` (holding ``index.json``), an index
    file, a brace-expanded shard pattern or a list of shard URLs (without an index, lengths come from each
    sample's ``.json``; no ``len()``); or several datasets mixed by ``weights``: a ``{name: folder}``
    mapping, a list of folders, or a mixture file. ``budget`` is the largest padded size of a batch in the
    dataset's unit (or a duration like ``"60s"`` for audio with an index).
    ``options`` are the batching options (:class:`BatchingConfig`) and read options (``READ_OPTIONS``) by
    name. ``where``: keep only the samples for which this SQL expression over the sample table's columns is
    true (``"language = 'de' AND snr > 10"``; DuckDB). The README lists every option.
    """

    _ring: BatchRing | None = None  # the workers' reused batch buffers, made with the first DataLoader
    _open_passes = 0  # passes begun and not ended: the ring is reclaimed only between passes

    def __init__(
        self,
        source: str | Sequence[str] | dict[str, str] | ShardIndex,
        budget: float | str | None = None,
        *,
        weights: dict[str, float] | Sequence[float] | None = None,
        index: str | ShardIndex | None = None,
        decode: Decode = "auto",
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        worker_init_fn: Any = None,
        pin_memory: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        even_batches: str = "split",
        batches_per_epoch: int | None = None,
        micro_batches: int = 1,
        loss_weight_by: str = "samples",
        hardest_first: bool = False,
        planning: str = "auto",
        progress: bool = False,
        storage_options: dict | None = None,
        where: str | None = None,
        **options: Any,
    ):
        per_sample = pop_sample_options(options)  # transform, speed_perturb, features
        batching, reading = split_options(options)
        self._check(micro_batches, loss_weight_by, even_batches)
        if budget is not None and not isinstance(budget, str):
            check_budget(budget)  # before reading anything
        self.storage_options = storage_options
        self.read_options = read_options(**reading)
        sources = mixture_sources(source, weights)
        if sources is not None:
            self.index = MixedIndex.open(sources, storage_options)
            self.urls = ShardURLs(self.index)  # type: ignore[arg-type]
            self.name = "mixture of " + ", ".join(self.index.names)
        else:
            self.index, self.urls = resolve_source(source, index, storage_options)
            self.name = str(source) if isinstance(source, str) else (self.index.root if self.index is not None else "")
        if not self.urls:
            raise ValueError(f"{source}: no shards found")
        self.length_plan, ops = sample_plan(per_sample, self.index, decode, batching.get("seed", 0))
        self.config = batching_config(self._parse_budget(budget), self.index, batching, self.length_plan)
        self._check_shortest_fits()
        self.filter = open_filter(self.index, where)  # evaluated by DuckDB over the sample table's columns
        info = process_info(rank, world_size)
        self.rank, self.world_size = info.rank, info.world_size
        self.num_workers = int(num_workers)
        self.prefetch_factor, self.pin_memory, self.worker_init_fn = prefetch_factor, pin_memory, worker_init_fn
        self.persistent_workers = persistent_workers and self.num_workers > 0
        self.even_batches, self.hardest_first = even_batches, bool(hardest_first)
        if planning not in PLANNING:
            raise ValueError(f"planning must be one of {PLANNING}, got {planning!r}")
        self.planning, self.progress = planning, bool(progress)
        self._meter: EpochMeter | None = None
        ix = self.index
        self.collate_options = CollateOptions(
            decode=decode,
            pad_to_multiple_of=batching.get("pad_to_multiple_of"),
            sample_rate=ix.sample_rate if ix is not None and ix.unit == "samples" else None,
            packed=self.config.cost.packed,
            micro_batches=int(micro_batches),
            loss_weight_by=loss_weight_by,
            datasets=dataset_names(self.index),
            per_sample=ops,
        )
        if self.index is None and self.world_size > 1 and not batches_per_epoch:
            raise ValueError(
                f"without an index the ranks cannot know how many batches the data gives, so {self.world_size} "
                "ranks would step unevenly (a DDP hang): write an index (`shardify write`), or pass "
                "batches_per_epoch=N to give every rank exactly N batches per epoch"
            )
        self.batches_per_epoch = int(batches_per_epoch) if batches_per_epoch else None
        self.epoch = 0
        self._consumed = 0  # batches of the current epoch already yielded (or restored)
        self._schedules: dict[int, RankSchedule] = {}
        self._resumed: Resumed | None = None  # the layouts this epoch ran on before a resume on another one
        self._saved_steps: int | None = None  # the steps of a restored epoch, until it is planned here
        self._state = SharedEpochState(self.num_workers)
        self._fault_counts, self._bad_shards = fault_tensors(self.num_workers, len(self.urls))
        self._dataloader: DataLoader | None = None

    def _parse_budget(self, budget: Any) -> float | None:
        """The budget in the plan's unit (a duration like ``"60s"`` converted with the index's rate)."""
        return plan_budget(budget, self.index, self.length_plan)

    def _check_shortest_fits(self) -> None:
        """A budget that not even the shortest sample fits alone is an error now (from the index's shard
        table), not an epoch without batches later."""
        if self.index is None:
            return
        table = self.index.shard_table(("count", "min_length"))
        mins = table["min_length"][table["count"] > 0]
        shortest = float(mins.min()) if mins.size else 0.0
        if self.length_plan is not None:
            shortest = self.length_plan.shortest(shortest)
        alone = BucketBatcher(self.config.replace(min_length=0, max_length=None, strict=False, buffer_size=1))
        if shortest <= 0 or alone.accepts(shortest):
            return
        cfg, ix = self.config, self.index
        padded = cfg.cost.name == "padded" and not cfg.pad_to_multiple_of
        how = "is smaller than" if padded else f"({cfg.cost.name} cost) cannot hold even"
        frames = self.length_plan is not None and self.length_plan.in_frames
        text = (lambda x: f"{x:,.0f} frames") if frames else (lambda x: length_text(x, ix))
        raise BudgetError(
            f"{self.name}: budget {text(cfg.budget)} {how} the shortest sample, "
            f"{text(shortest)}: every sample would be skipped and no epoch would have a batch; "
            "use a larger budget (`shardify inspect` suggests one)"
        )

    @staticmethod
    def _check(micro_batches: int, loss_weight_by: str, even_batches: str) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        if loss_weight_by not in ("samples", "frames"):
            raise ValueError(f"loss_weight_by must be 'samples' or 'frames', got {loss_weight_by!r}")
        if even_batches not in EVEN_BATCHES:
            raise ValueError(f"even_batches must be one of {EVEN_BATCHES}, got {even_batches!r}")

    # ---- epochs and planning ----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shard and batch order follow ``(seed, epoch)``). After a full pass the loader
        moves to the next epoch by itself, so calling this is optional; calling it with the epoch a restored
        state is in keeps the resume point."""
        if int(epoch) != self.epoch:
            self._consumed = 0
        self.epoch = int(epoch)

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch's plan for every rank and worker (requires an index). O(N): it reads every length; for
        inspection and tests. Iteration and ``len()`` use :meth:`schedule`."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = self.epoch if epoch is None else int(epoch)
        lengths = self._lengths(e)
        plan = self._whole_plan(e, lengths)
        if isinstance(self.index, MixedIndex):
            plan.datasets = mixture_report(self.index, plan, lengths)
        return plan

    def _lengths(self, epoch: int) -> Lengths:
        """The lengths ``epoch`` is planned on: the index's, or as speed perturbation and features make them."""
        kept = self.filter.scale if self.filter is not None else None  # where=: shards dealt by kept length
        return planned_lengths(index_lengths(self.index, kept), self.length_plan, self.config.seed, epoch)

    def _whole_plan(self, epoch: int, lengths: Lengths) -> EpochPlan:
        return make_epoch_plan(
            lengths,
            self.config,
            epoch,
            self.world_size,
            max(1, self.num_workers),
            self.even_batches,
            self._excluded_in(epoch, lengths),
            self.hardest_first,
        )

    def schedule(self, epoch: int | None = None) -> RankSchedule:
        """This rank's batches in the epoch (requires an index). With an initialised process group of this
        layout, each rank plans only its own slots and the ranks agree on the step count with one all_gather
        (every rank must call it, as every DDP step does); else the whole epoch is planned on this rank, O(N)."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = self.epoch if epoch is None else int(epoch)
        if e not in self._schedules:
            t0 = time.perf_counter()
            lengths = self._lengths(e)
            local = self._rank_local(e)
            if local:
                sched = plan_rank_local(
                    lengths,
                    self.config,
                    e,
                    self.rank,
                    self.world_size,
                    max(1, self.num_workers),
                    all_gather_ints,
                    self.even_batches,
                    self.hardest_first,
                    self._excluded_in(e, lengths),
                )
            else:
                sched = RankSchedule.of(self._whole_plan(e, lengths), self.rank)
            self._log_plan(sched, local, lengths.loaded, time.perf_counter() - t0)
            if sched.steps == 0 and self._earlier(e) == 0:
                raise EmptyEpochError(empty_epoch_message(self, sched, local))
            self._schedules = {e: sched}
        return self._schedules[e]

    def _rank_local(self, epoch: int) -> bool:
        """Whether this epoch is planned rank-locally (``planning`` option and a process group of this layout)."""
        possible = self.world_size > 1 and process_group_matches(self.rank, self.world_size)
        if self.planning == "local" and not possible:
            raise ValueError(
                f"planning='local' needs an initialised torch.distributed group of rank {self.rank} in "
                f"{self.world_size}; without one use planning='auto' (plans the whole epoch on each rank)"
            )
        return self.planning != "global" and possible

    def _excluded_in(self, epoch: int, lengths: Lengths) -> Any:
        return excluded_in(
            self._resumed,
            epoch,
            lengths,
            self.config,
            left_out(self.index, self.filter, epoch, self.config.seed, lengths.offsets),
        )

    def _earlier(self, epoch: int) -> int:
        """Batches of ``epoch`` consumed on earlier layouts before a resume on this one, as they counted them."""
        r = self._resumed
        return sum(layout.consumed for layout in r.layouts) if r is not None and r.epoch == epoch else 0

    def __len__(self) -> int:
        """The current epoch's steps as this run counts them, the same on every rank: after a resume, the
        batches consumed before it (on this or another layout) plus those still to come, so a progress bar
        or schedule built from ``len()`` and :attr:`consumed` is right. With a process group this is a
        collective: ask on every rank."""
        if self.index is None:
            if self.batches_per_epoch:
                return self.batches_per_epoch
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
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            if self._ring is None:  # the workers' reused batch buffers (read/ring.py), made once
                self._ring = batch_ring(
                    self.num_workers, self.config.budget, self.collate_options.decode, self.prefetch_factor
                )
            kwargs["prefetch_factor"] = self.prefetch_factor or 2
            kwargs["persistent_workers"] = self.persistent_workers
            kwargs["worker_init_fn"] = _WorkerInit(self.worker_init_fn)
            if self.filter is not None:  # DuckDB is not fork-safe: workers start from a clean forkserver
                kwargs["multiprocessing_context"] = "forkserver"
        return DataLoader(
            EpochStream(self._context()),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=self.pin_memory,
            **kwargs,
        )

    def _context(self) -> SlotContext:
        """What every DataLoader worker of this loader gets once."""
        return SlotContext(
            urls=self.urls,
            index=self.index,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=max(1, self.num_workers),
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
        )

    def _publish(self, epoch: int) -> int | None:
        """Put the epoch, the resume point and each worker's equalisation where the workers read them."""
        nw = max(1, self.num_workers)
        state = EpochState(epoch=epoch, consumed=self._consumed, adjust=[Adjust() for _ in range(nw)])
        steps = None
        if self.index is not None:
            sched = self.schedule(epoch)
            steps = sched.steps
            order = sched.order()
            state.rotation = order[self._consumed][0] if self._consumed < len(order) else 0
            state.start = sched.start
            state.adjust = list(sched.adjust)
        elif self.batches_per_epoch:
            steps = self.batches_per_epoch
            for w, t in enumerate(per_worker([steps] * nw, steps)):
                state.adjust[w].take = t
        self._state.publish(state)
        return steps

    def _log_plan(self, s: RankSchedule, local: bool, loaded: int, seconds: float) -> None:
        scope = "this rank" if local else f"all {self.world_size} ranks"
        log.info(
            "epoch %d: %d batches per rank on %d ranks; rank %d planned %d samples in %.2f s (%s plan, %d lengths "
            "read); even_batches=%s on %s: %d samples left out, %d repeated, %d batches split; %d skipped "
            "(outside min_length/max_length/budget), %d dropped (drop_last)",
            s.epoch,
            s.steps,
            self.world_size,
            self.rank,
            s.planned_samples,
            seconds,
            "rank-local" if local else "whole-epoch O(N)",
            loaded,
            self.even_batches,
            scope,
            s.surplus,
            s.repeated,
            s.splits,
            s.skipped,
            s.dropped,
        )

    def fault_stats(self) -> dict[str, Any]:
        """What storage faults cost this rank in the current (or last) pass: ``bad_shards`` skipped (and their
        URLs in ``bad_shard_urls``), planned samples lost with them, samples re-drawn in their place, batches
        that came out smaller, request retries, bytes read from remote storage, cache downloads and hits."""
        out: dict[str, Any] = dict(zip(FAULT_FIELDS, (int(x) for x in self._fault_counts.sum(0).tolist())))
        del out[STORAGE_WAIT]  # a time, not a fault: metrics() reports it
        out["bad_shard_urls"] = [self.urls[i] for i in self._bad_shards.nonzero().flatten().tolist()]
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
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
            for item in self._progress(metered(self._dataloader, self._meter), epoch, steps):
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
        log.info(metrics_line(self.metrics()))
        self._consumed = 0
        self._resumed, self._saved_steps = None, None
        self.epoch = epoch + 1  # a finished pass moves on: state_dict() now points at the next epoch

    def _progress(self, items: Iterator[Any], epoch: int, steps: int | None) -> Iterator[Any]:
        """With ``progress=True``, a tqdm bar over the pass (from the batches already consumed)."""
        if not self.progress:
            return items
        from tqdm.auto import tqdm

        return tqdm(
            items,
            total=None if steps is None else self._earlier(epoch) + steps,
            initial=self.consumed,
            desc=f"epoch {epoch}",
            unit="batch",
        )

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
        :meth:`fault_stats`. ``planned=True`` adds the planned epoch's padding and budget use for this rank
        (plans the whole epoch: O(N))."""
        out = self._meter.summary() if self._meter is not None else {}
        faults = self.fault_stats()
        out["storage"] = {k: faults[k] for k in ("retries", "bytes_read", "cache_downloads", "cache_hits")}
        out.update(storage_waits(self._fault_counts[:, FAULT_FIELDS.index(STORAGE_WAIT)].tolist()))
        if planned and self.index is not None:
            epoch = self._meter.epoch if self._meter is not None else self.epoch
            out["planned"] = planned_figures(
                self.plan(epoch), self.rank, self._lengths(epoch), self.config.budget, self.config.cost
            )
        return out

    # ---- resumption ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch, the batches of it already yielded, and the layouts it ran on (save it
        with the model). Small: no per-sample data, whatever the dataset's size."""
        resumed = self._resumed if self._resumed is not None and self._resumed.epoch == self.epoch else None
        sched = self._schedules.get(self.epoch)
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches_consumed": self._consumed,
            "steps": sched.steps if sched is not None else self._saved_steps,
            "seed": self.config.seed,
            "world_size": self.world_size,
            "num_workers": max(1, self.num_workers),
            "even_batches": self.even_batches,
            "hardest_first": self.hardest_first,
            "num_samples": self.index.num_samples if self.index is not None else None,
            "mixture": self.index.state() if isinstance(self.index, MixedIndex) else None,
            "where": self.filter.expr if self.filter is not None else None,
            "batching": batching_record(self.config),
            "earlier_layouts": [layout.state_dict() for layout in resumed.layouts] if resumed else [],
            "excluded": pack_mask(resumed.base) if resumed is not None and resumed.base is not None else None,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration yields the epoch's remaining batches
        (:attr:`remaining`), while ``len()`` still counts the whole epoch, consumed batches included.

        With the same world size and workers, the remaining batches are exactly those the uninterrupted run
        would have yielded. With another layout (a job restarted on more or fewer nodes), the samples not
        yet consumed are planned again over the new layout: none is seen twice, none is lost. Each rank works
        out what was consumed by re-planning only the old ranks that held its own shards.
        """
        consumed = check_state(self, state)
        self.epoch = int(state["epoch"])
        self._schedules = {}
        self._dataloader = None  # workers must see the new plan
        layouts = [Layout.from_state(d) for d in state.get("earlier_layouts") or []]
        base = unpack_mask(state["excluded"], self.index.num_samples) if state.get("excluded") else None
        same_layout = (
            state.get("world_size") == self.world_size
            and state.get("num_workers") == max(1, self.num_workers)
            and state.get("even_batches", self.even_batches) == self.even_batches
            and state.get("hardest_first", self.hardest_first) == self.hardest_first
        )
        if consumed and not same_layout:
            layouts.append(old_layout(self, state, consumed, Resumed(self.epoch, tuple(layouts), base)))
            consumed = 0
        self._resumed = Resumed(self.epoch, tuple(layouts), base) if layouts or base is not None else None
        self._consumed = consumed
        self._saved_steps = state.get("steps") if same_layout else None
        if consumed == 0 and layouts:
            old = layouts[-1]
            log.info(
                "resuming epoch %d on %d ranks × %d workers (saved on %d × %d after %d of %d batches per rank): "
                "the samples not yet consumed are planned again",
                self.epoch,
                self.world_size,
                max(1, self.num_workers),
                old.world_size,
                old.num_workers,
                old.consumed,
                old.steps,
            )
