"""Not reading what the plan leaves out: a piece whose excluded samples (filtered, consumed before a resume,
not selected by a mixture) form a run of at least ``min_gap`` bytes is read as byte ranges around that run.

Only where the index knows each sample's byte offset and size (a version 2 index). A piece read as
`Span` starts at its first sample's header and ends after its last sample's members; its shard is then
not read whole, so its sha256 cannot be checked: the bytes delivered are checked against the range instead
(and the shard's size against the index, as always).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..plan.lengths import Mask
from ..plan.shards import Piece
from ..plan.slot import piece_excluded
from ..select.mixture import AnyIndex


@dataclass(frozen=True)
class Span(Piece):
    """Samples ``[start, stop)`` of a shard, read as the shard's bytes ``[first_byte, end_byte)``."""

    first_byte: int = 0
    end_byte: int = 0


def _segments(skip: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, min_gap: int) -> list[tuple[int, int]]:
    """``[a, b)`` runs of a piece (positions in it) between the excluded runs of at least ``min_gap`` bytes."""
    n = len(skip)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], skip.astype(np.int8), [0]])))
    out, at = [], 0
    for g0, g1 in zip(edges[::2].tolist(), edges[1::2].tolist()):
        if int(offsets[g1 - 1] + sizes[g1 - 1] - offsets[g0]) >= min_gap:
            if g0 > at:
                out.append((at, g0))
            at = g1
    if at < n:
        out.append((at, n))
    return out


def skip_left_out(
    needed: Sequence[tuple[Piece, int]], index: AnyIndex, offsets: np.ndarray, excluded: Mask | None, min_gap: int
) -> list[tuple[Piece, int]]:
    """``needed`` (piece, stream position) with each piece that holds a long excluded run split into
    `Span` byte ranges around it; the others as they are (read from the shard's start)."""
    if excluded is None:
        return list(needed)
    out: list[tuple[Piece, int]] = []
    for piece, pos in needed:
        skip = piece_excluded(piece, offsets, excluded)
        where = index.sample_offsets(piece.shard) if skip.any() else None
        if where is None:
            out.append((piece, pos))
            continue
        off, size = (np.asarray(a[piece.start : piece.stop], dtype=np.int64) for a in where)
        segments = _segments(skip, off, size, min_gap)
        if segments == [(0, piece.count)]:
            out.append((piece, pos))
            continue
        kept_before = np.concatenate([[0], np.cumsum(~skip)])
        for a, b in segments:
            span = Span(piece.shard, piece.start + a, piece.start + b, int(off[a]), int(off[b - 1] + size[b - 1]))
            out.append((span, pos + int(kept_before[a])))
    return out
