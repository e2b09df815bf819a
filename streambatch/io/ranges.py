"""Requests to a remote shard: its size, and byte ranges whose retries resume at the byte where one broke.

A request that fails with a transient error (`is_transient()`) is retried with backoff from the
first byte not yet received, so the tar parser sees one unbroken stream and no byte is asked for twice.
Every answer's object size is checked against the index's, so a shard of the wrong size is caught before
a byte of it is used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ShardReadError
from . import objstore
from .digest import size_problem
from .objstore import same_bytes
from .retry import RetryPolicy, call_with_retry, is_transient
from .storage import is_local, object_size, read_range_fsspec, reading_filesystem

log = logging.getLogger("streambatch")

Count = Callable[..., None]  # count(name, n=1): add to a fault counter


def warm_up(urls: Sequence[str], storage_options: dict | None, timeout: float) -> None:
    """Make this process's fsspec filesystem for the first shard's store on a thread while the epoch is planned, so
    the first request does not wait; nothing for a store obstore reads (made at the first read, cheaply)."""
    if not urls or is_local(urls[0]) or objstore.usable(urls[0], storage_options):
        return
    threading.Thread(
        target=_warm, args=(urls[0], storage_options, timeout), name="streambatch-warm-up", daemon=True
    ).start()


def _warm(url: str, storage_options: dict | None, timeout: float) -> None:
    try:
        reading_filesystem(url, storage_options, timeout)
    except Exception:  # noqa: BLE001 - the first request reports what is wrong, with its URL
        pass


def check_size(url: str, size: int, expected: int | None, verify: str) -> None:
    """Raise `ShardReadError` when ``size`` is not the index's (unless ``verify`` is ``"none"``)."""
    problem = size_problem(size, expected) if verify != "none" else None
    if problem:
        raise ShardReadError(f"{url}: {problem}")


def _same_object(url: str, versions: list[str | None], heard: list[str | None]) -> None:
    """Add the versions an answer named to those of the read's earlier answers; refuse bytes of two objects (one
    rewritten between two answers of a read: a break and its resumption) as a `ShardReadError`."""
    for v in heard:
        if versions and None not in (versions[0], v) and not same_bytes(versions[0], v):
            raise ShardReadError(f"{url}: the object changed while it was read (another version answered)")
        versions.append(v)


class RangeReader:
    """Size requests and range requests to remote objects, with the retries of ``policy``; ``count`` gets
    ``retries`` and ``bytes_read``, and setting ``stop`` ends a read in progress."""

    def __init__(
        self, storage_options: dict | None, policy: RetryPolicy, verify: str, count: Count, stop: threading.Event
    ):
        self.storage_options = storage_options
        self.policy = policy
        self.verify = verify
        self.count = count
        self.stop = stop

    def _fs(self, url: str) -> tuple[Any, str]:
        return reading_filesystem(url, self.storage_options, self.policy.timeout)

    def _store(self, url: str) -> tuple[Any, str] | None:
        """This process's obstore store for ``url`` and the object's path (None: fsspec reads it)."""
        return objstore.store_for(url, self.storage_options, self.policy.timeout or None)

    def size(self, url: str, expected: int | None = None) -> int:
        """The object's size (a size request, retried), checked against ``expected`` (the index's)."""
        store = self._store(url)
        if store is None:
            fs, path = self._fs(url)
            ask = lambda: object_size(fs, path)  # noqa: E731
        else:
            ask = lambda: objstore.head(store[0], store[1], url)[0]  # noqa: E731

        def on_retry(e: BaseException, attempt: int) -> None:
            self.count("retries")
            log.info(
                "streambatch: %s: size request failed (%s: %s), retry %d/%d",
                url,
                type(e).__name__,
                e,
                attempt + 1,
                self.policy.retries,
            )

        try:
            size = call_with_retry(ask, self.policy, url, on_retry)
        except FileNotFoundError as e:
            raise ShardReadError(f"{url}: shard not found") from e
        except Exception as e:  # noqa: BLE001 - anything that leaves the shard unreadable
            raise ShardReadError(f"{url}: cannot open shard ({type(e).__name__}: {e})") from e
        check_size(url, size, expected, self.verify)
        return size

    def read(self, url: str, start: int, end: int, expected: int | None) -> bytes:
        """`fetch()`, checking each answer's object size with ``expected`` unless ``verify`` is "none"."""
        return self.fetch(url, start, end, self._checked(expected))

    def read_versioned(self, url: str, start: int, end: int, expected: int | None) -> tuple[bytes, str | None]:
        """`read()`, and the version of the object the bytes are of (None where an answer did not name one)."""
        versions: list[str | None] = []
        data = self.fetch(url, start, end, self._checked(expected), versions)
        return data, versions[0] if versions and all(v is not None for v in versions) else None

    def _checked(self, expected: int | None) -> int | None:
        """The object size answers are checked against: the index's, unless ``verify`` is "none"."""
        return expected if self.verify != "none" else None

    def fetch(
        self, url: str, start: int, end: int, expected_size: int | None = None, versions: list | None = None
    ) -> bytes:
        """Bytes ``[start, end)`` of ``url``. A request that breaks with a transient error is retried from the
        first byte not yet received (progress resets the retry count). With ``expected_size`` (the
        index's), an answer that shows another object size is a bad shard; answers that name different
        versions of the object (it was rewritten between two of them) are too. ``versions`` gets each answer's."""
        store = self._store(url)
        fs, path = store if store is not None else self._fs(url)
        parts: list[bytes] = []
        pos, attempt = start, 0
        seen: list[str | None] = [] if versions is None else versions
        while pos < end:
            if self.stop.is_set():
                raise ShardReadError(f"{url}: reading stopped")
            sink: list[bytes] = []
            err = self._request(fs, path, url, pos, end, sink, expected_size, seen, store is not None)
            got = sum(len(x) for x in sink)
            if got:
                parts.extend(sink)
                pos += got
                self.count("bytes_read", got)
            if pos >= end:
                break
            if got and err is None:
                continue  # the object ended early? ask again for the rest (counts as no progress next time)
            if got:
                attempt = 0  # progress: this break is a new one
            if attempt == 0 and store and expected_size is not None and isinstance(err, objstore.StoreError):
                self._same_size(store, url, expected_size)
            self._backoff(url, pos, end, attempt, err)
            attempt += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _request(
        self,
        fs: Any,
        path: str,
        url: str,
        pos: int,
        end: int,
        sink: list[bytes],
        expected_size: int | None,
        versions: list[str | None],
        obstore: bool = False,
    ) -> BaseException | None:
        """One range request into ``sink`` (its answer's version appended to ``versions``): the transient error it
        broke with (None if it did not); a permanent error, a wrong object size or an object rewritten since an
        earlier answer raises `ShardReadError`."""
        heard: list[str | None] = []
        try:
            if obstore:  # ``fs`` is an obstore store
                total = objstore.read_range(fs, path, url, pos, end, sink, heard)
            else:
                total = read_range_fsspec(fs, path, pos, end, sink, heard)
        except Exception as e:  # noqa: BLE001 - classified below
            _same_object(url, versions, heard)
            if not is_transient(e):
                hint = ""
                if expected_size is not None and "range" in str(e).lower():
                    hint = f" (the object is shorter than the {expected_size} bytes the index says)"
                raise ShardReadError(f"{url}: bytes {pos}-{end - 1}: {type(e).__name__}: {e}{hint}") from e
            return e
        _same_object(url, versions, heard)
        problem = size_problem(total, expected_size) if total is not None else None
        if problem:
            raise ShardReadError(f"{url}: {problem}")
        return None

    def _same_size(self, store: tuple[Any, str], url: str, expected_size: int) -> None:
        """After a store's failure: whether the object still has the index's size (a range past the end of a shorter
        object fails every time: that is the data's fault, said at once, not retried)."""
        try:
            size, _ = objstore.head(store[0], store[1], url)
        except Exception:  # noqa: BLE001 - the store fails this too: the retry says what is wrong
            return
        problem = size_problem(size, expected_size)
        if problem:
            raise ShardReadError(f"{url}: {problem}")

    def _backoff(self, url: str, pos: int, end: int, attempt: int, err: BaseException | None) -> None:
        """Before retry ``attempt + 1`` at byte ``pos``: give up past the policy's retries, else count, log
        and wait."""
        if attempt >= self.policy.retries:
            why = f"{type(err).__name__}: {err}" if err is not None else "the object ended early"
            raise ShardReadError(f"{url}: bytes {pos}-{end - 1} failed {attempt + 1} times, last: {why}") from err
        self.count("retries")
        wait = self.policy.delay(attempt)
        log.info(
            "streambatch: %s: read broke at byte %d (%s), retry %d/%d in %.2fs from there",
            url,
            pos,
            f"{type(err).__name__}: {err}" if err is not None else "short read",
            attempt + 1,
            self.policy.retries,
            wait,
        )
        if wait > 0:
            time.sleep(wait)
