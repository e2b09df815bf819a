"""Every table of an index read in full, as the loader reads it: what ``shardify verify`` and ``inspect`` check
before they trust the index.

Loading an index reads its header and the shard table's planning columns; the loader reads the rest (the
shard table's urls and checksums, every sample row group with its keys, offsets and metadata columns) as it
streams, with Parquet page checksums verified, and refuses a damaged table there. `table_problems()` reads
all of it up front through the same reader (`ColumnarIndex`), so a table the loader would
refuse is found here, named, and not mistaken for a bad shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import IndexFormatError
from .columnar import BASE_COLUMNS, ColumnarIndex, table_url

#: how many table problems are listed before "... and N more"
MAX_LISTED = 20


def table_problems(index: Any) -> list[str]:
    """``"TABLE: problem"`` for each table of a version 2 index the loader would refuse (missing, truncated,
    a flipped byte under a page checksum, another write's table, rows that disagree with the shard table);
    empty when every table reads in full, and for an index with no tables (version 1, built in memory)."""
    reader = _columnar(index)
    if reader is None:
        return []
    problems = _shard_table_problems(reader)
    for g in range(len(reader.group_start)):
        problems += _group_problems(reader, g)
        if len(problems) > MAX_LISTED:
            return problems[:MAX_LISTED] + ["... and more: the index's tables are damaged"]
    problems += _unread_groups(reader)
    return _unique(problems)


def check_tables(index: Any) -> None:
    """Raise `IndexFormatError` naming the first damaged table of ``index`` (see `table_problems()`)."""
    problems = table_problems(index)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise IndexFormatError(f"damaged index: {problems[0]}{more}")


def _columnar(index: Any) -> ColumnarIndex | None:
    """The version 2 reader of an index loaded from its tables (None when it has none)."""
    reader = getattr(index.shards, "reader", None)
    return reader if isinstance(reader, ColumnarIndex) else None


def _shard_table_problems(reader: ColumnarIndex) -> list[str]:
    """The shard table's columns not read at load time (urls, checksums, sizes, max/min length)."""
    try:
        reader._read_rest()
    except IndexFormatError as e:
        return [str(e)]
    return []


def _group_problems(reader: ColumnarIndex, g: int) -> list[str]:
    """Row group ``g`` of its sample file, every column the header names, read as the loader reads it."""
    if reader.group_part[g] < 0:
        return []
    try:
        reader.read_columns(g, _sample_columns(reader))
    except IndexFormatError as e:
        return [str(e)]
    return []


def _sample_columns(reader: ColumnarIndex) -> Sequence[str]:
    """The sample table's columns (the shard column is read and checked by every read)."""
    own = [c for c in BASE_COLUMNS if c not in ("shard", "output_length")]
    return own + (["output_length"] if reader.has_output_lengths else []) + list(reader.extra)


def _unread_groups(reader: ColumnarIndex) -> list[str]:
    """Row groups a sample file holds that no shard of the shard table points to (rows the loader never reads:
    the files and the shard table do not belong together)."""
    problems = []
    for part, entry in enumerate(reader.parts):
        used = int((reader.group_part == part).sum())
        try:
            declared = int(entry["row_groups"])
        except (KeyError, TypeError, ValueError):
            declared = -1
        if used and used != declared:
            where = table_url(reader.root, str(entry.get("path")))
            problems.append(f"{where}: {declared} row groups, the shard table points to {used}")
    return problems


def _unique(problems: list[str]) -> list[str]:
    """Each problem once (a damaged file fails every row group read of it with the same message)."""
    return list(dict.fromkeys(problems))
