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

import itertools
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
from .plan import EVEN_BATCHES, Adjust, EpochPlan, SlotPlan, apply_adjust, consumed_ids, global_offsets
from .plan import make_epoch_plan, per_worker, plan_slot
from .reader import read_pieces
from .shards import Piece, shard_order

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
        self.excluded = loader._excluded  # (epoch, mask) of samples consumed before a re-planned resume
        self.shared = loader._shared  # see StreamBatchLoader._publish

    def __iter__(self) -> Iterator[dict[str, Any]]:
        physical, _ = worker_info()
        sh = self.shared.tolist()
        epoch, consumed, rotation = sh[0], sh[1], sh[2]
        # after a resume the DataLoader starts its round robin at worker 0 while the next batch is due from
        # another worker: rotate which slot each DataLoader worker serves
        worker = (physical + rotation) % self.num_workers
        adj = Adjust(split=sh[3 + 3 * worker], pad=sh[4 + 3 * worker], take=sh[5 + 3 * worker])
        counts = [sh[5 + 3 * w] for w in range(self.num_workers)]
        first = per_worker(counts, consumed)[worker]
        yield from stream_slot(self, epoch, self.rank * self.num_workers + worker, adj, first)


def stream_slot(ds: _EpochStream, epoch: int, slot: int, adj: Adjust, first: int) -> Iterator[dict[str, Any]]:
    """The one place the read stages are composed, for one (rank, worker) slot."""
    cfg = ds.cfg
    if ds.shard_lengths is not None:
        excluded = ds.excluded[1] if ds.excluded is not None and ds.excluded[0] == epoch else None
        all_lengths = np.concatenate(ds.shard_lengths)
        raw = plan_slot(ds.shard_lengths, all_lengths, cfg, epoch, slot, ds.world_size * ds.num_workers, excluded)
        plan = apply_adjust(raw, adj, cfg.seed, epoch, slot)
        offsets = global_offsets([len(x) for x in ds.shard_lengths])
        pieces = _pieces_needed(plan, first, offsets, excluded)
        samples = read_pieces(ds.urls, [p for p, _ in pieces], ds.storage_options)
        positioned = _positioned(samples, pieces, offsets, excluded)
        batches = execute_plan(positioned, plan, first, all_lengths)
    else:
        num_slots = ds.world_size * ds.num_workers
        if adj.take < 0:  # one pass over this slot's shards
            pieces = _unindexed_pieces(len(ds.urls), num_slots, cfg.seed, epoch, cfg.shuffle)[slot]
            samples = read_pieces(ds.urls, pieces, ds.storage_options)
            batches = iter_batches(samples, cfg.batcher(epoch, slot), _json_length)
        else:  # batches_per_epoch: cycle the shards (reshuffled each pass) until the slot's share is met
            samples = _cycle_unindexed(ds, num_slots, epoch, slot)
            batches = itertools.islice(iter_batches(samples, cfg.batcher(epoch, slot), _json_length), adj.take)
    for batch in batches:
        yield collate(batch, ds.decode, pad_to_multiple_of=ds.pad_to_multiple_of, sample_rate=ds.sample_rate)


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


def _positioned(
    samples: Iterator[dict[str, Any]], pieces: list[tuple[Piece, int]], offsets: np.ndarray, excluded: np.ndarray | None
) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Attach each streamed sample's position in the slot's stream and its global id; drop excluded ones."""
    it = iter(samples)
    for piece, pos in pieces:
        base = int(offsets[piece.shard])
        for i in range(piece.start, piece.stop):
            try:
                s = next(it)
            except StopIteration:
                raise RuntimeError(
                    f"shard {piece.shard} ended at sample {i}, before its planned end {piece.stop}; "
                    "the index does not match the shards (check with `shardify verify`)"
                ) from None
            gid = base + i
            if excluded is not None and excluded[gid]:
                continue
            yield pos, gid, s
            pos += 1


def execute_plan(
    samples: Iterator[tuple[int, int, dict[str, Any]]], plan: SlotPlan, first: int, all_lengths: np.ndarray
) -> Iterator[list[dict[str, Any]]]:
    """Stage: hold each streamed sample until its planned batch is complete, then yield that batch.

    Batches ``plan.batches[first:]`` are yielded in plan order; a batch marked as a repeat is yielded again
    from the samples of the one before it. Samples no remaining batch needs are dropped on arrival.
    """
    todo = plan.batches[first:]
    repeat = plan.repeat[first:]
    if not todo:
        return
    needed = np.zeros(len(plan.gids), dtype=bool)
    for b in todo:
        needed[b] = True
    ready_at = [int(b.max()) for b in todo]
    held: dict[int, dict[str, Any]] = {}
    last: list[dict[str, Any]] = []
    k = 0
    for pos, gid, sample in samples:
        if needed[pos]:
            got = (sample.get("json") or {}).get("length")
            if got is not None and got != all_lengths[gid]:
                raise RuntimeError(
                    f"{sample['__url__']}: sample {sample['__key__']!r} has length {got} but the index says "
                    f"{all_lengths[gid]}; the index does not match the shards (check with `shardify verify`)"
                )
            held[pos] = sample
        while k < len(todo) and ready_at[k] <= pos:
            if repeat[k] and k > 0:
                yield list(last)
            else:
                # keep the samples a following repeat needs
                keep = k + 1 < len(todo) and repeat[k + 1]
                last = [held[int(i)] if keep else held.pop(int(i)) for i in todo[k]]
                if keep:
                    for i in todo[k]:
                        held.pop(int(i))
                yield last
            k += 1
        if k == len(todo):
            return
    raise RuntimeError(
        f"the stream ended with {len(todo) - k} planned batches unformed; "
        "the index does not match the shards (check with `shardify verify`)"
    )


def _cycle_unindexed(ds: _EpochStream, num_slots: int, epoch: int, slot: int) -> Iterator[dict[str, Any]]:
    """A slot's shards over and over, dealt afresh each pass (``batches_per_epoch`` without an index)."""
    for rep in itertools.count():
        pieces = _unindexed_pieces(len(ds.urls), num_slots, ds.cfg.seed, epoch, ds.cfg.shuffle, rep)[slot]
        if not pieces:
            raise ValueError(
                f"{len(ds.urls)} shards cannot feed {num_slots} (rank, worker) slots without an index; "
                "use fewer workers or ranks, more shards, or write an index with `shardify write`"
            )
        yield from read_pieces(ds.urls, pieces, ds.storage_options)


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
        even_batches: str = "split",
        batches_per_epoch: int | None = None,
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
        self._shared = torch.zeros(3 + 3 * max(1, self.num_workers), dtype=torch.int64).share_memory_()
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
                    self.even_batches, excluded,
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
        sh = [epoch, self._consumed, 0] + [0, 0, -1] * nw
        steps = None
        if self.index is not None:
            plan = self.plan(epoch)
            steps = plan.steps
            counts = plan.worker_counts(self.rank)
            order = plan.rank_order(self.rank)
            sh[2] = order[self._consumed][0] if self._consumed < len(order) else 0
            for w, s in enumerate(plan.rank_slots(self.rank)):
                adj = plan.adjust[s]
                sh[3 + 3 * w: 6 + 3 * w] = [adj.split, adj.pad, counts[w]]
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
                sh[5 + 3 * w] = t
        self._shared.copy_(torch.tensor(sh, dtype=torch.int64))
        return steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch
        steps = self._publish(epoch)
        if self._dataloader is None or not self.persistent_workers:
            self._dataloader = self._make_dataloader()
        for batch in self._dataloader:
            self._consumed += 1
            yield batch
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
            int(state["num_workers"]), state.get("even_batches", self.even_batches), excluded,
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
