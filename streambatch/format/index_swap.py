"""Replacing a version 2 index in place without ever breaking the one there: the new tables go under names the
index in place does not use (`table_names()`, usual or alternate), the header is swapped last in
one atomic step, and only then are the old tables removed. A write that fails or is interrupted before the swap
leaves the old index whole; one interrupted after it leaves the new one whole (and the old tables, which the next
rewrite clears)."""

from __future__ import annotations

import contextlib
import os
import re

from .. import limits
from ..io.storage import is_local, listdir, local_path, read_prefix, remove
from ..io.tempname import is_temporary
from .columnar import beside_index, table_names, table_url

#: the most of an index file in place read to learn which tables it names (a header of 10⁹ samples is ~1 MB)
HEADER_READ = 64 << 20
_PART = re.compile(r"part-\d{5}\.parquet")


def named_tables(index_url: str, storage_options: dict | None = None) -> set[str]:
    """The table paths (beside the index) that the index file now at ``index_url`` names; empty where there is
    none, or it is not a version 2 header (then nothing of it needs keeping)."""
    header = _header(index_url, storage_options)
    try:
        tables = header["tables"]
        paths = [tables["shards"]["path"], *(part["path"] for part in tables["samples"])]
    except (KeyError, TypeError):
        return set()
    return {p for p in paths if isinstance(p, str) and beside_index(p)}


def free_names(index_name: str, taken: set[str]) -> tuple[str, str]:
    """(shard table, sample folder) for a new write of ``index_name`` that touch none of the ``taken`` paths: the
    usual names, else the alternate ones (a header naming both, which no writer makes, gets the usual ones)."""
    for names in (table_names(index_name), table_names(index_name, alternate=True)):
        if not any(_under(p, names) for p in taken):
            return names
    return table_names(index_name)


def clear_names(root: str, names: tuple[str, str], storage_options: dict | None = None) -> None:
    """Remove what an earlier write left under ``names`` that no header names (chosen by `free_names()`):
    a shard table and sample files whose header was replaced before they could be removed, and the temporary
    files of a writer that was killed (a live one writing the same index fails on it, rather than mixing tables)."""
    shards, samples = names
    remove(table_url(root, shards), storage_options)
    for name in listdir(root, storage_options) if is_local(root) else []:
        if is_temporary(name, shards):
            remove(table_url(root, name))
    for name in listdir(table_url(root, samples), storage_options):
        final = name.split(".tmp-", 1)[0]  # a sample file, or a killed writer's temporary one
        if _PART.fullmatch(final) and (name == final or is_temporary(name, final)):
            remove(table_url(root, f"{samples}/{name}"), storage_options)


def drop_tables(root: str, paths: set[str], storage_options: dict | None = None) -> None:
    """Remove the tables an index named before its header was replaced (and their folders, once empty); a table
    that cannot be removed is left for the next rewrite to clear."""
    for rel in sorted(paths):
        with contextlib.suppress(OSError):
            remove(table_url(root, rel), storage_options)
    if is_local(root):
        for folder in sorted({rel.rsplit("/", 1)[0] for rel in paths if "/" in rel}):
            with contextlib.suppress(OSError):  # not empty, or already gone
                os.rmdir(local_path(table_url(root, folder)))


def swapped_in(index_url: str, write_id: str, shards_path: str, storage_options: dict | None = None) -> bool:
    """Whether the header at ``index_url`` is this write's (its id and shard table): after an error or interrupt
    around the header's write, whether the swap happened."""
    header = _header(index_url, storage_options)
    tables = header.get("tables")
    shards = tables.get("shards") if isinstance(tables, dict) else None
    return header.get("id") == write_id and isinstance(shards, dict) and shards.get("path") == shards_path


def _header(index_url: str, storage_options: dict | None) -> dict:
    """The JSON object at ``index_url``; empty where there is none, or it cannot be read or is not one."""
    try:
        d = limits.loads(read_prefix(index_url, HEADER_READ, storage_options))
    except (OSError, ValueError):  # none, unreadable, not JSON, nested too deep or longer than HEADER_READ
        return {}
    return d if isinstance(d, dict) else {}


def _under(path: str, names: tuple[str, str]) -> bool:
    shards, samples = names
    return path == shards or path.startswith(samples + "/")
