"""Several shards streamed at once: the read side of a slot plan that interleaves its pieces (``interleave``).

The plan merges each group of ``interleave`` consecutive pieces in a seeded order
(`arrival_order()`). A worker reads such a slot in *lanes*: lane ``i`` streams the
``i``-th piece of every group, one after another, with its own share of the worker's read-ahead and requests in
flight (`lane_options()`), so the worker's totals stay within its read options. `interleaved()` pulls
from the lanes in the planned arrival order; each lane's samples keep their stream positions, faults and
checksum spans (`positioned()`), so the executor sees the same items it would see from one stream,
only in the planned order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import IndexMismatch
from ..plan.lengths import Mask
from ..plan.shards import Piece
from ..plan.slot import SlotEpoch, kept_counts
from .execute import _MISMATCH, Invalid, positioned
from .reader import OpenedPieces, ReadOptions

#: the smallest range request a lane makes when it divides the worker's read-ahead
MIN_LANE_CHUNK = 1 << 20


def lane_options(opts: ReadOptions, lanes: int) -> ReadOptions:
    """One lane's share of a worker's read options: ``read_ahead``, ``read_concurrency`` (the requests in flight at
    the start) and ``max_read_concurrency`` divided among the lanes (at least one request each), and chunks of at
    most half a lane's share, so a lane keeps one arriving while the parser reads the other (smaller chunks cost
    more requests, each some CPU)."""
    if lanes <= 1:
        return opts
    share = opts.read_ahead // lanes
    chunk = min(opts.chunk_size, max(MIN_LANE_CHUNK, share // 2)) if share else opts.chunk_size
    most = max(1, opts.max_read_concurrency // lanes)
    return dataclasses.replace(
        opts,
        read_ahead=share,
        chunk_size=chunk,
        read_concurrency=max(1, opts.read_concurrency // lanes),  # the lane's in-flight target grows when it waits
        max_read_concurrency=most,
    )


def interleaved(
    needed: Sequence[tuple[Piece, int]],
    plan: SlotEpoch,
    offsets: np.ndarray,
    excluded: Mask | None,
    streams: int,
    open_lane: Callable[[list[Piece]], OpenedPieces],
) -> Iterator[Any]:
    """Stage: the positioned samples of the ``needed`` pieces (piece or byte span, its first stream position) in
    the plan's arrival order, read in lanes (``open_lane`` starts streaming a lane's pieces, faults as markers: all
    lanes request their first bytes at once); checksum spans that fail come as `Invalid` where
    their lane delivers them."""
    assert plan.order is not None  # an interleaved plan
    starts = np.concatenate([[0], np.cumsum(kept_counts(plan.pieces, offsets, excluded))]).astype(np.int64)
    lane_of = _lanes(needed, starts, streams)
    left = {lane: _positions(entries, starts) for lane, entries in lane_of.items()}
    opened: list[OpenedPieces] = []
    lanes: dict[int, Generator[Any, None, None]] = {}
    try:
        for lane, entries in lane_of.items():
            opened.append(open_lane([p for p, _ in entries]))
            lanes[lane] = positioned(opened[-1], entries, offsets, excluded)
        for pos, lane in _arrivals(needed, plan.order, starts, streams):
            item = next(lanes[lane], None)
            while isinstance(item, Invalid):
                yield item
                item = next(lanes[lane], None)
            if item is None or item[0] != pos:
                raise IndexMismatch(f"a shard's samples did not arrive as planned at position {pos}; {_MISMATCH}")
            yield item
            left[lane] -= 1
            if not left[lane]:  # the lane's last sample: read its shard to the end (checked), as a stream moves on
                yield from _rest(lanes[lane], pos)
    finally:
        for stream in lanes.values():
            stream.close()
        for source in opened:
            source.close()


def _rest(lane: Iterator[Any], pos: int) -> Iterator[Invalid]:
    """What a lane still gives after its last sample: the spans whose checksum failed once read to the end."""
    for item in lane:
        if not isinstance(item, Invalid):
            raise IndexMismatch(f"a shard gave more samples than planned after stream position {pos}; {_MISMATCH}")
        yield item


def _positions(entries: Sequence[tuple[Piece, int]], starts: np.ndarray) -> int:
    """The stream positions a lane delivers: every kept sample of the plan pieces its entries belong to."""
    pieces = {_plan_piece(starts, pos) for _, pos in entries}
    return int(sum(int(starts[i + 1] - starts[i]) for i in pieces))


def _lanes(needed: Sequence[tuple[Piece, int]], starts: np.ndarray, streams: int) -> dict[int, list[tuple[Piece, int]]]:
    """The needed pieces by lane: the place of a piece's plan piece in its group of ``streams``."""
    out: dict[int, list[tuple[Piece, int]]] = {}
    for piece, pos in needed:
        out.setdefault(_plan_piece(starts, pos) % streams, []).append((piece, pos))
    return out


def _plan_piece(starts: np.ndarray, pos: int) -> int:
    """The plan piece holding stream position ``pos`` (``starts``: each plan piece's first position)."""
    return int(np.searchsorted(starts, pos, side="right")) - 1


def _arrivals(
    needed: Sequence[tuple[Piece, int]], order: np.ndarray, starts: np.ndarray, streams: int, chunk: int = 4096
) -> Iterator[tuple[int, int]]:
    """(stream position, lane) of every sample of the needed pieces, in arrival order, a chunk at a time."""
    read = np.zeros(len(starts) - 1, dtype=bool)
    for _, first in needed:
        read[_plan_piece(starts, first)] = True
    for a in range(0, len(order), chunk):
        at = order[a : a + chunk].astype(np.int64)
        piece = np.searchsorted(starts, at, side="right") - 1
        keep = read[piece]
        yield from zip(at[keep].tolist(), (piece[keep] % streams).tolist())
