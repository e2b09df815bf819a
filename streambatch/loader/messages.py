"""What the loader tells its user in words: a budget no sample fits, why an epoch has no batches, and what a
mixture's epoch holds."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..errors import BudgetError
from ..format.describe import length_text
from ..format.index import ShardIndex
from ..plan.batcher import BucketBatcher
from ..plan.config import BatchingConfig
from ..plan.epoch import EpochPlan, RankSchedule
from ..plan.layout import Layout
from ..plan.lengths import Lengths
from ..plan.perturb import LengthTransform
from ..plan.resume import EarlierRun
from ..select.mixture import AnyIndex, MixedIndex, datasets_of
from ..select.where import IndexFilter


class EpochSetting(Protocol):
    """What an empty epoch's message names: the dataset, its filter, the batching and the ranks and workers (a
    `StreamBatchLoader` has these attributes)."""

    @property
    def name(self) -> str: ...
    @property
    def index(self) -> AnyIndex | None: ...
    @property
    def filter(self) -> IndexFilter | None: ...
    @property
    def config(self) -> BatchingConfig: ...
    @property
    def world_size(self) -> int: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def even_batches(self) -> str: ...


def unit_index(ix: AnyIndex) -> ShardIndex:
    """An index that says the lengths' unit and rate: the dataset's, or a mixture's first (its datasets share
    them)."""
    return datasets_of(ix)[0][1]


def empty_epoch_message(setting: EpochSetting, s: RankSchedule, local: bool) -> str:
    """Why an epoch plans no batch at all (``s``: the rank's schedule), and what to change."""
    ix, slots = setting.index, f"{setting.world_size} × {max(1, setting.num_workers)}"
    assert ix is not None, "an epoch is planned from an index"
    head = f"{setting.name}: epoch {s.epoch} has no batches"
    if not ix.num_samples:
        return f"{head}: the dataset has no samples"
    causes, fixes = [], []
    if s.skipped:
        causes.append(f"{s.skipped:,} skipped ({kept_text(setting.config, ix)})")
        fixes.append("widen min_length/max_length or raise the budget")
    if s.dropped:
        causes.append(f"{s.dropped:,} dropped by drop_last=True (no (rank, worker) slot of {slots} fills a batch)")
        fixes.append("use drop_last=False or fewer ranks/workers")
    flt, mixed = setting.filter, isinstance(ix, MixedIndex)
    if flt is not None:  # the filter first: it is what most often leaves too few
        whose = "the datasets'" if mixed else "the dataset's"
        head += f" (where={flt.expr!r} keeps {flt.kept:,} of {whose} {flt.total:,} samples)"
    n = s.planned_samples if local else _epoch_samples(ix, flt, mixed)
    few = f"too few for every rank to get a batch ({slots} (rank, worker) slots, even_batches={setting.even_batches!r})"
    if n == 0 and local:
        causes.append(f"none reached this rank: the epoch's samples are {few}")
        fixes.append("use fewer ranks/workers")
    elif n is None:  # a mixture's draw after a filter: not counted before planning
        causes.append(f"what where= keeps of the samples the weights take is {few}")
        fixes.append("loosen where=, weigh the datasets it keeps, or use fewer ranks/workers")
    elif s.skipped + s.dropped < n:  # the rest was batched, but some rank got none
        causes.append(f"the rest {few}")
        fixes.append("use fewer ranks/workers")
    whose = "this rank's" if local else "the"
    of = "" if n is None or (n == 0 and local) else f"of {whose} {n:,} samples, "
    return f"{head}: {of}{'; '.join(causes)}; {' or '.join(fixes)}"


def _epoch_samples(ix: AnyIndex, flt: IndexFilter | None, mixed: bool) -> int | None:
    """The samples an epoch plans before batching: a mixture's draw (``round(w·N)`` each), a dataset's samples
    or what its filter keeps; None for a mixture's draw after a filter (known once planned)."""
    if mixed:
        assert isinstance(ix, MixedIndex)
        return None if flt is not None else int(sum(d.take for d in ix.draws))
    return int(flt.kept) if flt is not None else int(ix.num_samples)


def kept_text(cfg: BatchingConfig, ix: AnyIndex) -> str:
    """The dataset's length range and what the options keep: ``lengths 1 to 9 samples; kept: ...``."""
    table = ix.shard_table(("count", "min_length", "max_length"))
    full = table["count"] > 0
    lo, hi = table["min_length"][full].min(), table["max_length"][full].max()
    unit = unit_index(ix)
    kept = [
        f"{k}={length_text(v, unit)}" for k, v in (("min_length", cfg.min_length), ("max_length", cfg.max_length)) if v
    ]
    kept.append(f"at most the budget {length_text(cfg.budget, unit)} alone")
    return f"lengths {length_text(lo, unit)} to {length_text(hi, unit)}; kept: {', '.join(kept)}"


def unindexed_empty_message(name: str, num_urls: int, cfg: BatchingConfig, epoch: int, bad: int) -> str:
    """Why a pass without an index gave no batch: every sample skipped (or lost with bad shards)."""
    limits = "".join(f", {k}={v:g}" for k, v in (("min_length", cfg.min_length), ("max_length", cfg.max_length)) if v)
    return (
        f"{name}: epoch {epoch} yielded no batches from {num_urls} shards: every "
        f"sample was skipped (kept: lengths within budget={cfg.budget:g}{limits})"
        + (f" or lost with {bad} bad shards" if bad else "")
        + "; check the budget against the lengths "
        "in the samples' .json (`shardify inspect` needs an index)"
    )


def mixture_report(index: MixedIndex, plan: EpochPlan, lengths: Lengths) -> dict[str, dict[str, float]]:
    """Per dataset of a mixture, what the planned epoch holds: samples, total length (and hours for audio)
    and share of the epoch's samples — the batches every rank yields, repeats of ``pad`` not counted."""
    parts = [s.gids[b] for s in plan.slots for b, rep in zip(s.batches, s.repeat) if not rep]
    gids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    dataset, _, _ = index.locate(gids)
    lens = np.asarray(lengths[gids], dtype=np.float64)
    spu = index.seconds_per_unit()
    out = {}
    for d, name in enumerate(index.names):
        sel = dataset == d
        row = {
            "samples": int(sel.sum()),
            "length": float(lens[sel].sum()),
            "share": float(sel.sum() / max(1, gids.size)),
        }
        if spu:
            row["hours"] = row["length"] * spu / 3600
        out[name] = row
    return out


def check_shortest_fits(
    cfg: BatchingConfig, ix: AnyIndex | None, length_transform: LengthTransform | None, name: str
) -> None:
    """A budget that not even the shortest sample fits alone is an error now (from the index's shard table), not an
    epoch without batches later: a `BudgetError` naming both lengths."""
    if ix is None:
        return
    table = ix.shard_table(("count", "min_length"))
    mins = table["min_length"][table["count"] > 0]
    shortest = float(mins.min()) if mins.size else 0.0
    if length_transform is not None:
        shortest = length_transform.shortest(shortest)
    alone = BucketBatcher(cfg.replace(min_length=0, max_length=None, strict=False, buffer_size=1))
    if shortest <= 0 or alone.accepts(shortest):
        return
    padded = cfg.cost.name == "padded" and not cfg.pad_to_multiple_of
    how = "is smaller than" if padded else f"({cfg.cost.name} cost) cannot hold even"
    frames = length_transform is not None and length_transform.in_frames
    unit = unit_index(ix)
    text = (lambda x: f"{x:,.0f} frames") if frames else (lambda x: length_text(x, unit))
    raise BudgetError(
        f"{name}: budget {text(cfg.budget)} {how} the shortest sample, "
        f"{text(shortest)}: every sample would be skipped and no epoch would have a batch; "
        "use a larger budget (`shardify inspect` suggests one)"
    )


def plan_line(s: RankSchedule, layout: Layout, rank: int, local: bool, loaded: int, seconds: float) -> str:
    """The log line of a planned epoch: steps, what this rank planned and how, what evening out cost."""
    scope = "this rank" if local else f"all {layout.world_size} ranks"
    how = "rank-local" if local else "whole-epoch O(N)"
    return (
        f"epoch {s.epoch}: {s.steps} batches per rank on {layout.world_size} ranks; rank {rank} planned "
        f"{s.planned_samples} samples in {seconds:.2f} s ({how} plan, {loaded} lengths read); "
        f"even_batches={layout.even_batches} on {scope}: {s.surplus} samples left out, {s.repeated} repeated, "
        f"{s.splits} batches split; {s.skipped} skipped (outside min_length/max_length/budget), {s.dropped} "
        "dropped (drop_last)"
    )


def split_repeat_line(s: RankSchedule, layout: Layout, local: bool) -> str:
    """The warning of a ``split`` epoch that repeats samples: some rank had too few to split to the step count."""
    scope = "this rank" if local else f"all {layout.world_size} ranks"
    return (
        f"epoch {s.epoch}: even_batches='split' could not give every rank {s.steps} batches by splitting (too few "
        f"samples in some of the {layout.world_size} × {layout.num_workers} (rank, worker) slots), so {s.repeated} "
        f"samples on {scope} are repeated to keep the ranks in step; use fewer ranks or workers to see each once"
    )


def resume_line(epoch: int, layout: Layout, old: EarlierRun) -> str:
    """The log line of a resume on another layout."""
    return (
        f"resuming epoch {epoch} on {layout.world_size} ranks × {layout.num_workers} workers (saved on "
        f"{old.layout.world_size} × {old.layout.num_workers} after {old.consumed} of {old.steps} batches per rank): "
        "the samples not yet consumed are planned again"
    )
