"""Files one node's processes share: the name a URL is kept under, and the lock that lets one process of the node
fetch what the others then read (the shard cache, :mod:`streambatch.read.cache`; the node copies of an index,
:mod:`.shared_index`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator


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
