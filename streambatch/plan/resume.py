"""Resuming an epoch on another layout: which samples the earlier layouts consumed, worked out per shard.

A checkpoint names the layouts an epoch ran on before it (ranks × workers, equalisation, agreed steps,
batches consumed), not the consumed samples: those follow from the plan. When the new layout's planner asks
whether some samples were consumed, `Consumed` batches only the old slots that held those samples, and each only
as far as the batches it yielded before the save, so a rank resuming on another world size reads O(N / world)
lengths, never the whole index, and batches about as many samples as a fresh plan of its own slots.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OptionError, StateError, shown
from .balance import BAND_ROUNDS, balanced_order, band_read_ahead, targets
from .batcher import BucketBatcher
from .config import BatchingConfig
from .epoch import RankEqualised, SlotEqualised, plan_rank, rank_raw_slots
from .layout import EVEN_BATCHES, Layout
from .lengths import LazyMask, Lengths, by_shard
from .mixing import any_of
from .shards import Deal, Piece, epoch_rng, plan_slots
from .slot import per_worker, piece_excluded, slot_order, stream_groups, stream_lengths, stream_outputs


@dataclass(frozen=True)
class EarlierRun:
    """How part of an epoch ran before a resume on another layout."""

    layout: Layout
    """The ranks, workers and equalisation it ran on."""
    steps: int
    """The batches per rank that layout agreed on for the epoch."""
    consumed: int
    """The batches every rank had consumed when the state was saved."""
    equalised: tuple[RankEqualised, ...] = ()
    """Every old rank's equalisation (a state saved before this was recorded has none): with it, a resume
    batches an old rank's slots only as far as the batches it consumed, not in full."""

    def state_dict(self) -> dict[str, Any]:
        """As a checkpoint holds it: the layout's fields, ``steps``, ``consumed`` and (when known) ``equalised``
        as one list of integers per rank, flat."""
        out = {**dataclasses.asdict(self.layout), "steps": self.steps, "consumed": self.consumed}
        if self.equalised:
            out["equalised"] = [r.to_ints() for r in self.equalised]
        return out

    @classmethod
    def from_state(cls, state: Any, name: str = "an earlier layout") -> EarlierRun:
        """An earlier run as `state_dict()` (or an older version, without ``equalised``) saved it; anything
        else (not a mapping, a key missing, a value of the wrong type or out of range) is a `StateError`
        naming ``name`` (the checkpoint's key) and the value."""
        names = [f.name for f in dataclasses.fields(Layout)] + ["steps", "consumed"]
        if not isinstance(state, Mapping):
            raise StateError(f"loader state: {name} must be a mapping of {', '.join(names)}, got {shown(state)}")
        missing = [n for n in names if n not in state]
        if missing:
            raise StateError(f"loader state: {name} lacks {', '.join(missing)}: {shown(state)}")
        layout = state_layout(name, state)
        steps = state_count(f"{name}.steps", state["steps"])
        consumed = state_count(f"{name}.consumed", state["consumed"], 0, steps)
        return cls(layout, steps, consumed, equalised_of(state.get("equalised"), layout, steps, f"{name}.equalised"))

    def rank(self, rank: int) -> RankEqualised | None:
        """The old rank's equalisation, where the checkpoint holds it."""
        return self.equalised[rank] if rank < len(self.equalised) else None


def equalised_of(
    rows: Any, layout: Layout, steps: int | None = None, name: str = "equalised"
) -> tuple[RankEqualised, ...]:
    """Every rank's equalisation from a checkpoint's lists of integers (None or none: an older state). Rows that
    do not fit ``layout`` (one list of ``1 + 6 × num_workers`` whole numbers per rank), or whose numbers are out of
    range (a worker number from 0, counts from 0, ``pad`` and ``take`` at most ``steps``), are a
    `StateError` naming ``name`` rather than trusted."""
    if rows is None or (isinstance(rows, (list, tuple)) and not rows):
        return ()
    width = 1 + len(_SLOT_FIELDS) * layout.num_workers
    if (
        not isinstance(rows, (list, tuple))
        or len(rows) != layout.world_size
        or any(not isinstance(r, (list, tuple)) or len(r) != width or not all(map(_whole, r)) for r in rows)
    ):
        raise StateError(
            f"loader state: {name} {shown(rows)} does not fit {layout.world_size} ranks x {layout.num_workers} "
            f"workers (one list of {width} whole numbers per rank)"
        )
    ranks = tuple(RankEqualised.of_ints([int(v) for v in row]) for row in rows)
    for r, rank in enumerate(ranks):
        state_count(f"{name}[{r}] start", rank.start, 0, layout.num_workers - 1)
        for s in rank.slots:
            for f in _SLOT_FIELDS:
                most = steps if f in ("pad", "take") and steps is not None else MAX_COUNT
                state_count(f"{name}[{r}] {f}", getattr(s, f), -1 if f == "hardest" else 0, most)
    return ranks


_SLOT_FIELDS = tuple(f.name for f in dataclasses.fields(SlotEqualised))

#: the largest count a checkpoint may hold (steps, batches, a step number): no epoch has 10¹² steps (each batch
#: holds a sample, and the largest datasets hold some 10⁹), so a larger one is garbage, not a plan
MAX_COUNT = 10**12


def _whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def state_count(name: str, value: Any, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    """A checkpoint's whole number from ``minimum`` to ``maximum``, else a `StateError` naming it."""
    if not _whole(value):
        raise StateError(f"loader state: {name} must be a whole number, got {shown(value)}")
    if value < minimum:
        raise StateError(f"loader state: {name} must be at least {minimum}, got {shown(value)}")
    if value > maximum:
        raise StateError(f"loader state: {name} must be at most {maximum:,}, got {shown(value)}")
    return int(value)


def state_layout(name: str, state: Mapping[str, Any]) -> Layout:
    """The `Layout` a checkpoint's mapping names (its four keys), else a `StateError` naming it."""
    world = state_count(f"{name}.world_size", state["world_size"], 1)
    workers = state_count(f"{name}.num_workers", state["num_workers"], 1)
    try:
        return Layout(world, workers, state["even_batches"], state["hardest_first"])
    except OptionError:
        said = f"even_batches={shown(state['even_batches'])}, hardest_first={shown(state['hardest_first'])}"
        raise StateError(
            f"loader state: {name} must have even_batches one of {', '.join(EVEN_BATCHES)} and hardest_first True "
            f"or False, got {said}"
        ) from None


@dataclass(frozen=True)
class Resumed:
    """The layouts epoch ``epoch`` ran on before this one (oldest first), and ``base``: a mask of consumed
    samples saved by an older state format (O(N) bits; new states never write one)."""

    epoch: int
    layouts: tuple[EarlierRun, ...] = ()
    base: np.ndarray | None = None

    def consumed(self, lengths: Lengths, config: BatchingConfig, selection: Any = None) -> Any:
        """The samples consumed before this layout, as a mask indexable by global ids (None: nothing); with a
        mixture's ``selection``, the samples the epoch does not take are in it too (the old plans left them out)."""
        mask: Any = any_of(selection, self.base)
        for run in self.layouts:
            mask = Consumed(lengths, config, self.epoch, run, mask)
        return mask


class Consumed(LazyMask):
    """The samples consumed under ``layout`` (after those of ``prior``), as a lazily computed mask over global
    ids: ``consumed[gids]``, ``consumed[lo:hi]`` and ``consumed[gid]`` give booleans. Asking about samples costs,
    once, the first batches of the old slots that held them (where the checkpoint holds the old ranks'
    equalisation; else a re-plan of their old ranks), and nothing else: a rank resuming on more ranks than
    the state was saved on batches only the old slots its own shards came from, not their ranks' other slots."""

    def __init__(self, lengths: Lengths, config: BatchingConfig, epoch: int, run: EarlierRun, prior: Any = None):
        self.lengths, self.config, self.epoch, self.run, self.prior = lengths, config, epoch, run, prior
        self.layout = run.layout
        seed = config.epoch_seed
        self._deal = Deal.of(lengths, run.layout.num_slots, seed, epoch, config.shuffle)
        self._position = np.empty(lengths.num_shards, dtype=np.int64)
        self._position[self._deal.order] = np.arange(lengths.num_shards)
        self._marks: dict[int, np.ndarray] = {}  # shard -> samples consumed under this layout (of slots worked out)
        self._slots: set[int] = set()  # old slots whose consumed samples are marked so far
        self._ranks: set[int] = set()  # old ranks re-planned in full (a state without their equalisation)

    def __getitem__(self, key: Any) -> Any:
        # ids inside one shard (what the planner asks of each piece): no grouping by shard
        offsets = self.lengths.offsets
        if isinstance(key, slice) and key.step in (None, 1) and key.start is not None and key.stop is not None:
            lo, hi = int(key.start), int(key.stop)
            s = int(np.searchsorted(offsets, lo, side="right")) - 1 if hi > lo else -1
            if 0 <= s < self.lengths.num_shards and hi <= offsets[s + 1]:
                out = self._shard_mask(s, slice(lo - int(offsets[s]), hi - int(offsets[s])), hi - lo)
                return out if self.prior is None else out | np.asarray(self.prior[lo:hi], dtype=bool)
        elif isinstance(key, np.ndarray) and key.ndim == 1 and key.size and key.dtype.kind in "iu":
            lo, hi = int(key.min()), int(key.max())
            s = int(np.searchsorted(offsets, lo, side="right")) - 1
            if 0 <= lo and 0 <= s < self.lengths.num_shards and hi < offsets[s + 1]:
                out = self._shard_mask(s, key - int(offsets[s]), key.size)
                return out if self.prior is None else out | np.asarray(self.prior[key], dtype=bool)
        return super().__getitem__(key)

    def _mask(self, gids: np.ndarray) -> np.ndarray:
        """Whether each sample was consumed: work out the old slots that held these samples (once each)."""
        out = np.zeros(gids.size, dtype=bool)
        offsets = self.lengths.offsets
        for s, sel in by_shard(gids, offsets):
            out[sel] = self._shard_mask(s, gids[sel] - offsets[s], int(sel.size))
        if self.prior is not None and gids.size:
            out |= np.asarray(self.prior[gids], dtype=bool)
        return out

    def _shard_mask(self, shard: int, pos: Any, size: int) -> np.ndarray:
        """Whether the samples at ``pos`` (positions in the shard: a slice or an array) were consumed."""
        if not self._slots.issuperset(self._candidate_slots(shard)):
            for slot in np.unique(self._old_slots(shard)[pos]).tolist():
                self._consume_slot(int(slot))
        marks = self._marks.get(shard)
        return np.zeros(size, dtype=bool) if marks is None else marks[pos].copy()

    def _candidate_slots(self, shard: int) -> range:
        """The old slots the shard's samples can have gone to, from its span of the running total alone (a
        superset of `_old_slots()`'s): once they are all worked out, no sample needs its slot."""
        deal = self._deal
        if deal.total <= 0:
            return range(1)
        p, slack = int(self._position[shard]), 1e-9 * deal.total  # slack: rounding of the sums never drops a slot
        lo, hi = (
            min(int(v * deal.num_slots / deal.total), deal.num_slots - 1)
            for v in (max(0.0, deal.prefix[p] - slack), deal.prefix[p + 1] + slack)
        )
        return range(lo, hi + 1)

    def _old_slots(self, shard: int) -> np.ndarray:
        """The old slot each sample of the shard was dealt to (recomputed when asked, not kept: it would
        cost 8 bytes a sample, the most of a resume's memory)."""
        if self._deal.total <= 0:  # nothing was dealt: every sample "belongs" to slot 0, which has none
            return np.zeros(int(self.lengths.counts[shard]), dtype=np.int64)
        return self._deal.slot_of(int(self._position[shard]))

    def _consume_slot(self, slot: int) -> None:
        """Mark the samples of the old slot's first yielded batches: from the batches the slot formed up to them
        where the checkpoint holds its rank's equalisation, else by re-planning the old rank as it ran (all its
        slots at once)."""
        if slot in self._slots:
            return
        self._slots.add(slot)
        rank, worker = divmod(slot, self.layout.num_workers)
        eq = self.run.rank(rank)
        if eq is not None and self.config.batch_order == "random":
            self._consume_prefix(slot, eq, worker)
        elif rank not in self._ranks:
            self._ranks.add(rank)
            self._slots.update(self.layout.rank_slots(rank))
            self._replan_rank(rank)

    def _replan_rank(self, rank: int) -> None:
        """Re-plan one old rank as it ran (its slots, equalised to the old step count) and mark the samples
        of its first ``consumed`` batches (a state without the rank's equalisation: O(the rank's samples))."""
        run, cfg = self.run, self.config
        raw = rank_raw_slots(self.lengths, cfg, self.epoch, rank, run.layout, self.prior)
        rp = plan_rank(raw, run.steps, run.layout, cfg, self.epoch, rank, self.lengths)
        done = per_worker([len(s.batches) for s in rp.slots], run.consumed, rp.first_worker)
        taken = [s.gids[b] for s, k in zip(rp.slots, done) for b in s.batches[:k]]
        if taken:
            self._mark(np.concatenate(taken))

    def _consume_prefix(self, slot: int, eq: RankEqualised, worker: int) -> None:
        """Mark the old slot's consumed samples knowing its rank's equalisation: the batches each of the rank's
        workers yielded follow from the equalisation alone, and the slot's batcher runs only until its yielded
        batches are formed (`PrefixOf`)."""
        run, cfg = self.run, self.config
        k = per_worker([s.take for s in eq.slots], run.consumed, eq.start)[worker]
        if not k:
            return
        one = range(slot, slot + 1)
        layout = run.layout
        dealt = plan_slots(
            self.lengths, layout.num_slots, cfg.epoch_seed, self.epoch, cfg.shuffle, self.prior, one, self._deal
        )
        self._mark_stream(dealt[slot], self._slot_prefix(dealt[slot], slot, eq.slots[worker], k))

    def _slot_prefix(self, pieces: list[Piece], slot: int, eq: SlotEqualised, k: int) -> np.ndarray:
        """Stream positions of the samples of one old slot's first ``k`` batches, batching its stream no
        further."""
        cfg, lengths, prior = self.config, self.lengths, self.prior
        lens = stream_lengths(pieces, lengths, prior)
        outs = stream_outputs(pieces, lengths, prior) if cfg.output_budget is not None else None
        keys = stream_groups(pieces, lengths, prior, cfg.batch_by) if cfg.batch_by is not None else None
        order = slot_order(pieces, lengths.offsets, prior, cfg, self.epoch, slot)
        if order is not None:  # interleaved shards: the batcher saw the stream as it arrived
            lens = lens[order]
            outs = None if outs is None else outs[order]
            keys = None if keys is None else keys[order]
        rng = epoch_rng(cfg.epoch_seed, self.epoch, slot, 1)
        prefix = PrefixOf(eq, k, rng) if cfg.balance is None else BalancedPrefix(eq, k, rng, cfg, self.epoch, lens)
        for flat, sizes in BucketBatcher.for_slot(cfg, self.epoch, slot).rounds(lens, outs, keys):
            if prefix.add(flat, sizes):
                break
        return prefix.positions() if order is None else order[prefix.positions()]

    def _mark_stream(self, pieces: list[Piece], taken: np.ndarray) -> None:
        """Mark the samples at stream positions ``taken`` of a slot streaming ``pieces`` (a piece at a time: no
        sort of the samples' ids)."""
        if not taken.size:
            return
        lengths, prior = self.lengths, self.prior
        kept = [~piece_excluded(p, lengths.offsets, prior) for p in pieces] if prior is not None else None
        hit = np.zeros(sum(int(x.sum()) for x in kept) if kept is not None else sum(p.count for p in pieces), bool)
        hit[taken] = True
        at = 0
        for i, p in enumerate(pieces):
            n = p.count if kept is None else int(kept[i].sum())
            seg, at = hit[at : at + n], at + n
            if seg.any():
                mask = self._marks.setdefault(p.shard, np.zeros(int(lengths.counts[p.shard]), dtype=bool))
                if kept is None:
                    mask[p.start : p.stop] |= seg
                else:
                    mask[p.start : p.stop][kept[i]] |= seg

    def _mark(self, gids: np.ndarray) -> None:
        offsets = self.lengths.offsets
        for s, sel in by_shard(gids, offsets):
            mask = self._marks.setdefault(s, np.zeros(int(self.lengths.counts[s]), dtype=bool))
            mask[gids[sel] - offsets[s]] = True


class PrefixOf:
    """The stream positions of the samples in a slot's first ``k`` yielded batches, from its batcher's batches
    in the order they form: each is split as `split_rule()` recorded, repeats
    follow the seeded pad picks (they add no sample), and the batch hardest-first moved to the front counts as
    yielded. Exact against `apply_adjust()` (tested on random plans)."""

    def __init__(self, eq: SlotEqualised, k: int, pad_rng: np.random.Generator):
        self.eq = eq
        moved = eq.hardest >= 0 and k >= 1
        # entries (batches after splits and repeats, before the move) whose samples were yielded
        self.upto = k - 1 if moved and eq.hardest >= k - 1 else k
        self.extra = eq.hardest if moved and eq.hardest >= k - 1 else -1
        self.needed = max(self.upto, self.extra + 1)
        self.repeats = np.zeros(max(eq.batches, 0), dtype=np.int64)
        if eq.pad and eq.batches:
            picks = pad_rng.choice(eq.batches, size=eq.pad, replace=eq.pad > eq.batches)
            self.repeats = np.bincount(picks, minlength=eq.batches)
        self.entry, self.piece, self.ties = 0, 0, 0  # entries and pieces seen; ties of the cut size met
        self.taken: list[np.ndarray] = []

    def add(self, flat: np.ndarray, sizes: np.ndarray) -> bool:
        """Take one round's batches (positions flat, sizes); True once every yielded batch is formed."""
        starts = np.cumsum(sizes) - sizes
        for a, n in zip(starts.tolist(), sizes.tolist()):
            for piece in self._pieces(flat[a : a + n]):
                self._entry(piece)
                if self.entry >= self.needed:
                    return True
        return self.entry >= self.needed

    def _pieces(self, batch: np.ndarray) -> list[np.ndarray]:
        """One batch as the split rule leaves it: halved while larger than the cut size, or of that size and
        among the first ``cut_ties`` such (depth first: the order of the pieces in the slot)."""
        t = self.eq.cut_size
        n = len(batch)
        if not self.eq.cut_ties or n < t:
            return [batch]
        if n == t:
            self.ties += 1
            if self.ties > self.eq.cut_ties:
                return [batch]
        h = n // 2
        return self._pieces(batch[:h]) + self._pieces(batch[h:])

    def _entry(self, piece: np.ndarray) -> None:
        """One batch after the splits, with its repeats: taken if among the yielded entries."""
        copies = 1 + (int(self.repeats[self.piece]) if self.piece < len(self.repeats) else 0)
        first, self.entry, self.piece = self.entry, self.entry + copies, self.piece + 1
        if first < self.upto or any(e == self.extra for e in range(first, self.entry)):
            self.taken.append(piece)

    def positions(self) -> np.ndarray:
        """Stream positions of the yielded batches' samples."""
        return np.concatenate(self.taken).astype(np.int64) if self.taken else np.zeros(0, dtype=np.int64)


class BalancedPrefix(PrefixOf):
    """`PrefixOf` for a balanced order (`balance`): every batch of the groups of rounds that the first ``k``
    yielded batches come from is formed, each with its round, and they are equalised and ordered as
    `apply_adjust()` orders them; a group is ordered on its own batches and positions alone, so its order in
    this prefix is its order in the whole slot. A sliding span (`band_order()`) orders a round on the rounds
    after it too: the prefix then runs on past the first ``k`` batches' rounds by as many rounds as that reads."""

    def __init__(
        self, eq: SlotEqualised, k: int, pad_rng: np.random.Generator, config: BatchingConfig, epoch: int, lens: Any
    ):
        super().__init__(eq, k, pad_rng)
        self.k, self.config, self.epoch, self.lens = k, config, epoch, lens
        self.needed = max(k + 1, eq.hardest + 1)  # a move to the front shifts the others by one at most
        self.round = 0
        self.balance = config.balance  # resolved once: add() reads it every round
        self.span = self.balance.rounds if self.balance is not None else 1
        # a sliding span orders each round against the rounds around it (`band_order()`), not in groups
        self.sliding = self.balance is not None and bool(self.balance.band) and 2 <= self.span <= BAND_ROUNDS
        self.reached: int | None = None
        # the batches after splits and pads, as three lists: positions, whether a repeat, round
        self.batches: list[np.ndarray] = []
        self.repeated: list[bool] = []
        self.rounds: list[int] = []

    def add(self, flat: np.ndarray, sizes: np.ndarray) -> bool:
        t = self.eq.cut_size
        if len(sizes) and (not self.eq.cut_ties or int(sizes.max()) < t):  # no batch of the round is split
            ends = np.cumsum(sizes).tolist()
            pieces = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
            if not self.repeats[self.piece : self.piece + len(pieces)].any():
                self.batches += pieces
                self.repeated += [False] * len(pieces)
                self.rounds += [self.round] * len(pieces)
                self.entry, self.piece = self.entry + len(pieces), self.piece + len(pieces)
            else:
                for piece in pieces:
                    self._entry(piece)
        else:
            starts = np.cumsum(sizes) - sizes
            for a, n in zip(starts.tolist(), sizes.tolist()):
                for piece in self._pieces(flat[a : a + n]):
                    self._entry(piece)
        self.round += 1
        if self.sliding:
            if self.reached is None and self.entry >= self.needed:
                self.reached = self.round - 1  # the round that forms the needed-th batch
            return self.reached is not None and self.round > self.reached + band_read_ahead(self.span)
        return self.entry >= self.needed and self.round % self.span == 0

    def _entry(self, piece: np.ndarray) -> None:
        copies = 1 + (int(self.repeats[self.piece]) if self.piece < len(self.repeats) else 0)
        self.batches += [piece] * copies
        self.repeated += [c > 0 for c in range(copies)]
        self.rounds += [self.round] * copies
        self.entry, self.piece = self.entry + copies, self.piece + 1

    def positions(self) -> np.ndarray:
        balance = self.config.balance
        assert balance is not None
        idx = np.arange(len(self.batches))
        if 0 <= self.eq.hardest < len(idx):
            idx = np.concatenate([[self.eq.hardest], idx[: self.eq.hardest], idx[self.eq.hardest + 1 :]])
        idx = idx[: self.eq.take] if self.eq.take >= 0 else idx
        n, k = len(idx), min(self.k, len(idx))
        repeated = np.asarray(self.repeated, dtype=bool)
        if n > 1 and k:
            rounds = np.asarray(self.rounds, dtype=np.int64)[idx]
            if self.sliding:  # a batch may move across rounds: the whole prefix is ordered
                lo, stop = 0, n
            else:
                # the order moves batches only within a group of rounds: every group before the one holding
                # position k - 1 is yielded whole, whatever its order, so only that group is ordered here
                group = rounds // max(1, balance.rounds)
                bounds = np.concatenate([[0], np.flatnonzero(np.diff(group) != 0) + 1, [n]])
                i = int(np.searchsorted(bounds, k - 1, side="right")) - 1
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                stop = min(hi + 1, n)  # and the next batch, which says whether the group's last one is repeated
            part = idx[lo:stop]
            order = balanced_order(
                balance.time.times([self.batches[j] for j in part], self.lens),
                rounds[lo:stop].tolist(),
                repeated[part].tolist(),
                lo == 0 and self.eq.hardest >= 0,
                targets(self.config.epoch_seed, self.epoch, lo, stop - lo),
                balance.rounds,
                balance.band,
            )
            idx[lo:stop] = part[order]
        taken = [self.batches[j] for j in idx[:k].tolist() if not repeated[j]]
        return np.concatenate(taken).astype(np.int64) if taken else np.zeros(0, dtype=np.int64)


def excluded_in(
    resumed: Resumed | None, epoch: int, lengths: Lengths, config: BatchingConfig, selection: Any = None
) -> Any:
    """The samples ``epoch`` leaves out — consumed on earlier layouts, or (``selection``) not taken by a
    mixture this epoch — as a lazy mask over global ids, or None: what the loader plans around and each
    worker streams around."""
    if resumed is None or resumed.epoch != epoch:
        return selection
    return resumed.consumed(lengths, config, selection)
