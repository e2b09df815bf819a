"""The epoch plan: which samples every (rank, worker) slot streams and which batches it forms, with the
same number of steps on every rank.

Everything here is a pure function of the index lengths, ``(seed, epoch)`` and the layout (world size ×
workers), so every rank computes the same plan with no collective call, ``len(loader)`` is known before the
epoch starts, and a restart can skip exactly what was consumed.

Equal steps (``even_batches``):

* ``"split"`` (default): ranks with fewer batches split their largest batches in two until every rank has
  as many as the longest one. No sample is left out; a few steps run smaller batches.
* ``"drop"``: every rank stops at the shortest rank's count; the surplus samples are left out of this epoch
  (counted and logged; which ones changes with the epoch's shuffle).
* ``"pad"``: ranks with fewer batches repeat some of their own batches (re-drawn samples, counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .shards import Piece, epoch_rng, plan_slots

EVEN_BATCHES = ("split", "drop", "pad")


@dataclass
class SlotPlan:
    """One slot's epoch: pieces to stream, the global ids of its samples in stream order, and its batches
    (arrays of stream positions). ``repeat[i]`` marks batch ``i`` as a repeat of batch ``i - 1`` (pad)."""

    pieces: list[Piece]
    gids: np.ndarray
    batches: list[np.ndarray]
    repeat: list[bool] = field(default_factory=list)
    skipped: int = 0
    dropped: int = 0


@dataclass
class Adjust:
    """What one slot does to its own batches: split the ``split`` largest, repeat ``pad`` chosen ones, yield
    the first ``take``, and with ``hardest`` move its most expensive batch to the front."""

    split: int = 0
    pad: int = 0
    take: int = -1
    hardest: bool = False


@dataclass
class EpochPlan:
    """The whole epoch for every rank: slots, steps per rank, and what was left out or repeated."""

    epoch: int
    world_size: int
    num_workers: int
    slots: list[SlotPlan]
    adjust: list[Adjust]
    steps: int
    first_worker: list[int] = field(default_factory=list)  # per rank: the worker its first batch comes from
    surplus_samples: int = 0
    repeated_samples: int = 0
    split_batches: int = 0
    skipped_samples: int = 0
    dropped_samples: int = 0

    def rank_slots(self, rank: int) -> range:
        return range(rank * self.num_workers, (rank + 1) * self.num_workers)

    def worker_counts(self, rank: int) -> list[int]:
        """Batches each of the rank's workers yields this epoch (after equalisation)."""
        return [len(self.slots[s].batches) for s in self.rank_slots(rank)]

    def start(self, rank: int) -> int:
        return self.first_worker[rank] if self.first_worker else 0

    def rank_order(self, rank: int) -> list[tuple[int, int]]:
        """(worker, batch number) of the rank's batches in the order its DataLoader yields them."""
        return interleave(self.worker_counts(rank), self.start(rank))


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
    """How many of each worker's batches are among the first ``consumed`` batches of the rank."""
    done = [0] * len(counts)
    for w, _ in interleave(counts, start)[:consumed]:
        done[w] += 1
    return done


def global_offsets(shard_counts: Sequence[int]) -> np.ndarray:
    """Global id of each shard's first sample (ids run over shards in index order)."""
    return np.concatenate([[0], np.cumsum(shard_counts)]).astype(np.int64)


def slot_stream(pieces: Sequence[Piece], offsets: np.ndarray, excluded: np.ndarray | None) -> np.ndarray:
    """Global ids of a slot's samples in stream order, without the excluded (already consumed) ones."""
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    gids = np.concatenate([np.arange(offsets[p.shard] + p.start, offsets[p.shard] + p.stop) for p in pieces])
    if excluded is not None:
        gids = gids[~excluded[gids]]
    return gids


def plan_slot(
    shard_lengths: Sequence[np.ndarray],
    all_lengths: np.ndarray,
    cfg,
    epoch: int,
    slot: int,
    num_slots: int,
    excluded: np.ndarray | None = None,
    pieces: list[Piece] | None = None,
    offsets: np.ndarray | None = None,
) -> SlotPlan:
    """One slot's unequalised plan; workers call this for their own slot only (``pieces``: the slot's
    share when the caller has dealt all slots already)."""
    if pieces is None:
        pieces = plan_slots(shard_lengths, num_slots, cfg.seed, epoch, cfg.shuffle, excluded=excluded)[slot]
    if offsets is None:
        offsets = global_offsets([len(x) for x in shard_lengths])
    gids = slot_stream(pieces, offsets, excluded)
    bp = cfg.plan(all_lengths[gids], epoch, slot)
    return SlotPlan(pieces, gids, list(bp), [False] * len(bp), len(bp.skipped), len(bp.dropped))


def apply_adjust(
    plan: SlotPlan, adj: Adjust, seed: int, epoch: int, slot: int, lengths: np.ndarray | None = None, cost=None
) -> SlotPlan:
    """Equalise one slot's batches as the epoch plan decided (deterministic from the slot's own plan)."""
    batches, repeat = list(plan.batches), list(plan.repeat)
    for _ in range(adj.split):
        i = _largest(len(b) for b in batches)
        b = batches[i]
        h = len(b) // 2
        batches[i:i + 1] = [b[:h], b[h:]]
        repeat[i:i + 1] = [False, False]
    if adj.pad:
        rng = epoch_rng(seed, epoch, slot, 1)
        picks = np.sort(rng.choice(len(batches), size=adj.pad, replace=adj.pad > len(batches)))
        count = np.bincount(picks, minlength=len(batches))
        nb, nr = [], []
        for i, b in enumerate(batches):
            nb.append(b)
            nr.append(repeat[i])
            for _ in range(int(count[i])):
                nb.append(b)
                nr.append(True)
        batches, repeat = nb, nr
    if adj.hardest and batches:
        h = hardest_batch(batches, repeat, lengths, cost)
        batches.insert(0, batches.pop(h))
        repeat.insert(0, repeat.pop(h))
    if adj.take >= 0:
        batches, repeat = batches[: adj.take], repeat[: adj.take]
    return SlotPlan(plan.pieces, plan.gids, batches, repeat, plan.skipped, plan.dropped)


def batch_costs(batches: Sequence[np.ndarray], lengths: np.ndarray | None, cost) -> list[float]:
    """Each batch's cost under the model, on its samples' lengths (``lengths`` indexed by stream position)."""
    out = []
    for b in batches:
        x = lengths[b]
        out.append(float(x.sum()) if cost.packed else float(cost.cost(len(b), float(x.max()))))
    return out


def hardest_batch(batches: Sequence[np.ndarray], repeat: Sequence[bool], lengths: np.ndarray, cost) -> int:
    """The most expensive batch that can move (not a repeat, not followed by its repeat); first on ties."""
    costs = batch_costs(batches, lengths, cost)
    best, best_i = -1.0, 0
    for i, c in enumerate(costs):
        movable = not repeat[i] and not (i + 1 < len(repeat) and repeat[i + 1])
        if movable and c > best:
            best, best_i = c, i
    return best_i


def _largest(sizes) -> int:
    """Index of the first largest value."""
    best, best_i = -1, 0
    for i, n in enumerate(sizes):
        if n > best:
            best, best_i = n, i
    return best_i


def make_epoch_plan(
    shard_lengths: Sequence[np.ndarray],
    cfg,
    epoch: int,
    world_size: int,
    num_workers: int,
    even_batches: str = "split",
    excluded: np.ndarray | None = None,
    hardest_first: bool = False,
) -> EpochPlan:
    """Plan every slot of the epoch and equalise the ranks' step counts."""
    if even_batches not in EVEN_BATCHES:
        raise ValueError(f"even_batches must be one of {EVEN_BATCHES}, got {even_batches!r}")
    num_slots = world_size * num_workers
    all_lengths = np.concatenate(list(shard_lengths)) if len(shard_lengths) else np.zeros(0)
    dealt = plan_slots(shard_lengths, num_slots, cfg.seed, epoch, cfg.shuffle, excluded=excluded)
    offsets = global_offsets([len(x) for x in shard_lengths])
    raw = [
        plan_slot(shard_lengths, all_lengths, cfg, epoch, s, num_slots, excluded, dealt[s], offsets)
        for s in range(num_slots)
    ]
    adjust = [Adjust() for _ in range(num_slots)]
    counts = [sum(len(raw[s].batches) for s in range(r * num_workers, (r + 1) * num_workers)) for r in range(world_size)]
    surplus = repeated = splits = 0
    if even_batches == "split":
        # ranks with fewer batches halve their largest batch, again and again, until they have as many as
        # the longest rank (a batch of n samples can become at most n batches)
        spare = [
            sum(len(b) - 1 for s in range(r * num_workers, (r + 1) * num_workers) for b in raw[s].batches)
            for r in range(world_size)
        ]
        steps = min(max(counts), min(c + k for c, k in zip(counts, spare)))
        for r in range(world_size):
            sizes = [[len(b) for b in raw[r * num_workers + w].batches] for w in range(num_workers)]
            for _ in range(max(0, steps - counts[r])):
                # the same choice apply_adjust makes inside each worker: the largest, first in order
                w = max(range(num_workers), key=lambda w: (max(sizes[w], default=0), -w))
                i = _largest(sizes[w])
                sizes[w][i:i + 1] = [sizes[w][i] // 2, sizes[w][i] - sizes[w][i] // 2]
                adjust[r * num_workers + w].split += 1
                splits += 1
    elif even_batches == "pad":
        steps = max(counts)
        for r in range(world_size):
            need = steps - counts[r]
            have = [w for w in range(num_workers) if raw[r * num_workers + w].batches]
            if need and not have:
                raise ValueError(
                    f"rank {r} gets no data this epoch ({len(all_lengths)} samples over {world_size} ranks × "
                    f"{num_workers} workers); use fewer ranks/workers, a smaller budget, or even_batches='drop'"
                )
            for i in range(need):
                adjust[r * num_workers + have[i % len(have)]].pad += 1
    else:
        steps = min(counts)
    slots = [apply_adjust(raw[s], adjust[s], cfg.seed, epoch, s) for s in range(num_slots)]
    # every rank yields `steps` batches: its first `steps` in DataLoader order
    first_worker = [0] * world_size
    for r in range(world_size):
        ids = range(r * num_workers, (r + 1) * num_workers)
        if hardest_first and steps:
            # the rank's most expensive batch goes first: its worker moves it to the front and starts the round
            best = (-1.0, 0)
            for w, s in enumerate(ids):
                sp = slots[s]
                if sp.batches:
                    lens = all_lengths[sp.gids]
                    c = batch_costs([sp.batches[hardest_batch(sp.batches, sp.repeat, lens, cfg.cost)]], lens, cfg.cost)[0]
                    if c > best[0]:
                        best = (c, w)
            s = r * num_workers + best[1]
            first_worker[r] = best[1]
            adjust[s].hardest = True
            slots[s] = apply_adjust(slots[s], Adjust(hardest=True), cfg.seed, epoch, s, all_lengths[slots[s].gids], cfg.cost)
        take = per_worker([len(slots[s].batches) for s in ids], steps, first_worker[r])
        for s, t in zip(ids, take):
            surplus += int(sum(len(b) for b, rep in zip(slots[s].batches[t:], slots[s].repeat[t:]) if not rep))
            adjust[s].take = t
            slots[s] = apply_adjust(slots[s], Adjust(take=t), cfg.seed, epoch, s)
            repeated += int(sum(len(b) for b, rep in zip(slots[s].batches, slots[s].repeat) if rep))
    return EpochPlan(
        epoch=epoch,
        world_size=world_size,
        num_workers=num_workers,
        slots=slots,
        adjust=adjust,
        steps=steps,
        first_worker=first_worker,
        surplus_samples=surplus,
        repeated_samples=repeated,
        split_batches=splits,
        skipped_samples=sum(s.skipped for s in raw),
        dropped_samples=sum(s.dropped for s in raw),
    )


def consumed_ids(plan: EpochPlan, consumed: int) -> np.ndarray:
    """Global ids of the samples every rank has consumed after ``consumed`` steps (for re-planning)."""
    out = []
    for r in range(plan.world_size):
        done = per_worker(plan.worker_counts(r), consumed, plan.start(r))
        for w, k in enumerate(done):
            sp = plan.slots[r * plan.num_workers + w]
            for b in sp.batches[:k]:
                out.append(sp.gids[b])
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)
