"""The loader's side of a weight schedule (:mod:`streambatch.dataset.schedule`): the mixture it reads follows the
epoch it is at. Setting the epoch lays the mixture out for that epoch's weights (its shard URLs, filter, dataset
names and bad-shard flags with it) and the next pass starts its workers on it; a checkpoint records the epoch's
weights, and a resume whose schedule gives that epoch other weights is refused.

Functions here take the :class:`~streambatch.loader.core.StreamBatchLoader` (typed ``Any``: the loader imports
this module, not the other way round) and touch only the attributes that depend on the mixture's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..dataset.mixture import AnyIndex, dataset_names
from ..dataset.schedule import WeightSchedule
from ..dataset.source import ShardURLs, open_source
from ..errors import OptionError, StateError
from ..read.worker import fault_tensors

#: the loader's attributes that depend on how the mixture is laid out (what :func:`at_epoch` puts back)
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
    """What :func:`~streambatch.dataset.source.open_source` opens, with ``weights`` possibly a schedule: then the
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
    """Move the loader to the epoch of a state it loads (``saved``: a :class:`~streambatch.loader.state.LoaderState`)
    and, under a weight schedule, refuse a state whose epoch ran on other weights than the schedule gives it now
    (the samples it took would be lost or repeated), naming both."""
    loader.set_epoch(saved.epoch)
    if loader.weight_schedule is None or not saved.knows("mixture") or saved.mixture == loader.index.state():
        return
    now = {row[0]: row[1] for row in loader.index.state()}
    then = {row[0]: row[1] for row in saved.mixture or [] if isinstance(row, (list, tuple)) and len(row) >= 2}
    what = f"the weights {now}" if now != then else "the same weights after other weights before it"
    raise StateError(
        f"state was saved at epoch {saved.epoch} with weights {then} (mixture {saved.mixture}); this loader's weight "
        f"schedule gives epoch {saved.epoch} {what} (mixture {loader.index.state()}): resume with the schedule the "
        "state was saved with"
    )
