"""The batcher: a bounded, length-sorted window of samples cut greedily into budget-bounded batches.

One algorithm, two drivers: `BucketBatcher` takes samples one at a time (the online path, without an
index), and `plan_batches()` / `BucketBatcher.plan()` run the very same batcher over a length array
with no I/O (the epoch planner, ``len(loader)`` and the benchmarks). So the plan and the run cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import OptionError, SampleTooLongError, int_option, shown
from .batchplan import BatchPlan, plan_inputs, sort_batches, sorted_oracle  # noqa: F401 - sorted_oracle: the reference, public here
from .config import BatchingConfig, check_seed, slot_seed
from .cost import PaddedCost
from .groups import GroupHistograms, group_ends, group_runs
from .mates import LEVEL_CUT_WINDOWS, LevelCut, mix_runs
from .outputs import bound_reach
from .packed import pack_by_sum
from .select import LengthHistogram, batch_members, run_keys, run_positions, select_runs, tight_share


class BucketBatcher:
    """Online batcher over a bounded, length-sorted window of samples.

    `push()` adds one sample (an integer id and its length) and returns the batches that became ready;
    `flush()` packs what is left at the end of the stream. When the window holds ``buffer_size``
    samples it is sorted by length and packed greedily, longest first, into batches that each take as many
    samples as ``n × max_len ≤ budget`` (and ``max_batch_size``) allow; with ``bucket_boundaries`` no batch
    crosses a boundary. Complete batches are then emitted in a seeded random choice and order until at least
    ``refill`` samples have left the window, and the rest wait for new samples to pack with. Every batch is
    thus cut from a sorted run of up to ``buffer_size`` samples (padding close to a global sort), while the
    emission order stays random (no correlation of length with position in the epoch). With ``batch_order``
    ``"ascending"``/``"descending"``, `plan()` sorts the stream's batches by their longest sample
    (`sort_batches()`); `push()`/`flush()` emit batches as they form (no whole stream to sort).
    With ``batch_by``, each sample also carries a group key and no batch holds two keys (`groups`).
    """

    def __init__(
        self, config: BatchingConfig, seed: int | Sequence[int] | None = None, stream_length: int | None = None
    ):
        if not isinstance(config, BatchingConfig):
            raise OptionError(f"config must be a BatchingConfig (BatchingConfig.make(...)), got {shown(config)}")
        if seed is not None:
            check_seed(seed)
        c = config
        # samples the stream will bring, where known (plan() knows it)
        self.stream_length = None if stream_length is None else int_option("stream_length", stream_length, 0)
        self.config = c
        self.budget = float(c.budget)
        self.boundaries = c.bucket_boundaries if c.bucket_boundaries is not None else np.zeros(0)
        self.max_batch_size = int(c.max_batch_size) if c.max_batch_size else 1 << 40
        self.multiple = int(c.batch_size_multiple_of)
        assert c.buffer_size is not None  # BatchingConfig.__post_init__ sets it
        self.buffer_size = int(c.buffer_size)
        self.refill = max(1, int(c.refill) if c.refill else self.buffer_size // 4)
        self.min_length = float(c.min_length or 0)
        self.max_length = float(c.max_length) if c.max_length is not None else math.inf
        self.cost = c.cost if c.cost is not None else PaddedCost()
        self.drop_last = c.drop_last
        self.strict = c.strict
        self.shuffle = c.shuffle
        self.pad_multiple = int(c.pad_to_multiple_of or 1)
        self.rng = np.random.default_rng(c.seed if seed is None else seed)
        # batches trade members (`mates`; padded, shuffled, one budget) from a generator of their own
        trades = c.shuffle and c.plan_version >= 2 and c.output_budget is None
        self._mates = self.rng.spawn(1)[0] if trades else None
        # a short stream is cut at level tops, a level's samples in random order (`mates.LevelCut`; v5)
        # (``level_width``: every stream, at levels that many length units apart)
        cut = trades and c.plan_version >= 5 and not self.cost.packed and not self.boundaries.size
        self._level_cut = LevelCut(self.rng.spawn(1)[0], self._capacity, c.level_width) if cut else None
        self._ids = np.zeros(self.buffer_size, dtype=np.int64)
        self._out_dtype: type = np.int64  # batches as int32 positions when the whole stream is known to fit
        self._lens = np.zeros(self.buffer_size, dtype=np.float64)
        self.output_budget = float(c.output_budget) if c.output_budget is not None else None
        self._outs = np.zeros(self.buffer_size, dtype=np.float64)  # output lengths (with an output budget)
        self.grouped = c.batch_by is not None
        self._groups = np.zeros(self.buffer_size, dtype=np.int64)  # group keys (with batch_by)
        self._ties = np.zeros(self.buffer_size, dtype=np.uint64)  # a level's order (a short stream's level cut)
        self.held = 0
        self._nsorted = 0  # window[:_nsorted] is sorted longest first; the rest arrived since
        self.max_held = 0
        self.skipped: list[int] = []
        self.dropped: list[int] = []
        # lengths pushed so far: how common each length is in this stream (per group key with batch_by)
        self._seen: Any = GroupHistograms() if self.grouped else LengthHistogram()
        self._pushed = 0  # samples that entered the window

    # ---- input ----------------------------------------------------------------------------------
    def _tensor_len(self, lengths: np.ndarray) -> np.ndarray:
        """Lengths as the padded tensor will have them (rounded up to ``pad_to_multiple_of``)."""
        if self.pad_multiple > 1:
            return np.ceil(lengths / self.pad_multiple) * self.pad_multiple
        return lengths

    def _capacity(self, lengths: np.ndarray) -> np.ndarray:
        """Most samples a batch whose longest sample has each length can hold under the budget."""
        t = self._tensor_len(lengths)
        if self.cost.packed:  # by sum: a sample alone fits if it is within the budget
            return np.where(t <= self.budget, self.max_batch_size, 0)
        return self.cost.capacity(t, self.budget, self.max_batch_size)

    def accepts_many(self, lengths: np.ndarray, outputs: np.ndarray | None = None) -> np.ndarray:
        """Whether samples of these lengths (and output lengths) can ever be batched (else they are skipped
        and counted)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        ok = (lengths >= self.min_length) & (lengths <= self.max_length) & (lengths > 0)
        ok[ok] = self._capacity(lengths[ok]) >= 1
        if self.output_budget is not None and outputs is not None:
            ok &= np.asarray(outputs, dtype=np.float64) <= self.output_budget
        return ok

    def accepts(self, length: float, output: float = 0.0) -> bool:
        return bool(self.accepts_many(np.array([length]), np.array([output]))[0])

    def push(self, sid: int, length: float, output: float = 0.0, group: int = 0) -> list[np.ndarray]:
        """Add one sample (with its output length under an ``output_budget``, its group key under ``batch_by``);
        return the batches (arrays of ids) that are ready, usually none."""
        if self._cut_short() is not None:  # the vectorised path, the same batches (it cuts at level tops)
            return self.push_many(np.array([sid]), np.array([length]), np.array([output]), np.array([group]))
        if not self.accepts(length, output):
            self._reject(sid, length)
            return []
        h = self.held
        self._ids[h] = sid
        self._lens[h] = length
        self._outs[h] = output
        self._groups[h] = group
        self._seen.add_one(float(length), int(group))
        self._pushed += 1
        self.held = h + 1
        if self.held > self.max_held:
            self.max_held = self.held
        if self.held >= self.buffer_size:
            return self._round(final=False)
        return []

    def push_many(
        self, sids: np.ndarray, lengths: np.ndarray, outputs: np.ndarray | None = None, groups: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """Vectorised `push()` of many samples; the same batches as pushing them one by one."""
        out: list[np.ndarray] = []
        for flat, k in self._push_many_flat(sids, lengths, outputs, groups):
            out.extend(np.split(flat, np.cumsum(k)[:-1]) if len(k) else [])
        return out

    def _push_many_flat(
        self, sids: np.ndarray, lengths: np.ndarray, outputs: np.ndarray | None = None, groups: np.ndarray | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`push_many()`, yielding each round's emitted batches flat (ids, sizes)."""
        sids = np.asarray(sids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.float64)
        outputs = np.zeros(len(lengths)) if outputs is None else np.asarray(outputs, dtype=np.float64)
        groups = np.zeros(len(lengths), dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
        ok = self.accepts_many(lengths, outputs)
        if not ok.all():
            for sid, length in zip(sids[~ok].tolist(), lengths[~ok].tolist()):
                self._reject(sid, length)
            sids, lengths, outputs, groups = sids[ok], lengths[ok], outputs[ok], groups[ok]
        lengths, ties = self._cut_lengths(lengths)
        pos, n = 0, len(sids)
        while pos < n:
            k = min(self.buffer_size - self.held, n - pos)
            self._ids[self.held : self.held + k] = sids[pos : pos + k]
            self._lens[self.held : self.held + k] = lengths[pos : pos + k]
            self._outs[self.held : self.held + k] = outputs[pos : pos + k]
            self._groups[self.held : self.held + k] = groups[pos : pos + k]
            if ties is not None:
                self._ties[self.held : self.held + k] = ties[pos : pos + k]
            self._seen.add(lengths[pos : pos + k], groups[pos : pos + k])
            self._pushed += k
            self.held += k
            pos += k
            self.max_held = max(self.max_held, self.held)
            if self.held >= self.buffer_size:
                yield self._round_flat(final=False)

    def _cut_short(self) -> LevelCut | None:
        """The level cut, where this stream is short enough for it (`LEVEL_CUT_WINDOWS` windows) or
        ``level_width`` asks for it."""
        if self.config.level_width is not None:
            return self._level_cut
        n = self.stream_length
        return self._level_cut if n is not None and n <= LEVEL_CUT_WINDOWS * self.buffer_size else None

    def _cut_lengths(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The lengths the window sorts and cuts by: the samples' own, or their level tops and the keys that order
        a level's samples (`_cut_short()`)."""
        cut = self._cut_short()
        return (lengths, None) if cut is None else (cut.lengths(lengths), cut.ties(lengths))

    def _reject(self, sid: int, length: float) -> None:
        if self.strict:
            raise SampleTooLongError(
                f"sample {sid} has length {length}: outside [min_length={self.min_length}, "
                f"max_length={self.max_length}] or over the budget {self.budget} ({self.cost.name} cost) by itself"
            )
        self.skipped.append(int(sid))

    def flush(self) -> list[np.ndarray]:
        """End of stream: pack everything left and emit it (``drop_last`` drops the one incomplete batch)."""
        if not self.held:
            return []
        return self._round(final=True)

    @classmethod
    def for_slot(cls, config: BatchingConfig, epoch: int, slot: int, stream_length: int | None = None) -> BucketBatcher:
        """A fresh batcher whose shuffle is seeded for one (rank, worker) slot of one epoch."""
        return cls(config, seed=slot_seed(config.seed, epoch, slot), stream_length=stream_length)

    def plan(
        self, lengths: Sequence[float] | np.ndarray, outputs: np.ndarray | None = None, groups: np.ndarray | None = None
    ) -> BatchPlan:
        """Run a whole stream with these lengths (output lengths, group keys) through this (fresh) batcher: its
        batches as positions (int32 where they fit), gathered flat a chunk at a time (a rank's plan costs its
        positions only). The stream's length is known here: pushing the same lengths into a batcher made with
        ``stream_length=len(lengths)`` forms the same batches."""
        rounds = list(self.rounds(lengths, outputs, groups))
        flat = np.concatenate([f for f, _ in rounds]) if rounds else np.zeros(0, dtype=self._out_dtype)
        counts = np.concatenate([k for _, k in rounds]) if rounds else np.zeros(0, dtype=np.int64)
        per_round: np.ndarray | None = np.array([len(k) for _, k in rounds], dtype=np.int64)
        if self.config.batch_order != "random" and len(counts) > 1:
            flat, counts = sort_batches(flat, counts, np.asarray(lengths), self.config.batch_order == "descending")
            per_round = None
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return BatchPlan(skipped=self.skipped, dropped=self.dropped, flat=flat, bounds=bounds, rounds=per_round)

    def rounds(
        self, lengths: Sequence[float] | np.ndarray, outputs: np.ndarray | None = None, groups: np.ndarray | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`plan()`'s batches round by round, unsorted (flat positions, sizes): a resume stops early."""
        n = len(lengths)
        if self.grouped and groups is None:
            raise OptionError(f"batch_by={self.config.batch_by!r} needs each sample's group key (groups=)")
        if self.stream_length is None:
            self.stream_length = n
        if n < 2**31:
            self._out_dtype = np.int32
        step = max(self.buffer_size, 1 << 16)  # in chunks: the same batches, a chunk's temporaries at a time
        for a in range(0, n, step):
            b = min(n, a + step)
            outs = None if outputs is None else np.asarray(outputs[a:b])
            keys = None if groups is None else np.asarray(groups[a:b])
            yield from self._push_many_flat(np.arange(a, b), np.asarray(lengths[a:b]), outs, keys)
        if self.held:
            yield self._round_flat(final=True)

    # ---- packing --------------------------------------------------------------------------------
    def _sort_window(self) -> None:
        """Merge the samples pushed since the last round into the window, kept sorted longest first.

        Ties keep arrival order, so the result equals a stable sort of the whole window. With ``batch_by`` the
        window is sorted by group key first, and a short stream's level cut (`LevelCut`) breaks
        ties at random: both sort the whole window again.
        """
        h, m = self.held, self._nsorted
        if m == h:
            return
        cut = self._cut_short()
        if self.grouped or cut is not None:  # the whole window sorted again (by key, length, tie)
            g = self._groups[:h] if self.grouped else None
            o = cut.order(self._lens[:h], self._ties[:h], g) if cut else np.lexsort((-self._lens[:h], self._groups[:h]))
            for a in (self._lens, self._ids, self._outs, self._groups, self._ties):
                a[:h] = a[:h][o]
            self._nsorted = h
            return
        new_lens, new_ids, new_outs = self._lens[m:h], self._ids[m:h], self._outs[m:h]
        o = np.argsort(-new_lens, kind="stable")
        new_lens, new_ids, new_outs = new_lens[o], new_ids[o], new_outs[o]
        # final slots of the new samples; the old ones fill the rest in their order
        pos = np.searchsorted(-self._lens[:m], -new_lens, side="right") + np.arange(h - m)
        old = np.ones(h, dtype=bool)
        old[pos] = False
        lens, ids, outs = np.empty(h), np.empty(h, dtype=np.int64), np.empty(h)
        lens[old], ids[old], outs[old] = self._lens[:m], self._ids[:m], self._outs[:m]
        lens[pos], ids[pos], outs[pos] = new_lens, new_ids, new_outs
        self._lens[:h], self._ids[:h], self._outs[:h] = lens, ids, outs
        self._nsorted = h

    def _runs(
        self, s: np.ndarray, o: np.ndarray | None = None, g: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each position of the sorted window ``s``: where a batch starting there ends (its capacity,
        in multiples of ``batch_size_multiple_of``; under an output budget also ``n × max(o) ≤ output_budget``
        for the output lengths ``o``), and where its bucket's run of the window ends (with ``batch_by``: its
        group's run too, for the group keys ``g``). Where a batch ends never decreases along the window."""
        n = len(s)
        cap = self._capacity(s)
        if self.multiple > 1:
            cap = np.where(cap >= self.multiple, cap - cap % self.multiple, cap)
        reach = np.arange(n, dtype=np.int64) + cap
        g_end = group_ends(g) if self.grouped and g is not None else None
        if g_end is not None:  # past its group's run means "not complete yet": one past is as good, and monotone
            reach = np.minimum(reach, g_end + 1)
        if self.output_budget is not None and o is not None:
            reach = bound_reach(reach, o, self.output_budget, self.multiple, g_end)
        cuts = np.zeros(max(n - 1, 0), dtype=bool)
        if self.boundaries.size:
            cuts |= np.diff(np.searchsorted(self.boundaries, s, side="left")) != 0
        if g is not None and g_end is not None:
            cuts |= np.diff(g) != 0
        if cuts.any():
            change = np.flatnonzero(cuts) + 1
            seg_end = np.append(change, n)[np.searchsorted(change, np.arange(n), side="right")]
        else:
            seg_end = np.full(n, n, dtype=np.int64)
        return reach, seg_end

    def _pack(
        self, s: np.ndarray, o: np.ndarray | None = None, g: np.ndarray | None = None
    ) -> tuple[list[np.ndarray] | tuple[np.ndarray, np.ndarray], np.ndarray]:
        """Cut lengths ``s`` (sorted longest first; with ``batch_by`` within each group key of ``g``) greedily
        into batches.

        Returns the batches — ``(starts, ends)`` of runs in ``s``, or for packed batches a list of position
        arrays — and whether each is complete (no further sample could join).
        """
        if self.cost.packed:
            return self._pack_by_sum(s, g)
        n = len(s)
        reach, seg_end = self._runs(s, o, g)
        full = reach <= seg_end
        nxt = np.append(np.minimum(reach, seg_end), n)  # sentinel n jumps to itself
        # the greedy chain start → start + capacity, followed by pointer doubling: a few vectorised passes
        starts = np.zeros(1, dtype=np.int64)
        jump = nxt
        while True:
            more = jump[starts]
            more = more[more < n]
            if more.size == 0:
                break
            starts = np.concatenate([starts, more])
            jump = jump[jump]
        starts.sort()
        return (starts, nxt[starts]), full[starts]

    def _pack_by_sum(self, s: np.ndarray, g: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """Packed batches (no padding) by `pack_by_sum()`; with ``batch_by`` each
        group's run of the window on its own."""
        t = self._tensor_len(s).tolist()
        if not self.grouped or g is None:
            return pack_by_sum(t, self.budget, self.max_batch_size)
        members: list[np.ndarray] = []
        full: list[np.ndarray] = []
        for a, b in group_runs(g):
            m, f = pack_by_sum(t[a:b], self.budget, self.max_batch_size)
            members += [x + a for x in m]
            full.append(f)
        return members, np.concatenate(full) if full else np.zeros(0, dtype=bool)

    def _round(self, final: bool) -> list[np.ndarray]:
        """One round of packing and emission, as a list of batches (the online path)."""
        flat, sizes = self._round_flat(final)
        return np.split(flat, np.cumsum(sizes)[:-1]) if len(sizes) else []

    def _round_flat(self, final: bool) -> tuple[np.ndarray, np.ndarray]:
        """Sort the window, cut it into batches and emit some: the emitted batches' ids flat, and their sizes.

        Mid-stream, the tightest complete batches leave (`select`; packed batches: complete
        ones at random) until ``refill`` samples are freed, in random order; partial ones, fullest first, only if
        those don't free enough. At the end all leave, in random order (``drop_last``: complete ones only)."""
        self._sort_window()
        if final:
            return self._final_round()
        if self.cost.packed:
            return self._emit(*self._greedy_choice(np.arange(self.held), self.refill))
        out, sizes = self._tightest_choice()
        return self._emit(self._traded(out, sizes), sizes)

    def _traded(self, out: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Window positions ``out`` of the round's batches with members traded among near runs (`mates`)."""
        if self._mates is None or self.cost.packed:
            return out
        h, keys = self.held, None
        if self.boundaries.size or self.grouped:  # what no batch crosses: a bucket (as `_runs()` cuts), a key
            keys = np.searchsorted(self.boundaries, self._lens[:h], side="left") * (1 << 32) + self._groups[:h]
        return mix_runs(out, sizes, self._lens[:h], self._capacity, self._mates, keys)

    def _final_round(self) -> tuple[np.ndarray, np.ndarray]:
        """End of stream: the whole window cut greedily, every batch emitted (``drop_last``: complete ones)."""
        h = self.held
        ids = self._ids[:h]
        batches, full = self._pack(self._lens[:h], self._outs[:h], self._groups[:h])
        members, sizes = batch_members(batches)
        nb = len(sizes)
        chosen = self.rng.permutation(nb) if self.shuffle else np.arange(nb)
        if self.drop_last:
            keep = full[chosen]
            self.dropped.extend(ids[members(chosen[~keep])].tolist())
            chosen = chosen[keep]
        out = self._traded(members(chosen), sizes[chosen])
        self.held = self._nsorted = 0
        return ids[out].astype(self._out_dtype), sizes[chosen]

    def _tightest_choice(self) -> tuple[np.ndarray, np.ndarray]:
        """Window positions of the batches to emit (flat, in emission order) and their sizes: the tightest
        disjoint complete runs (`tight_share()` of ``refill``), topped up with
        the greedy cut's batches (complete ones at random, then partial ones) to ``refill``."""
        h = self.held
        lens = self._lens[:h]
        g = self._groups[:h]
        ends, seg_end = self._runs(lens, self._outs[:h], g)
        tiebreak = self.rng if self.shuffle else None
        need = tight_share(self._pushed, self.stream_length, self.buffer_size, self.refill)
        starts = np.zeros(0, dtype=np.int64)
        if need:
            seen = self._seen.of_sorted(lens, g) if self.grouped else self._seen.of_sorted(lens)
            key = run_keys(lens, self._tensor_len(lens), ends, ends <= seg_end, seen, tiebreak)
            starts = select_runs(key, ends, need)
        if not self.shuffle:
            starts = np.sort(starts)
        sizes = ends[starts] - starts
        out = run_positions(starts, ends[starts])
        if len(out) < min(self.refill, h):
            rest = np.ones(h, dtype=bool)
            rest[out] = False
            more, more_sizes = self._greedy_choice(np.flatnonzero(rest), self.refill - len(out))
            out, sizes = np.concatenate([out, more]), np.concatenate([sizes, more_sizes])
        if self.shuffle and len(starts) and len(sizes) > 1:  # (only greedy batches: in random order already)
            order = self.rng.permutation(len(sizes))
            first = np.cumsum(sizes) - sizes
            out, sizes = out[run_positions(first[order], first[order] + sizes[order])], sizes[order]
        return out, sizes

    def _greedy_choice(self, positions: np.ndarray, need: int) -> tuple[np.ndarray, np.ndarray]:
        """The window at ``positions`` (sorted) cut greedily; complete batches in random order, then partial
        ones fullest first, until ``need`` samples are chosen: their window positions flat, and sizes."""
        lens = self._lens[positions]
        batches, full = self._pack(lens, self._outs[positions], self._groups[positions])
        members, sizes = batch_members(batches)
        complete = np.flatnonzero(full)
        partial = np.flatnonzero(~full)
        fill = (
            np.add.reduceat(lens[members(partial)], np.cumsum(sizes[partial]) - sizes[partial])
            if len(partial)
            else np.zeros(0)
        )
        if self.shuffle:
            complete = complete[self.rng.permutation(len(complete))]
        cand = np.concatenate([complete, partial[np.argsort(-fill, kind="stable")]]).astype(np.int64)
        freed = np.cumsum(sizes[cand])
        chosen = cand[: int(np.searchsorted(freed, need, side="left")) + 1]
        return positions[members(chosen)], sizes[chosen]

    def _emit(self, out: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove the samples at window positions ``out`` from the window; their ids flat, and the sizes."""
        h = self.held
        keep = np.ones(h, dtype=bool)
        keep[out] = False
        k = h - len(out)
        flat = self._ids[:h][out].astype(self._out_dtype)
        for a in (self._ids, self._lens, self._outs, self._groups, self._ties):
            a[:k] = a[:h][keep]
        self.held = self._nsorted = k
        return flat, sizes


def iter_batches(items: Iterable, batcher: BucketBatcher, length_of, output_of=None, group_of=None) -> Iterator[list]:
    """Stage: feed ``items`` through ``batcher`` (``length_of(item)`` gives the length; ``output_of`` the output
    length under an output budget, ``group_of`` the group key under ``batch_by``), yield item batches.

    Items are held in a dict keyed by arrival number until their batch is emitted, so at most
    ``buffer_size`` items are in memory.
    """
    held: dict[int, object] = {}
    for i, item in enumerate(items):
        held[i] = item
        ready = batcher.push(
            i,
            length_of(item),
            output_of(item) if output_of is not None else 0.0,
            group_of(item) if group_of is not None else 0,
        )
        if batcher.skipped and batcher.skipped[-1] == i:
            held.pop(i)
        for batch in ready:
            yield [held.pop(j) for j in batch.tolist()]
    for batch in batcher.flush():
        yield [held.pop(j) for j in batch.tolist()]
    for j in batcher.dropped:
        held.pop(j, None)


def plan_batches(
    lengths: Sequence[float] | np.ndarray,
    budget: float | None = None,
    *,
    config: BatchingConfig | None = None,
    output_lengths: Sequence[float] | np.ndarray | None = None,
    groups: Sequence[int] | np.ndarray | None = None,
    **options: Any,
) -> BatchPlan:
    """The batches the loader forms for a stream with these lengths, as arrays of stream positions.

    Pure and without I/O: the same `BucketBatcher` the loader runs, fed with the whole array. Give a
    `BatchingConfig`, or its options by name (`BatchingConfig.make()`: ``num_buckets`` estimates
    boundaries from ``lengths``; without boundaries every batch is cut from the sorted window directly).
    ``output_lengths`` with ``output_budget``: every batch also holds ``n × max output length ≤ output_budget``.
    ``groups`` with ``batch_by``: each sample's group key (integers); no batch holds two keys.
    """
    config, lens, outs, keys = plan_inputs(lengths, budget, config, options, output_lengths, groups)
    return BucketBatcher(config).plan(lens, outs, keys)
