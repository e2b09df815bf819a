"""The loader's side of a mixture and its weight schedule (`streambatch.select.schedule`): opening the source with
epoch 0's weights, and whether a checkpoint's mixture can resume this loader's. The loader lays its mixture out for
each epoch's weights itself (``StreamBatchLoader._follow``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..format.index import ShardIndex
from ..select.mixture import AnyIndex, draw_rows
from ..select.schedule import WeightSchedule
from ..select.source import ShardURLs, open_source


def open_scheduled(
    source: str | Sequence[str] | Mapping[str, str] | ShardIndex,
    weights: Mapping[str, float] | Sequence[Any] | Callable[[int], Any] | None,
    index: str | ShardIndex | None,
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
    if not mid_epoch and began(then) == began(now):  # nothing of the epoch taken: its weights may change
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


def began(rows: list[tuple[str, float, int, int]]) -> list[tuple[str, int, int]]:
    """Of `draw_rows()`: each dataset's name, size and where the epoch begins."""
    return [(name, size, start) for name, _, size, start in rows]
