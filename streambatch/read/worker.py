"""The worker side: what a DataLoader worker knows (`SlotContext`), what the main process tells it each
pass (`EpochState` over shared memory), and `stream_slot()`, the one place the read stages are
composed: shard pieces → read_pieces → positioned → execute_plan (or the online batcher) → decode and pad.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..dist import worker_info
from ..errors import EmptyEpochError, OptionError, SampleError, StreamBatchError, shown
from ..io.ranges import warm_up
from ..plan.batcher import BucketBatcher, iter_batches
from ..plan.config import BatchingConfig
from ..plan.epoch import RankSchedule
from ..plan.lengths import Lengths, index_lengths
from ..plan.perturb import LengthTransform, PlannedLengths, planned_lengths
from ..plan.resume import Resumed, excluded_in
from ..plan.shards import Piece, plan_slots, shard_order
from ..plan.skips import SkippedBatch, SkippedSteps, batch_runs
from ..plan.slot import Adjust, SlotEpoch, apply_adjust, per_worker, plan_slot, stream_lengths
from ..select.mixture import AnyIndex, DatasetNames
from ..select.where import IndexFilter, left_out
from .collate import Decode, collate, split_micro_batches
from .direct import DirectShards, can_read_direct
from .execute import execute_direct, execute_plan, pieces_needed, positioned
from .exits import closed_at_exit
from .faults import FAULT_FIELDS, FaultLog
from .lanes import interleaved, lane_options
from .reader import OpenedPieces, ReadOptions, read_pieces
from .ring import BatchRing
from .skip import skip_left_out
from .table_text import TableText


@dataclass
class EpochState:
    """What the main process tells its workers before each pass: the epoch, the batches the rank already
    yielded, the worker the next batch is due from (``rotation``) and the one the epoch began with
    (``start``), and each worker's `Adjust` (``take < 0``: one unplanned pass)."""

    epoch: int = 0
    consumed: int = 0
    rotation: int = 0
    start: int = 0
    adjust: list[Adjust] = field(default_factory=list)


_HEAD = ("epoch", "consumed", "rotation", "start")
_PER_WORKER = tuple(f.name for f in dataclasses.fields(Adjust))


class SharedEpochState:
    """`EpochState` in a shared int64 tensor, so persistent workers see each new epoch and resume
    point; the layout is derived from the field names above, never written by hand."""

    def __init__(self, num_workers: int):
        self.num_workers = max(1, num_workers)
        self.tensor = torch.zeros(len(_HEAD) + len(_PER_WORKER) * self.num_workers, dtype=torch.int64).share_memory_()
        #: slot plans the loader's planner kept for this process's own stream (no workers), by (epoch, slot)
        self.kept: dict[tuple[int, int], SlotEpoch] = {}
        #: the lengths the loader planned an epoch on, with the index they are of: this process's stream and workers
        #: forked after the planning take them instead of reading the index again (`SlotContext.lengths()`)
        self.planned: tuple[int, Any, Lengths] | None = None

    def __getstate__(self) -> dict[str, Any]:  # a worker that does not fork reads the index itself
        return {**self.__dict__, "kept": {}, "planned": None}

    def take_plans(self, epoch: int, sched: RankSchedule, index: AnyIndex) -> None:
        """Move the slot plans ``sched`` (a `RankSchedule` of ``epoch``) kept to
        this state, and hold the lengths it was planned on (of ``index``), where it kept them."""
        self.kept, sched.kept = {(epoch, s): p for s, p in sched.kept.items()}, {}
        self.planned = (epoch, index, sched.lengths) if sched.lengths is not None else None

    def publish(self, state: EpochState) -> None:
        adjust = state.adjust or [Adjust() for _ in range(self.num_workers)]
        row = [getattr(state, f) for f in _HEAD]
        for a in adjust:
            row += [int(getattr(a, f)) for f in _PER_WORKER]
        self.tensor.copy_(torch.tensor(row, dtype=torch.int64))

    def read(self) -> EpochState:
        row = self.tensor.tolist()
        n, k = len(_HEAD), len(_PER_WORKER)
        adjust = [
            Adjust(
                **{f: (bool(v) if f == "hardest" else v) for f, v in zip(_PER_WORKER, row[n + k * w : n + k * (w + 1)])}
            )
            for w in range(self.num_workers)
        ]
        return EpochState(**dict(zip(_HEAD, row[:n])), adjust=adjust)


@dataclass(frozen=True)
class CollateOptions:
    """How a formed batch becomes tensors: decoding, padding, packing, micro-batches."""

    decode: Decode = "auto"
    pad_to_multiple_of: int | None = None
    sample_rate: int | None = None
    packed: bool = False
    micro_batches: int = 1
    loss_weight_by: str = "samples"
    datasets: DatasetNames | None = None  # a mixture's dataset names by shard: ``batch["dataset"]``
    per_sample: Any = None  # a read.transforms.SampleOps: speed perturbation, transform, features


@dataclass
class SlotContext:
    """Everything a DataLoader worker needs to stream its slot, handed over once (pickled to each worker).

    ``index`` is None without one; ``faults``/``bad``/``state`` are shared
    tensors; ``resumed`` names the layouts the epoch ran on before a resume on another one."""

    urls: Sequence[str]
    index: AnyIndex | None
    config: BatchingConfig
    rank: int
    world_size: int
    num_workers: int
    collate: CollateOptions
    read: ReadOptions
    storage_options: dict | None
    state: SharedEpochState
    faults: torch.Tensor
    bad: torch.Tensor
    resumed: Resumed | None = None
    length_transform: LengthTransform | None = None  # speed perturbation / feature frames (plan/perturb.py)
    filter: IndexFilter | None = None  # ``where=``
    ring: BatchRing | None = None  # reused shared-memory batch buffers per worker (read/ring.py)
    skips: SkippedSteps | None = None  # steps a resume skips (plan/skips.py)

    @property
    def num_slots(self) -> int:
        return self.world_size * self.num_workers

    def lengths(self, index: AnyIndex, epoch: int) -> Lengths:
        """The lengths the epoch is planned on, as the planner reads them from ``index`` (this context's):
        per shard, only the shards asked for (shards dealt by kept length under ``where=``; speed perturbation /
        feature frames planned)."""
        planned = self.state.planned
        if planned is not None and planned[0] == epoch and planned[1] is index:  # the loader's, at hand (or forked)
            return planned[2]
        kept = self.filter.scale if self.filter is not None else None
        return planned_lengths(index_lengths(index, kept), self.length_transform, self.config.epoch_seed, epoch)


class EpochStream(IterableDataset):
    """The per-process dataset the DataLoader iterates: one slot of the current pass per worker."""

    def __init__(self, ctx: SlotContext):
        super().__init__()
        self.ctx = ctx

    def __iter__(self) -> Iterator[Any]:
        return closed_at_exit(self._stream())

    def _stream(self) -> Generator[Any, None, None]:
        ctx = self.ctx
        physical, _ = worker_info()
        st = ctx.state.read()
        # the DataLoader starts its round robin at worker 0, while the next batch may be due from another
        # worker (after a resume, or with hardest_first): rotate which slot each DataLoader worker serves
        worker = (physical + st.rotation) % ctx.num_workers
        counts = [a.take for a in st.adjust]
        first = per_worker(counts, st.consumed, st.start)[worker]
        faults = FaultLog(
            ctx.faults.numpy(),
            ctx.bad.numpy(),
            row=physical,
            max_bad_shards=ctx.read.max_bad_shards,
            urls=ctx.urls,
            rank=ctx.rank,
        )
        place = ctx.ring.writer(physical) if ctx.ring is not None and torch.utils.data.get_worker_info() else None
        skip = ctx.skips.worker_batches(st.epoch, counts, st.start, worker) if ctx.skips is not None else []
        try:
            yield from stream_slot(
                ctx, st.epoch, ctx.rank * ctx.num_workers + worker, st.adjust[worker], first, faults, place, skip
            )
        except StreamBatchError as e:
            if torch.utils.data.get_worker_info() is None:  # this process reads: the error is the caller's as it is
                raise
            yield WorkerFailed(type(e), str(e))  # raised in the main process by raised_in_workers()


@dataclass(frozen=True)
class WorkerFailed:
    """What a DataLoader worker sends in place of a batch when one of the package's errors ends its slot: the
    error's class and message. Torch would send it wrapped (another error of the same class whose message is
    "Caught ... in DataLoader worker process N" and the worker's traceback); `raised_in_workers()` raises it in
    the main process as the worker met it. Class and message only: any error pickles that way."""

    kind: type[StreamBatchError]
    message: str

    def error(self) -> StreamBatchError:
        try:
            return self.kind(self.message)
        except TypeError:  # a class that takes other arguments (RetriesExhausted): the root, saying which
            return StreamBatchError(f"{self.kind.__name__}: {self.message}")


def raised_in_workers(items: Iterable[Any]) -> Iterator[Any]:
    """Stage (main process): pass a pass's items on, raising a worker's `WorkerFailed` as its error. The
    DataLoader's iterator is dropped first, so its workers are shut down before the error reaches the caller."""
    it: Iterator[Any] | None = iter(items)
    while it is not None:
        try:
            item = next(it)
        except StopIteration:
            return
        if isinstance(item, WorkerFailed):
            it = None  # the DataLoader iterator's last reference: its workers stop now
            raise item.error() from None
        yield item


def stream_slot(
    ctx: SlotContext,
    epoch: int,
    slot: int,
    adj: Adjust,
    first: int,
    faults: FaultLog | None = None,
    place: Any = None,
    skip: Sequence[tuple[int, int]] = (),
) -> Iterator[Any]:
    """The one place the read stages are composed, for one (rank, worker) slot; ``place`` (a worker's
    `RingWriter`) makes each batch in a reused shared-memory buffer; ``skip``: ranges
    of the slot's batch numbers a resume skips (each yielded as a `SkippedBatch`)."""
    warm_up(ctx.urls, ctx.storage_options, ctx.read.timeout)  # the store's client made while the slot is planned
    opts = ctx.collate
    if opts.per_sample is not None:  # per-sample randomness follows the epoch
        opts = dataclasses.replace(opts, per_sample=opts.per_sample.for_epoch(epoch))
    checked = CheckedBatches(opts, faults)
    if ctx.index is not None:
        batches = _planned_batches(ctx, ctx.index, epoch, slot, adj, first, faults, skip)
    else:
        batches = _online_batches(ctx, epoch, slot, adj, faults)
    texts = TableText.of(ctx.index)  # transcripts the tars do not hold (an adopted NeMo dataset's)
    for batch in batches:
        if isinstance(batch, SkippedBatch):
            yield batch
            continue
        batch = texts(batch) if texts is not None else batch
        yield checked(batch) if place is None else place(lambda b=batch: checked(b))


def _planned_batches(
    ctx: SlotContext,
    index: AnyIndex,
    epoch: int,
    slot: int,
    adj: Adjust,
    first: int,
    faults: FaultLog | None,
    skip: Sequence[tuple[int, int]] = (),
) -> Iterator[Any]:
    """With an index (``ctx.index``): re-plan this slot, equalise it as the epoch plan said, stream what it
    still needs."""
    lengths = ctx.lengths(index, epoch)
    offsets = lengths.offsets
    excluded = excluded_in(
        ctx.resumed, epoch, lengths, ctx.config, left_out(index, ctx.filter, epoch, ctx.config.epoch_seed, offsets)
    )
    cfg = ctx.config
    pieces = plan_slots(lengths, ctx.num_slots, cfg.epoch_seed, epoch, cfg.shuffle, excluded, range(slot, slot + 1))[
        slot
    ]
    raw = ctx.state.kept.pop((epoch, slot), None)  # the loader's planner kept it (no workers): not planned twice
    if raw is None or raw.pieces != pieces:
        raw = plan_slot(pieces, lengths, offsets, cfg, epoch, slot, excluded, keep_lengths=True)
    by_pos = raw.lengths
    assert by_pos is not None  # plan_slot(keep_lengths=True) keeps them
    index_pos = stream_lengths(pieces, lengths.base, excluded) if isinstance(lengths, PlannedLengths) else None
    plan = apply_adjust(raw, adj, cfg.epoch_seed, epoch, slot, by_pos, cfg.cost, cfg.balance)

    direct = None
    if ctx.read.read_by_position and can_read_direct(ctx.urls, plan.pieces, index):  # local: by position
        direct = DirectShards(ctx.urls, index, plan.pieces, lengths.counts, ctx.read, faults)

    def run(part: SlotEpoch, start: int, last: bool = True) -> Iterator[list[dict[str, Any]]]:
        if direct is not None:
            return execute_direct(direct, part, start, by_pos, offsets, faults, ctx.read.reservoir, last, index_pos)
        needed = skip_left_out(
            pieces_needed(part, start, offsets, excluded), index, offsets, excluded, ctx.read.chunk_size
        )
        streams = cfg.streams if part.order is not None else 1
        args = (ctx.storage_options, lane_options(ctx.read, streams), index.shards, faults, True, index)
        samples: Iterator[Any]
        if part.order is None:
            samples = positioned(read_pieces(ctx.urls, [p for p, _ in needed], *args), needed, offsets, excluded)
        else:  # several shards at once, in lanes (each started at once), merged in the planned order
            lane = lambda ps: OpenedPieces(ctx.urls, ps, *args, ramp=False)  # noqa: E731
            samples = interleaved(needed, part, offsets, excluded, streams, lane)
        return execute_plan(samples, part, start, by_pos, faults, ctx.read.reservoir, index_pos, last)

    runs = batch_runs(first, len(plan.batches), skip)
    for i, (lo, hi, kept) in enumerate(runs):
        if not kept:  # steps a resume skips: a marker each, nothing read
            yield from _skipped(plan.batches[lo:hi], faults)
            continue
        if adj.hardest and lo == 0:
            # hardest_first: the most expensive batch is read ahead of the stream, so it comes first without
            # holding everything the stream delivers before it
            yield from run(dataclasses.replace(plan, batches=plan.batches[:1], repeat=[False]), 0, last=False)
            lo = 1
        part = plan if hi == len(plan.batches) else dataclasses.replace(plan, batches=plan.batches[:hi])
        yield from run(part, lo, last=i == len(runs) - 1)
    if not runs or not runs[-1][2]:
        yield from run(plan, len(plan.batches))  # nothing left to read: the end of the slot's reading


def _skipped(batches: Sequence[Any], faults: FaultLog | None) -> Iterator[SkippedBatch]:
    """A `SkippedBatch` for each batch a resume skips, counted as ``skipped_steps``/``skipped_samples``."""
    for b in batches:
        if faults is not None:
            faults.add("skipped_steps")
            faults.add("skipped_samples", len(b))
        yield SkippedBatch(len(b))


def _online_batches(
    ctx: SlotContext, epoch: int, slot: int, adj: Adjust, faults: FaultLog | None
) -> Iterator[list[dict[str, Any]]]:
    """Without an index: lengths from each sample's ``.json``, the same batcher run online."""
    batcher = BucketBatcher.for_slot(ctx.config, epoch, slot)
    if adj.take < 0:  # one pass over this slot's shards
        pieces = unindexed_pieces(len(ctx.urls), ctx.num_slots, ctx.config.epoch_seed, epoch, ctx.config.shuffle)[slot]
        samples = read_pieces(ctx.urls, pieces, ctx.storage_options, ctx.read, None, faults)
        return iter_batches(samples, batcher, json_length, _output_of(ctx.config))
    # batches_per_epoch: cycle the shards (reshuffled each pass) until the slot's share is met
    samples = _cycle_unindexed(ctx, epoch, slot, faults, batcher)
    return itertools.islice(iter_batches(samples, batcher, json_length, _output_of(ctx.config)), adj.take)


def _cycle_unindexed(
    ctx: SlotContext, epoch: int, slot: int, faults: FaultLog | None, batcher: BucketBatcher
) -> Iterator[dict[str, Any]]:
    """A slot's shards over and over, dealt afresh each pass (``batches_per_epoch`` without an index); a pass
    in which the batcher accepted no sample is an error (the next would not either: it would cycle forever)."""
    for rep in itertools.count():
        pieces = unindexed_pieces(len(ctx.urls), ctx.num_slots, ctx.config.epoch_seed, epoch, ctx.config.shuffle, rep)[
            slot
        ]
        if not pieces:
            raise OptionError(
                f"{len(ctx.urls)} shards cannot feed {ctx.num_slots} (rank, worker) slots without an index; "
                "use fewer workers or ranks, more shards, or write an index with `shardify write`"
            )
        streamed, skipped = 0, len(batcher.skipped)
        for sample in read_pieces(ctx.urls, pieces, ctx.storage_options, ctx.read, None, faults):
            streamed += 1
            yield sample
        if len(batcher.skipped) - skipped >= streamed:
            raise EmptyEpochError(
                f"slot {slot}: a whole pass over its {len(pieces)} shards gave no sample the batcher accepts "
                f"({streamed} streamed, all outside min_length/max_length or over the budget {batcher.budget:g} "
                "alone): no batch can be formed; raise the budget or widen min_length/max_length"
            )


def unindexed_pieces(
    num_urls: int, num_slots: int, seed: int, epoch: int, shuffle: bool, rep: int = 0
) -> list[list[Piece]]:
    """Without an index: whole shards dealt round robin in the epoch's shard order (end of shard unknown)."""
    order = shard_order(num_urls, seed, epoch, shuffle, rep)
    slots: list[list[Piece]] = [[] for _ in range(num_slots)]
    for i, s in enumerate(order):
        slots[i % num_slots].append(Piece(int(s), 0, 1 << 62))
    return slots


def _output_of(config: BatchingConfig) -> Any:
    """How the online path reads a sample's output length: from its ``.json``, under an output budget."""
    return json_output_length if config.output_budget is not None else None


def json_output_length(sample: dict[str, Any]) -> float:
    """A sample's output length from its ``.json`` (two-length budgets without an index)."""
    return _json_number(
        sample, "output_length", "output_budget needs shards written with `shardify write --output-length`"
    )


def json_length(sample: dict[str, Any]) -> float:
    """A sample's length from its ``.json`` (the online path)."""
    return _json_number(sample, "length", "write the shards with `shardify write` (length-annotated) or give an index")


def _json_number(sample: dict[str, Any], field: str, hint: str) -> float:
    """The ``field`` of a sample's ``.json`` once it is a length (a finite number, at least 0), else a SampleError
    naming the sample: the shard is data, and a length batches are cut by must be one."""
    meta = sample.get("json")
    url = sample.get("__url__")
    where = f"{url}: sample {sample.get('__key__')!r}" if url else f"sample {sample.get('__key__')!r}"
    if not isinstance(meta, dict) or field not in meta:
        raise SampleError(f"{where} has no {field!r} in its .json; {hint}")
    value = meta[field]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < math.inf:
        raise SampleError(f"{where}: its .json {field} {shown(value)} is not a length (a finite number ≥ 0)")
    return float(value)


def finish_batch(samples: list[dict[str, Any]], opts: CollateOptions) -> dict[str, Any] | list[dict[str, Any]]:
    """Stage end: decode and pad a formed batch, or with ``micro_batches`` its micro-batches as one list (the
    DataLoader passes them on together; the loader yields them one by one)."""
    kw = dict(
        pad_to_multiple_of=opts.pad_to_multiple_of,
        sample_rate=opts.sample_rate,
        packed=opts.packed,
        per_sample=opts.per_sample,
    )
    if opts.micro_batches <= 1:
        return _named(collate(samples, opts.decode, **kw), samples, opts.datasets)
    groups, weights = split_micro_batches(samples, opts.micro_batches, opts.loss_weight_by)
    out = []
    for j, (group, w) in enumerate(zip(groups, weights)):
        mb = _named(collate(group, opts.decode, **kw), group, opts.datasets)
        mb.update(micro_batch=j, num_micro_batches=len(groups), loss_weight=w, last_micro_batch=j == len(groups) - 1)
        out.append(mb)
    return out


def _named(batch: dict[str, Any], samples: list[dict[str, Any]], names: DatasetNames | None) -> dict[str, Any]:
    """Under a mixture, ``batch["dataset"]``: the name of each sample's dataset."""
    if names is not None:
        batch["dataset"] = [names.of(int(s["__shard__"])) for s in samples]
    return batch


class CheckedBatches:
    """`finish_batch()`, except that a sample whose payload cannot be decoded (a corrupt member) is left
    out of its batch and its shard counted bad (within ``max_bad_shards``) instead of ending the run; a batch
    left with nothing is replaced by the last good one (counted as re-drawn), so the steps stay equal."""

    def __init__(self, opts: CollateOptions, faults: FaultLog | None):
        self.opts, self.faults = opts, faults
        self.last: list[dict[str, Any]] | None = None

    def __call__(self, batch: list[dict[str, Any]]) -> Any:
        try:
            out = finish_batch(batch, self.opts)
            self.last = batch
            return out
        except Exception as error:  # noqa: BLE001 - narrowed down per sample below
            if self.faults is None or self.faults.max_bad_shards == 0:
                raise  # nothing may be skipped: the error as it is (a decode callable's own, or the sample's named)
            good = self._decodable(batch, self.faults)
            if len(good) == len(batch):
                raise error
            if not good:
                if self.last is None:
                    raise error
                self.faults.add("redrawn_samples", len(self.last))
                return finish_batch(self.last, self.opts)
            self.faults.add("shrunk_batches")
            self.last = good
            return finish_batch(good, self.opts)

    def _decodable(self, batch: Sequence[dict[str, Any]], faults: FaultLog) -> list[dict[str, Any]]:
        """The samples that decode alone; each one that does not is counted and its shard marked bad."""
        good = []
        for s in batch:
            try:
                collate([s], self.opts.decode, sample_rate=self.opts.sample_rate)
                good.append(s)
            except Exception as e:  # noqa: BLE001
                faults.add("lost_samples")
                url, said = str(s.get("__url__")), str(e)
                named = said.startswith(f"{url}: sample ")  # the decoder's error names the sample already
                why = said[len(url) + 2 :] if named else f"sample {s.get('__key__')!r} cannot be decoded ({said})"
                faults.bad_shard(int(s.get("__shard__", -1)), url, why)
        return good


def fault_tensors(num_workers: int, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared fault counters per DataLoader worker, and a bad flag per shard, for one pass."""
    counts = torch.zeros((max(1, num_workers), len(FAULT_FIELDS)), dtype=torch.int64).share_memory_()
    return counts, torch.zeros(num_shards, dtype=torch.int8).share_memory_()
