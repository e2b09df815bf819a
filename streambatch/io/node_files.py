"""Files one node's processes share: the name a URL is kept under, the lock that lets one process of the node
fetch what the others then read (the shard cache, `streambatch.io.cache`; the node copies of an index,
`shared_index`), and the check that the cache folder can hold them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import NO_SPACE_ERRNOS, OptionError, os_problem

#: what an object store's ``info`` may say about an object's version, besides its size (each store sets one of
#: these on every write: a rewrite in place at the same URL changes it)
VERSION_KEYS = ("ETag", "etag", "VersionId", "generation", "md5Hash", "LastModified", "mtime", "updated", "created")


def object_version(info: Mapping[str, Any]) -> str:
    """One version of an object's bytes, from what its store's ``info`` says: its size and its ETag, version id,
    generation or mtime (all that the store gives)."""
    return json.dumps([info.get("size"), *(str(info[k]) for k in VERSION_KEYS if info.get(k) is not None)])


def cache_name(url: str) -> str:
    """The file name a URL is cached under: a hash of the whole URL plus its readable last part."""
    h = hashlib.sha1(url.encode("utf-8")).hexdigest()[:20]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
    return f"{h}-{base}"


@contextlib.contextmanager
def file_lock(path: str, blocking: bool = True) -> Iterator[bool]:
    """Hold the ``flock`` of the file ``path`` (made if absent) for the block: yields True, or False when
    ``blocking`` is off and another process holds it. The lock dies with its process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            if not blocking and e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def cache_folder(cache_dir: str, *parts: str) -> str:
    """The folder ``cache_dir/parts...``, made if absent. A cache folder that cannot be written at all (read-only,
    not this user's, a file in the way) is an `OptionError` naming ``cache_dir`` and the OS's reason; one
    whose disk is full just now raises the ``OSError`` (callers read around a full cache)."""
    path = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), *parts)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        if e.errno in NO_SPACE_ERRNOS:
            raise
        raise unwritable(cache_dir, e) from None
    return path


def check_cache_dir(cache_dir: str) -> None:
    """Before anything is read: ``cache_dir`` is made if absent and a file can be made in it, else an
    `OptionError` says why (a cache that cannot work is a setting to fix, not a run to start that would
    fetch every shard on every rank, every epoch). A disk full just now passes: readers then read around it."""
    try:
        probe = os.path.join(cache_folder(cache_dir), f".write-test-{os.getpid():x}-{uuid.uuid4().hex[:8]}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        if e.errno not in NO_SPACE_ERRNOS:
            raise unwritable(cache_dir, e) from None


def unwritable(cache_dir: str, e: OSError) -> OptionError:
    """The error for a cache folder the OS will not let this process write."""
    where = f" ({e.filename})" if e.filename and os.path.abspath(str(e.filename)) != os.path.abspath(cache_dir) else ""
    return OptionError(
        f"cache_dir={cache_dir!r} cannot be written: {os_problem(e)}{where}. Give a folder on a local disk this "
        "user can write, or cache_dir=None to read without a node cache"
    )
