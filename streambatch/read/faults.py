"""Fault accounting for a rank's readers: counters, the bad-shard budget and the faults themselves.

Every worker counts retries, bytes, cache use, bad shards and the time it waited for storage in its row of
one shared array, so the main process and the other workers see the whole rank's numbers. By default
(``max_bad_shards=0``) the first shard that cannot be read ends the pass with a `ShardReadError` naming
it, its cause and the option that tolerates it; with ``max_bad_shards=N`` up to N are skipped per epoch and rank
(their samples lost, counted, and re-drawn to keep the steps equal) and one more raises `TooManyBadShards`.
`ShardFault` marks, in a sample stream, where a shard went bad.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..errors import ChecksumMismatch, IndexMismatch, RetriesExhausted, ShardReadError, TooManyBadShards  # noqa: F401
from ..io.retry import error_code, is_transient

log = logging.getLogger("streambatch")

#: the counter of nanoseconds a reader was blocked waiting for shard bytes (`waiting_on_storage()`)
STORAGE_WAIT = "storage_wait_ns"
FAULT_FIELDS = (
    "bad_shards",
    "lost_samples",
    "redrawn_samples",
    "shrunk_batches",
    "retries",
    "bytes_read",
    "cache_downloads",
    "cache_hits",
    STORAGE_WAIT,
    "skipped_steps",  # steps a resume skipped (load_state_dict(skip_steps=...)), and their samples
    "skipped_samples",
    "sha256_hashed",  # shards a reader hashed whole (verify="sha256"), and those whose hash this node
    "sha256_reused",  # had already computed for the same file version (io/verified.py): not read again
    "bad_shards_storage",  # of bad_shards, those the store did not answer or refused (storage_fault)
    "cache_bypassed",  # remote shards read without the node cache, which could not store them (disk full, ...)
)

T = TypeVar("T")


class FaultLog:
    """One worker's fault counters: a row of ``counts`` (a [workers, fields] array, shared memory in the
    loader, so the main process and the other workers see it), plus a flag per shard that went bad.
    The bad-shard budget is checked against the sum over all rows (the whole rank)."""

    def __init__(
        self,
        counts: np.ndarray | None = None,
        bad: np.ndarray | None = None,
        row: int = 0,
        max_bad_shards: int = 0,
        urls: Sequence[str] | None = None,
        rank: int = 0,
    ):
        self.counts = counts if counts is not None else np.zeros((1, len(FAULT_FIELDS)), dtype=np.int64)
        self.bad = bad
        self.row = row
        self.max_bad_shards = max_bad_shards
        self.urls = urls
        self.rank = rank
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to this worker's counter ``name`` (one of `FAULT_FIELDS`)."""
        with self._lock:
            self.counts[self.row, FAULT_FIELDS.index(name)] += n

    def total(self, name: str) -> int:
        """The rank's total of counter ``name`` (all workers' rows)."""
        return int(self.counts[:, FAULT_FIELDS.index(name)].sum())

    def bad_shard(self, shard: int, url: str, reason: str, error: BaseException | None = None) -> None:
        """Count a bad shard (and log it); raise `TooManyBadShards` past the budget. A shard already
        counted on this rank this pass (another fault of the same shard) is logged, not counted again.
        ``error``: what made it bad (default: the exception being handled, for a caller in its ``except``
        block); the budget's message advises by what the bad shards' errors were (`storage_fault()`)."""
        if self.bad is not None and 0 <= shard < len(self.bad):
            if self.bad[shard]:
                log.info("streambatch: shard %s again: %s", url, reason)
                return
            self.bad[shard] = 1
        self.add("bad_shards")
        if storage_fault(error if error is not None else sys.exc_info()[1]):
            self.add("bad_shards_storage")
        n = self.total("bad_shards")
        if self.max_bad_shards == 0:
            raise unreadable(url, reason, error if error is not None else sys.exc_info()[1])
        if n > self.max_bad_shards:
            raise TooManyBadShards(
                f"{n} bad shards on rank {self.rank} this epoch, more than max_bad_shards={self.max_bad_shards}. "
                f"Last: {reason}{self._listed()}. {self._advice(n)}, or allow more with max_bad_shards=N"
            )
        # tolerated: the loader logs one summary of the pass's bad shards at its end (not a line per shard)
        log.info(
            "streambatch: skipping bad shard %s: %s (%d of at most %d bad shards on rank %d this epoch)",
            url,
            reason,
            n,
            self.max_bad_shards,
            self.rank,
        )

    def _advice(self, n: int) -> str:
        """What to do about ``n`` bad shards, by their errors: the store's (it did not answer or refused) or the
        data's (not the bytes, size or members the index says)."""
        store = min(n, self.total("bad_shards_storage"))
        if store == 0:
            return _DATA_ADVICE[0].upper() + _DATA_ADVICE[1:]
        if store == n:
            return f"{_STORE_SAID}: the shards themselves may be fine; {_STORE_ADVICE}"
        return (
            f"{store} of them failed in the store ({_STORE_SAID.lower()}: {_STORE_ADVICE}), {n - store} in the data "
            f"({_DATA_ADVICE})"
        )

    def _listed(self) -> str:
        """``"; bad shards: URL, ..."`` (the first ten flagged shards), or ``""`` without flags or URLs."""
        if self.bad is None or self.urls is None:
            return ""
        bad = [self.urls[i] for i in np.flatnonzero(np.asarray(self.bad))[:10]]
        return "; bad shards: " + ", ".join(bad)


def unreadable(url: str, reason: str, error: BaseException | None) -> ShardReadError:
    """The error that ends a pass at its first bad shard (``max_bad_shards=0``), in one line: the shard, the cause
    and the option that would skip it. Of the kind the reader raised (a `ChecksumMismatch` stays one), else
    a `ShardReadError`."""
    said = " ".join(reason.split())  # one line, whatever the cause's text held
    named = said if said.startswith(url) else f"{url}: {said}"
    advice = f"{_STORE_SAID}: the shard itself may be fine; {_STORE_ADVICE}" if storage_fault(error) else _DATA_ADVICE
    message = (
        f"{named}. {advice[0].upper()}{advice[1:]}. The pass stops at a shard it cannot read: max_bad_shards=N skips "
        "up to N such shards per epoch and rank instead (their samples re-drawn from others, counted in metrics())"
    )
    kind = type(error) if isinstance(error, ShardReadError) else ShardReadError
    try:
        return kind(message)
    except TypeError:  # a subclass that takes other arguments
        return ShardReadError(message)


_STORE_SAID = "The store did not answer or refused their requests (every retry failed or timed out, access denied)"
_STORE_ADVICE = (
    "check the store's endpoint, the network and the credentials in storage_options (and raise retries or timeout "
    "for a store that is slow to recover)"
)
_DATA_ADVICE = "check the data with `shardify verify`, rewrite or restore those shards"
#: error codes of a store that refuses a request (what s3fs does not already turn into a PermissionError)
REFUSED_CODES = frozenset(
    {"AccessDenied", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken", "SignatureDoesNotMatch", "401", "403"}
)


def storage_fault(error: BaseException | None) -> bool:
    """Whether a bad shard's error was the store's rather than the data's: the store did not answer (every retry
    of a request failed, a request timed out) or refused (access denied, credentials expired). A missing object,
    an answer of another size, a checksum or tar that does not match the index are the data's. Walks the chain of
    causes: a `ShardReadError` carries the request's own error."""
    seen: set[int] = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (FileNotFoundError, ChecksumMismatch, IndexMismatch)):
            return False
        if isinstance(e, (RetriesExhausted, PermissionError, TimeoutError)) or is_transient(e):
            return True
        if error_code(e) in REFUSED_CODES:
            return True
        e = e.__cause__ or e.__context__
    return False


def bad_sample(faults: FaultLog | None, sample: dict) -> None:
    """Count a sample its shard holds but the loader cannot use (``__bad__``: a member over a limit, JSON nested too
    deep) as lost, and log why; without ``faults`` raise `ShardReadError` naming it."""
    reason = f"{sample.get('__url__')}: bad sample {sample.get('__bad__')}"
    if faults is None:
        raise ShardReadError(reason)
    faults.add("lost_samples")
    log.warning("streambatch: skipping %s", reason)


def waiting_on_storage(fn: Callable[..., T], count: Callable[..., None] | None) -> Callable[..., T]:
    """``fn``, adding the nanoseconds each call takes to counter `STORAGE_WAIT` with ``count``. The one
    way the read side measures how long it was blocked on storage: wrap exactly the calls the consumer waits
    in (a chunk read, waiting for a read-ahead chunk, a positioned read), so read-ahead that is done in time
    costs nothing."""
    if count is None:
        return fn

    def timed(*args: object, **kwargs: object) -> T:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            count(STORAGE_WAIT, time.perf_counter_ns() - t0)

    return timed


@dataclass(frozen=True)
class ShardFault:
    """Marker in a `read_pieces()` stream (``markers=True``): piece number
    ``ordinal`` went bad after ``delivered`` of its samples. ``invalidate``: its checksum failed after all were
    delivered, so the ones delivered should not be used any more where that is still possible."""

    ordinal: int
    shard: int
    url: str
    reason: str
    delivered: int
    invalidate: bool = False
