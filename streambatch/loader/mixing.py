"""The loader's side of a weight schedule (`streambatch.select.schedule`): the mixture it reads follows the
epoch it is at. Setting the epoch lays the mixture out for that epoch's weights (its shard URLs, filter, dataset
names and bad-shard flags with it) and the next pass starts its workers on it; a checkpoint records the epoch's
weights, and a resume whose schedule gives that epoch other weights is refused.

Functions here take the `StreamBatchLoader` (typed ``Any``: the loader imports
this module, not the other way round) and touch only the attributes that depend on the mixture's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import OptionError, StateError
from ..read.worker import fault_tensors
from ..select.mixture import AnyIndex, dataset_names, draw_rows
from ..select.schedule import WeightSchedule
from ..select.source import ShardURLs, open_source

#: the loader's attributes that depend on how the mixture is laid out (what `at_epoch()` puts back)
LAYOUT = ("index", "urls", "filter", "collate_options", "_bad_shards", "_schedules", "_dataloader")


def open_scheduled(
    source: Any,
    weights: Any,
    index: Any,
    storage_options: dict | None,
    shard_roots: Sequence[str],
    max_plan_bytes: int,
    cache_dir: str | None = None,
) -> tuple[AnyIndex | None, Sequence[str], str, WeightSchedule | None]:
    """What `open_source()` opens, with ``weights`` possibly a schedule: then the
    mixture is opened with epoch 0's weights, every entry of a list checked, and the schedule returned."""
    schedule = WeightSchedule.of(weights)
    first = weights if schedule is None else schedule.given(0)
    ix, urls, name = open_source(source, first, index, storage_options, shard_roots, max_plan_bytes, cache_dir)
    if schedule is None:
        return ix, urls, name, None
    ix = schedule.bind(ix)
    return ix, ShardURLs(ix), name, schedule


def follow(loader: Any, epoch: int) -> None:
    """Lay the loader's mixture out for ``epoch``'s weights (nothing without a schedule, or when it already is):
    the epoch's plan, its workers and its bad-shard flags start afresh; the fault counters are kept."""
    schedule: WeightSchedule | None = loader.weight_schedule
    if schedule is None:
        return
    ix = schedule.index_for(epoch)
    if ix.state() == loader.index.state():  # already laid out for these weights and windows
        return
    loader.index, loader.urls = ix, ShardURLs(ix)
    if loader.filter is not None:
        loader.filter = loader.filter.relaid(ix)
    loader.collate_options = dataclasses.replace(loader.collate_options, datasets=dataset_names(ix))
    loader._bad_shards = fault_tensors(loader.num_workers, len(loader.urls))[1]
    loader._schedules, loader._dataloader = {}, None  # persistent workers too: they hold the old mixture


@contextmanager
def at_epoch(loader: Any, epoch: int) -> Iterator[None]:
    """The loader laid out for ``epoch`` while the block runs (``plan(epoch)`` of another epoch than the current
    one, ``metrics(planned=True)`` after a pass), then as it was."""
    if loader.weight_schedule is None or epoch == loader.epoch:
        yield
        return
    saved = {name: getattr(loader, name) for name in LAYOUT}
    follow(loader, epoch)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(loader, name, value)


def epoch_index(loader: Any, epoch: int) -> Any:
    """The index ``epoch`` is planned from: the loader's; under a weight schedule it must be laid out for that
    epoch (``schedule(epoch)`` of another epoch: set the epoch first)."""
    schedule: WeightSchedule | None = loader.weight_schedule
    if schedule is not None and schedule.index_for(epoch).state() != loader.index.state():
        raise OptionError(
            f"the mixture's weights follow a schedule and this loader is at epoch {loader.epoch}: call "
            f"set_epoch({epoch}) before planning epoch {epoch}"
        )
    return loader.index


def to_saved_epoch(loader: Any, saved: Any) -> None:
    """Move the loader to the epoch of a state it loads (``saved``: a `LoaderState`)
    and, under a weight schedule, refuse a state whose epoch began elsewhere in the datasets (earlier epochs took
    other samples) or, saved mid-epoch, ran on other weights than the schedule gives it now (the samples it took
    would be lost or repeated), naming both. Other mixtures are `mixture_problem()`'s to name."""
    loader.set_epoch(saved.epoch)
    if loader.weight_schedule is None or not saved.knows("mixture") or not saved.mixture:
        return
    then, now = draw_rows(saved.mixture, saved.epoch), draw_rows(loader.index.state(), saved.epoch)
    if [r[::2] for r in then] != [r[::2] for r in now]:  # other datasets (mixture_problem), or the same draw
        return
    if then == now or (not saved.mid_epoch and _began(then) == _began(now)):  # between epochs: where it begins
        return
    weights = {r[0]: r[1] for r in then}, {r[0]: r[1] for r in now}
    what = f"the weights {weights[1]}" if weights[0] != weights[1] else "the same weights after other weights before it"
    raise StateError(
        f"state was saved at epoch {saved.epoch} with weights {weights[0]} (mixture {saved.mixture}); this loader's "
        f"weight schedule gives epoch {saved.epoch} {what} (mixture {loader.index.state()}): resume with the "
        "schedule the state was saved with"
    )


def mixture_problem(saved: list | None, mine: list | None, epoch: int, mid_epoch: bool) -> str | None:
    """Why a state saved for the mixture ``saved`` (checkpoint rows; None: one dataset) cannot resume a loader
    reading ``mine`` at ``epoch``, or None. Between epochs only where the epoch begins in each dataset matters (the
    samples earlier epochs took): its own weights may change, and fixed weights and a schedule are alike. Within
    an epoch its weights must be the saved ones, of the same kind (a schedule lays an epoch out in other batches)."""
    if saved == mine:
        return None
    if saved is None or mine is None:
        was, reads = (f"the mixture {rows}" if rows else "one dataset" for rows in (saved, mine))
        return f"state was saved for {was}, this loader reads {reads}"
    then, now = draw_rows(saved, epoch), draw_rows(mine, epoch)
    if not mid_epoch and _began(then) == _began(now):  # nothing of the epoch taken: its weights may change
        return None
    same_draw = then == now
    if same_draw:
        kinds = ("a weight schedule" if len(rows[0]) > 3 else "fixed weights" for rows in (saved, mine))
        return (
            f"state was saved during epoch {epoch} under {next(kinds)}, and this loader has {next(kinds)}: they take "
            "the same samples, but lay the epoch out in other batches, so its rest cannot be resumed exactly; "
            "finish the epoch with the weights the state was saved with, or resume from a state saved between epochs"
        )
    return f"state was saved for the mixture {saved}, this loader reads {mine}"


def _began(rows: list[tuple[str, float, int, int]]) -> list[tuple[str, int, int]]:
    """Of `draw_rows()`: each dataset's name, size and where the epoch begins."""
    return [(name, size, start) for name, _, size, start in rows]
