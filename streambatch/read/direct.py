"""Local shards read where the index says each sample is, when its planned batch is due.

A local file needs no stream: with an index that knows each sample's byte span in its tar, a worker reads a
planned batch's samples with one positioned read each (``os.pread``) when the batch is next. Nothing is held
between batches (memory: one batch of compressed bytes, not a window of them), and the first batch costs its
own samples, not the whole stream up to the last of them. The checks are a stream's: each shard's size
before its first byte is used, every member header's checksum (:func:`~streambatch.dataset.tar.buffer_members`),
the json length against the index, and with ``verify="sha256"`` the file's hash, computed by a background
thread once the shard is opened, unless this node already hashed this version of the file (:mod:`.verified`).
A mismatch marks the shard bad from then on: like a stream, which knows the hash only at the shard's end,
samples emitted before stay emitted.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..dataset.format import sha256_problem
from ..dataset.limits import max_member_bytes
from ..dataset.members import PLAIN, ShardMembers
from ..dataset.mixture import AnyIndex
from ..dataset.storage import is_local
from ..dataset.tar import buffer_members, group_samples
from ..errors import IndexFormatError, IndexMismatch, ShardReadError
from ..plan.shards import Piece
from .faults import ChecksumMismatch, FaultLog, waiting_on_storage
from .fetch import Job, _prepare_local
from .ranges import Count
from .verified import changed_since, hash_file, recorded_sha256

#: open shard files (and their offset arrays) a worker keeps; a batch's samples come from a window of shards
OPEN_SHARDS = 64
_MISMATCH = "the index does not match the shards (check with `shardify verify`)"


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
    later sample of it comes back as None (lost); without ``faults`` it raises :class:`ShardReadError`."""

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
        self.hashing: dict[int, Future] = {}
        self.hashed: set[int] = set()
        self.reused: dict[int, tuple[str, os.stat_result]] = {}  # hash taken from the node record (verified.py)
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
        info = self.shards[s]
        job = Job(0, self.urls[s], s, getattr(info, "bytes", None), getattr(info, "sha256", None))
        spans = self.index.sample_offsets(s)
        if spans is None:
            raise IndexFormatError(f"{job.url}: the index has no byte offsets for this shard but has them for others")
        count = self.faults.add if self.faults is not None else None
        members = self.index.shard_members(s)
        sh = waiting_on_storage(_Shard, count)(job, spans, self.opts.verify, count, members)  # opening it waits too
        if len(self.open) >= OPEN_SHARDS:
            self.open.popitem(last=False)[1].close()
        self.open[s] = sh
        self._start_hash(sh)
        return sh

    def _start_hash(self, sh: _Shard) -> None:
        """Hash the shard in the background, unless this node already hashed this version of the file."""
        job = sh.job
        if (
            self.opts.verify != "sha256"
            or not job.expected_sha
            or job.shard in self.hashed
            or job.shard not in self.hash_at_end
        ):
            return
        self.hashed.add(job.shard)
        if recorded_sha256(sh.local, sh.stat, self.opts.cache_dir) == job.expected_sha:
            self.reused[job.shard] = (sh.local, sh.stat)
            self._count("sha256_reused")
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streambatch-sha256")
        self._count("sha256_hashed")
        self.hashing[job.shard] = self._pool.submit(hash_file, sh.local, self.opts.cache_dir)

    def _count(self, name: str) -> None:
        if self.faults is not None:
            self.faults.add(name)

    def check_hashes(self, wait: bool = False) -> None:
        """Count the shards whose hash came out wrong (all of them still pending, with ``wait``); with ``wait``,
        also those vouched for by the node record whose file changed while it was read."""
        if wait:
            for s, (path, before) in list(self.reused.items()):
                del self.reused[s]
                if changed_since(path, before):
                    self._bad_shard(s, ChecksumMismatch(f"{self.urls[s]}: the file changed while it was read"))
        for s, fut in list(self.hashing.items()):
            if not (wait or fut.done()):
                continue
            del self.hashing[s]
            try:
                actual = fut.result()
            except OSError as e:
                self._bad_shard(s, ShardReadError(f"{self.urls[s]}: cannot read the shard to hash it ({e})"))
                continue
            problem = sha256_problem(actual, self.shards[s].sha256)
            if problem:
                self._bad_shard(s, ChecksumMismatch(f"{self.urls[s]}: {problem}"))

    def _bad_shard(self, s: int, error: ShardReadError) -> None:
        if self.faults is None:
            raise error
        if s not in self.bad:
            self.bad.add(s)
            self.faults.bad_shard(s, self.urls[s], str(error))

    def close(self) -> None:
        for sh in self.open.values():
            sh.close()
        self.open.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
