"""Where the heavy steps of a write run: an `Engine` (such as `RayEngine`) runs them on
other machines, ``None`` in this process and its ``workers``.

A write's heavy steps are the ones that touch each record or tar apart from the others: probing the records'
headers, writing the planned shards, scanning tars to adopt them. Everything that needs the whole list (the
write order, the shard plan, the index's sample rate, the index itself) stays in the calling process, so an
engine changes where the work runs, never what is written: the output is byte for byte the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..format.index import ShardInfo
    from .adopt.scan import ShardScan
    from .probe import Probed
    from .records import Record
    from .tarwrite import ShardTask


class Engine(Protocol):
    """Runs the per-record, per-shard and per-tar steps of ``write_shards`` and ``index_tars``; each method
    returns what the local function it stands for returns, in the same order."""

    def probe(
        self, records: Sequence[Record], kind: str, workers: int, progress: bool, storage_options: dict | None
    ) -> Probed:
        """`probe_slice()` of every record."""
        ...

    def write(
        self, tasks: Sequence[ShardTask], workers: int, progress: bool, stats: dict[str, int] | None
    ) -> list[ShardInfo]:
        """`write_planned()` of every planned shard (infos in shard order)."""
        ...

    def scan(
        self, tars: Sequence[str], workers: int, progress: bool, storage_options: dict | None, suffixes: tuple[str, ...]
    ) -> list[ShardScan]:
        """`scan_tars()` of every tar (scans in tar order)."""
        ...
