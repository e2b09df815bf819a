"""How long object-storage calls wait: every obstore store `storage.store_of()` makes (its timeouts, tries and
upload deadline are these: `objstore.store_for()`) and every ``s3://`` filesystem `filesystem()` makes (s3fs: for
options obstore is not given, reads before obstore's runtime runs, and its callers outside `storage`); all
storage calls but the shard reader's, which has its own: `ReadOptions`.

Unless ``storage_options`` set them (``config_kwargs.connect_timeout``, ``read_timeout``, ``retries``), a request
waits at most `CONNECT_TIMEOUT` seconds to connect and `READ_TIMEOUT` seconds for data, and is tried
`ATTEMPTS` times (botocore's ``standard`` retry mode: backoff with jitter; timeouts, dropped connections, 5xx
and throttling retried; s3fs's own retry loop is off, ``storage_options["retries"]`` turns it on). aiohttp times
an upload only once its body is sent: the wait for ``100 Continue`` and a body the storage stops taking have no
timeout, so an upload (``PUT``) also has a deadline, `upload_deadline()`: the two timeouts plus a second per
`UPLOAD_RATE` bytes of its body. A stalled endpoint thus fails a write after a few minutes, with one line
naming the URL (`guards`), instead of hanging it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

import fsspec

#: seconds to wait for a connection to object storage
CONNECT_TIMEOUT = 10.0
#: seconds a request to object storage may wait for data (as the shard reader's default ``timeout``)
READ_TIMEOUT = 60.0
#: tries of a request to object storage (the first and two retries)
ATTEMPTS = 3
#: the slowest upload that is not taken for a stalled one, in bytes per second (256 KiB/s, about 2 Mbit/s)
UPLOAD_RATE = 256 * 1024


def with_timeouts(url: str, storage_options: dict | None) -> tuple[dict, int]:
    """``storage_options`` for ``url``'s filesystem with the defaults above where it is an ``s3://`` URL, and how
    many times s3fs itself tries a call there (0: not an ``s3://`` URL)."""
    opts = dict(storage_options or {})
    if "::" in url or fsspec.core.split_protocol(url)[0] not in ("s3", "s3a"):
        return opts, 0
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", CONNECT_TIMEOUT)
    cfg.setdefault("read_timeout", READ_TIMEOUT)
    cfg.setdefault("retries", {"mode": "standard", "total_max_attempts": ATTEMPTS})
    session = _deadline_session(float(cfg["connect_timeout"]), float(cfg["read_timeout"]))
    if session is not None:
        cfg.setdefault("http_session_cls", session)
    opts["config_kwargs"] = cfg
    return opts, int(opts.get("retries", 1))


def upload_deadline(method: str, headers: Any, connect: float, read: float) -> float | None:
    """Seconds an HTTP request may take in all, or None for no deadline: an upload (``PUT``: PutObject, UploadPart)
    gets ``connect + read`` plus a second per `UPLOAD_RATE` bytes of its body; any other request is
    timed by aiohttp alone (its small body is sent at once, then the read timeout runs)."""
    if method.upper() != "PUT":
        return None
    size = 0
    for name in ("Content-Length", "X-Amz-Decoded-Content-Length"):
        value = headers.get(name) if hasattr(headers, "get") else None
        if value is not None:
            size = max(size, int(value.decode() if isinstance(value, bytes) else value))
    return connect + read + size / UPLOAD_RATE


@functools.cache
def _deadline_session(connect: float, read: float) -> type | None:
    """aiobotocore's HTTP session class with `upload_deadline()` (one class per pair of timeouts: fsspec tells
    cached filesystems apart by their options' text); None where this aiobotocore has no ``http_session_cls``."""
    try:
        from aiobotocore.config import AioConfig
        from aiobotocore.httpsession import AIOHTTPSession
        from botocore.exceptions import ReadTimeoutError
    except ImportError:  # pragma: no cover - s3fs needs both
        return None
    if "http_session_cls" not in inspect.signature(AioConfig.__init__).parameters:
        return None

    class DeadlineSession(AIOHTTPSession):
        """aiobotocore's session; an upload past its deadline is a read timeout (retried like one)."""

        async def send(self, request: Any) -> Any:
            deadline = upload_deadline(request.method, request.headers, connect, read)
            if deadline is None:
                return await super().send(request)
            try:
                return await asyncio.wait_for(super().send(request), deadline)
            except asyncio.TimeoutError as e:
                raise ReadTimeoutError(endpoint_url=request.url, error=e) from e

    DeadlineSession.__qualname__ = DeadlineSession.__name__ = f"DeadlineSession_{connect:g}s_{read:g}s"
    return DeadlineSession
