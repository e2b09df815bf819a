"""One (rank, worker) slot's plan: its pieces, its batches, and the adjustments that equalise the ranks.

The planner decides an `Adjust` per slot; each DataLoader worker re-plans its own slot (a loader without
workers takes the plan its planner kept, `KeptSlots`) and applies that same `Adjust` with
`apply_adjust()`. Both sides use the one split rule here (`cut_largest()`),
so what the planner counted is what the workers yield.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import OptionError
from .balance import StepBalance, balanced_order, targets
from .batcher import BucketBatcher
from .config import BatchingConfig
from .cost import CostModel
from .lengths import Mask
from .shards import Piece, epoch_rng


@dataclass
class SlotEpoch:
    """One slot's epoch: pieces to stream, the global ids of its samples in stream order, and its batches
    (arrays of stream positions). ``repeat[i]`` marks batch ``i`` as a repeat of batch ``i - 1`` (pad).

    Stream positions run over the pieces in turn (each in tar order); ``order``, where several pieces stream at
    once (``interleave``), lists the positions in the order their samples arrive (`arrival_order()`)."""

    pieces: list[Piece]
    gids: np.ndarray
    batches: list[np.ndarray]
    repeat: list[bool] = field(default_factory=list)
    skipped: int = 0
    dropped: int = 0
    samples: int = -1  # of a counted plan (`counted()`), whose ``gids`` are gone
    lengths: np.ndarray | None = None  # by stream position, when planned with ``keep_lengths``
    order: np.ndarray | None = None  # stream positions by arrival; None: they arrive in position order
    rounds: list[int] | None = None  # the batcher round each batch came from (`balance`); None: not known

    @property
    def num_samples(self) -> int:
        """Samples the slot streams this epoch."""
        return self.samples if self.samples >= 0 else len(self.gids)

    @classmethod
    def counted(cls, pieces: list[Piece], streamed: int, plan: Any) -> SlotEpoch:
        """The plan as a rank's main process needs it to count and equalise steps: each batch stood in for by
        ``range(size)`` (what the split and pad rules look at) and no ids — a fraction of the memory."""
        sizes = plan.sizes.tolist()
        return cls(
            pieces,
            np.zeros(0, dtype=np.int64),
            [range(k) for k in sizes],  # type: ignore[misc]  # stand-ins: only their len() is read
            [False] * len(sizes),
            len(plan.skipped),
            len(plan.dropped),
            streamed,
        )


@dataclass
class Adjust:
    """What one slot does to its own batches: split the ``split`` largest, repeat ``pad`` chosen ones, yield
    the first ``take``, and with ``hardest`` move its most expensive batch to the front."""

    split: int = 0
    pad: int = 0
    take: int = -1
    hardest: bool = False


def global_offsets(shard_counts: Sequence[int]) -> np.ndarray:
    """Global id of each shard's first sample (ids run over shards in index order)."""
    return np.concatenate([[0], np.cumsum(shard_counts)]).astype(np.int64)


def piece_excluded(piece: Piece, offsets: np.ndarray, excluded: Mask | None) -> np.ndarray:
    """Which of a piece's samples (tar order) were consumed before a resume; none without ``excluded`` (a mask
    over global ids, or a lazy one asked about just these samples)."""
    if excluded is None:
        return np.zeros(piece.count, dtype=bool)
    lo = int(offsets[piece.shard]) + piece.start
    return np.asarray(excluded[lo : lo + piece.count], dtype=bool)


def slot_stream(pieces: Sequence[Piece], offsets: np.ndarray, excluded: Mask | None) -> np.ndarray:
    """Global ids of a slot's samples in stream order, without the excluded (already consumed) ones."""
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(
        [
            np.arange(offsets[p.shard] + p.start, offsets[p.shard] + p.stop)[~piece_excluded(p, offsets, excluded)]
            for p in pieces
        ]
    )


def stream_lengths(pieces: Sequence[Piece], lengths: Any, excluded: Mask | None) -> np.ndarray:
    """The lengths of a slot's stream (as `slot_stream()` orders it), sliced from each piece's shard; the
    planned ones (speed perturbation, feature frames) where ``lengths`` plans them (`perturb`)."""
    parts = [lengths.shard(p.shard)[p.start : p.stop][~piece_excluded(p, lengths.offsets, excluded)] for p in pieces]
    out = np.concatenate(parts) if parts else np.zeros(0)
    if hasattr(lengths, "plan_lengths"):  # the one hook of per-sample length changes
        out = lengths.plan_lengths(out, slot_stream(pieces, lengths.offsets, excluded))
    return out


def stream_outputs(pieces: Sequence[Piece], lengths: Any, excluded: Mask | None) -> np.ndarray:
    """The output lengths of a slot's stream (two-length budgets), ordered as `stream_lengths()`."""
    parts = [lengths.outputs(p.shard)[p.start : p.stop][~piece_excluded(p, lengths.offsets, excluded)] for p in pieces]
    return np.concatenate(parts) if parts else np.zeros(0)


def stream_groups(pieces: Sequence[Piece], lengths: Any, excluded: Mask | None, batch_by: str) -> np.ndarray:
    """The group key of each sample of a slot's stream (``batch_by``: its shard's dataset), ordered as
    `stream_lengths()`."""
    groups = getattr(lengths, "groups", None)
    if groups is None:
        raise OptionError(
            f"batch_by={batch_by!r} groups the samples of a mixture by dataset; these lengths come "
            "from one dataset (give several datasets, or leave batch_by=None)"
        )
    kept = [int(np.count_nonzero(~piece_excluded(p, lengths.offsets, excluded))) for p in pieces]
    return np.repeat(groups[[p.shard for p in pieces]], kept) if pieces else np.zeros(0, dtype=np.int64)


def kept_counts(pieces: Sequence[Piece], offsets: np.ndarray, excluded: Mask | None) -> np.ndarray:
    """How many of each piece's samples the slot streams (those not excluded)."""
    if excluded is None:
        return np.array([p.count for p in pieces], dtype=np.int64)
    return np.array([p.count - int(piece_excluded(p, offsets, excluded).sum()) for p in pieces], dtype=np.int64)


def arrival_order(kept: np.ndarray, streams: int, rng: np.random.Generator) -> np.ndarray:
    """Stream positions in the order their samples arrive when the pieces (``kept`` samples each) stream
    ``streams`` at a time: consecutive groups of that many pieces, each group's samples merged in a seeded
    random order (each piece's own in tar order), group after group. The merge draws a 16-bit key per sample
    and stable-sorts by it (radix sorts, linear), so ties keep the pieces' order: near enough to uniform."""
    starts = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    out = np.empty(int(starts[-1]), dtype=np.int32 if starts[-1] < 2**31 else np.int64)
    for g in range(0, len(kept), streams):
        lo, hi = int(starts[g]), int(starts[min(g + streams, len(kept))])
        piece = np.repeat(np.arange(len(kept[g : g + streams]), dtype=np.uint8), kept[g : g + streams])
        which = piece[np.argsort(rng.integers(0, 1 << 16, hi - lo, dtype=np.uint16), kind="stable")]
        out[lo:hi][np.argsort(which, kind="stable")] = np.arange(lo, hi, dtype=out.dtype)
    return out


def slot_order(
    pieces: Sequence[Piece], offsets: np.ndarray, excluded: Mask | None, config: BatchingConfig, epoch: int, slot: int
) -> np.ndarray | None:
    """The arrival order of a slot's stream positions this epoch (`arrival_order()`, seeded by the epoch and
    slot), or None where they arrive in position order (one stream, or a single piece)."""
    if config.streams <= 1 or len(pieces) <= 1:
        return None
    kept = kept_counts(pieces, offsets, excluded)
    return arrival_order(kept, config.streams, epoch_rng(config.epoch_seed, epoch, slot, 2))


def plan_slot(
    pieces: list[Piece],
    lengths: Any,
    offsets: np.ndarray,
    config: BatchingConfig,
    epoch: int,
    slot: int,
    excluded: Mask | None = None,
    keep_lengths: bool = False,
    counted: bool = False,
) -> SlotEpoch:
    """One slot's batches before equalisation: the slot's batcher run over its stream's lengths.

    ``lengths`` gives lengths by global id: a `Lengths` or an array.
    ``keep_lengths``: the plan keeps the stream's lengths (a worker needs them; a planner of every slot not).
    ``counted``: only the batch sizes (`SlotEpoch.counted()`), planned without listing the samples' ids."""
    outs = stream_outputs(pieces, lengths, excluded) if config.output_budget is not None else None
    keys = stream_groups(pieces, lengths, excluded, config.batch_by) if config.batch_by is not None else None
    order = slot_order(pieces, offsets, excluded, config, epoch, slot)
    if counted and hasattr(lengths, "shard"):
        lens = stream_lengths(pieces, lengths, excluded)
        bp = _batched(lens, outs, keys, order, BucketBatcher.for_slot(config, epoch, slot))
        return SlotEpoch.counted(pieces, len(lens), bp)
    gids = slot_stream(pieces, offsets, excluded)
    lens = stream_lengths(pieces, lengths, excluded) if hasattr(lengths, "shard") else lengths[gids]
    bp = _batched(lens, outs, keys, order, BucketBatcher.for_slot(config, epoch, slot))
    if counted:
        return SlotEpoch.counted(pieces, len(gids), bp)
    batches = list(bp) if order is None else [order[b] for b in bp]  # arrival ranks back to stream positions
    rounds = np.repeat(np.arange(len(bp.rounds)), bp.rounds).tolist() if bp.rounds is not None else None
    return SlotEpoch(
        pieces,
        gids,
        batches,
        [False] * len(bp),
        len(bp.skipped),
        len(bp.dropped),
        lengths=lens if keep_lengths else None,
        order=order,
        rounds=rounds,
    )


@dataclass
class KeptSlots:
    """The slots whose plans a rank's planner keeps whole (their lengths too) for the process that streams them
    (``num_workers=0``: the loader's own): that stream takes its plan from here instead of planning it again."""

    slots: range
    plans: dict[int, SlotEpoch] = field(default_factory=dict)

    def plan(
        self,
        pieces: list[Piece],
        lengths: Any,
        offsets: np.ndarray,
        config: BatchingConfig,
        epoch: int,
        slot: int,
        excluded: Mask | None = None,
        counted: bool = False,
    ) -> SlotEpoch:
        """`plan_slot()`; a slot of `slots` is planned whole with its lengths and kept (the planner then
        counts its steps from the whole plan: the same counts)."""
        if slot not in self.slots:
            return plan_slot(pieces, lengths, offsets, config, epoch, slot, excluded, counted=counted)
        self.plans[slot] = plan_slot(pieces, lengths, offsets, config, epoch, slot, excluded, keep_lengths=True)
        return self.plans[slot]


def _batched(
    lens: np.ndarray, outs: np.ndarray | None, keys: np.ndarray | None, order: np.ndarray | None, batcher: BucketBatcher
) -> Any:
    """The batcher run over the stream as it arrives (``order``: positions by arrival), batches as arrival ranks."""
    if order is None:
        return batcher.plan(lens, outs, keys)
    return batcher.plan(lens[order], None if outs is None else outs[order], None if keys is None else keys[order])


def cut_largest(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    """The one split rule on batch sizes: the first largest batch, at ``i``, becomes two (the first half the
    smaller). Returns the new sizes and ``i``."""
    i = int(np.argmax(sizes))
    n = int(sizes[i])
    sizes = np.insert(sizes, i + 1, n - n // 2)
    sizes[i] = n // 2
    return sizes, i


def halve_largest(batches: list[Any], times: int = 1, rounds: list[int] | None = None) -> None:
    """Split batches in place by `cut_largest()`, ``times`` over (sizes tracked in numpy: each cut costs
    a copy in C, not a Python scan). The planner counts with the same rule on sizes alone. ``rounds`` (each
    batch's batcher round) gets both halves the round of the batch they were cut from."""
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    for _ in range(times):
        sizes, i = cut_largest(sizes)
        b = batches[i]
        batches[i : i + 1] = [b[: int(sizes[i])], b[int(sizes[i]) :]]
        if rounds is not None:
            rounds.insert(i, rounds[i])


def apply_adjust(
    plan: SlotEpoch,
    adj: Adjust,
    seed: int,
    epoch: int,
    slot: int,
    lengths: np.ndarray | None = None,
    cost: CostModel | None = None,
    balance: StepBalance | None = None,
    first_kept: bool = False,
) -> SlotEpoch:
    """Equalise one slot's batches as the epoch plan decided (deterministic from the slot's own plan). With
    ``balance`` (`BatchingConfig.balance`) the batches taken are then ordered for balanced steps
    (`balanced_order()`, on ``lengths`` by stream position), the first one kept first where ``adj.hardest`` or
    ``first_kept`` (hardest-first applied by an earlier call)."""
    batches, repeat = list(plan.batches), list(plan.repeat)
    rounds = list(plan.rounds) if plan.rounds is not None else None
    if adj.split:
        halve_largest(batches, adj.split, rounds)
        repeat = [False] * len(batches)
    if adj.pad:
        batches, repeat, rounds = _padded(batches, repeat, adj.pad, epoch_rng(seed, epoch, slot, 1), rounds)
    if adj.hardest and batches:
        if lengths is None or cost is None:
            raise ValueError("hardest_first needs the slot's lengths by stream position and the cost model")
        h = hardest_batch(batches, repeat, lengths, cost)
        batches.insert(0, batches.pop(h))
        repeat.insert(0, repeat.pop(h))
        if rounds is not None:
            rounds.insert(0, rounds.pop(h))
    if adj.take >= 0:
        batches, repeat = batches[: adj.take], repeat[: adj.take]
        rounds = rounds[: adj.take] if rounds is not None else None
        if balance is not None and rounds is not None and len(batches) > 1:
            if lengths is None:
                raise ValueError("step_balance needs the slot's lengths by stream position")
            goals = targets(seed, epoch, 0, len(batches))
            times = balance.time.times(batches, lengths)
            first = adj.hardest or first_kept
            order = balanced_order(times, rounds, repeat, first, goals, balance.rounds, balance.band)
            batches, rounds = [batches[i] for i in order], [rounds[i] for i in order]
    out = SlotEpoch(plan.pieces, plan.gids, batches, repeat, plan.skipped, plan.dropped, order=plan.order)
    out.rounds = rounds
    return out


def _padded(
    batches: list[np.ndarray], repeat: list[bool], pad: int, rng: np.random.Generator, rounds: list[int] | None = None
) -> tuple[list[np.ndarray], list[bool], list[int] | None]:
    """``pad`` seeded picks of batches, each repeated right after itself (marked as a repeat, of its round)."""
    picks = np.sort(rng.choice(len(batches), size=pad, replace=pad > len(batches)))
    count = np.bincount(picks, minlength=len(batches))
    nb, nr, nk = [], [], []
    for i, b in enumerate(batches):
        k = 1 + int(count[i])
        nb += [b] * k
        nr += [repeat[i]] + [True] * (k - 1)
        if rounds is not None:
            nk += [rounds[i]] * k
    return nb, nr, (nk if rounds is not None else None)


def batch_costs(batches: Sequence[np.ndarray], lengths: np.ndarray, cost: CostModel) -> list[float]:
    """Each batch's cost under the model, on its samples' lengths (``lengths`` indexed by stream position)."""
    out = []
    for b in batches:
        x = lengths[b]
        out.append(float(x.sum()) if cost.packed else float(cost.cost(len(b), float(x.max()))))
    return out


def hardest_batch(batches: Sequence[np.ndarray], repeat: Sequence[bool], lengths: np.ndarray, cost: CostModel) -> int:
    """The most expensive batch that can move (not a repeat, not followed by its repeat); first on ties."""
    costs = batch_costs(batches, lengths, cost)
    best, best_i = -1.0, 0
    for i, c in enumerate(costs):
        movable = not repeat[i] and not (i + 1 < len(repeat) and repeat[i + 1])
        if movable and c > best:
            best, best_i = c, i
    return best_i


def interleave(counts: Sequence[int], start: int = 0) -> list[tuple[int, int]]:
    """A torch DataLoader's order over iterable-dataset workers: round robin (beginning with worker
    ``start``), skipping exhausted ones."""
    nw = len(counts)
    order = [(start + i) % nw for i in range(nw)]
    out = []
    for r in range(max(counts, default=0)):
        for w in order:
            if r < counts[w]:
                out.append((w, r))
    return out


def per_worker(counts: Sequence[int], consumed: int, start: int = 0) -> list[int]:
    """How many of each worker's batches are among the first ``consumed`` batches of the rank (the
    `interleave()` order, counted without listing it: full rounds found by bisection, then the last
    partial round in the round-robin order)."""
    c = np.asarray(counts, dtype=np.int64)
    nw = len(c)
    if not nw or consumed <= 0:
        return [0] * nw
    lo, hi = 0, int(c.max())
    while lo < hi:  # the most full rounds whose batches fit in ``consumed``
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(np.minimum(c, mid).sum()) <= consumed else (lo, mid - 1)
    done = np.minimum(c, lo)
    left = consumed - int(done.sum())
    for w in [(start + i) % nw for i in range(nw)]:
        if left and c[w] > lo:
            done[w] += 1
            left -= 1
    return done.tolist()
