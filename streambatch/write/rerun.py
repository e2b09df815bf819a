"""What ``shardify write --resume`` (of a whole dataset) finds in OUT before it writes anything.

A resume finishes an interrupted write of the same command; it must not replace what a finished write left. So
a complete dataset there (``index.json``) is compared with this command by what its index records of the command
that wrote it — the source, the sharding options, the tokenizers (`SAME_RUN_FIELDS`), the unit and
sample rate, as ``shardify merge`` compares parts — and is either this command's, complete (nothing left to
write: it is returned as it is, its files untouched), or another's (refused: ``--overwrite`` replaces it). With
no readable index, the write is an interrupted one and the resume goes on (shards compared byte for byte). A
``--part I/N --resume`` does the same with the part's own index (``index.part-I.json``), which also records I/N.
"""

from __future__ import annotations

from typing import Any

from ..errors import ShardifyError
from ..format.index import ShardIndex
from ..io import storage
from .parts import SAME_RUN_FIELDS, Scope, check_shards_there, missing_shard


def complete_before(
    out: str,
    meta: dict[str, Any],
    unit: str,
    sample_rate: int | None,
    storage_options: dict | None,
    part: tuple[int, int] | None = None,
) -> ShardIndex | None:
    """The dataset in ``out`` when it is this command's and complete (every shard it lists there): the one a whole
    write made, or the one ``shardify merge`` made from this command's parts; with ``part``, that part's. None
    when there is nothing to keep (no index, a damaged one, or this command's index with a shard missing: the
    resume writes what is missing). A dataset of another command (``meta``, ``unit``, ``sample_rate`` or the part
    differ from its index's) is refused with one line naming the first difference."""
    scope = Scope(part)
    index = _index_there(out, scope.index_name, storage_options)
    if index is None:
        return None
    differ = _differences(index, meta, unit, sample_rate) + _part_differs(index, part)
    if differ:
        raise ShardifyError(_another_text(out, index, *differ[0]))
    if index.meta.get("parts"):  # shards of parts: not re-planned here; a missing one is that part's to write
        check_shards_there(index, out, storage_options)
        return index
    return index if missing_shard(index, out, storage_options) is None else None


def _index_there(out: str, name: str, storage_options: dict | None) -> ShardIndex | None:
    """The index ``name`` in ``out``; None when there is none or it cannot be read (as after an interrupted
    write)."""
    if name not in storage.listdir(out, storage_options):
        return None
    try:
        return ShardIndex.load(storage.join_url(out, name), storage_options)
    except (ValueError, OSError):
        return None  # a damaged index: the resume writes the dataset again, as after any interrupted write


def _differences(
    index: ShardIndex, meta: dict[str, Any], unit: str, sample_rate: int | None
) -> list[tuple[str, Any, Any]]:
    """(field, the index's value, this command's) for each recorded field in which they differ."""
    differ = [(k, index.meta.get(k), meta.get(k)) for k in SAME_RUN_FIELDS if index.meta.get(k) != meta.get(k)]
    differ += [("unit", index.unit, unit)] if index.unit != unit else []
    if sample_rate and index.sample_rate != sample_rate:
        differ.append(("sample_rate", index.sample_rate, sample_rate))
    return differ


def _part_differs(index: ShardIndex, part: tuple[int, int] | None) -> list[tuple[str, Any, Any]]:
    """("part", the part index's I/N, this command's) when a part index records another part than ``part``."""
    if part is None:
        return []
    recorded = index.meta.get("part") or {}
    theirs = (recorded.get("index"), recorded.get("count"))
    return [] if theirs == tuple(part) else [("part", "{}/{}".format(*theirs), "{}/{}".format(*part))]


def _another_text(out: str, index: ShardIndex, field: str, theirs: Any, ours: Any) -> str:
    """The refusal of a resume into a dataset another command wrote."""
    what = f"a dataset merged from {index.meta['parts']} parts" if index.meta.get("parts") else "a dataset"
    if index.meta.get("part"):
        what = f"part {index.meta['part'].get('index')}/{index.meta['part'].get('count')}"
    return (
        f"{out} holds {what} of another command ({field}={_shown(theirs)}, this command: {_shown(ours)}); "
        "--resume only finishes an interrupted write of the same command: pass --overwrite to replace it"
    )


def _shown(value: Any) -> str:
    """A recorded value as the message shows it (a unit by its name)."""
    return repr(getattr(value, "value", value))
