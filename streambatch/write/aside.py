"""``--overwrite`` that keeps the dataset it replaces until the new one is complete (a local OUT), on the stage
then swap transaction of `publish` (`publish.Aside`).

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
and any other write puts the old dataset back first, saying so on stderr.

Object storage has no cheap rename: there ``--overwrite`` removes the old files first (`clear_out()`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import InputErrors, StreamBatchError
from ..io import storage
from .parts import ASIDE_PREFIX, Scope, clear_out, replaced_names
from .publish import Aside

PART_ASIDE_NAME = ASIDE_PREFIX + "-part-{:04d}"


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
    aside = _aside(out, part) if overwrite and storage.is_local(out) else None
    if aside is None or not (aside.exists() or any(_owned(m, part) for m in _replaced(out, part))):
        if overwrite:
            clear_out(out, storage_options, part)
        yield False
        return
    try:
        if aside.complete():  # what a killed --overwrite left aside stays the dataset to put back
            clear_out(out, None, part)
        else:
            aside.set_aside(_replaced(out, part), drop=lambda m: not _owned(m, part))
        yield True
    except BaseException as e:
        _put_back(out, part, aside)
        _say_put_back(e, out)
        raise
    aside.discard()


def recover_replaced(out: str, part: tuple[int, int] | None, overwrite: bool) -> None:
    """Before a write into ``out`` (holding its lock): finish what an ``--overwrite`` killed there left. A finished
    write's aside folder is removed; an unfinished one's is kept for an ``overwrite`` (`replacing()` writes
    again with it as the dataset to put back), and put back for any other write, which says so on stderr."""
    if not storage.is_local(out):
        return
    aside = _aside(out, part)
    finished = os.path.exists(os.path.join(storage.local_path(out), Scope(part).index_name))
    if overwrite and not (aside.complete() and finished):
        aside.clear_discarded()
        return  # `replacing()` keeps it (if any) as the dataset to put back
    done = aside.recover(finished, lambda: _made(out, part), _index_last(part))
    if done == "removed":
        print(
            f"shardify: removed {aside.path}: the dataset an earlier --overwrite of {out} replaced (that write "
            "finished, but was killed before removing it)",
            file=sys.stderr,
        )
    elif done == "put back":
        print(
            f"shardify: warning: an --overwrite of {out} did not finish (killed); put back the dataset it was "
            f"replacing from {aside.path}",
            file=sys.stderr,
        )


def _aside(out: str, part: tuple[int, int] | None) -> Aside:
    return Aside(storage.local_path(out), aside_path(out, part))


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


def _made(out: str, part: tuple[int, int] | None) -> list[str]:
    """What the new write made in ``out`` (removed before the old dataset is put back)."""
    return [m for m in _replaced(out, part) if _owned(m, part)]


def _index_last(part: tuple[int, int] | None) -> Callable[[str], Any]:
    """The order in which old files go back: the JSON files after the others, the index last."""
    index_name = Scope(part).index_name
    return lambda m: (m.endswith(".json"), m == index_name)


def _put_back(out: str, part: tuple[int, int] | None, aside: Aside) -> None:
    aside.put_back(lambda: _made(out, part), _index_last(part))


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
