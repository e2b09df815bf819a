"""StreamBatchLoader: length-annotated shards in, budget-bounded padded batches out.

The read stages are composed in one place, :func:`stream_slot`:

    shard pieces ─► read_pieces ─► (planned batches | online batcher) ─► collate ─► batches

With an index (``index.json``) the whole epoch is planned before a byte is read: the shard order from
``(seed, epoch)``, the pieces each (rank, worker) slot streams, and with :func:`plan_batches` the batches
each slot forms. The workers then execute that plan; so ``len(loader)`` is exact, every rank steps the same
number of times, and a resumed run skips exactly the batches already consumed. Without an index, lengths come
from each sample's ``.json`` as it streams and the same batcher runs online (no ``len``).
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import braceexpand
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from .dataset import storage
from .plan.batcher import BatchPlan, BucketBatcher, estimate_boundaries, iter_batches
from .read.collate import Decode, collate, split_micro_batches
from .plan.cost import CostModel, PackedCost, PaddedCost, calibration_info, resolve_cost
from .dist import process_info, worker_info
from .dataset.index import INDEX_NAME, ShardIndex
from .plan.epoch import EVEN_BATCHES, Adjust, EpochPlan, SlotPlan, apply_adjust, consumed_ids, global_offsets
from .plan.epoch import make_epoch_plan, per_worker, plan_slot
from .read.reader import FAULT_FIELDS, FaultLog, ReadOptions, ShardFault, read_pieces
from .read.retry import RetryPolicy
from .plan.shards import Piece, shard_order

log = logging.getLogger("streambatch")


def expand_urls(source: str | Sequence[str]) -> list[str]:
    """Brace-expand a shard pattern (or each of a list of them) into URLs."""
    items = [source] if isinstance(source, str) else list(source)
    out: list[str] = []
    for item in items:
        out.extend(braceexpand.braceexpand(str(item)))
    return out


def resolve_source(
    source: str | Sequence[str], index: str | ShardIndex | None, storage_options: dict | None
) -> tuple[ShardIndex | None, list[str]]:
    """(index or None, shard URLs) for a dataset folder, an index file, a shard pattern or a URL list."""
    if isinstance(index, ShardIndex):
        return index, index.shard_urls()
    if index is not None:
        ix = ShardIndex.load(str(index), storage_options)
        return ix, ix.shard_urls()
    if isinstance(source, ShardIndex):
        return source, source.shard_urls()
    if isinstance(source, (list, tuple)):
        return None, expand_urls(source)
    source = str(source)
    if source.endswith(".json"):
        ix = ShardIndex.load(source, storage_options)
        return ix, ix.shard_urls()
    if source.endswith(".tar") or "{" in source:
        return None, expand_urls(source)
    index_url = storage.join_url(source, INDEX_NAME)
    if not storage.exists(index_url, storage_options):
        raise FileNotFoundError(
            f"{source}: no {INDEX_NAME} here. Pass a dataset folder written by `shardify write`, an index file, "
            f"a shard pattern like '{source}/shard-{{000000..000009}}.tar', or a list of shard URLs."
        )
    ix = ShardIndex.load(index_url, storage_options)
    return ix, ix.shard_urls()


def _slot_seed(seed: int, epoch: int, slot: int) -> list[int]:
    return [int(seed) & 0xFFFFFFFF, int(epoch), int(slot)]


@dataclass
class BatchingConfig:
    """Everything that decides which batches form; identical on every rank and worker."""

    budget: float
    boundaries: np.ndarray | None = None
    max_batch_size: int | None = None
    batch_size_multiple_of: int = 1
    buffer_size: int = 2_000
    min_length: float = 0
    max_length: float | None = None
    drop_last: bool = False
    strict: bool = False
    shuffle: bool = True
    seed: int = 0
    pad_to_multiple_of: int | None = None
    cost: CostModel = field(default_factory=PaddedCost)

    def batcher(self, epoch: int, slot: int) -> BucketBatcher:
        return BucketBatcher(
            self.budget,
            self.boundaries,
            max_batch_size=self.max_batch_size,
            batch_size_multiple_of=self.batch_size_multiple_of,
            buffer_size=self.buffer_size,
            min_length=self.min_length,
            max_length=self.max_length,
            drop_last=self.drop_last,
            strict=self.strict,
            shuffle=self.shuffle,
            seed=_slot_seed(self.seed, epoch, slot),
            pad_to_multiple_of=self.pad_to_multiple_of,
            cost=self.cost,
        )

    def plan(self, lengths: np.ndarray, epoch: int, slot: int) -> BatchPlan:
        """The batches :meth:`batcher` forms over a slot's stream with these lengths."""
        return self.batcher(epoch, slot).plan(lengths)


class _EpochStream(IterableDataset):
    """The per-process dataset the DataLoader iterates; reads the epoch and resume point from shared memory."""

    def __init__(self, loader: "StreamBatchLoader"):
        super().__init__()
        self.urls = loader.urls
        self.shard_lengths = [s.lengths for s in loader.index.shards] if loader.index is not None else None
        self.cfg = loader.cfg
        self.rank = loader.rank
        self.world_size = loader.world_size
        self.num_workers = max(1, loader.num_workers)
        self.decode = loader.decode
        self.pad_to_multiple_of = loader.pad_to_multiple_of
        ix = loader.index
        self.sample_rate = ix.sample_rate if ix is not None and ix.unit == "samples" else None
        self.storage_options = loader.storage_options
        self.read_options = loader.read_options
        # expected bytes and sha256 of each shard (the reader checks them); lengths travel separately
        self.shard_checks = [_ShardCheck(s.bytes, s.sha256) for s in ix.shards] if ix is not None else None
        self.fault_counts = loader._fault_counts  # shared: [worker, FAULT_FIELDS]
        self.bad_flags = loader._bad_shards  # shared: 1 for each shard that went bad this pass
        self.excluded = loader._excluded  # (epoch, mask) of samples consumed before a re-planned resume
        self.micro_batches = loader.micro_batches
        self.loss_weight_by = loader.loss_weight_by
        self.shared = loader._shared  # see StreamBatchLoader._publish

    def __iter__(self) -> Iterator[dict[str, Any]]:
        physical, _ = worker_info()
        sh = self.shared.tolist()
        epoch, consumed, rotation, start = sh[:4]
        # the DataLoader starts its round robin at worker 0, while the next batch may be due from another
        # worker (after a resume, or with hardest_first): rotate which slot each DataLoader worker serves
        worker = (physical + rotation) % self.num_workers
        split, pad, take, hardest = sh[4 + 4 * worker: 8 + 4 * worker]
        adj = Adjust(split=split, pad=pad, take=take, hardest=bool(hardest))
        counts = [sh[6 + 4 * w] for w in range(self.num_workers)]
        first = per_worker(counts, consumed, start)[worker]
        faults = FaultLog(
            self.fault_counts.numpy(), self.bad_flags.numpy(), row=physical,
            max_bad_shards=self.read_options.max_bad_shards, urls=self.urls, rank=self.rank,
        )
        yield from stream_slot(self, epoch, self.rank * self.num_workers + worker, adj, first, faults)


@dataclass(frozen=True)
class _ShardCheck:
    bytes: int
    sha256: str | None


def stream_slot(
    ds: _EpochStream, epoch: int, slot: int, adj: Adjust, first: int, faults: FaultLog | None = None
) -> Iterator[dict[str, Any]]:
    """The one place the read stages are composed, for one (rank, worker) slot."""
    cfg = ds.cfg
    ropts = getattr(ds, "read_options", None) or ReadOptions()
    checked = _Checked(ds, faults)
    if ds.shard_lengths is not None:
        excluded = ds.excluded[1] if ds.excluded is not None and ds.excluded[0] == epoch else None
        all_lengths = np.concatenate(ds.shard_lengths)
        raw = plan_slot(ds.shard_lengths, all_lengths, cfg, epoch, slot, ds.world_size * ds.num_workers, excluded)
        plan = apply_adjust(raw, adj, cfg.seed, epoch, slot, all_lengths[raw.gids], cfg.cost)
        offsets = global_offsets([len(x) for x in ds.shard_lengths])
        if adj.hardest and first == 0 and plan.batches:
            # hardest_first: the most expensive batch is read ahead of the stream, so it comes first without
            # holding everything the stream delivers before it
            one = SlotPlan(plan.pieces, plan.gids, plan.batches[:1], [False])
            head = _pieces_needed(one, 0, offsets, excluded)
            head_samples = read_pieces(
                ds.urls, [p for p, _ in head], ds.storage_options, ropts, ds.shard_checks, faults, markers=True
            )
            for batch in execute_plan(_positioned(head_samples, head, offsets, excluded), one, 0, all_lengths, faults):
                yield checked(batch)
            first = 1
        pieces = _pieces_needed(plan, first, offsets, excluded)
        samples = read_pieces(
            ds.urls, [p for p, _ in pieces], ds.storage_options, ropts, ds.shard_checks, faults, markers=True
        )
        positioned = _positioned(samples, pieces, offsets, excluded)
        batches = execute_plan(positioned, plan, first, all_lengths, faults, ropts.reservoir)
    else:
        num_slots = ds.world_size * ds.num_workers
        if adj.take < 0:  # one pass over this slot's shards
            pieces = _unindexed_pieces(len(ds.urls), num_slots, cfg.seed, epoch, cfg.shuffle)[slot]
            samples = read_pieces(ds.urls, pieces, ds.storage_options, ropts, None, faults)
            batches = iter_batches(samples, cfg.batcher(epoch, slot), _json_length)
        else:  # batches_per_epoch: cycle the shards (reshuffled each pass) until the slot's share is met
            samples = _cycle_unindexed(ds, num_slots, epoch, slot, faults)
            batches = itertools.islice(iter_batches(samples, cfg.batcher(epoch, slot), _json_length), adj.take)
    for batch in batches:
        yield checked(batch)


class _Checked:
    """:func:`finish_batch`, except that a sample whose payload cannot be decoded (a corrupt member) is left
    out of its batch and its shard counted bad (within ``max_bad_shards``) instead of ending the run; a batch
    left with nothing is replaced by the last good one (counted as re-drawn), so the steps stay equal."""

    def __init__(self, ds: "_EpochStream", faults: FaultLog | None):
        self.ds, self.faults, self.last = ds, faults, None

    def __call__(self, batch: list[dict[str, Any]]) -> Any:
        try:
            out = finish_batch(batch, self.ds)
            self.last = batch
            return out
        except Exception as error:  # noqa: BLE001 - narrowed down per sample below
            if self.faults is None:
                raise
            good = []
            for s in batch:
                try:
                    collate([s], self.ds.decode, sample_rate=self.ds.sample_rate)
                    good.append(s)
                except Exception as e:  # noqa: BLE001
                    self.faults.add("lost_samples")
                    self.faults.bad_shard(int(s.get("__shard__", -1)), str(s.get("__url__")),
                                          f"sample {s.get('__key__')!r} cannot be decoded ({type(e).__name__}: {e})")
            if len(good) == len(batch) or (not good and self.last is None):
                raise error
            if not good:
                self.faults.add("redrawn_samples", len(self.last))
                return finish_batch(self.last, self.ds)
            self.faults.add("shrunk_batches")
            self.last = good
            return finish_batch(good, self.ds)


def finish_batch(samples: list[dict[str, Any]], ds: "_EpochStream") -> dict[str, Any] | list[dict[str, Any]]:
    """Stage end: decode and pad a formed batch, or with ``micro_batches`` its micro-batches as one list (the
    DataLoader passes them on together; the loader yields them one by one)."""
    packed = ds.cfg.cost.packed
    opts = dict(pad_to_multiple_of=ds.pad_to_multiple_of, sample_rate=ds.sample_rate, packed=packed)
    if ds.micro_batches <= 1:
        return collate(samples, ds.decode, **opts)
    groups, weights = split_micro_batches(samples, ds.micro_batches, ds.loss_weight_by)
    out = []
    for j, (group, w) in enumerate(zip(groups, weights)):
        mb = collate(group, ds.decode, **opts)
        mb.update(micro_batch=j, num_micro_batches=len(groups), loss_weight=w, last_micro_batch=j == len(groups) - 1)
        out.append(mb)
    return out


def _pieces_needed(plan: SlotPlan, first: int, offsets: np.ndarray, excluded: np.ndarray | None) -> list[tuple[Piece, int]]:
    """(piece, stream position of its first sample) for the pieces holding a sample of a batch still to
    come; pieces whose samples were all consumed before a resume are not read again."""
    needed_pos = np.zeros(len(plan.gids), dtype=bool)
    for b in plan.batches[first:]:
        needed_pos[b] = True
    out, pos = [], 0
    for p in plan.pieces:
        lo, hi = int(offsets[p.shard]) + p.start, int(offsets[p.shard]) + p.stop
        n = hi - lo if excluded is None else int((~excluded[lo:hi]).sum())
        if needed_pos[pos:pos + n].any():
            out.append((p, pos))
        pos += n
    return out


@dataclass(frozen=True)
class _Invalid:
    """Stream positions ``[lo, hi)`` came from a shard whose checksum failed after it was read."""

    lo: int
    hi: int
    url: str


def _positioned(
    samples: Iterator[Any], pieces: list[tuple[Piece, int]], offsets: np.ndarray, excluded: np.ndarray | None
) -> Iterator[tuple[int, int, dict[str, Any] | None] | _Invalid]:
    """Attach each streamed sample's position in the slot's stream and its global id; drop excluded ones.

    Where a piece's shard went bad (a :class:`ShardFault` in the stream), each of its samples that did not
    arrive comes as ``(pos, gid, None)``; a checksum that failed after the whole shard was read comes as an
    :class:`_Invalid` span of the positions that shard delivered."""
    it = iter(samples)
    spans: list[tuple[int, int]] = []
    for j, (piece, pos) in enumerate(pieces):
        lo = pos
        base = int(offsets[piece.shard])
        i = piece.start
        while i < piece.stop:
            s = next(it, None)
            if s is None:
                raise RuntimeError(
                    f"shard {piece.shard} ended at sample {i}, before its planned end {piece.stop}; "
                    "the index does not match the shards (check with `shardify verify`)"
                )
            if isinstance(s, ShardFault):
                if s.ordinal < j:  # an earlier piece's checksum failed once it was read to the end
                    yield _Invalid(*spans[s.ordinal], s.url)
                    continue
                for rest in range(i, piece.stop):  # this piece broke: the rest of it is lost
                    gid = base + rest
                    if excluded is None or not excluded[gid]:
                        yield pos, gid, None
                        pos += 1
                break
            gid = base + i
            i += 1
            if excluded is not None and excluded[gid]:
                continue
            yield pos, gid, s
            pos += 1
        spans.append((lo, pos))
    for s in it:
        if isinstance(s, ShardFault) and s.invalidate and s.ordinal < len(spans):
            yield _Invalid(*spans[s.ordinal], s.url)


class _Reservoir:
    """The last few samples a worker emitted, to re-draw samples lost with a bad shard."""

    def __init__(self, size: int):
        self.items: collections.deque[tuple[float, dict[str, Any]]] = collections.deque(maxlen=max(1, size))

    def add(self, length: float, sample: dict[str, Any]) -> None:
        self.items.append((length, sample))

    def discard(self, url: str) -> None:
        self.items = collections.deque((x for x in self.items if x[1].get("__url__") != url), maxlen=self.items.maxlen)

    def pick(self, max_length: float, exclude: set[str]) -> dict[str, Any] | None:
        """The longest sample not longer than ``max_length`` and not in ``exclude`` (latest on ties)."""
        best, best_len = None, -1.0
        for length, s in self.items:
            if length <= max_length and length >= best_len and s["__key__"] not in exclude:
                best, best_len = s, length
        return best

    def shortest(self) -> dict[str, Any] | None:
        return min(self.items, key=lambda x: x[0])[1] if self.items else None


_END = object()


def execute_plan(
    samples: Iterator[Any],
    plan: SlotPlan,
    first: int,
    all_lengths: np.ndarray,
    faults: FaultLog | None = None,
    reservoir: int = 64,
) -> Iterator[list[dict[str, Any]]]:
    """Stage: hold each streamed sample until its planned batch is complete, then yield that batch.

    Batches ``plan.batches[first:]`` are yielded in plan order; a batch marked as a repeat is yielded again
    from the samples of the one before it. Samples no remaining batch needs are dropped on arrival.

    Samples lost with a bad shard (``(pos, gid, None)`` or an :class:`_Invalid` span) never stop a batch
    from being yielded, so every worker still yields its planned number of batches: each lost sample is
    replaced by a sample this worker already emitted this epoch (the longest one of the last ``reservoir``
    that is not longer than the lost one, so the batch stays within the budget), or left out when none fits
    (a smaller batch). A batch that lost everything and finds no replacement takes the shortest sample seen
    (alone, it fits the budget). Each case is counted in ``faults``.
    """
    todo = plan.batches[first:]
    repeat = plan.repeat[first:]
    if not todo:
        return
    needed = np.zeros(len(plan.gids), dtype=bool)
    for b in todo:
        needed[b] = True
    held: dict[int, dict[str, Any]] = {}
    lost: set[int] = set()
    pool = _Reservoir(reservoir)
    it = iter(samples)
    upto = -1

    def count(name: str, n: int = 1) -> None:
        if faults is not None and n:
            faults.add(name, n)

    def pull() -> Any:
        """Process one stream item; the position of a held sample, None, or _END."""
        nonlocal upto
        item = next(it, _END)
        if item is _END:
            return _END
        if isinstance(item, _Invalid):
            gone = [p for p in held if item.lo <= p < item.hi]
            for p in gone:
                held.pop(p)
                lost.add(p)
            count("lost_samples", len(gone))
            pool.discard(item.url)
            return None
        pos, gid, sample = item
        upto = max(upto, pos)
        if not needed[pos]:
            return None
        if sample is None:
            lost.add(pos)
            count("lost_samples")
            return None
        got = (sample.get("json") or {}).get("length")
        if got is not None and got != all_lengths[gid]:
            raise RuntimeError(
                f"{sample['__url__']}: sample {sample['__key__']!r} has length {got} but the index says "
                f"{all_lengths[gid]}; the index does not match the shards (check with `shardify verify`)"
            )
        held[pos] = sample
        return pos

    last: list[dict[str, Any]] = []
    for k, b in enumerate(todo):
        if repeat[k] and k > 0:
            yield list(last)
            continue
        ready = int(b.max())
        while upto < ready:
            if pull() is _END:
                raise RuntimeError(
                    f"the stream ended with {len(todo) - k} planned batches unformed; "
                    "the index does not match the shards (check with `shardify verify`)"
                )
        batch: list[dict[str, Any]] = []
        fresh: list[tuple[float, dict[str, Any]]] = []
        missing: list[int] = []
        for i in b:
            i = int(i)
            if i in lost:
                lost.discard(i)
                missing.append(i)
            else:
                s = held.pop(i)
                batch.append(s)
                fresh.append((float(all_lengths[plan.gids[i]]), s))
        if missing:
            keys = {s["__key__"] for s in batch}
            for i in missing:
                rep = pool.pick(float(all_lengths[plan.gids[i]]), keys)
                if rep is not None:
                    batch.append(rep)
                    keys.add(rep["__key__"])
                    count("redrawn_samples")
            if not batch:
                rep = pool.shortest()
                while rep is None:  # nothing emitted yet: take the next planned sample that arrives
                    r = pull()
                    if r is _END:
                        raise RuntimeError(
                            "every sample of this worker's planned batches was lost with bad shards; "
                            "nothing is left to fill its batches (see the bad shards logged above)"
                        )
                    if r is not None:
                        rep = held[r]
                batch.append(rep)
                count("redrawn_samples")
            if len(batch) < len(b):
                count("shrunk_batches")
        for length, s in fresh:
            pool.add(length, s)
        last = batch
        yield batch


def _cycle_unindexed(
    ds: _EpochStream, num_slots: int, epoch: int, slot: int, faults: FaultLog | None = None
) -> Iterator[dict[str, Any]]:
    """A slot's shards over and over, dealt afresh each pass (``batches_per_epoch`` without an index)."""
    for rep in itertools.count():
        pieces = _unindexed_pieces(len(ds.urls), num_slots, ds.cfg.seed, epoch, ds.cfg.shuffle, rep)[slot]
        if not pieces:
            raise ValueError(
                f"{len(ds.urls)} shards cannot feed {num_slots} (rank, worker) slots without an index; "
                "use fewer workers or ranks, more shards, or write an index with `shardify write`"
            )
        yield from read_pieces(ds.urls, pieces, ds.storage_options, getattr(ds, "read_options", None), None, faults)


def _unindexed_pieces(
    num_urls: int, num_slots: int, seed: int, epoch: int, shuffle: bool, rep: int = 0
) -> list[list[Piece]]:
    """Without an index: whole shards dealt round robin in the epoch's shard order (end of shard unknown)."""
    order = shard_order(num_urls, seed, epoch, shuffle, rep)
    slots: list[list[Piece]] = [[] for _ in range(num_slots)]
    for i, s in enumerate(order):
        slots[i % num_slots].append(Piece(int(s), 0, 1 << 62))
    return slots


def _json_length(sample: dict[str, Any]) -> float:
    meta = sample.get("json")
    if not isinstance(meta, dict) or "length" not in meta:
        raise ValueError(
            f"{sample.get('__url__')}: sample {sample.get('__key__')!r} has no .json with a 'length'; "
            "write the shards with `shardify write` (length-annotated) or give an index"
        )
    return meta["length"]


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
    file, a brace-expanded shard pattern (``/data/shard-{000000..000099}.tar``) or a list of shard URLs
    (without an index, lengths come from each sample's ``.json``; no ``len()``).

    ``budget`` is the largest padded size of a batch in the dataset's unit (audio samples, seconds or
    tokens). See the README for every option.
    """

    def __init__(
        self,
        source: str | Sequence[str] | ShardIndex,
        budget: float | None = None,
        *,
        index: str | ShardIndex | None = None,
        bucket_boundaries: Sequence[float] | None = None,
        num_buckets: int | None = None,
        buffer_size: int = 2_000,
        max_batch_size: int | None = None,
        batch_size_multiple_of: int = 1,
        min_length: float = 0,
        max_length: float | None = None,
        shuffle: bool = True,
        seed: int = 0,
        decode: Decode = "auto",
        pad_to_multiple_of: int | None = None,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        worker_init_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        strict: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        even_batches: str = "split",
        batches_per_epoch: int | None = None,
        cost: Any = "padded",
        quadratic_factor: float | None = None,
        packed: bool = False,
        micro_batches: int = 1,
        loss_weight_by: str = "samples",
        hardest_first: bool = False,
        storage_options: dict | None = None,
        chunk_size: int | str = "8M",
        read_ahead: int | str = "64M",
        read_concurrency: int = 4,
        retries: int = 8,
        timeout: float = 60.0,
        backoff: float = 0.25,
        verify: str = "sha256",
        max_bad_shards: int = 2,
        cache_dir: str | None = None,
        cache_size: int | str | None = None,
    ):
        cost_model, calibrated_budget = (PackedCost(), None) if packed else resolve_cost(cost, quadratic_factor)
        if budget is None:
            budget = calibrated_budget
        if budget is None or budget <= 0:
            raise ValueError(
                f"budget must be a positive number in the dataset's unit (or come from a calibration file "
                f"given as cost=...), got {budget!r}"
            )
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        if loss_weight_by not in ("samples", "frames"):
            raise ValueError(f"loss_weight_by must be 'samples' or 'frames', got {loss_weight_by!r}")
        self.storage_options = storage_options
        self.read_options = ReadOptions(
            chunk_size=storage.parse_bytes(chunk_size, "chunk_size"),
            read_ahead=storage.parse_bytes(read_ahead, "read_ahead"),
            read_concurrency=int(read_concurrency),
            retry=RetryPolicy(retries=int(retries), backoff=float(backoff), timeout=float(timeout)),
            verify=verify,
            max_bad_shards=int(max_bad_shards),
            cache_dir=cache_dir,
            cache_size=storage.parse_bytes(cache_size, "cache_size"),
        )
        self.index, self.urls = resolve_source(source, index, storage_options)
        if not self.urls:
            raise ValueError(f"{source}: no shards found")
        calib = None if packed else calibration_info(cost)
        if calib is not None:
            if self.index is not None and calib.get("unit") not in (None, self.index.unit):
                raise ValueError(
                    f"{cost}: calibrated for lengths in {calib['unit']!r}, but this dataset's unit is {self.index.unit!r}"
                )
            if max_batch_size is None and calib.get("max_batch_size"):
                # the search stopped there: larger batches would be extrapolated, not measured
                max_batch_size = int(calib["max_batch_size"])
        if bucket_boundaries is None and num_buckets:
            if self.index is None:
                raise ValueError("num_buckets estimates boundaries from the index; without one pass bucket_boundaries")
            bucket_boundaries = estimate_boundaries(self.index.lengths, budget, num_buckets)
        self.cfg = BatchingConfig(
            budget=float(budget),
            boundaries=None if bucket_boundaries is None else np.asarray(bucket_boundaries, dtype=np.float64),
            max_batch_size=max_batch_size,
            batch_size_multiple_of=batch_size_multiple_of,
            buffer_size=buffer_size,
            min_length=min_length,
            max_length=max_length,
            drop_last=drop_last,
            strict=strict,
            shuffle=shuffle,
            seed=seed,
            # the planner rounds lengths up as the tensor will be, when lengths count tensor elements
            pad_to_multiple_of=pad_to_multiple_of if self.index is None or self.index.unit != "seconds" else None,
            cost=cost_model,
        )
        if hasattr(cost_model, "check_monotone") and self.index is not None:
            cost_model.check_monotone(self.index.lengths)
        self.micro_batches = int(micro_batches)
        self.loss_weight_by = loss_weight_by
        self.hardest_first = bool(hardest_first)
        self.worker_init_fn = worker_init_fn
        info = process_info(rank, world_size)
        self.rank, self.world_size = info.rank, info.world_size
        self.decode = decode
        self.pad_to_multiple_of = pad_to_multiple_of
        self.num_workers = int(num_workers)
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers and self.num_workers > 0
        self.pin_memory = pin_memory
        if even_batches not in EVEN_BATCHES:
            raise ValueError(f"even_batches must be one of {EVEN_BATCHES}, got {even_batches!r}")
        self.even_batches = even_batches
        if self.index is None and self.world_size > 1 and not batches_per_epoch:
            raise ValueError(
                f"without an index the ranks cannot know how many batches the data gives, so {self.world_size} "
                "ranks would step unevenly (a DDP hang): write an index (`shardify write`), or pass "
                "batches_per_epoch=N to give every rank exactly N batches per epoch"
            )
        self.batches_per_epoch = int(batches_per_epoch) if batches_per_epoch else None
        self.epoch = 0
        self._consumed = 0  # batches of the current epoch already yielded (or restored)
        self._plans: dict[int, EpochPlan] = {}
        self._excluded: tuple[int, np.ndarray] | None = None  # samples consumed before a re-planned resume
        # shared with the workers (persistent ones too): epoch, consumed, rotation, then per worker
        # (split, pad, take)
        self._shared = torch.zeros(4 + 4 * max(1, self.num_workers), dtype=torch.int64).share_memory_()
        # fault counters per DataLoader worker and a bad flag per shard, for the current pass
        self._fault_counts = torch.zeros((max(1, self.num_workers), len(FAULT_FIELDS)), dtype=torch.int64).share_memory_()
        self._bad_shards = torch.zeros(len(self.urls), dtype=torch.int8).share_memory_()
        self._dataloader: DataLoader | None = None

    # ---- epochs and planning ----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shard and batch order follow ``(seed, epoch)``). After a full pass the loader
        moves to the next epoch by itself, so calling this is optional; calling it with the epoch a restored
        state is in keeps the resume point."""
        if int(epoch) != self.epoch:
            self._consumed = 0
        self.epoch = int(epoch)

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The epoch's plan for every rank and worker (requires an index)."""
        if self.index is None:
            raise TypeError("planning needs an index (index.json); this loader streams shards without one")
        e = self.epoch if epoch is None else int(epoch)
        if e not in self._plans:
            excluded = self._excluded[1] if self._excluded is not None and self._excluded[0] == e else None
            self._plans = {
                e: make_epoch_plan(
                    [s.lengths for s in self.index.shards], self.cfg, e, self.world_size, max(1, self.num_workers),
                    self.even_batches, excluded, self.hardest_first,
                )
            }
        return self._plans[e]

    def __len__(self) -> int:
        """Batches every rank yields in the current epoch (the same on every rank), counting from the
        start of the epoch."""
        if self.index is None:
            if self.batches_per_epoch:
                return self.batches_per_epoch
            raise TypeError("len() needs an index: without one the number of batches is unknown until the end")
        return self.plan().steps

    # ---- iteration ----------------------------------------------------------------------------------
    def _make_dataloader(self) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor or 2
            kwargs["persistent_workers"] = self.persistent_workers
            kwargs["worker_init_fn"] = _WorkerInit(self.worker_init_fn)
        return DataLoader(
            _EpochStream(self),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=self.pin_memory,
            **kwargs,
        )

    def _publish(self, epoch: int) -> int | None:
        """Put the epoch, the resume point and each worker's equalisation where the workers read them."""
        nw = max(1, self.num_workers)
        sh = [epoch, self._consumed, 0, 0] + [0, 0, -1, 0] * nw  # per worker: split, pad, take, hardest
        steps = None
        if self.index is not None:
            plan = self.plan(epoch)
            steps = plan.steps
            counts = plan.worker_counts(self.rank)
            order = plan.rank_order(self.rank)
            sh[2] = order[self._consumed][0] if self._consumed < len(order) else 0
            sh[3] = plan.start(self.rank)
            for w, s in enumerate(plan.rank_slots(self.rank)):
                adj = plan.adjust[s]
                sh[4 + 4 * w: 8 + 4 * w] = [adj.split, adj.pad, counts[w], int(adj.hardest)]
            if self._consumed == 0:
                log.info(
                    "epoch %d: %d batches per rank on %d ranks; even_batches=%s: %d samples left out, "
                    "%d repeated, %d batches split; %d skipped (outside min_length/max_length/budget), "
                    "%d dropped (drop_last)",
                    epoch, steps, self.world_size, self.even_batches, plan.surplus_samples, plan.repeated_samples,
                    plan.split_batches, plan.skipped_samples, plan.dropped_samples,
                )
        elif self.batches_per_epoch:
            steps = self.batches_per_epoch
            for w, t in enumerate(per_worker([steps] * nw, steps)):
                sh[6 + 4 * w] = t
        self._shared.copy_(torch.tensor(sh, dtype=torch.int64))
        return steps

    def fault_stats(self) -> dict[str, Any]:
        """What storage faults cost this rank in the current (or last) pass: ``bad_shards`` skipped (and their
        URLs in ``bad_shard_urls``), planned samples lost with them, samples re-drawn in their place, batches
        that came out smaller, request retries, bytes read from remote storage, cache downloads and hits."""
        out: dict[str, Any] = dict(zip(FAULT_FIELDS, (int(x) for x in self._fault_counts.sum(0).tolist())))
        out["bad_shard_urls"] = [self.urls[i] for i in torch.nonzero(self._bad_shards).flatten().tolist()]
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch
        self._fault_counts.zero_()
        self._bad_shards.zero_()
        steps = self._publish(epoch)
        if self._dataloader is None or not self.persistent_workers:
            self._dataloader = self._make_dataloader()
        for item in self._dataloader:
            if isinstance(item, list):  # the micro-batches of one batch: the batch counts as consumed once the
                yield from item[:-1]  # last one is out (a state saved mid-batch resumes at its first)
                self._consumed += 1
                yield item[-1]
            else:
                self._consumed += 1
                yield item
        if steps is not None and self._consumed != steps:
            raise RuntimeError(f"rank {self.rank} yielded {self._consumed} batches but {steps} were planned")
        self._consumed = 0
        self._excluded = None
        self.epoch = epoch + 1  # a finished pass moves on: state_dict() now points at the next epoch

    # ---- resumption ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches of it already yielded (save it with the model)."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches_consumed": self._consumed,
            "seed": self.cfg.seed,
            "world_size": self.world_size,
            "num_workers": max(1, self.num_workers),
            "even_batches": self.even_batches,
            "num_samples": self.index.num_samples if self.index is not None else None,
            "excluded": None,
        }
        if self._excluded is not None and self._excluded[0] == self.epoch:
            state["excluded"] = _pack_mask(self._excluded[1])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration yields the epoch's remaining batches.

        With the same world size and workers, the remaining batches are exactly those the uninterrupted run
        would have yielded. With another layout (a job restarted on more or fewer nodes), the samples not
        yet consumed are planned again over the new layout: none is seen twice, none is lost.
        """
        if state.get("seed", self.cfg.seed) != self.cfg.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this loader has seed {self.cfg.seed}")
        if self.index is not None and state.get("num_samples") not in (None, self.index.num_samples):
            raise ValueError(
                f"state was saved for a dataset of {state['num_samples']} samples, this one has {self.index.num_samples}"
            )
        consumed = int(state.get("batches_consumed", 0))
        if self.index is None and consumed:
            raise ValueError("mid-epoch resumption needs an index (the epoch's batches must be planned)")
        self.epoch = int(state["epoch"])
        self._plans = {}
        self._dataloader = None  # workers must see the new plan
        excluded = _unpack_mask(state["excluded"], self.index.num_samples) if state.get("excluded") else None
        self._excluded = (self.epoch, excluded) if excluded is not None else None
        same_layout = (
            state.get("world_size") == self.world_size
            and state.get("num_workers") == max(1, self.num_workers)
            and state.get("even_batches", self.even_batches) == self.even_batches
        )
        if same_layout or not consumed:
            self._consumed = consumed
            return
        # another layout: mark what the old layout consumed, and plan the rest afresh
        old = make_epoch_plan(
            [s.lengths for s in self.index.shards], self.cfg, self.epoch, int(state["world_size"]),
            int(state["num_workers"]), state.get("even_batches", self.even_batches), excluded, self.hardest_first,
        )
        mask = np.zeros(self.index.num_samples, dtype=bool) if excluded is None else excluded.copy()
        mask[consumed_ids(old, consumed)] = True
        self._excluded = (self.epoch, mask)
        self._consumed = 0
        log.info(
            "resuming epoch %d on %d ranks × %d workers (saved on %d × %d): %d samples already consumed, "
            "the remaining %d are planned again",
            self.epoch, self.world_size, max(1, self.num_workers), state["world_size"], state["num_workers"],
            int(mask.sum()), int((~mask).sum()),
        )


def _pack_mask(mask: np.ndarray) -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode("ascii")


def _unpack_mask(packed: str, n: int) -> np.ndarray:
    import base64
    import zlib

    bits = np.frombuffer(zlib.decompress(base64.b64decode(packed)), dtype=np.uint8)
    return np.unpackbits(bits)[:n].astype(bool)
