"""Resuming an epoch on another layout: which samples the earlier layouts consumed, worked out per shard.

A checkpoint names the layouts an epoch ran on before it (ranks × workers, equalisation, agreed steps,
batches consumed), not the consumed samples: those follow from the plan. When the new layout's planner asks
whether some samples were consumed, :class:`Consumed` re-plans only the old ranks whose slots held those
samples' shards, so a rank resuming on another world size reads O(N / world) lengths, never the whole index.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import BatchingConfig
from .epoch import plan_rank, rank_raw_slots
from .layout import Layout
from .lengths import LazyMask, Lengths, by_shard
from .mixing import any_of
from .shards import Deal
from .slot import per_worker


@dataclass(frozen=True)
class EarlierRun:
    """How part of an epoch ran before a resume on another layout."""

    layout: Layout
    """The ranks, workers and equalisation it ran on."""
    steps: int
    """The batches per rank that layout agreed on for the epoch."""
    consumed: int
    """The batches every rank had consumed when the state was saved."""

    def state_dict(self) -> dict[str, Any]:
        """As a checkpoint holds it: the layout's fields, ``steps`` and ``consumed``, flat."""
        return {**dataclasses.asdict(self.layout), "steps": self.steps, "consumed": self.consumed}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EarlierRun:
        names = [f.name for f in dataclasses.fields(Layout)] + ["steps", "consumed"]
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"loader state: an earlier layout lacks {', '.join(missing)}")
        layout = Layout(**{f.name: state[f.name] for f in dataclasses.fields(Layout)})
        return cls(layout, int(state["steps"]), int(state["consumed"]))


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
    ids: ``consumed[gids]``, ``consumed[lo:hi]`` and ``consumed[gid]`` give booleans. Asking about samples costs
    a re-plan of the old ranks that held them (once per rank), and nothing else."""

    def __init__(self, lengths: Lengths, config: BatchingConfig, epoch: int, run: EarlierRun, prior: Any = None):
        self.lengths, self.config, self.epoch, self.run, self.prior = lengths, config, epoch, run, prior
        self.layout = run.layout
        seed = config.epoch_seed
        self._deal = Deal.of(lengths, run.layout.num_slots, seed, epoch, config.shuffle)
        self._position = np.empty(lengths.num_shards, dtype=np.int64)
        self._position[self._deal.order] = np.arange(lengths.num_shards)
        self._marks: dict[int, np.ndarray] = {}  # shard -> samples consumed under this layout (of ranks re-planned)
        self._ranks: set[int] = set()  # old ranks re-planned so far

    def _mask(self, gids: np.ndarray) -> np.ndarray:
        """Whether each sample was consumed: re-plan the old ranks that held these samples (once each)."""
        out = np.zeros(gids.size, dtype=bool)
        offsets = self.lengths.offsets
        for s, sel in by_shard(gids, offsets):
            pos = gids[sel] - offsets[s]
            if not self._ranks.issuperset(self._candidate_ranks(s)):
                for r in np.unique(self._old_slots(s)[pos] // self.layout.num_workers):
                    self._consume_rank(int(r))
            if s in self._marks:
                out[sel] = self._marks[s][pos]
        if self.prior is not None and gids.size:
            out |= np.asarray(self.prior[gids], dtype=bool)
        return out

    def _candidate_ranks(self, shard: int) -> range:
        """The old ranks the shard's samples can have gone to, from its span of the running total alone (a
        superset of :meth:`_old_slots`'s ranks): once they are all re-planned, no sample needs its slot."""
        deal = self._deal
        if deal.total <= 0:
            return range(1)
        p, slack = int(self._position[shard]), 1e-9 * deal.total  # slack: rounding of the sums never drops a rank
        lo, hi = (
            min(int(v * deal.num_slots / deal.total), deal.num_slots - 1)
            for v in (max(0.0, deal.prefix[p] - slack), deal.prefix[p + 1] + slack)
        )
        return range(lo // self.layout.num_workers, hi // self.layout.num_workers + 1)

    def _old_slots(self, shard: int) -> np.ndarray:
        """The old slot each sample of the shard was dealt to (recomputed when asked, not kept: it would
        cost 8 bytes a sample, the most of a resume's memory)."""
        if self._deal.total <= 0:  # nothing was dealt: every sample "belongs" to rank 0, which has none
            return np.zeros(int(self.lengths.counts[shard]), dtype=np.int64)
        return self._deal.slot_of(int(self._position[shard]))

    def _consume_rank(self, rank: int) -> None:
        """Re-plan one old rank as it ran (its slots, equalised to the old step count) and mark the samples
        of its first ``consumed`` batches."""
        if rank in self._ranks:
            return
        self._ranks.add(rank)
        run, cfg = self.run, self.config
        raw = rank_raw_slots(self.lengths, cfg, self.epoch, rank, run.layout, self.prior)
        rp = plan_rank(raw, run.steps, run.layout, cfg, self.epoch, rank, self.lengths)
        done = per_worker([len(s.batches) for s in rp.slots], run.consumed, rp.first_worker)
        taken = [s.gids[b] for s, k in zip(rp.slots, done) for b in s.batches[:k]]
        if taken:
            self._mark(np.concatenate(taken))

    def _mark(self, gids: np.ndarray) -> None:
        offsets = self.lengths.offsets
        for s, sel in by_shard(gids, offsets):
            mask = self._marks.setdefault(s, np.zeros(int(self.lengths.counts[s]), dtype=bool))
            mask[gids[sel] - offsets[s]] = True


def excluded_in(
    resumed: Resumed | None, epoch: int, lengths: Lengths, config: BatchingConfig, selection: Any = None
) -> Any:
    """The samples ``epoch`` leaves out — consumed on earlier layouts, or (``selection``) not taken by a
    mixture this epoch — as a lazy mask over global ids, or None: what the loader plans around and each
    worker streams around."""
    if resumed is None or resumed.epoch != epoch:
        return selection
    return resumed.consumed(lengths, config, selection)
