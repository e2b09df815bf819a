"""A file that a block replaces (or removes) put back as it was when the block fails or is interrupted: so two
files written one after the other (``errors.jsonl``, then ``index.json`` of ``shardify merge``) change together
or not at all.

Locally the file is kept under a temporary name (`tempname`) by a hard link, which
costs no space (a copy where the filesystem has no hard links), and renamed back on failure, which needs none;
on object storage its bytes are kept in memory and uploaded again. A file that was not there is removed again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import output_fits
from ..io import storage
from ..io.tempname import is_temporary, temporary_name


@dataclass
class _Kept:
    """How the file was before the block: ``there`` or not; locally its copy's path, else its bytes."""

    there: bool
    path: str | None = None
    data: bytes | None = None


@contextlib.contextmanager
def restored_on_failure(url: str, storage_options: dict | None = None) -> Iterator[None]:
    """Run a block that may replace or remove the file at ``url``; if it fails or is interrupted (any exception,
    Ctrl-C), ``url`` is as it was before the block (put back, or removed if there was none) and the error is
    raised again."""
    kept = _keep(url, storage_options)
    try:
        yield
    except BaseException:
        _put_back(url, kept, storage_options)
        raise
    if kept.path is not None:
        with contextlib.suppress(OSError):
            os.remove(kept.path)


def clear_kept(url: str) -> None:
    """Remove the copies of a local ``url`` that runs killed inside `restored_on_failure()` left (and any
    other temporary file of it): call it holding the folder's lock, before writing ``url`` again."""
    if not storage.is_local(url):
        return
    path = storage.local_path(url)
    folder, name = os.path.split(path)
    for other in os.listdir(folder or ".") if os.path.isdir(folder or ".") else []:
        if is_temporary(other, name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, other))


def _keep(url: str, storage_options: dict | None) -> _Kept:
    """Keep the file at ``url`` as it is now (see the module docstring)."""
    if not storage.is_local(url):
        try:
            return _Kept(True, data=storage.read_whole(url, storage_options))
        except FileNotFoundError:
            return _Kept(False)
    path = storage.local_path(url)
    if not os.path.exists(path):
        return _Kept(False)
    copy = temporary_name(path)
    try:
        os.link(path, copy)
    except OSError:  # no hard links here: a copy (no space for it names the file, and nothing was changed)
        try:
            with output_fits(url, "a copy of it to put back should the write fail"):
                shutil.copy2(path, copy)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(copy)
            raise
    return _Kept(True, path=copy)


def _put_back(url: str, kept: _Kept, storage_options: dict | None) -> None:
    """Make ``url`` as it was (best effort: the block's error is the one to report)."""
    with contextlib.suppress(OSError):
        if kept.path is not None:
            os.replace(kept.path, storage.local_path(url))
            if os.path.lexists(kept.path):  # both names were links to one file (never replaced): rename did nothing
                os.remove(kept.path)
        elif kept.data is not None:
            storage.write_bytes_atomic(url, kept.data, storage_options)
        else:
            storage.remove(url, storage_options)
