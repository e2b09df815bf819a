"""Local shards read where the index says each sample is, when its planned batch is due.

A local file needs no stream: with an index that knows each sample's byte span in its tar, a worker reads a
planned batch's samples with one positioned read each (``os.pread``) when the batch is next. Nothing is held
between batches (memory: one batch of compressed bytes, not a window of them), and the first batch costs its
own samples, not the whole stream up to the last of them. The checks are a stream's: each shard's size
before its first byte is used, every member header's checksum (`buffer_members()`),
the json length against the index, and with ``verify="sha256"`` the file's hash, computed by a background
thread once the shard is opened (from the descriptor the samples are read from), unless this node already hashed
this version of the file (`verified`). A mismatch marks the shard bad from then on: like a stream, which
knows the hash only at the shard's end, samples emitted before stay emitted. So does a file written to while
the slot reads it: the hash vouches for the version it was taken on, and a descriptor whose file is another
version when the shard is closed or the pass ends makes the shard bad (the next pass hashes the new version).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import IndexFormatError, IndexMismatch, ShardReadError
from ..format.members import PLAIN, ShardMembers
from ..format.tar import buffer_members, group_samples
from ..io.digest import sha256_problem
from ..io.ranges import Count
from ..io.storage import is_local, local_path
from ..io.verified import Hashed, fd_changed, file_version, hash_open_file, recorded_sha256
from ..limits import max_member_bytes
from ..plan.shards import Piece
from ..select.mixture import AnyIndex
from .faults import ChecksumMismatch, FaultLog, waiting_on_storage
from .fetch import Job, _prepare_local

#: open shard files (and their offset arrays) a worker keeps; a batch's samples come from a window of shards
OPEN_SHARDS = 64
_MISMATCH = "the index does not match the shards (check with `shardify verify`)"
CHANGED = "the file changed while it was read"


def can_read_direct(urls: Sequence[str], pieces: Sequence[Piece], index: AnyIndex | None) -> bool:
    """Whether a slot's pieces can be read by position: local files, and an index that knows the byte spans."""
    if index is None or not pieces or not all(is_local(urls[p.shard]) for p in pieces):
        return False
    return index.sample_offsets(pieces[0].shard) is not None


class _Shard:
    """One open shard: its file, the byte span of each sample, the index's size and sha256."""

    def __init__(
        self,
        job: Job,
        spans: tuple[np.ndarray, np.ndarray],
        verify: str,
        count: Count | None = None,
        members: ShardMembers = PLAIN,
    ):
        self.local = _prepare_local(job, verify)  # the size, before any byte is used
        self.job = job
        self.offsets, self.sizes = spans
        self.members = members  # the key rule, and the rows of member groups that hold several samples
        self.fd = os.open(self.local, os.O_RDONLY)
        self.stat = os.fstat(self.fd)
        self.file_size = self.stat.st_size
        self.most = max_member_bytes()  # the member-size limit, read once per shard rather than per sample
        self.pread = waiting_on_storage(os.pread, count)  # a positioned read is time waited on storage

    def read(self, i: int) -> dict[str, Any]:
        """Sample ``i`` of the shard (tar order): its members as bytes, its ``.json`` parsed. The span the index
        gives is checked against the file's real size before a byte is allocated for it."""
        url, off, n = self.job.url, int(self.offsets[i]), int(self.sizes[i])
        if off < 0 or n < 0 or off + n > self.file_size:
            raise ShardReadError(
                f"{url}: the index says sample {i} is bytes {off}-{off + n - 1}, past the end of the "
                f"{self.file_size}-byte file; {_MISMATCH}"
            )
        buf = self.pread(self.fd, n, off)
        if len(buf) < n:
            raise ShardReadError(f"{url}: not a readable tar shard (sample {i} ends early: truncated)")
        got = list(group_samples(buffer_members(buf, url, self.most), url, self.job.shard, self.members.suffixes))
        if len(got) != 1:
            held = f"{url}: bytes {off}-{off + n - 1} hold {len(got)} samples, not sample {i}"
            raise IndexMismatch(f"{held}; {_MISMATCH}")
        if self.members.rows is not None:  # one of the segments its member group holds
            return self.members.rows.row(got[0], i)
        got[0]["__index__"] = i
        return got[0]

    def close(self) -> None:
        os.close(self.fd)


class DirectShards:
    """The samples of a slot's local shards by (shard, position in the shard), read on demand.

    A bad shard (missing, wrong size, broken header, sha256 mismatch) is counted in ``faults`` once and every
    later sample of it comes back as None (lost); without ``faults`` it raises `ShardReadError`.

    With ``verify="sha256"`` each shard the slot reads to its end is *vouched for* by its hash: the hash of the
    very descriptor the samples are read from (taken by a background thread), or the node record's for the
    version the file was when opened. The version is what `file_version()` names (inode, size,
    mtime, ctime): a descriptor of the shard whose file is another version when it is closed, when the pass ends
    (`check_hashes()` with ``wait``), or when the shard is opened again, was read while the file changed, and
    the shard is counted bad."""

    def __init__(
        self,
        urls: Sequence[str],
        index: AnyIndex,
        pieces: Sequence[Piece],
        counts: np.ndarray,
        opts: Any,
        faults: FaultLog | None,
    ):
        self.urls, self.index, self.opts, self.faults = urls, index, opts, faults
        self.shards = index.shards
        # as a stream does, check the whole file's hash where the slot reads a shard to its end
        self.hash_at_end = {p.shard for p in pieces if p.stop >= int(counts[p.shard])}
        self.open: collections.OrderedDict[int, _Shard] = collections.OrderedDict()
        self.bad: set[int] = set()
        self.hashing: dict[int, Future[Hashed]] = {}
        self.vouched: dict[int, os.stat_result] = {}  # the version of each shard its hash (or the record's) is of
        self._pool: ThreadPoolExecutor | None = None

    def sample(self, shard: int, i: int) -> dict[str, Any] | None:
        """Sample ``i`` of ``shard``, or None when the shard is bad."""
        if shard in self.bad:
            return None
        try:
            return self._shard(shard).read(i)
        except ShardReadError as e:
            self._bad_shard(shard, e)
            return None

    def _shard(self, s: int) -> _Shard:
        sh = self.open.get(s)
        if sh is not None:
            self.open.move_to_end(s)
            return sh
        sh = self._open_shard(s)
        self.open[s] = sh
        if len(self.open) > OPEN_SHARDS:
            self._close_shard(self.open.popitem(last=False)[1])
        if s in self.vouched and file_version(sh.stat) != file_version(self.vouched[s]):
            raise ChecksumMismatch(f"{self.urls[s]}: {CHANGED} (opened again, it is another version)")
        self._start_hash(sh)
        return sh

    def _open_shard(self, s: int) -> _Shard:
        """Open shard ``s``: its size checked, its file open, its byte spans and member rule at hand."""
        info = self.shards[s]
        job = Job(0, self.urls[s], s, getattr(info, "bytes", None), getattr(info, "sha256", None))
        spans = self.index.sample_offsets(s)
        if spans is None:
            raise IndexFormatError(f"{job.url}: the index has no byte offsets for this shard but has them for others")
        count = self.faults.add if self.faults is not None else None
        members = self.index.shard_members(s)
        return waiting_on_storage(_Shard, count)(job, spans, self.opts.verify, count, members)  # opening waits too

    def _start_hash(self, sh: _Shard) -> None:
        """Hash the shard's descriptor in the background, unless this node already hashed this version of the
        file; either way the shard is vouched for as the version it was when opened."""
        job = sh.job
        if (
            self.opts.verify != "sha256"
            or not job.expected_sha
            or job.shard in self.vouched
            or job.shard not in self.hash_at_end
        ):
            return
        self.vouched[job.shard] = sh.stat
        if recorded_sha256(sh.local, sh.stat, self.opts.cache_dir) == job.expected_sha:
            self._count("sha256_reused")
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streambatch-sha256")
        self._count("sha256_hashed")
        copy = os.dup(sh.fd)  # the same open file, kept open for the hash even if the shard is closed first
        fut = self._pool.submit(hash_open_file, copy, sh.local, self.opts.cache_dir)
        fut.add_done_callback(lambda _: os.close(copy))  # done, failed or cancelled
        self.hashing[job.shard] = fut

    def _count(self, name: str) -> None:
        if self.faults is not None:
            self.faults.add(name)

    def check_hashes(self, wait: bool = False) -> None:
        """Count the shards whose hash came out wrong (all of them still pending, with ``wait``); with ``wait``
        (the end of the pass), also those whose file is no longer the version their hash is of."""
        for s, fut in list(self.hashing.items()):
            if wait or fut.done():
                del self.hashing[s]
                self._check_hash(s, fut)
        if wait:
            for sh in self.open.values():
                self._check_steady(sh)

    def _check_hash(self, s: int, fut: Future[Hashed]) -> None:
        """The background hash of shard ``s``: the index's sha256, of the version the shard was opened as."""
        try:
            got = fut.result()
        except OSError as e:
            self._bad_shard(s, ShardReadError(f"{self.urls[s]}: cannot read the shard to hash it ({e})"))
            return
        if not got.steady(self.vouched[s], self._local(s)):
            self._bad_shard(s, ChecksumMismatch(f"{self.urls[s]}: {CHANGED}"))
            return
        problem = sha256_problem(got.digest, self.shards[s].sha256)
        if problem:
            self._bad_shard(s, ChecksumMismatch(f"{self.urls[s]}: {problem}"))

    def _check_steady(self, sh: _Shard) -> None:
        """Count the shard bad if its open file is no longer the version its hash vouches for."""
        s = sh.job.shard
        if s in self.vouched and s not in self.bad and fd_changed(sh.fd, self.vouched[s], sh.local):
            self._bad_shard(s, ChecksumMismatch(f"{self.urls[s]}: {CHANGED}"))

    def _local(self, s: int) -> str:
        """The path shard ``s`` is opened by."""
        return local_path(self.urls[s])

    def _close_shard(self, sh: _Shard) -> None:
        """Close a shard the slot may still come back to (checked first: its bytes were read as its version)."""
        try:
            self._check_steady(sh)
        finally:
            sh.close()

    def _bad_shard(self, s: int, error: ShardReadError) -> None:
        if self.faults is None:
            raise error
        if s not in self.bad:
            self.bad.add(s)
            self.faults.bad_shard(s, self.urls[s], str(error), error)

    def close(self) -> None:
        """Close every shard at once (a pass stopped early is not checked further), and stop hashing."""
        for sh in self.open.values():
            sh.close()
        self.open.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
