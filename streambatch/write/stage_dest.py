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
  keeps shards at their size (unless that copy was replacing another dataset), anything else is re-hashed.

An ``--overwrite`` never leaves DEST without a readable dataset for longer than the swap at its end (`publish()`):
while the shards are copied the old index stays in place, and each new shard that would replace a file of the old
dataset waits in `WAITING_NAME` instead. Then, in a local DEST, the old index and the entries of the old dataset
are set aside and the new set moved in, its index last (`publish.Aside`): a kill at any step leaves the old
dataset or the new one, and the next stage into DEST (under its lock, `recover()`) keeps a complete new one or
puts the old one back. An object store has no rename: there the old index is removed only when a new file must
take the name of one of its files (a waiting shard or a table; each waiting shard is then copied in on the
store's side), and the new index is written last, over the old one where nothing collides (the rule of
`format.index_swap`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ShardifyError, StreamBatchError
from ..format.index import INDEX_NAME, ShardIndex
from ..format.index_swap import drop_tables, named_tables
from ..io import storage
from ..io.tempname import is_temporary
from .publish import Aside

#: the marker in DEST naming the dataset a stage under way (or cut short) copies there
STAGING_NAME = ".shardify-staging.json"
#: the folder (prefix) in DEST where new shards that replace files of the dataset there wait until all are copied
WAITING_NAME = ".shardify-staged"
#: the hidden folder of a local DEST where the replaced dataset's entries wait while the new one moves in
ASIDE_NAME = ".shardify-stage-replaced"


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
    #: what the new set replaces and so must not be written over while the old index is in place: in a local DEST
    #: its top-level entries (set aside whole in the swap), on an object store the files themselves
    replaces: set[str] = field(default_factory=set)
    local: bool = True

    def waits(self, name: str) -> bool:
        """Whether the new shard ``name`` waits in `WAITING_NAME` until every shard is copied (it would replace a
        file of the dataset in DEST; one of this very dataset, ``trusted``, is kept where it is)."""
        return not self.trusted and (_top(name) if self.local else name) in self.replaces


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
    trusted, local = ours is not None and theirs == ours, storage.is_local(dest)
    replaced = named_tables(dest_index, options) if trusted else old_files  # this dataset's shards stay in place
    replaces = {_top(p) for p in replaced} if local else set(replaced)
    return DestState(
        trusted=trusted,
        replaced=True,
        old_files=old_files,
        replaces={p for p in replaces if not p.startswith(".shardify-")},
        local=local,
    )


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
    """Before the first copy: mark DEST as holding a copy of this dataset under way (and whether it replaces
    another: then a copy cut short after the old index went keeps no shard on its size alone)."""
    if state.same:
        return
    marker = {"dataset": _ours(index, names), "src": src, "replacing": state.replaced}
    storage.write_bytes_atomic(storage.join_url(dest, STAGING_NAME), json.dumps(marker).encode(), options)


def waiting_url(dest: str, name: str) -> str:
    """Where the new shard ``name`` waits (see `DestState.waits()`)."""
    return storage.join_url(dest, WAITING_NAME, *name.split("/"))


def wait_in_place(final: str, waiting: str) -> None:
    """Make the shard of a local DEST already complete at ``final`` (its sha256 this index's) wait at ``waiting``
    too: a hard link (no copy, no space), or a copy where the filesystem has none; ``final`` stays for the old
    index meanwhile."""
    src, dst = storage.local_path(final), storage.local_path(waiting)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(dst)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _aside(dest: str) -> Aside:
    root = storage.local_path(dest)
    return Aside(root, os.path.join(root, ASIDE_NAME))


def _index_last(name: str) -> bool:
    return name == INDEX_NAME


def recover(dest: str) -> None:
    """Finish what a stage into the local ``dest`` killed during its swap left (call it holding DEST's lock): a
    complete new dataset is kept, anything else puts the old one back, saying so on stderr."""
    if not storage.is_local(dest):
        return
    finished = os.path.exists(os.path.join(storage.local_path(dest), INDEX_NAME))
    if _aside(dest).recover(finished, lambda: [INDEX_NAME], _index_last) == "put back":
        print(
            f"shardify: warning: a stage --overwrite into {dest} was killed while swapping datasets; put back the "
            f"dataset it was replacing (from {_aside(dest).path})",
            file=sys.stderr,
        )


def publish(
    dest: str,
    state: DestState,
    waiting: list[str],
    tables: set[str],
    write_index: Callable[[], None],
    options: dict | None,
) -> None:
    """Put the new set in place once every shard is copied: the shards ``waiting`` moved in, then the index
    (``write_index()``, which writes the ``tables`` before the header); see the module docstring."""
    if not state.replaced:
        write_index()
    elif state.local:
        aside = _aside(dest)
        try:
            aside.set_aside([INDEX_NAME, *sorted(state.replaces)])  # the index first
            for name in waiting:
                target = storage.local_path(storage.join_url(dest, *name.split("/")))
                if not os.path.isdir(os.path.dirname(target)):
                    os.makedirs(os.path.dirname(target))
                os.rename(storage.local_path(waiting_url(dest, name)), target)
            write_index()
        except BaseException:
            aside.put_back(lambda: [INDEX_NAME], _index_last)
            raise
        with contextlib.suppress(OSError):  # what is left aside, the next stage removes
            aside.discard()
    else:
        if waiting or tables & state.old_files:  # never an old index beside a new file under one of its names
            storage.remove(storage.join_url(dest, INDEX_NAME), options)
        for name in waiting:
            storage.copy(waiting_url(dest, name), storage.join_url(dest, *name.split("/")), options)
        write_index()


def finish(dest: str, state: DestState, names: list[str], options: dict | None) -> None:
    """Once the new index is written: remove the files of the index it replaced that it does not list (shards,
    tables), what waited, then the marker (and temporary ones of stages killed while writing it)."""
    listed = set(names) | named_tables(storage.join_url(dest, INDEX_NAME), options) | {INDEX_NAME}
    drop_tables(dest, state.old_files - listed, options)
    storage.remove(storage.join_url(dest, WAITING_NAME), options, recursive=True)
    storage.remove(storage.join_url(dest, STAGING_NAME), options)
    for name in storage.listdir(dest, options) if storage.is_local(dest) else []:
        if is_temporary(name, STAGING_NAME):  # the marker of a stage killed while writing it
            storage.remove(storage.join_url(dest, name))


def _top(name: str) -> str:
    return name.split("/", 1)[0]


def _marker(dest: str, options: dict | None) -> str | None:
    """The identity of the dataset a stage cut short was copying into ``dest`` (None: no marker, an unreadable
    one, or one of a stage replacing another dataset, whose files under the same names may be left there)."""
    try:
        d = json.loads(storage.read_whole(storage.join_url(dest, STAGING_NAME), options))
    except (OSError, ValueError):
        return None
    value = d.get("dataset") if isinstance(d, dict) and not d.get("replacing") else None
    return value if isinstance(value, str) else None
