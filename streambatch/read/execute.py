"""Executing a slot's plan: streamed samples in, the planned batches out, in plan order.

Each sample is held only until its planned batch is complete. Samples lost with a bad shard never stop a
batch: they are re-drawn from what the worker already emitted (within the budget) or left out, and counted,
so every worker still yields its planned number of batches and the ranks stay in step.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import IndexMismatch, TooManyBadShards
from ..plan.lengths import Mask
from ..plan.shards import Piece
from ..plan.slot import SlotEpoch, piece_excluded
from ..units import same_length
from .direct import _MISMATCH, DirectShards
from .faults import FaultLog, ShardFault, bad_sample


def pieces_needed(plan: SlotEpoch, first: int, offsets: np.ndarray, excluded: Mask | None) -> list[tuple[Piece, int]]:
    """(piece, stream position of its first sample) for the pieces holding a sample of a batch still to
    come; pieces whose samples were all consumed before a resume are not read again."""
    needed_pos = np.zeros(len(plan.gids), dtype=bool)
    for b in plan.batches[first:]:
        needed_pos[b] = True
    out, pos = [], 0
    for p in plan.pieces:
        n = p.count - int(piece_excluded(p, offsets, excluded).sum())
        if needed_pos[pos : pos + n].any():
            out.append((p, pos))
        pos += n
    return out


@dataclass(frozen=True)
class Invalid:
    """Stream positions ``[lo, hi)`` came from a shard whose checksum failed after it was read."""

    lo: int
    hi: int
    url: str


def positioned(
    samples: Iterator[Any], pieces: list[tuple[Piece, int]], offsets: np.ndarray, excluded: Mask | None
) -> Generator[tuple[int, int, dict[str, Any] | None] | Invalid, None, None]:
    """Stage: attach each streamed sample's position in the slot's stream and its global id; drop excluded ones.

    Where a piece's shard went bad (a `ShardFault` in the stream), each of its samples that did not
    arrive comes as ``(pos, gid, None)``; a checksum that failed after the whole shard was read comes as an
    `Invalid` span of the positions that shard delivered."""
    it = iter(samples)
    spans: list[tuple[int, int]] = []
    for j, (piece, pos) in enumerate(pieces):
        lo = pos
        base = int(offsets[piece.shard])
        skip = piece_excluded(piece, offsets, excluded)
        i = piece.start
        while i < piece.stop:
            s = next(it, None)
            if s is None:
                raise IndexMismatch(
                    f"shard {piece.shard} ended at sample {i}, before its planned end {piece.stop}; {_MISMATCH}"
                )
            if isinstance(s, ShardFault):
                if s.ordinal < j:  # an earlier piece's checksum failed once it was read to the end
                    yield Invalid(*spans[s.ordinal], s.url)
                    continue
                for rest in range(i, piece.stop):  # this piece broke: the rest of it is lost
                    if not skip[rest - piece.start]:
                        yield pos, base + rest, None
                        pos += 1
                break
            i += 1
            if skip[i - 1 - piece.start]:
                continue
            yield pos, base + i - 1, s
            pos += 1
        spans.append((lo, pos))
    for s in it:
        if isinstance(s, ShardFault) and s.invalidate and s.ordinal < len(spans):
            yield Invalid(*spans[s.ordinal], s.url)


def arrival_ranks(order: np.ndarray | None) -> np.ndarray | None:
    """Each stream position's place in the arrival order (the inverse of a slot plan's ``order``); None for None."""
    if order is None:
        return None
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order), dtype=order.dtype)
    return rank


class Reservoir:
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


class _Executor:
    """The state of `execute_plan()`: samples held by stream position, positions lost, the reservoir."""

    def __init__(
        self,
        samples: Iterator[tuple[int, int, dict[str, Any] | None] | Invalid],
        plan: SlotEpoch,
        first: int,
        lengths: np.ndarray,
        faults: FaultLog | None,
        reservoir: int,
        index_lengths: np.ndarray | None = None,
    ):
        self.it = iter(samples)
        self.plan, self.lengths, self.faults = plan, lengths, faults
        self.index_lengths = lengths if index_lengths is None else index_lengths  # what each .json must say
        self.needed = np.zeros(len(plan.gids), dtype=bool)
        for b in plan.batches[first:]:
            self.needed[b] = True
        self.held: dict[int, dict[str, Any]] = {}
        self.lost: set[int] = set()
        self.pool = Reservoir(reservoir)
        self.upto = -1  # the latest arrival rank seen (the stream position, where they arrive in order)

    @functools.cached_property
    def rank(self) -> np.ndarray | None:
        """Each stream position's arrival rank (a streamed, interleaved plan; reads by position never ask)."""
        return arrival_ranks(self.plan.order)

    def count(self, name: str, n: int = 1) -> None:
        if self.faults is not None and n:
            self.faults.add(name, n)

    def length(self, pos: int) -> float:
        return float(self.lengths[pos])

    def pull(self) -> Any:
        """Process one stream item; the position of a held sample, None, or _END."""
        item = next(self.it, None)  # never None itself: a tuple or an Invalid span
        if item is None:
            return _END
        if isinstance(item, Invalid):
            gone = [p for p in self.held if item.lo <= p < item.hi]
            for p in gone:
                self.held.pop(p)
                self.lost.add(p)
            self.count("lost_samples", len(gone))
            self.pool.discard(item.url)
            return None
        pos, gid, sample = item
        self.upto = max(self.upto, pos if self.rank is None else int(self.rank[pos]))
        return self.accept(pos, sample)

    def accept(self, pos: int, sample: dict[str, Any] | None) -> int | None:
        """Hold the sample at ``pos`` if a batch still needs it (None: it was lost); its position, or None."""
        if not self.needed[pos]:
            return None
        if sample is None:
            self.lost.add(pos)
            self.count("lost_samples")
            return None
        if "__bad__" in sample:  # over a limit (limits.py): a bad sample, counted, then re-drawn
            bad_sample(self.faults, sample)
            self.lost.add(pos)
            return None
        if sample.get("json") is None:  # a tar indexed in place (`shardify index`): its length is the index's
            sample["json"] = {"length": self.index_lengths[pos].item()}
        meta, said = sample.get("json") or {}, self.index_lengths[pos].item()
        if "length" in meta:  # within the tolerance `shardify index` adopted it by; the batch gets the planned one
            if not same_length(meta["length"], said):
                raise IndexMismatch(
                    f"{sample['__url__']}: sample {sample['__key__']!r} has length {meta['length']} but the index "
                    f"says {said}; {_MISMATCH}"
                )
            meta["length"] = said
        sample["__id__"] = int(self.plan.gids[pos])  # per-sample randomness is seeded by it (read/transforms.py)
        self.held[pos] = sample
        return pos

    def drain(self) -> None:
        """Read the stream to its end once every batch is formed: the rest of the shards still open (samples no
        batch needs, the tar's end) is read, so each is checked (size, sha256) as a shard read whole is."""
        while self.pull() is not _END:
            pass

    def gather(self, b: np.ndarray, unformed: int) -> None:
        """Read the stream until every sample of batch ``b`` has arrived (``unformed``: batches still due)."""
        last = int(b.max()) if self.rank is None else int(self.rank[b].max())
        while self.upto < last:
            if self.pull() is _END:
                raise IndexMismatch(f"the stream ended with {unformed} planned batches unformed; {_MISMATCH}")

    def form(self, b: np.ndarray) -> list[dict[str, Any]]:
        """The batch of positions ``b``, with lost samples re-drawn where they can be."""
        batch: list[dict[str, Any]] = []
        fresh: list[tuple[float, dict[str, Any]]] = []
        missing: list[int] = []
        for i in b.tolist():
            if i in self.lost:
                self.lost.discard(i)
                missing.append(i)
            else:
                s = self.held.pop(i)
                batch.append(s)
                fresh.append((self.length(i), s))
        if missing:
            self.refill(batch, missing, len(b))
        for length, s in fresh:
            self.pool.add(length, s)
        return batch

    def refill(self, batch: list[dict[str, Any]], missing: list[int], planned: int) -> None:
        """Replace lost samples by emitted ones no longer than them; an emptied batch takes the shortest."""
        keys = {s["__key__"] for s in batch}
        for i in missing:
            rep = self.pool.pick(self.length(i), keys)
            if rep is not None:
                batch.append(rep)
                keys.add(rep["__key__"])
                self.count("redrawn_samples")
        if not batch:
            rep = self.pool.shortest()
            while rep is None:  # nothing emitted yet: take the next planned sample that arrives
                r = self.pull()
                if r is _END:
                    raise TooManyBadShards(
                        "every sample of this worker's planned batches was lost with bad shards; "
                        "nothing is left to fill its batches (see the bad shards logged above)"
                    )
                if r is not None:
                    rep = self.held[r]
            batch.append(rep)
            self.count("redrawn_samples")
        if len(batch) < planned:
            self.count("shrunk_batches")


class _DirectExecutor(_Executor):
    """`_Executor` over samples read by position (`DirectShards`) as each batch is due,
    instead of a stream: nothing is read before its batch, nothing held after it."""

    def __init__(
        self,
        shards: DirectShards,
        plan: SlotEpoch,
        first: int,
        lengths: np.ndarray,
        offsets: np.ndarray,
        faults: FaultLog | None,
        reservoir: int,
        index_lengths: np.ndarray | None = None,
    ):
        super().__init__(iter(()), plan, first, lengths, faults, reservoir, index_lengths)
        self.shards, self.offsets, self.first = shards, offsets, first
        self.k = 0  # the batch being formed (of plan.batches[first:])
        self.discarded: set[int] = set()  # bad shards whose samples left the re-draw pool

    def fetch(self, pos: int) -> int | None:
        if pos in self.held or pos in self.lost:
            return pos if pos in self.held else None
        gid = int(self.plan.gids[pos])
        shard = int(np.searchsorted(self.offsets, gid, side="right")) - 1
        return self.accept(pos, self.shards.sample(shard, gid - int(self.offsets[shard])))

    def gather(self, b: np.ndarray, unformed: int) -> None:
        self.shards.check_hashes()
        self.discard_bad()
        for pos in b.tolist():
            self.fetch(pos)
        self.k += 1

    def discard_bad(self) -> None:
        """Take the samples of shards found bad since the last batch (a hash that came out wrong after their
        samples were emitted) out of the re-draw pool, as a stream's end-of-shard check does."""
        for s in self.shards.bad - self.discarded:
            self.pool.discard(self.shards.urls[s])
            self.discarded.add(s)

    def pull(self) -> Any:
        """The next sample a later batch needs that can be read (to fill a batch when nothing was emitted yet)."""
        for b in self.plan.batches[self.first + self.k :]:
            for pos in b.tolist():
                if pos not in self.lost and self.fetch(pos) is not None:
                    return pos
        return _END


def _run(ex: _Executor, plan: SlotEpoch, first: int) -> Iterator[list[dict[str, Any]]]:
    todo, repeat = plan.batches[first:], plan.repeat[first:]
    last: list[dict[str, Any]] = []
    for k, b in enumerate(todo):
        if repeat[k] and k > 0:
            yield list(last)
            continue
        ex.gather(b, len(todo) - k)
        last = ex.form(b)
        yield last


def execute_plan(
    samples: Iterator[Any],
    plan: SlotEpoch,
    first: int,
    lengths: np.ndarray,
    faults: FaultLog | None = None,
    reservoir: int = 64,
    index_lengths: np.ndarray | None = None,
    last: bool = True,
) -> Iterator[list[dict[str, Any]]]:
    """Stage: hold each streamed sample until its planned batch is complete, then yield that batch.

    ``samples`` come from `positioned()`; ``lengths`` are the planned ones by stream position, and
    ``index_lengths`` the index's where they differ (speed perturbation, feature frames). Batches
    ``plan.batches[first:]`` are yielded in plan order; a batch marked as a repeat is yielded again from the
    samples of the one before it. Samples no remaining batch needs are dropped on arrival; lost ones are re-drawn
    from the last ``reservoir`` emitted (counted). Once the last batch is taken and the next one asked for (the
    pass ends normally), a ``last`` part of the slot's plan reads its stream to the end (`_Executor.drain()`),
    so the shards it still has open are checked in the pass that read them; a pass stopped early reads no more.
    """
    if plan.batches[first:]:
        ex = _Executor(samples, plan, first, lengths, faults, reservoir, index_lengths)
        yield from _run(ex, plan, first)
        if last:
            ex.drain()


def execute_direct(
    shards: DirectShards,
    plan: SlotEpoch,
    first: int,
    lengths: np.ndarray,
    offsets: np.ndarray,
    faults: FaultLog | None = None,
    reservoir: int = 64,
    last: bool = True,
    index_lengths: np.ndarray | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """Stage: `execute_plan()`'s batches, each sample read by position (``plan.gids`` → shard, place in the
    shard) when its batch is due; lost samples are re-drawn the same way. At the end of the ``last`` part of
    the slot's plan, pending sha256 checks are waited for and each open shard's file is checked to be the version
    its hash is of (a corrupt shard, or one written to while it was read, is always counted in the pass that read
    it), and the shards closed; stopped early, they are closed at once."""
    try:
        if plan.batches[first:]:
            ex = _DirectExecutor(shards, plan, first, lengths, offsets, faults, reservoir, index_lengths)
            yield from _run(ex, plan, first)
        if last:
            shards.check_hashes(wait=True)
    except GeneratorExit:
        last = True
        raise
    finally:
        if last:
            shards.close()
