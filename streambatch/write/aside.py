"""``--overwrite`` that keeps the dataset it replaces until the new one is complete (a local OUT).

Once the input is read and checked, and before the new dataset's first file is written, every file ``--overwrite``
replaces (`replaced_names()`: the index first, then its tables, the shards, the errors file,
temporaries) is renamed into a hidden folder in OUT, ``.shardify-replaced`` (``.shardify-replaced-part-IIII`` for
part I): renames, which cost neither time nor space, and the old dataset stays whole there (it even loads from
there). When the new index is written the folder is removed; when the write fails or is interrupted (any
exception, Ctrl-C) the new write's files are removed and the old ones moved back, index last. The new dataset is
written while the old one still takes its space on the disk.

A writer killed hard (SIGKILL, a lost node) leaves the folder behind. The next ``shardify write`` into OUT finds
it, under OUT's lock (`recover_replaced()`): if that write finished (its index is there), only the removal was
lost and is done then; otherwise ``--overwrite`` keeps the folder as the dataset to put back while it writes again,
and any other write puts the old dataset back first, saying so on stderr. A marker in the folder
(`_ALL_ASIDE`) says every old file is in it: before it is there OUT holds nothing new, so a writer killed
while setting the dataset aside, or while putting it back, is recovered as well.

Object storage has no cheap rename: there ``--overwrite`` removes the old files first (`clear_out()`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator

from ..errors import InputErrors, StreamBatchError
from ..io import storage
from .parts import ASIDE_PREFIX, Scope, clear_out, remove_quiet, replaced_names

PART_ASIDE_NAME = ASIDE_PREFIX + "-part-{:04d}"
#: the file in an aside folder saying that every replaced file is in it (the new write may have begun)
_ALL_ASIDE = ".all-set-aside"
#: the suffix an aside folder is renamed to before it is removed (a removal cut short leaves no half dataset aside)
_DISCARDED = ".discarded"


def aside_path(out: str, part: tuple[int, int] | None = None) -> str:
    """The local path of the folder where an ``--overwrite`` of ``out`` (of ``part``) keeps the dataset it replaces."""
    name = ASIDE_PREFIX if part is None else PART_ASIDE_NAME.format(part[0])
    return os.path.join(storage.local_path(out), name)


@contextlib.contextmanager
def replacing(out: str, part: tuple[int, int] | None, overwrite: bool, storage_options: dict | None) -> Iterator[bool]:
    """Run the block that writes the new dataset into ``out``. With ``overwrite``, the dataset it replaces is set
    aside before the block and removed after it, or put back if the block fails or is interrupted (the error is
    raised again, saying so). Yields whether a dataset was set aside: not without ``overwrite``, on object storage
    (the old files are removed first, as before) or when ``out`` holds nothing to replace."""
    aside = aside_path(out, part) if overwrite and storage.is_local(out) else None
    if aside is None or not (os.path.isdir(aside) or any(_owned(m, part) for m in _replaced(out, part))):
        if overwrite:
            clear_out(out, storage_options, part)
        yield False
        return
    try:
        _set_aside(out, part, aside)
        yield True
    except BaseException as e:
        _put_back(out, part, aside)
        _say_put_back(e, out)
        raise
    _discard(aside)


def recover_replaced(out: str, part: tuple[int, int] | None, overwrite: bool) -> None:
    """Before a write into ``out`` (holding its lock): finish what an ``--overwrite`` killed there left. A finished
    write's aside folder is removed; an unfinished one's is kept for an ``overwrite`` (`replacing()` writes
    again with it as the dataset to put back), and put back for any other write, which says so on stderr."""
    if not storage.is_local(out):
        return
    aside = aside_path(out, part)
    shutil.rmtree(aside + _DISCARDED, ignore_errors=True)
    if not os.path.isdir(aside):
        return
    if _all_aside(aside) and os.path.exists(os.path.join(storage.local_path(out), Scope(part).index_name)):
        _discard(aside)
        print(
            f"shardify: removed {aside}: the dataset an earlier --overwrite of {out} replaced (that write finished, "
            "but was killed before removing it)",
            file=sys.stderr,
        )
    elif not overwrite:
        _put_back(out, part, aside)
        print(
            f"shardify: warning: an --overwrite of {out} did not finish (killed); put back the dataset it was "
            f"replacing from {aside}",
            file=sys.stderr,
        )


def _replaced(out: str, part: tuple[int, int] | None) -> list[str]:
    """What an ``--overwrite`` of ``out`` replaces, index first; a whole write also takes the aside folders that
    parts killed while overwriting left (their parts are replaced as well)."""
    names = os.listdir(storage.local_path(out)) if os.path.isdir(storage.local_path(out)) else []
    stale = sorted(m for m in names if part is None and m.startswith(ASIDE_PREFIX + "-part-"))
    return replaced_names(names, part) + stale


def _owned(name: str, part: tuple[int, int] | None) -> bool:
    """Whether an ``--overwrite`` sets ``name`` aside: every file it replaces, or for a part its own files (the
    merged index and the files it shares with the other parts are removed, as the others may change meanwhile)."""
    return part is None or Scope(part).owns(name)


def _all_aside(aside: str) -> bool:
    return os.path.exists(os.path.join(aside, _ALL_ASIDE))


def _set_aside(out: str, part: tuple[int, int] | None, aside: str) -> None:
    """Move what the new write replaces into ``aside`` (index first), then mark it complete. An aside folder a
    killed ``--overwrite`` left, complete, stays the dataset to put back: what that write left in OUT is removed."""
    folder = storage.local_path(out)
    if _all_aside(aside):
        clear_out(out, None, part)
        return
    os.makedirs(aside, exist_ok=True)
    for m in _replaced(out, part):
        if _owned(m, part):
            with contextlib.suppress(FileNotFoundError):  # a temporary file another part removed meanwhile
                os.rename(os.path.join(folder, m), os.path.join(aside, m))
        else:
            remove_quiet(os.path.join(folder, m), None)
    open(os.path.join(aside, _ALL_ASIDE), "wb").close()


def _put_back(out: str, part: tuple[int, int] | None, aside: str) -> None:
    """Undo a replacement that did not finish: remove what the new write made (only once every old file is aside;
    before, OUT holds nothing new), then move the old files back, index last, and remove ``aside``."""
    if not os.path.isdir(aside):
        return
    folder = storage.local_path(out)
    if _all_aside(aside):
        for m in _replaced(out, part):
            if _owned(m, part):
                remove_quiet(os.path.join(folder, m), None)
        os.remove(os.path.join(aside, _ALL_ASIDE))
    index_name = Scope(part).index_name
    for m in sorted(os.listdir(aside), key=lambda m: (m.endswith(".json"), m == index_name)):
        _move_back(os.path.join(aside, m), os.path.join(folder, m))
    with contextlib.suppress(OSError):
        os.rmdir(aside)


def _move_back(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, replacing whatever is there (a folder, such as a sample table, as a whole)."""
    if os.path.isdir(dst) and not os.path.islink(dst):
        shutil.rmtree(dst)
    os.replace(src, dst)


def _discard(aside: str) -> None:
    """Remove ``aside``: renamed first, so that a removal cut short never leaves part of a dataset to put back."""
    gone = aside + _DISCARDED
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(aside, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _say_put_back(e: BaseException, out: str) -> None:
    """Say that ``out`` holds the old dataset again: in the message of an error raised on purpose (raised again
    with it, still one line) or, for anything else (an interrupt, an unexpected error), in a line on stderr."""
    note = f"nothing was replaced: {out} holds the dataset that was there again"
    if isinstance(e, StreamBatchError) and not isinstance(e, InputErrors):
        try:
            again = type(e)(f"{e}; {note}")
        except Exception:  # an error class with other arguments: say it on stderr
            again = None
        if again is not None:
            raise again from e
    print(f"shardify: the --overwrite did not finish; {note}", file=sys.stderr)
