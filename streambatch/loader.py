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

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import braceexpand
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from . import storage
from .buckets import BatchPlan, BucketBatcher, estimate_boundaries, iter_batches, plan_batches
from .collate import Decode, collate
from .dist import process_info, worker_info
from .index import INDEX_NAME, ShardIndex
from .shards import Piece, plan_slots, shard_order, slot_lengths
from .reader import read_pieces

log = logging.getLogger("streambatch")

EVEN_BATCHES = ("drop", "pad")


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
        )

    def plan(self, lengths: np.ndarray, epoch: int, slot: int) -> BatchPlan:
        """The batches :meth:`batcher` forms over a slot's stream with these lengths."""
        return plan_batches(
            lengths,
            self.budget,
            bucket_boundaries=self.boundaries,
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
        )


@dataclass
class SlotPlan:
    """One (rank, worker) slot's epoch: the pieces it streams and the batches it forms from them."""

    pieces: list[Piece]
    batches: list[np.ndarray]  # positions in the slot's stream
    skipped: int = 0
    dropped: int = 0


@dataclass
class EpochPlan:
    """The whole epoch for every rank: slots, steps per rank, and what was left out to keep ranks even."""

    epoch: int
    world_size: int
    num_workers: int
    slots: list[SlotPlan]
    steps: int  # batches every rank yields
    take: list[int]  # per slot: how many of its batches are yielded
    surplus_samples: int = 0
    skipped_samples: int = 0
    dropped_samples: int = 0

    def rank_slots(self, rank: int) -> range:
        return range(rank * self.num_workers, (rank + 1) * self.num_workers)

    def rank_batches(self, rank: int) -> list[tuple[int, int]]:
        """(slot, batch number) of each of a rank's batches, in the order the DataLoader yields them."""
        return interleave([self.take[s] for s in self.rank_slots(rank)], offset=rank * self.num_workers)


def interleave(counts: Sequence[int], offset: int = 0) -> list[tuple[int, int]]:
    """A torch DataLoader's order over iterable workers: round robin, skipping exhausted workers."""
    out = []
    for r in range(max(counts, default=0)):
        for w, c in enumerate(counts):
            if r < c:
                out.append((offset + w, r))
    return out


def consumed_per_worker(counts: Sequence[int], consumed: int) -> list[int]:
    """How many of each worker's batches are among the first ``consumed`` batches of the rank."""
    done = [0] * len(counts)
    for w, _ in interleave(counts)[:consumed]:
        done[w] += 1
    return done


def make_epoch_plan(index: ShardIndex, cfg: BatchingConfig, epoch: int, world_size: int, num_workers: int) -> EpochPlan:
    """Plan an epoch from the index: every slot's pieces and batches, the common step count, the surplus."""
    shard_lengths = [s.lengths for s in index.shards]
    num_slots = world_size * num_workers
    assignment = plan_slots(shard_lengths, num_slots, cfg.seed, epoch, cfg.shuffle)
    slots = []
    for slot, pieces in enumerate(assignment):
        lengths = slot_lengths(shard_lengths, pieces)
        bp = cfg.plan(lengths, epoch, slot)
        slots.append(SlotPlan(pieces, list(bp), len(bp.skipped), len(bp.dropped)))
    per_rank = [sum(len(slots[s].batches) for s in range(r * num_workers, (r + 1) * num_workers)) for r in range(world_size)]
    steps = min(per_rank) if per_rank else 0
    take = [0] * num_slots
    surplus = 0
    for r in range(world_size):
        counts = [len(slots[s].batches) for s in range(r * num_workers, (r + 1) * num_workers)]
        kept = consumed_per_worker(counts, steps)
        for w, k in enumerate(kept):
            s = r * num_workers + w
            take[s] = k
            surplus += int(sum(len(b) for b in slots[s].batches[k:]))
    return EpochPlan(
        epoch=epoch,
        world_size=world_size,
        num_workers=num_workers,
        slots=slots,
        steps=steps,
        take=take,
        surplus_samples=surplus,
        skipped_samples=sum(s.skipped for s in slots),
        dropped_samples=sum(s.dropped for s in slots),
    )


class _EpochStream(IterableDataset):
    """The per-process dataset the DataLoader iterates; reads the epoch and resume point from shared memory."""

    def __init__(self, loader: "StreamBatchLoader"):
        super().__init__()
        self.urls = loader.urls
        self.index = loader.index
        self.cfg = loader.cfg
        self.rank = loader.rank
        self.world_size = loader.world_size
        self.num_workers = max(1, loader.num_workers)
        self.decode = loader.decode
        self.pad_to_multiple_of = loader.pad_to_multiple_of
        self.sample_rate = loader.index.sample_rate if loader.index is not None and loader.index.unit == "samples" else None
        self.storage_options = loader.storage_options
        self.shared = loader._shared  # [epoch, steps, consumed, rotation, batches planned per worker...]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        physical, _ = worker_info()
        epoch, consumed, rotation = int(self.shared[0]), int(self.shared[2]), int(self.shared[3])
        # after a resume the DataLoader starts its round robin at worker 0, while the next batch is due
        # from another worker: rotate which slot each DataLoader worker serves
        worker = (physical + rotation) % self.num_workers
        slot = self.rank * self.num_workers + worker
        yield from stream_slot(self, epoch, slot, worker, consumed)


def stream_slot(ds: _EpochStream, epoch: int, slot: int, worker: int, consumed: int) -> Iterator[dict[str, Any]]:
    """The one place the read stages are composed, for one (rank, worker) slot."""
    cfg = ds.cfg
    if ds.index is not None:
        plan = make_epoch_plan_for_slot(ds, epoch, slot)
        counts = [int(c) for c in ds.shared[4:4 + ds.num_workers].tolist()]
        first = consumed_per_worker(counts, consumed)[worker]
        take = consumed_per_worker(counts, int(ds.shared[1]))[worker]
        lengths = slot_lengths([s.lengths for s in ds.index.shards], plan.pieces)
        # skip whole pieces that hold no sample of a remaining batch (finished shards are not read again)
        remaining = plan.batches[first:take]
        pieces = _pieces_needed(plan.pieces, remaining)
        samples = _positioned(read_pieces(ds.urls, [p for p, _ in pieces], ds.storage_options), pieces)
        batches = _execute_positioned(samples, plan.batches, first, take, lengths)
    else:
        pieces = _unindexed_pieces(len(ds.urls), ds.world_size * ds.num_workers, cfg.seed, epoch, cfg.shuffle)[slot]
        samples = read_pieces(ds.urls, pieces, ds.storage_options)
        batches = iter_batches(samples, cfg.batcher(epoch, slot), _json_length)
    for batch in batches:
        yield collate(batch, ds.decode, pad_to_multiple_of=ds.pad_to_multiple_of, sample_rate=ds.sample_rate)


def make_epoch_plan_for_slot(ds: _EpochStream, epoch: int, slot: int) -> SlotPlan:
    shard_lengths = [s.lengths for s in ds.index.shards]
    pieces = plan_slots(shard_lengths, ds.world_size * ds.num_workers, ds.cfg.seed, epoch, ds.cfg.shuffle)[slot]
    bp = ds.cfg.plan(slot_lengths(shard_lengths, pieces), epoch, slot)
    return SlotPlan(pieces, list(bp), len(bp.skipped), len(bp.dropped))


def _pieces_needed(pieces: list[Piece], batches: Sequence[np.ndarray]) -> list[tuple[Piece, int]]:
    """(piece, stream offset of its first sample) for the pieces that hold a sample of ``batches``."""
    offsets = np.cumsum([0] + [p.count for p in pieces])
    needed = np.zeros(int(offsets[-1]), dtype=bool)
    for b in batches:
        needed[b] = True
    return [(p, int(offsets[i])) for i, p in enumerate(pieces) if needed[offsets[i]:offsets[i + 1]].any()]


def _positioned(samples: Iterator[dict[str, Any]], pieces: list[tuple[Piece, int]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Attach each sample's position in the slot's full stream (skipped pieces leave gaps)."""
    it = iter(samples)
    for piece, offset in pieces:
        for i in range(piece.count):
            try:
                s = next(it)
            except StopIteration:
                raise RuntimeError(
                    f"shard {piece.shard} ended after {i} of its planned samples {piece.start}..{piece.stop}; "
                    "the index does not match the shards (check with `shardify verify`)"
                ) from None
            yield offset + i, s


def _execute_positioned(
    samples: Iterator[tuple[int, dict[str, Any]]], batches: Sequence[np.ndarray], first: int, stop: int, lengths: np.ndarray
) -> Iterator[list[dict[str, Any]]]:
    todo = list(batches[first:stop])
    if not todo:
        return
    needed = np.zeros(len(lengths), dtype=bool)
    for b in todo:
        needed[b] = True
    ready_at = [int(b.max()) for b in todo]
    held: dict[int, dict[str, Any]] = {}
    k = 0
    for pos, sample in samples:
        if needed[pos]:
            got = (sample.get("json") or {}).get("length")
            if got is not None and got != lengths[pos]:
                raise RuntimeError(
                    f"{sample['__url__']}: sample {sample['__key__']!r} has length {got} but the index says "
                    f"{lengths[pos]}; the index does not match the shards (check with `shardify verify`)"
                )
            held[pos] = sample
        while k < len(todo) and ready_at[k] <= pos:
            yield [held.pop(int(i)) for i in todo[k]]
            k += 1
        if k == len(todo):
            return
    raise RuntimeError(
        f"the stream ended with {len(todo) - k} planned batches unformed; "
        "the index does not match the shards (check with `shardify verify`)"
    )


def _unindexed_pieces(num_urls: int, num_slots: int, seed: int, epoch: int, shuffle: bool) -> list[list[Piece]]:
    """Without an index: whole shards dealt round robin in the epoch's shard order (end of shard unknown)."""
    order = shard_order(num_urls, seed, epoch, shuffle)
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
        budget: float,
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
        pin_memory: bool = False,
        drop_last: bool = False,
        strict: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict | None = None,
    ):
        if budget is None or budget <= 0:
            raise ValueError(f"budget must be a positive number in the dataset's unit, got {budget!r}")
        self.storage_options = storage_options
        self.index, self.urls = resolve_source(source, index, storage_options)
        if not self.urls:
            raise ValueError(f"{source}: no shards found")
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
        )
        info = process_info(rank, world_size)
        self.rank, self.world_size = info.rank, info.world_size
        self.decode = decode
        self.pad_to_multiple_of = pad_to_multiple_of
        self.num_workers = int(num_workers)
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers and self.num_workers > 0
        self.pin_memory = pin_memory
        self.epoch = 0
        self._consumed = 0  # batches of the current epoch already yielded (or restored)
        self._plans: dict[int, EpochPlan] = {}
        self._shared = torch.zeros(4 + max(1, self.num_workers), dtype=torch.int64).share_memory_()
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
            self._plans = {e: make_epoch_plan(self.index, self.cfg, e, self.world_size, max(1, self.num_workers))}
        return self._plans[e]

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (the same on every rank)."""
        if self.index is None:
            raise TypeError("len() needs an index: without one the number of batches is unknown until the end")
        return self.plan().steps

    # ---- iteration ----------------------------------------------------------------------------------
    def _make_dataloader(self) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor or 2
            kwargs["persistent_workers"] = self.persistent_workers
        return DataLoader(
            _EpochStream(self),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=self.pin_memory,
            **kwargs,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch
        steps = None
        self._shared[0] = epoch
        self._shared[2] = self._consumed
        if self.index is not None:
            plan = self.plan(epoch)
            steps = plan.steps
            self._shared[1] = steps
            counts = [len(plan.slots[s].batches) for s in plan.rank_slots(self.rank)]
            for w, c in enumerate(counts):
                self._shared[4 + w] = c
            order = interleave([plan.take[s] for s in plan.rank_slots(self.rank)])
            self._shared[3] = order[self._consumed][0] if self._consumed < len(order) else 0
            if self._consumed == 0:
                log.info(
                    "epoch %d: %d batches per rank; %d samples left out to keep %d ranks even, %d skipped "
                    "(outside min_length/max_length/budget), %d dropped (drop_last)",
                    epoch, steps, plan.surplus_samples, self.world_size, plan.skipped_samples, plan.dropped_samples,
                )
        if self._dataloader is None or not self.persistent_workers:
            self._dataloader = self._make_dataloader()
        for batch in self._dataloader:
            self._consumed += 1
            yield batch
        if steps is not None and self._consumed != steps:
            raise RuntimeError(f"rank {self.rank} yielded {self._consumed} batches but {steps} were planned")
        self._consumed = 0
        self.epoch = epoch + 1  # a finished pass moves on: state_dict() now points at the next epoch

    # ---- resumption ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches of it already yielded (save with your checkpoint)."""
        return {
            "epoch": self.epoch,
            "batches_consumed": self._consumed,
            "seed": self.cfg.seed,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_workers": max(1, self.num_workers),
            "num_samples": self.index.num_samples if self.index is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration yields the epoch's remaining batches."""
        if state.get("seed", self.cfg.seed) != self.cfg.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this loader has seed {self.cfg.seed}")
        if self.index is not None and state.get("num_samples") not in (None, self.index.num_samples):
            raise ValueError("state was saved for a dataset with a different number of samples")
        same_layout = state.get("world_size") == self.world_size and state.get("num_workers") == max(1, self.num_workers)
        if not same_layout and state.get("batches_consumed"):
            raise NotImplementedError(
                "resuming mid-epoch with a different world size or num_workers is not supported yet; "
                "resume at an epoch boundary or with the same layout"
            )
        if self.index is None and state.get("batches_consumed"):
            raise ValueError("mid-epoch resumption needs an index (the epoch's batches must be planned)")
        self.epoch = int(state["epoch"])
        self._consumed = int(state.get("batches_consumed", 0))
