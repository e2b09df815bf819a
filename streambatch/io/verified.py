"""A shard's sha256, computed once per node: the record of files (and remote objects) already hashed.

With ``verify="sha256"`` every byte of a local shard used to be hashed again every epoch. A file's hash is now
remembered, keyed by what changes when its bytes change: its device, inode, size, mtime and ctime (in
nanoseconds; ctime cannot be set back by a user, so restoring the mtime after a write still changes the key). A
later pass, process or rank of the node that finds the same key takes the remembered digest instead of reading
the file again; a file whose key changed is hashed again. A remote shard streamed without a cache is keyed by its
URL, size and the version every range answer names (`object_key()`): its bytes are fetched every pass anyway,
but hashed only while no answer names a version this node has hashed.

Two levels: a dict in the process (epoch 2 of a worker costs a ``stat``), and a small file per shard in a folder
of this user's, shared by the node's processes: ``streambatch-verified-<uid>`` under ``cache_dir`` when the
reader has one, else under ``$XDG_RUNTIME_DIR`` or the temporary folder (``STREAMBATCH_VERIFY_RECORD`` names
another folder; ``off`` turns the node record off). Each entry is written whole under a temporary name and
renamed into place, so concurrent writers never leave half an entry. The folder is trusted only when it is
ours: a real directory (not a link) owned by this user with no access for anyone else; otherwise, and for any
entry that cannot be read, parsed, or that names another key, the file is simply hashed again. Deleting the
folder clears the record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import threading
import uuid
from typing import NamedTuple

from ..limits import loads

#: environment variable: the folder of the node record (``off``: no node record, only the in-process one)
RECORD_ENV = "STREAMBATCH_VERIFY_RECORD"
_MAX_ENTRY = 4096  # bytes: an entry is ~300; anything larger is not ours

_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


def _new_lock() -> None:
    """A forked child (a DataLoader worker) starts with a free lock, even if a hashing thread held it."""
    global _memo_lock
    _memo_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)


def file_key(path: str, st: os.stat_result) -> tuple:
    """What identifies one version of a file's bytes: its absolute path, device, inode, size, mtime and ctime."""
    return (os.path.abspath(path), *file_version(st))


def file_version(st: os.stat_result) -> tuple:
    """One version of the file ``st`` describes, whatever its name: device, inode, size, mtime and ctime (ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def record_dir(cache_dir: str | None = None) -> str | None:
    """The folder of this user's node record (None: turned off)."""
    where = os.environ.get(RECORD_ENV, "").strip()
    if where.lower() == "off":
        return None
    if not where:
        if cache_dir:
            where = os.path.abspath(os.path.expanduser(cache_dir))
        else:
            where = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        where = os.path.join(where, f"streambatch-verified-{os.getuid()}")
    return os.path.abspath(os.path.expanduser(where))


def _ours(folder: str, make: bool) -> bool:
    """Whether ``folder`` is a directory of this user's that nobody else can write or read (made if ``make``)."""
    if make:
        with contextlib.suppress(OSError):
            os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _entry(folder: str, key: tuple) -> str:
    return os.path.join(folder, hashlib.sha1(key[0].encode("utf-8", "surrogateescape")).hexdigest() + ".json")


def _read_entry(path: str) -> dict | None:
    """An entry's content, or None for anything not a small regular file of ours holding a JSON object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > _MAX_ENTRY:
            return None
        data = os.read(fd, _MAX_ENTRY + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        got = loads(data)  # the one parser for JSON we did not just write: a nested forgery is refused, not a crash
    except (ValueError, UnicodeDecodeError):
        return None
    return got if isinstance(got, dict) else None


def object_key(url: str, size: int, version: str) -> tuple:
    """What identifies one version of a remote object's bytes: its URL, size and the version its store answered
    with (ETag and Last-Modified, both set by the store on every write, and a version id where it keeps them)."""
    return (url, int(size), version)


def hashed_on_node(url: str, size: int | None, sha256: str | None, cache_dir: str | None, version: str) -> bool:
    """Whether this node hashed ``version`` of the remote object ``url`` of ``size`` bytes to ``sha256``."""
    return size is not None and bool(sha256) and recorded(object_key(url, size, version), cache_dir) == sha256


def recorded_sha256(path: str, st: os.stat_result, cache_dir: str | None = None) -> str | None:
    """The sha256 this node computed for exactly this version of ``path`` (``st``: its stat), or None."""
    return recorded(file_key(path, st), cache_dir)


def recorded(key: tuple, cache_dir: str | None = None) -> str | None:
    """The sha256 recorded for ``key`` (`file_key()` or `object_key()`), or None."""
    with _memo_lock:
        got = _memo.get(key)
    if got is not None:
        return got
    folder = record_dir(cache_dir)
    if folder is None or not _ours(folder, make=False):
        return None
    entry = _read_entry(_entry(folder, key))
    if entry is None or entry.get("key") != list(key):
        return None
    digest = entry.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    with _memo_lock:
        _memo[key] = digest
    return digest


def remember_sha256(
    path: str, before: os.stat_result, after: os.stat_result, digest: str, cache_dir: str | None = None
) -> None:
    """Record that ``path`` hashed to ``digest``, if the file did not change while it was read (``before`` and
    ``after``: its stat then); a record that cannot be written is skipped (the file is hashed again next time)."""
    key = file_key(path, before)
    if key == file_key(path, after):
        remember(key, digest, cache_dir)


def remember(key: tuple, digest: str, cache_dir: str | None = None) -> None:
    """Record that the version ``key`` names hashed to ``digest`` (in the process, and in the node record when it
    can be written)."""
    with _memo_lock:
        _memo[key] = digest
    folder = record_dir(cache_dir)
    if folder is None or not _ours(folder, make=True):
        return
    final = _entry(folder, key)
    tmp = f"{final}.tmp-{os.getpid():x}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": list(key), "sha256": digest}, f)
        os.replace(tmp, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def hash_file(path: str, cache_dir: str | None = None) -> str:
    """The sha256 of the file ``path`` (`hash_open_file()` of it, opened here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_open_file(fd, path, cache_dir).digest
    finally:
        os.close(fd)


class Hashed(NamedTuple):
    """The sha256 of an open file, and its stat before the first byte was read and after the last."""

    digest: str
    before: os.stat_result
    after: os.stat_result

    def steady(self, version: os.stat_result, path: str | None = None) -> bool:
        """Whether the file was ``version`` (a stat of it) all the while it was hashed; with ``path``, its name
        then, a file deleted or renamed meanwhile still is (`same_bytes()`)."""
        return same_bytes(self.before, version, path) and same_bytes(self.after, version, path)


def hash_open_file(fd: int, path: str, cache_dir: str | None = None) -> Hashed:
    """The sha256 of the open file ``fd`` (named ``path``), read by position a MiB at a time (the descriptor's
    offset is left alone; hashing releases the GIL): the bytes a positioned read of ``fd`` returns, whatever
    ``path`` names by then. Remembered for this version of the file when it did not change while read."""
    h = hashlib.sha256()
    before = os.fstat(fd)
    at = 0
    while block := os.pread(fd, 1 << 20, at):
        h.update(block)
        at += len(block)
    after = os.fstat(fd)
    digest = h.hexdigest()
    remember_sha256(path, before, after, digest, cache_dir)
    return Hashed(digest, before, after)


def changed_since(path: str, before: os.stat_result) -> bool:
    """Whether ``path`` is no longer the version ``before`` describes (or is gone): bytes vouched for by the
    record were read while it changed."""
    try:
        return file_key(path, os.stat(path)) != file_key(path, before)
    except OSError:
        return True


def fd_changed(fd: int, version: os.stat_result, path: str | None = None) -> bool:
    """Whether the open file ``fd`` is no longer the version ``version`` (a stat of it) describes: written to in
    place (size, mtime or ctime moved), or it cannot be looked at any more. With ``path``, the name it was opened
    by, a file that was only deleted or renamed since is still that version (`same_bytes()`)."""
    try:
        return not same_bytes(os.fstat(fd), version, path)
    except OSError:
        return True


def same_bytes(now: os.stat_result, version: os.stat_result, path: str | None = None) -> bool:
    """Whether an open file now stat'ed as ``now`` is still the version ``version`` describes. Its ctime also moves
    when the file loses a name: a file deleted or renamed after it was opened (``path``, the name it was opened by,
    is gone or names another file) whose device, inode, size and mtime did not move holds the same bytes (an open
    descriptor keeps them), so it is still that version. Under its own name, a moved ctime is a change (a write with
    the mtime put back)."""
    if file_version(now) == file_version(version):
        return True
    if path is None or file_version(now)[:4] != file_version(version)[:4]:
        return False
    try:
        there = os.stat(path)
    except OSError:
        return True  # deleted, or renamed away
    return (there.st_dev, there.st_ino) != (now.st_dev, now.st_ino)  # another file under the name now


def forget_in_process() -> None:
    """Drop the in-process record (tests: a new process's view of the node record)."""
    with _memo_lock:
        _memo.clear()
