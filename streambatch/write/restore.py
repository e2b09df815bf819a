"""A file that a block replaces (or removes) put back as it was when the block fails or is interrupted: so two
files written one after the other (``errors.jsonl``, then ``index.json`` of ``shardify merge``) change together
or not at all.

Locally the file is kept in a hidden folder beside it by the stage then swap transaction of `publish`
(`publish.Aside.keep()`: a hard link, which costs no space, a copy where the filesystem has no hard links) and
renamed back on failure, which needs none; on object storage its bytes are kept in memory and uploaded again. A
file that was not there is removed again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ..errors import output_fits
from ..io import storage
from ..io.tempname import is_temporary
from .publish import Aside

#: the folder beside the file where it is kept while the block runs (hidden, like every aside folder of OUT)
KEPT_NAME = ".shardify-replaced-kept"


@contextlib.contextmanager
def restored_on_failure(url: str, storage_options: dict | None = None) -> Iterator[None]:
    """Run a block that may replace or remove the file at ``url``; if it fails or is interrupted (any exception,
    Ctrl-C), ``url`` is as it was before the block (put back, or removed if there was none) and the error is
    raised again."""
    if not storage.is_local(url):
        with _kept_in_memory(url, storage_options):
            yield
        return
    name, aside = _aside(url)
    try:
        with output_fits(url, "a copy of it to put back should the write fail"):
            aside.keep([name])
    except BaseException:  # nothing was changed: the file stays as it is
        with contextlib.suppress(OSError):
            aside.discard()
        raise
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):  # best effort: the block's error is the one to report
            aside.put_back(lambda: [name], lambda m: 0)
        raise
    with contextlib.suppress(OSError):
        aside.discard()


def clear_kept(url: str) -> None:
    """Remove what runs killed inside `restored_on_failure()` left beside a local ``url`` (its kept copy, and any
    temporary file of it): call it holding the folder's lock, before writing ``url`` again."""
    if not storage.is_local(url):
        return
    name, aside = _aside(url)
    aside.clear_discarded()
    aside.discard()
    for other in os.listdir(aside.folder) if os.path.isdir(aside.folder) else []:
        if is_temporary(other, name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(aside.folder, other))


def _aside(url: str) -> tuple[str, Aside]:
    folder, name = os.path.split(storage.local_path(url))
    folder = folder or "."
    return name, Aside(folder, os.path.join(folder, KEPT_NAME))


@contextlib.contextmanager
def _kept_in_memory(url: str, storage_options: dict | None) -> Iterator[None]:
    """On object storage: the object's bytes kept in memory, uploaded again (or the object removed, where there
    was none) if the block fails."""
    try:
        data: bytes | None = storage.read_whole(url, storage_options)
    except FileNotFoundError:
        data = None
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if data is not None:
                storage.write_bytes_atomic(url, data, storage_options)
            else:
                storage.remove(url, storage_options)
        raise
