"""Node-local shard cache: each shard is downloaded once per node, however many ranks and workers read it.

A cached shard is keyed by its content, not its name alone: by the ``version`` the reader gives, the index's
sha256 of the shard (or, where the index has none, the version the store names: ETag, version id, mtime), so a
dataset rewritten in place at the same URL is fetched again, never served from the old copy. Fetching a new
version of a URL removes the copies of its other versions.

A process that needs a shard takes that shard's ``flock``; unless another process finished it meanwhile it
downloads it to a temporary name and, once checked, renames it into place, so readers (who open the final
file directly) see nothing or the whole shard. Least recently used shards are evicted to keep ``max_bytes``:
before a download (room for its declared size), and again once it is in place, so that the cache folder holds
at most ``max_bytes`` at rest (shards, plus what else the folder holds: the node copies of indexes, the record
of hashes) however many downloads overlapped. A shard is handed out as an open file (`ShardCache.open()`),
so one evicted before its reader gets to it is still read whole (the unlinked file lives until it is closed;
the disk then holds more than ``max_bytes`` for a while). Locks die with their process; a killed writer's
temporary files are removed by the next one (or a sweep). Folders someone deleted are made again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import uuid
from collections.abc import Callable
from typing import BinaryIO

from ..errors import OptionError
from .digest import size_problem
from .node_files import cache_name, file_lock

log = logging.getLogger("streambatch")

#: what separates a URL's name from its version's tag in a cached file's name
VERSION_SEP = "@"
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9a-f]+-[0-9a-f]+(?:-(?P<size>[0-9a-f]+))?$")


class ShardCache:
    """A size-limited LRU cache of whole shards on local disk, safe across processes of one node."""

    def __init__(self, root: str, max_bytes: int | None = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_bytes = max_bytes
        self.objects = os.path.join(self.root, "objects")
        self.locks = os.path.join(self.root, "locks")
        self._make_folders()
        self.sweep()

    def _make_folders(self) -> None:
        os.makedirs(self.objects, exist_ok=True)
        os.makedirs(self.locks, exist_ok=True)

    def _folders_back(self) -> None:
        """Make the cache's folders again if they are gone (someone cleared the cache while it was in use)."""
        if not (os.path.isdir(self.objects) and os.path.isdir(self.locks)):
            self._make_folders()
            log.warning("streambatch cache %s: its folders were gone; made them again", self.root)

    # ---- locks -------------------------------------------------------------------------------------
    def _flock(self, path: str, blocking: bool = True) -> contextlib.AbstractContextManager[bool]:
        return file_lock(path, blocking)

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.locks, name + ".lock")

    # ---- lookup and download -------------------------------------------------------------------------
    def path(self, url: str, version: str | None = None) -> str:
        """Where the copy of ``version`` of ``url`` is kept (``version``: what names its content, see the module;
        None: the URL alone)."""
        return os.path.join(self.objects, object_name(url, version))

    def lookup(self, url: str, size: int | None = None, version: str | None = None) -> str | None:
        """The path of the cached file of ``version`` of ``url`` if it is there (and has ``size`` bytes); marks it
        used. The file may be evicted once this returns: a reader uses `cached()` or `open()`, which hand
        it out open."""
        f = self.cached(url, size, version)
        if f is None:
            return None
        f.close()
        return self.path(url, version)

    def cached(self, url: str, size: int | None = None, version: str | None = None) -> BinaryIO | None:
        """The cached file of ``version`` of ``url`` opened for reading, if it is there (and has ``size`` bytes);
        marks it used."""
        p = self.path(url, version)
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            return None
        problem = size_problem(os.fstat(f.fileno()).st_size, size)
        if problem:
            f.close()
            log.warning("streambatch cache: %s: %s; fetching it again", p, problem)
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
            return None
        with contextlib.suppress(OSError):
            os.utime(p)  # last use, for LRU (not on a cache gone read-only: the copy is still good to read)
        return f

    def get(
        self, url: str, size: int | None, download: Callable[[str], None], version: str | None = None
    ) -> tuple[str, bool]:
        """`open()`, giving the path (the file may be evicted once this returns)."""
        f, downloaded = self.open(url, size, download, version)
        f.close()
        return self.path(url, version), downloaded

    def open(
        self, url: str, size: int | None, download: Callable[[str], None], version: str | None = None
    ) -> tuple[BinaryIO, bool]:
        """(the cached copy of ``version`` of ``url``, open for reading, whether this call downloaded it); it is
        kept under `path()`. ``version`` names the content (the index's sha256 of the shard, or the store's
        ETag or version id): a copy of another version is not this one, and is removed when this one is fetched.
        ``download(tmp_path)`` must write the complete, verified object to ``tmp_path`` or raise; it runs at most
        once per node at a time per URL. The file is opened before anyone may evict it, so it stays readable to its
        end whatever eviction does meanwhile (the disk then holds more than ``max_bytes``)."""
        self._folders_back()
        f = self.cached(url, size, version)
        if f is not None:
            return f, False
        name = cache_name(url)
        with self._flock(self._lock_path(name)):
            f = self.cached(url, size, version)  # another process finished it while we waited
            if f is not None:
                return f, False
            self._remove_tmp(name)  # we hold the lock: any temporary file of this shard is a dead writer's
            self._remove_versions(name)  # and any copy of this URL is of another version: never read again
            declared = f"-{size:x}" if size is not None else ""  # its size reserved: see make_room
            tmp = os.path.join(self.objects, f".{name}.tmp-{os.getpid():x}-{uuid.uuid4().hex[:8]}{declared}")
            if size is not None and self.max_bytes is not None:
                if size > self.max_bytes:
                    raise OptionError(
                        f"{url}: {size} bytes do not fit a cache of {self.max_bytes} bytes; raise cache_size"
                    )
                self.make_room(size, tmp)
            final = self.path(url, version)
            f = self._download(tmp, final, download)
            try:
                self.trim(keep=final)
            except OSError:  # the folder gone meanwhile: the download is in hand, the next one trims
                log.debug("streambatch cache %s: could not trim after %s", self.root, url, exc_info=True)
            return f, True

    def _download(self, tmp: str, final: str, download: Callable[[str], None]) -> BinaryIO:
        """``download`` into ``tmp``, opened, then renamed to ``final`` (holding the shard's lock)."""
        try:
            download(tmp)
            f = open(tmp, "rb")
            try:
                os.replace(tmp, final)
            except BaseException:
                f.close()
                raise
            return f
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    # ---- housekeeping --------------------------------------------------------------------------------
    def _remove_versions(self, name: str) -> None:
        """Remove the cached copies of the URL cached under ``name``, whatever their version (its lock held)."""
        for f in os.listdir(self.objects):
            if f == name or f.startswith(name + VERSION_SEP):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.objects, f))

    def _remove_tmp(self, name: str) -> None:
        prefix = f".{name}.tmp-"
        for f in os.listdir(self.objects):
            if f.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.objects, f))

    def sweep(self) -> int:
        """Remove temporary files left by killed processes (those whose shard lock nobody holds)."""
        removed = 0
        for f in os.listdir(self.objects):
            m = _TMP.match(f)
            if not m:
                continue
            with self._flock(self._lock_path(m.group("name")), blocking=False) as got:
                if got and os.path.exists(os.path.join(self.objects, f)):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.objects, f))
                        removed += 1
        if removed:
            log.info("streambatch cache %s: removed %d unfinished downloads of earlier runs", self.root, removed)
        return removed

    def entries(self) -> list[tuple[str, int, float]]:
        """(path, bytes, last use) of the complete shards, least recently used first."""
        out = []
        for f in os.listdir(self.objects):
            if f.startswith("."):
                continue
            p = os.path.join(self.objects, f)
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(p)
                out.append((p, st.st_size, st.st_mtime))
        out.sort(key=lambda e: e[2])
        return out

    def usage(self) -> int:
        """Bytes the cache folder holds at rest: its complete shards and what else it keeps (`other_bytes()`)."""
        return sum(e[1] for e in self.entries()) + self.other_bytes()

    def other_bytes(self) -> int:
        """Bytes of the cache folder's files that are not shards (the node copies of indexes, the record of hashes,
        a stamp): they count against ``max_bytes`` too, though only shards are evicted."""
        total = 0
        for top, dirs, files in os.walk(self.root):
            if top == self.root:
                dirs[:] = [d for d in dirs if d not in ("objects", "locks")]
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(top, f)).st_size
        return total

    def make_room(self, need: int, reserve: str | None = None) -> None:
        """Evict least recently used shards until ``need`` more bytes fit. Downloads in progress count at their
        declared size (in their temporary file's name), not at what they hold so far, and ``reserve`` (the
        caller's temporary file) is created before the lock is let go: downloads that start together (a
        worker's interleaved shards, other processes) each see the others' room taken."""
        if self.max_bytes is None:
            return
        with self._flock(os.path.join(self.root, ".evict.lock")):
            self._evict(need)
            if reserve is not None:
                open(reserve, "wb").close()

    def trim(self, keep: str | None = None) -> None:
        """After a download: evict least recently used shards (``keep`` last of all) until what the folder holds,
        with the downloads still in progress at their declared size, fits ``max_bytes``. Downloads that overlap
        can each find room taken by the others only once they started; the one to finish last leaves the folder
        within the limit."""
        if self.max_bytes is None:
            return
        with self._flock(os.path.join(self.root, ".evict.lock")):
            self._evict(0, keep)

    def _evict(self, need: int, keep: str | None = None) -> None:
        """Evict least recently used shards (``keep`` only if nothing else is left) until ``need`` more bytes fit."""
        assert self.max_bytes is not None
        entries = self.entries()
        entries.sort(key=lambda e: e[0] == keep)  # stable: LRU order otherwise
        total = sum(e[1] for e in entries) + self._pending() + self.other_bytes()
        for p, n, _ in entries:
            if total + need <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
                total -= n
                log.debug("streambatch cache: evicted %s (%d bytes)", p, n)

    def _pending(self) -> int:
        """Bytes of the downloads in progress: each at least its declared size."""
        pending = 0
        for f in os.listdir(self.objects):
            m = _TMP.match(f)
            if m:
                with contextlib.suppress(FileNotFoundError):
                    held = os.stat(os.path.join(self.objects, f)).st_size
                    pending += max(held, int(m.group("size") or "0", 16))
        return pending


def object_name(url: str, version: str | None = None) -> str:
    """The file name the copy of ``version`` of ``url`` is cached under: `cache_name()` of the URL, then a tag
    of the version (a hash of it: a version may hold any character)."""
    if version is None:
        return cache_name(url)
    return f"{cache_name(url)}{VERSION_SEP}{hashlib.sha256(version.encode('utf-8')).hexdigest()[:24]}"
