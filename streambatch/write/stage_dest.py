"""What ``shardify stage`` finds in DEST before it copies: which shards there it may keep, and whether it may
replace what DEST holds.

A shard already in DEST is kept rather than copied again, so that stage can be re-run to finish a copy. That is
only safe when DEST holds this very dataset: tars pad to whole records, so a shard of another dataset (another
version of the same audio) often has the size this index lists. So DEST is told apart by what identifies a
dataset's shards, each shard's name, size and sha256 (`identity()`):

* DEST's ``index.json`` is this one byte for byte, or lists the same shards (a staged copy of an index whose URLs
  were rewritten): DEST holds this dataset; a shard at its size is kept (re-hashed with ``--verify``).
* DEST's index lists other shards, or cannot be read: another dataset. Refused (exit 2) unless ``--overwrite``;
  with it, a shard there is kept only when its sha256 is the one this index lists, and the files the replaced
  index listed that this one does not are removed once the new index is written.
* DEST has no index: a copy cut short, or files of unknown origin. A marker written before the first copy
  (`STAGING_NAME`, removed with the new index written) says which dataset that copy was of: this one's
  keeps shards at their size, anything else is re-hashed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import ShardifyError, StreamBatchError
from ..format.index import INDEX_NAME, ShardIndex
from ..format.index_swap import drop_tables, named_tables
from ..io import storage

#: the marker in DEST naming the dataset a stage under way (or cut short) copies there
STAGING_NAME = ".shardify-staging.json"


@dataclass
class DestState:
    """What DEST holds, as `survey()` found it."""

    #: DEST's index is this one byte for byte (its tables there at their size are kept too)
    same: bool = False
    #: DEST holds this dataset (its index or a copy of it cut short): a shard at its size is kept
    trusted: bool = False
    #: DEST has an index that is not this one: it is removed before the first copy
    replaced: bool = False
    #: the files (relative paths) the index DEST had listed: removed at the end unless this index lists them
    old_files: set[str] = field(default_factory=set)


def identity(shards: Iterable[tuple[str, int, str | None]]) -> str | None:
    """A digest of a dataset's shards, ``(name in its folder, bytes, sha256)`` each: equal for two indexes of the
    same shard files; None when a shard has no sha256 (then nothing but the index's bytes tells datasets apart)."""
    h = hashlib.sha256()
    for name, nbytes, sha in shards:
        if not sha:
            return None
        h.update(f"{name}\t{int(nbytes)}\t{sha}\n".encode())
    return h.hexdigest()


def _ours(index: ShardIndex, names: list[str]) -> str | None:
    return identity((name, info.bytes, info.sha256) for name, info in zip(names, index.shards))


def survey(
    dest: str, raw: bytes, index: ShardIndex, names: list[str], rewrite: bool, overwrite: bool, options: dict | None
) -> DestState:
    """What DEST holds (see the module docstring); another dataset there is refused unless ``overwrite``.
    ``raw``: this index's bytes; ``names``: where its shards go in DEST; ``rewrite``: its URLs are rewritten."""
    ours = _ours(index, names)
    dest_index = storage.join_url(dest, INDEX_NAME)
    if not storage.exists(dest_index, options):
        return DestState(trusted=ours is not None and _marker(dest, options) == ours)
    if storage.read_whole(dest_index, options) == raw and not rewrite:
        return DestState(same=True, trusted=True)
    theirs, old_files, why = _dest_dataset(dest_index, index, names, options)
    if (ours is None or theirs != ours) and not overwrite:
        raise ShardifyError(
            f"{dest} holds another dataset ({why}); stage keeps one dataset per folder: pass --overwrite to "
            "replace it, or stage into another folder"
        )
    return DestState(trusted=ours is not None and theirs == ours, replaced=True, old_files=old_files)


def _dest_dataset(
    dest_index: str, index: ShardIndex, names: list[str], options: dict | None
) -> tuple[str | None, set[str], str]:
    """(identity, files, how it differs from this index) of the dataset whose index is at ``dest_index``; an index
    that cannot be read has no identity and no files."""
    try:
        there = ShardIndex.load(dest_index, options)
        shards = [(s.url, s.bytes, s.sha256) for s in there.shards]
    except (ValueError, OSError, StreamBatchError) as e:
        return None, set(), f"its {INDEX_NAME} cannot be read: {e}"
    inside = {url for url, _, _ in shards if "://" not in url and not url.startswith(("/", "..")) and "/../" not in url}
    return identity(shards), inside | named_tables(dest_index, options), _difference(shards, index, names)


def _difference(shards: list[tuple[str, int, str | None]], index: ShardIndex, names: list[str]) -> str:
    """How the shards DEST's index lists differ from this index's, the first difference named."""
    if len(shards) != len(names):
        return f"its {INDEX_NAME} lists {len(shards)} shards, this dataset {len(names)}"
    for (url, nbytes, sha), name, info in zip(shards, names, index.shards):
        if url != name:
            return f"its {INDEX_NAME} lists {url} where this dataset has {name}"
        if (int(nbytes), sha) != (int(info.bytes), info.sha256):
            return (
                f"its {INDEX_NAME} lists {name} with sha256 {str(sha)[:12]}... ({int(nbytes)} bytes), this "
                f"dataset's is {str(info.sha256)[:12]}... ({int(info.bytes)} bytes)"
            )
    return f"its {INDEX_NAME} differs and lists no sha256 to compare shards by"


def begin(dest: str, state: DestState, index: ShardIndex, names: list[str], src: str, options: dict | None) -> None:
    """Before the first copy: mark DEST as holding a copy of this dataset under way, then remove an index that is
    not this one (DEST never claims a dataset its shards no longer are)."""
    if state.same:
        return
    marker = {"dataset": _ours(index, names), "src": src}
    storage.write_bytes_atomic(storage.join_url(dest, STAGING_NAME), json.dumps(marker).encode(), options)
    if state.replaced:
        storage.remove(storage.join_url(dest, INDEX_NAME), options)


def finish(dest: str, state: DestState, names: list[str], options: dict | None) -> None:
    """Once the new index is written: remove the files of the index it replaced that it does not list (shards,
    tables), then the marker."""
    listed = set(names) | named_tables(storage.join_url(dest, INDEX_NAME), options) | {INDEX_NAME}
    drop_tables(dest, state.old_files - listed, options)
    storage.remove(storage.join_url(dest, STAGING_NAME), options)


def _marker(dest: str, options: dict | None) -> str | None:
    """The identity of the dataset a stage cut short was copying into ``dest`` (None: no marker, or unreadable)."""
    try:
        d = json.loads(storage.read_whole(storage.join_url(dest, STAGING_NAME), options))
    except (OSError, ValueError):
        return None
    value = d.get("dataset") if isinstance(d, dict) else None
    return value if isinstance(value, str) else None
