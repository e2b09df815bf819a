"""Retries for reads from object storage: which errors are transient, and exponential backoff with jitter.

A transient error is one that a second try can cure: a dropped or reset connection, a timeout, an HTTP 5xx
(500 InternalError, 502, 503 SlowDown / ServiceUnavailable, 504) or a throttling answer. A missing object,
a denied request or a bad range is permanent: retrying it only delays the error. Errors are told apart by their
types and the status they carry, never by class names or message text.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import RetriesExhausted

log = logging.getLogger("streambatch")

T = TypeVar("T")

#: S3 error codes and HTTP statuses worth retrying
TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "BandwidthLimitExceeded",
    "500",
    "502",
    "503",
    "504",
    "429",
}
_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EAGAIN,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    errno.ETIMEDOUT,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    errno.ENETRESET,
    errno.EREMOTEIO,
}


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry one request.

    ``retries``: tries after the first (so ``retries + 1`` attempts in all). The wait before try ``i`` is
    drawn uniformly from ``[0, min(max_backoff, backoff * 2**i)]`` ("full jitter"), so many workers that hit
    the same outage do not come back in lock step. ``timeout``: seconds one request may take to connect or
    go without receiving a byte before it counts as failed (a transient error).
    """

    retries: int = 8
    backoff: float = 0.25
    max_backoff: float = 20.0
    timeout: float = 60.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        cap = min(self.max_backoff, self.backoff * (2**attempt))
        return (rng or random).uniform(0, cap)

    @property
    def request_limit(self) -> float:
        """Seconds one try of a range request may take in all (the whole answer, not just a silence)."""
        return 4 * self.timeout

    @property
    def worst_case(self) -> float:
        """An upper bound on the seconds one request with all its retries can take (for watchdogs): every try
        at its `request_limit`, every wait at its cap."""
        waits = sum(min(self.max_backoff, self.backoff * 2**i) for i in range(self.retries))
        return (self.retries + 1) * self.request_limit + waits


def error_code(exc: BaseException) -> str | None:
    """The S3 error code or HTTP status an exception carries (botocore's ``response``, aiohttp's ``status``)."""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        code = err.get("Code")
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return str(code or status) if (code or status) else None
    status = getattr(exc, "status", None)  # aiohttp ClientResponseError
    return str(status) if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may cure (see the module doc); walks ``__cause__``/``__context__`` chains,
    since fsspec back-ends wrap the transport's exception in their own."""
    if isinstance(exc, RetriesExhausted):
        return False
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _transient_one(e):
            return True
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        e = e.__cause__ or e.__context__
    return False


def _transient_one(e: BaseException) -> bool:
    """One exception, by its type and the status it carries: transport errors are `ConnectionError` or
    `TimeoutError` (obstore's failures are `objstore.StoreError`, one of them; aiohttp's and urllib3's connection
    errors are `OSError` with a network ``errno``), a store's answer a 5xx or throttling code."""
    if isinstance(e, (FileNotFoundError, PermissionError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    code = error_code(e)
    if code is not None:
        return code in TRANSIENT_CODES or (code.isdigit() and 500 <= int(code) < 600)
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    on_retry: Callable[[BaseException, int], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()`` with retries on transient errors; permanent ones propagate at once."""
    for attempt in range(policy.retries + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            if attempt == policy.retries:
                raise RetriesExhausted(what, attempt + 1, e) from e
            wait = policy.delay(attempt)
            log.debug("%s: %s: %s; retry %d/%d in %.2fs", what, type(e).__name__, e, attempt + 1, policy.retries, wait)
            if on_retry is not None:
                on_retry(e, attempt)
            sleep(wait)
    raise AssertionError("unreachable")
