"""One writer per folder: the lock that ``write``, ``index``, ``merge`` and ``stage`` hold on their output folder.

A lock file in the folder, ``.shardify.lock``, and its writer's host, pid, start time and command (JSON: beside it
in a local folder, in it on object storage), so a second writer is refused with one line naming the first
(`LockHeld`, exit 2). The parts of an array job (``--part I/N``) write different files of one folder and run at
the same time: each holds the folder lock *shared* and its own part's lock ``.shardify-part-IIII.lock``
exclusively, so parts run together but never beside a whole write, a merge or another run of the same part.
``stage`` waits for the lock instead of being refused: one stage per node is the rule, and a second one into the
same folder (nodes sharing a "local" disk, a requeued job) finds the copy done and keeps it.

Local folders take the lock from `fasteners` (``InterProcessReaderWriterLock``): a reader-writer lock on the
kernel's ``fcntl`` record locks, which the kernel releases when the holding process dies (``kill -9`` too) and
which NFS carries between hosts. `fasteners` rather than `filelock`: filelock's file lock has no shared mode, and
its reader-writer lock is an SQLite database (journal files beside the dataset, SQLite's own caveats on network
filesystems). Only its public calls are used: the holder's info goes to a side file beside the lock,
``.shardify.lock.holder`` (``LOCK.holder`` for a part's lock), written whole by the exclusive holder once it holds
the lock and removed before it lets go, so a side file found by a writer that *got* the lock is the one a writer
that did not finish left: it is named in a warning and replaced, never obeyed. Record locks belong to a process,
not to a descriptor, and closing any descriptor of a locked file drops them, so this module refuses a second
holder of one lock file inside its own process and never opens a lock file it holds again: fasteners' handle and
one descriptor of this module's own, open from before the lock until after it, are the only ones. That descriptor
also tells, once locked, whether the file locked is still the one in the folder (its last holder removes it; a
writer that opened it just before then locks the new one instead).

Where record locks are not available (object storage URLs, a filesystem refusing them) the lock is an object
created only when absent, by the store itself (`storage.create_only()`: obstore's ``mode="create"``, S3's and
Azure's ``If-None-Match: *``, GCS's ``ifGenerationMatch=0``; fsspec's ``pipe_file(..., mode="create")`` for a store
obstore is not given; a local file opened with ``O_EXCL``), so of two writers starting at the same instant exactly
one wins. Its holder renews its mtime every `HEARTBEAT` seconds; it is
stale, and taken over with a warning, when its pid is dead on this host, or when it was not renewed for
`STALE_AFTER` seconds (another host). A store without create-only puts (an fsspec filesystem that ignores
``mode``) falls back to looking before writing, which two writers starting together can both pass. A clean exit
removes the lock file.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fnmatch
import functools
import inspect
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import fasteners

from ..errors import ShardifyError, os_problem
from ..procs import alive
from . import storage
from .storage import CLEANUP_TIMEOUT, within
from .tempname import temporary_name

LOCK_NAME = ".shardify.lock"
PART_LOCK_NAME = ".shardify-part-{:04d}.lock"
PART_LOCK_GLOB = ".shardify-part-*.lock"
#: what follows a local lock file's name in the name of its side file, which holds the holder's info (JSON)
HOLDER_SUFFIX = ".holder"
#: seconds between two renewals of a lock file's mtime (where record locks are not available)
HEARTBEAT = 30.0
#: seconds between two tries of a writer that waits for the lock (``stage``)
WAIT_POLL = 1.0
#: a lock file not renewed for this many seconds belongs to a writer that is gone (where record locks are not
#: available)
STALE_AFTER = 300.0

P = ParamSpec("P")
R = TypeVar("R")
Where = tuple[str, "tuple[int, int] | None", "dict | None"]


class LockHeld(ShardifyError):
    """Another writer holds the output folder: the message names it (host, pid, since when, command, lock file)."""


def is_lock_file(name: str) -> bool:
    """Whether a file name in an output folder is one of these locks or their holders' side files (and their
    temporaries): not part of any dataset."""
    return any(fnmatch.fnmatch(name, p + s) for p in (LOCK_NAME, PART_LOCK_GLOB) for s in ("", HOLDER_SUFFIX + "*"))


#: the OS errors of a folder that cannot be written: its lock file cannot be made there
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: ``unwritable(folder, error)``: the error to raise instead of ``error`` where the lock cannot be made in ``folder``
Unwritable = Callable[[str, OSError], Exception]


#: this process's writers holding a lock: how many run now, and how many have finished (succeeded, lock released)
_WRITERS = {"running": 0, "finished": 0}


def writers() -> tuple[int, int]:
    """``(running, finished)``: how many of this process's writers hold their lock now, and how many have finished
    (succeeded and released it). Once one has finished and none runs, what they wrote is complete: the CLI lets no
    signal turn that success into a failure."""
    return _WRITERS["running"], _WRITERS["finished"]


def holds_lock(
    where: Callable[[inspect.BoundArguments], Where | None], wait: bool = False, unwritable: Unwritable | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the decorated writer holding the lock of the folder ``where(arguments)`` names: ``(folder, part,
    storage_options)``, or None to run without one (the writer refuses its arguments itself). ``wait``: wait for
    a held lock (saying so once) instead of being refused. ``unwritable``: the error to raise where the folder
    cannot be written (the writer's own advice; default: the OS error, naming the lock file)."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        sig = inspect.signature(func)

        @functools.wraps(func)
        def locked(*args: P.args, **kwargs: P.kwargs) -> R:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            target = where(bound)
            if target is None:
                return func(*args, **kwargs)
            with output_lock(*target, wait=wait, unwritable=unwritable):
                return func(*args, **kwargs)

        return locked

    return decorate


@contextlib.contextmanager
def output_lock(
    folder: str,
    part: tuple[int, int] | None = None,
    storage_options: dict | None = None,
    wait: bool = False,
    unwritable: Unwritable | None = None,
) -> Iterator[None]:
    """Hold ``folder``'s lock: exclusive for a whole write, shared plus part ``I``'s own for ``part=(I, N)``.
    A local folder that does not exist is made (and removed again if it is left empty). ``wait``: wait for a
    held lock instead of raising `LockHeld`; ``unwritable``: see `holds_lock()`. Releasing the lock
    never replaces the writer's own error: a lock file that cannot be removed is a warning."""
    folder = str(folder).rstrip("/") or "/"
    path = storage.local_path(folder)
    if storage.is_local(folder) and os.path.exists(path) and not os.path.isdir(path):
        yield  # a file where the folder belongs: the writer refuses it with its own message
        return
    created = _make_folder(folder, storage_options)
    held: list[_Lock] = []
    _WRITERS["running"] += 1
    finished = False
    try:
        try:
            _take(held, folder, part, storage_options, wait)
        except OSError as e:
            if unwritable is None or e.errno not in DENIED_ERRNOS:
                raise
            raise unwritable(folder, e) from None
        yield
        finished = True
    finally:
        _release(held, patient=finished)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(storage.local_path(folder))  # only when empty: the write failed before writing a file
        _WRITERS["running"] -= 1
        _WRITERS["finished"] += finished


def _take(
    held: list[_Lock], folder: str, part: tuple[int, int] | None, storage_options: dict | None, wait: bool
) -> None:
    """Take the folder's lock (and the part's), each added to ``held`` before it is taken: one taken (or half
    taken: its file written, then an interrupt) is released with the others, and releasing one not taken does
    nothing."""
    whole = _lock_for(storage.join_url(folder, LOCK_NAME), storage_options)
    held.append(whole)
    _acquire(whole, shared=part is not None, folder=folder, storage_options=storage_options, wait=wait)
    if part is None:
        _no_running_parts(whole, folder, storage_options)
    else:
        own = _lock_for(storage.join_url(folder, PART_LOCK_NAME.format(part[0])), storage_options)
        held.append(own)
        _acquire(own, shared=False, folder=folder, storage_options=storage_options)


def _release(held: list[_Lock], patient: bool = True) -> None:
    """Release the locks taken, last first; one whose file cannot be removed (the folder made read-only meanwhile)
    is still released (its record lock ends with its handle) and is a warning, never an error: the error
    of the write, if any, is the one to report. Not ``patient`` (after an interrupt or an error), a lock file on
    object storage gets `CLEANUP_TIMEOUT` seconds to go, then a warning names
    it: the cleanup of an interrupted write never waits long for a storage that does not answer."""
    for lock in reversed(held):
        try:
            if patient or storage.is_local(lock.url):
                lock.release()
            elif not within(CLEANUP_TIMEOUT, functools.partial(lock.release, quick=True))[0]:
                print(
                    f"shardify: warning: gave up removing the lock file {lock.url} after {CLEANUP_TIMEOUT:g} s (the "
                    f"storage did not answer); remove it, or the next writer takes it over once it is "
                    f"{STALE_AFTER:g} s old",
                    file=sys.stderr,
                )
        except OSError as e:
            why = os_problem(e)
            print(
                f"shardify: warning: could not remove the lock file {lock.url} ({why}); the next writer takes it over",
                file=sys.stderr,
            )


def _make_folder(folder: str, storage_options: dict | None) -> bool:
    """Make a local ``folder`` that does not exist yet; whether it was made here."""
    if not storage.is_local(folder) or os.path.isdir(storage.local_path(folder)):
        return False
    storage.makedirs(folder, storage_options)
    return True


def _acquire(lock: _Lock, shared: bool, folder: str, storage_options: dict | None, wait: bool = False) -> None:
    """Take ``lock`` or raise `LockHeld` naming its holder (``wait``: try again every `WAIT_POLL`
    seconds, saying once whom it waits for); warn when taking over a dead writer's."""
    left, said = lock.acquire(shared), False
    while left is _HELD:
        holder = lock.holder() or (_part_holder(folder, storage_options) if not shared else None)
        if not wait:
            raise LockHeld(_held_text(folder, holder, lock.url))
        if not said:
            who = _who(holder) if holder else "a writer whose details are not readable yet"
            print(f"shardify: waiting for another shardify writing {folder} ({who})", file=sys.stderr, flush=True)
            said = True
        time.sleep(WAIT_POLL)
        left = lock.acquire(shared)
    if left:
        print(
            f"shardify: warning: taking over the lock of a writer that did not finish ({_who(left)}; "
            f"{lock.url}); what it left in {folder} is replaced or checked as after any interrupted write",
            file=sys.stderr,
        )


def _held_text(folder: str, holder: dict[str, Any] | None, url: str) -> str:
    who = _who(holder) if holder else "a writer whose details are not readable yet"
    return (
        f"{folder} is being written by another shardify ({who}; lock {url}); wait for it to finish, or write elsewhere"
    )


def _who(info: dict[str, Any]) -> str:
    return (
        f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {info.get('since', '?')}: "
        f"{info.get('command', '?')}"
    )


def _part_holder(folder: str, storage_options: dict | None) -> dict[str, Any] | None:
    """The info of a running part writer (the folder lock's shared holders write theirs in their part lock)."""
    for name in storage.listdir(folder, storage_options):
        if fnmatch.fnmatch(name, PART_LOCK_GLOB):
            info = _lock_for(storage.join_url(folder, name), storage_options).holder()
            if info:
                return info
    return None


def _no_running_parts(whole: _Lock, folder: str, storage_options: dict | None) -> None:
    """With the folder lock held exclusively: remove the part locks that parts which did not finish left (with
    record locks no part can be running), or (lock files with a heartbeat) refuse while a part's lock is live."""
    kernel = isinstance(whole, _KernelLock) and whole.fallback is None
    for name in storage.listdir(folder, storage_options):
        if not fnmatch.fnmatch(name, PART_LOCK_GLOB):
            continue
        url = storage.join_url(folder, name)
        if not kernel:
            part = _FileLock(url, storage_options)
            info = part.holder()
            if not part._stale(info):
                raise LockHeld(_held_text(folder, info, url))
        for gone in (url, url + HOLDER_SUFFIX) if kernel else (url,):
            with contextlib.suppress(FileNotFoundError):
                storage.remove(gone, storage_options)


def _my_info() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:500],
        "token": uuid.uuid4().hex,
    }


def _parse_info(data: bytes) -> dict[str, Any] | None:
    try:
        info = json.loads(data[:4096].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _read_info(url: str, storage_options: dict | None) -> dict[str, Any] | None:
    try:
        with storage.open_url(url, "rb", storage_options) as f:
            return _parse_info(f.read(4096))
    except (FileNotFoundError, OSError):
        return None


#: what `_Lock.acquire()` returns when another writer holds the lock
_HELD: Any = object()


class _Lock:
    """A lock file; `acquire()` returns ``_HELD``, or the info a dead writer left (None: none left)."""

    url: str

    def acquire(self, shared: bool) -> Any:
        raise NotImplementedError

    def holder(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def release(self, quick: bool = False) -> None:
        raise NotImplementedError


def _lock_for(url: str, storage_options: dict | None) -> _Lock:
    if storage.is_local(url):
        return _KernelLock(url)
    return _FileLock(url, storage_options)


class _KernelLock(_Lock):
    """A local lock file held with the kernel's record locks through `fasteners` (released by the kernel when its
    process dies, ``kill -9`` included); the exclusive holder's info in the side file ``PATH.holder``. ``fd``: this
    module's own descriptor of the lock file, open from before the lock until after it (see the module)."""

    def __init__(self, url: str) -> None:
        self.url, self.path = url, storage.local_path(url)
        self.holder_url = url + HOLDER_SUFFIX
        self.key = os.path.realpath(self.path)
        self.rw: fasteners.InterProcessReaderWriterLock | None = None
        self.fd: int | None = None
        self.shared = False
        self.fallback: _FileLock | None = None

    def acquire(self, shared: bool) -> Any:
        with _IN_PROCESS_GUARD:  # record locks never refuse their own process: a second holder here is refused
            if self.key in _IN_PROCESS:
                return _HELD
            _IN_PROCESS[self.key] = self
        try:
            left = self._acquire(shared)
        except BaseException:
            rw, self.rw = self.rw, None
            self._let_go(rw)
            self._forget()
            raise
        if left is _HELD:
            self._forget()
        return left

    def _acquire(self, shared: bool) -> Any:
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # a folder that cannot be written: its errno
            rw = fasteners.InterProcessReaderWriterLock(self.path, logger=_QUIET)
            try:
                got = rw.acquire_read_lock(blocking=False) if shared else rw.acquire_write_lock(blocking=False)
            except threading.ThreadError:  # a filesystem without record locks: the lock file with a heartbeat
                self._let_go(rw)
                return self._fall_back(shared)
            if not got:
                self._let_go(rw)
                return _HELD
            if self._still_there():
                break
            self._let_go(rw)  # removed by its last holder between our open and our lock: lock the new one
        self.rw, self.shared = rw, shared
        return self._take_holder(shared)

    def _still_there(self) -> bool:
        """Whether the file our descriptor opened is still the one in the folder: kept open, its inode is not
        reused, so the same inode under the name is the same file."""
        assert self.fd is not None
        try:
            st, now = os.fstat(self.fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)

    def _fall_back(self, shared: bool) -> Any:
        """The lock file created only when absent (see `_FileLock`): the empty file the open above made goes."""
        with contextlib.suppress(OSError):
            if os.path.getsize(self.path) == 0:
                os.remove(self.path)
        self.fallback = _FileLock(self.url, None)
        return self.fallback.acquire(shared)

    def _take_holder(self, shared: bool) -> dict[str, Any] | None:
        """What a writer killed while holding the lock exclusively left (its side file, or the info an older
        version wrote into the lock file itself; None: nothing), cleared; then our info into the side file,
        holding it exclusively (a shared holder, one of several, writes none)."""
        assert self.fd is not None
        left = _read_info(self.holder_url, None) or _parse_info(os.pread(self.fd, 4096, 0))
        if left is not None:
            os.ftruncate(self.fd, 0)
            if shared:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.holder_url)
        if not shared:
            _write_holder(self.holder_url, _my_info())
        return left

    def holder(self) -> dict[str, Any] | None:
        if self.fallback is not None:
            return self.fallback.holder()
        info = _read_info(self.holder_url, None)
        with _IN_PROCESS_GUARD:
            held_here = self.key in _IN_PROCESS
        if info is None and not held_here:  # no side file: a lock file of an older version or one without record
            info = _read_info(self.url, None)  # locks holds its writer's info itself (opened only if not held here)
        return info

    def release(self, quick: bool = False) -> None:
        if self.fallback is not None:
            try:
                self.fallback.release(quick)
            finally:
                self._forget()
            return
        rw = self.rw
        if rw is None:
            return
        try:
            # the last holder removes its side file, then the lock file (a shared one only if no other part holds it)
            if not self.shared or rw.acquire_write_lock(blocking=False):
                for gone in (self.holder_url, self.path):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(gone)
        finally:
            self.rw = None
            try:
                self._let_go(rw)
            finally:
                self._forget()

    def _let_go(self, rw: fasteners.InterProcessReaderWriterLock | None) -> None:
        """Unlock (``rw``'s release closes its handle), then close our own descriptor (closing it first would drop
        the lock early; closed, it drops what is left of it)."""
        try:
            if rw is not None:
                rw.release_write_lock()  # unlocks and closes its handle (whichever mode it held)
        finally:
            if self.fd is not None:
                fd, self.fd = self.fd, None
                os.close(fd)

    def _forget(self) -> None:
        with _IN_PROCESS_GUARD:
            if _IN_PROCESS.get(self.key) is self:
                del _IN_PROCESS[self.key]


def _write_holder(path: str, info: dict[str, Any]) -> None:
    """``info`` into the side file ``path``, whole (under a temporary name, then renamed: a reader sees none or
    all). Not synced, and a failure is let go: the details serve messages only (a reader finding none says so),
    and a disk that cannot take them fails the write itself, naming its own file."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(info))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


#: the local lock files held by this process (record locks do not tell two holders in one process apart)
_IN_PROCESS: dict[str, _KernelLock] = {}
_IN_PROCESS_GUARD = threading.Lock()
#: fasteners logs a failed unlock at error level: the caller handles what matters, so nothing is printed
_QUIET = logging.getLogger("streambatch.io.lock.fasteners")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class _FileLock(_Lock):
    """A lock file created only when absent, its mtime renewed by a heartbeat thread (object storage, or a
    filesystem without record locks); shared holders (parts) check it is absent or stale without holding it."""

    def __init__(self, url: str, storage_options: dict | None) -> None:
        self.url, self.storage_options = url, storage_options
        self.mine: dict[str, Any] | None = None
        #: our create-only put returned: the lock file is ours
        self.landed = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self, shared: bool) -> Any:
        info = self.holder()
        left = None
        if info is not None or storage.exists(self.url, self.storage_options):
            if not self._stale(info):
                return _HELD
            left = info or {}
        if shared:
            return left
        mine = _my_info()
        if left is not None:  # a dead writer's: removed, then ours created (two writers taking over the same
            # dead writer's lock at the same instant can both remove it before either creates theirs)
            with contextlib.suppress(FileNotFoundError):
                storage.remove(self.url, self.storage_options)
        self.mine = mine  # ours from the moment it may be written: release() removes it if it is there
        try:
            storage.create_only(self.url, json.dumps(mine).encode(), self.storage_options)
        except FileExistsError:
            self.mine = None
            return _HELD  # another writer created its lock first
        self.landed = True
        self._beat = threading.Thread(target=self._heartbeat, name="shardify-lock", daemon=True)
        self._beat.start()
        return left

    def _stale(self, info: dict[str, Any] | None) -> bool:
        """A lock of a dead pid on this host, or not renewed for `STALE_AFTER` seconds."""
        if info and info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
            return not alive(info["pid"])
        try:
            return time.time() - storage.modified(self.url, self.storage_options) > STALE_AFTER
        except (FileNotFoundError, OSError):
            return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            with contextlib.suppress(OSError):
                storage.write_bytes_atomic(self.url, json.dumps(self.mine).encode(), self.storage_options)

    def holder(self) -> dict[str, Any] | None:
        return _read_info(self.url, self.storage_options)

    def release(self, quick: bool = False) -> None:
        """Remove the lock file if it is ours. ``quick`` (the cleanup of an interrupted write, which has a few
        seconds): once our create-only put has landed it is removed without reading it back first, one request
        instead of two."""
        if self.mine is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if (quick and self.landed) or (self.holder() or {}).get("token") == self.mine["token"]:
            with contextlib.suppress(FileNotFoundError, OSError):
                storage.remove(self.url, self.storage_options)
        self.mine = None
        self.landed = False
