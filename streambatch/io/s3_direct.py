"""Range reads of S3 objects over presigned URLs: a shard's bytes at about half the CPU of s3fs's reads.

s3fs reads a body through aiobotocore and aiohttp on its event-loop thread, Python that holds the GIL while the
training process decodes: over one epoch of 204 MiB that thread used 0.25-0.27 CPU seconds on this project's
machine, where urllib3 (botocore's own HTTP library) reading the same ranges used 0.08-0.17 s (plus 0.05-0.07 s on
the event loop for the index and the signing). So a remote shard's range requests go, where nothing in the storage
options asks for more than a plain signed GET, to a URL the s3fs client presigns (locally: no request) with a
``Range`` header, over a per-process urllib3 pool:

* the client, its credentials (refreshed by botocore when they expire), endpoint and addressing stay s3fs's;
* a URL is signed again well before it expires, and once more on a 400/403 answer (temporary credentials can
  end before the URL does); any other unexpected answer, or a second refusal, hands the filesystem back to the
  s3fs path for good, which then reports the error in botocore's own words;
* proxies, server-side encryption with a customer key, requester-pays buckets, versioned paths, a ``client_kwargs``
  this module does not map and urllib3 before 2 keep the s3fs path (`usable()`), as does
  ``STREAMBATCH_S3_PRESIGNED=0`` in the environment.

Answers are classified as s3fs's are (`streambatch.io.retry`): 5xx and throttling are transient, a missing
object is a `FileNotFoundError`, a broken body leaves what arrived in ``sink`` for the retry to resume at.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import sys
import threading
import time
import weakref
from email.utils import parsedate_to_datetime
from typing import Any

from ..errors import StorageError

log = logging.getLogger("streambatch")

#: seconds a presigned URL is valid for, and the age at which it is signed again
EXPIRES, RESIGN_AFTER = 3600, 1800
#: the most bytes one read of the body asks for: what arrived before a break that raises is kept up to the last
#: piece (the retry resumes after it), and ``read1``'s pieces, joined afterwards, stay small beside the chunk
PIECE = 1 << 18
#: client_kwargs this module knows how to honour (anything else keeps the s3fs path)
_MAPPED_CLIENT_KWARGS = {"endpoint_url", "region_name", "verify", "aws_access_key_id", "aws_secret_access_key"}
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy")
_S3_CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")
#: whether a plain-HTTP body may be received in calls that wait in the kernel for all their bytes (Linux, whose
#: ``MSG_WAITALL`` returns what arrived when ``SO_RCVTIMEO`` passes, with a 64-bit ``struct timeval``)
_WAITALL = sys.platform.startswith("linux") and hasattr(socket, "MSG_WAITALL") and struct.calcsize("l") == 8


class S3HTTPError(StorageError):
    """A non-2xx answer to a presigned GET: ``status`` and the S3 error ``code`` of its XML body."""

    def __init__(self, status: int, code: str, url: str):
        super().__init__(f"HTTP {status} {code} for {url.split('?', 1)[0]}")
        self.status, self.code = status, code
        # the shape botocore's ClientError has, so retry.py classifies both alike
        self.response = {"Error": {"Code": code or str(status)}, "ResponseMetadata": {"HTTPStatusCode": status}}


def usable(fs: Any) -> bool:
    """Whether ``fs`` (an s3fs filesystem) asks for nothing beyond a plain signed GET: no proxy (environment or
    config), no extra request arguments (SSE-C keys, requester pays), no client option this module ignores, and
    not switched off with ``STREAMBATCH_S3_PRESIGNED=0``."""
    if os.environ.get("STREAMBATCH_S3_PRESIGNED", "1") == "0" or not hasattr(fs, "url") or not _urllib3_reads_some():
        return False
    if any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARS):
        return False
    if getattr(fs, "s3_additional_kwargs", None) or getattr(fs, "req_kw", None) or getattr(fs, "version_aware", False):
        return False
    config = getattr(fs, "config_kwargs", None) or {}
    client = getattr(fs, "client_kwargs", None) or {}
    return not config.get("proxies") and set(client) <= _MAPPED_CLIENT_KWARGS


def signs_for(fs: Any, options: dict) -> bool:
    """Whether range reads of ``fs`` (a reading filesystem made from the caller's storage ``options``) go over
    presigned URLs (`usable()`). Then the URLs are signed by the filesystem of ``options`` themselves, fsspec's
    instance that already read the index (its S3 client costs 50-100 ms of CPU to make: not twice per process), and
    ``fs``'s own client is made only if a read falls back to s3fs."""
    if not usable(fs):
        return False
    fs.streambatch_signing_options = dict(options)
    return True


def signed_elsewhere(fs: Any) -> bool:
    """Whether ``fs``'s range reads are signed by another filesystem (`signs_for()` said so)."""
    return hasattr(fs, "streambatch_signing_options")


def _signer(fs: Any) -> Any:
    """The filesystem that signs ``fs``'s URLs (`signs_for()`), its client made now; ``fs`` itself otherwise."""
    options = getattr(fs, "streambatch_signing_options", None)
    if options is None:
        return fs
    signer = type(fs)(**options)  # fsspec's instance cache: the filesystem the index was read with
    if getattr(signer, "session", True) is None:  # not connected yet (a forked worker's first signer)
        signer.session = _session_with_kept_loader(getattr(signer, "kwargs", None) or {})
    signer.connect()
    keep_loader(signer)
    return signer


#: botocore's loader of its service descriptions, as a connected client of this process left it: the S3
#: description it parsed (most of the 50-100 ms of CPU a new client costs) serves the signing clients of the
#: processes this one forks (a loader's workers), with the ``data_path`` it was made for
_KEPT_LOADER: tuple[Any, Any] | None = None


def keep_loader(fs: Any) -> None:
    """Keep the service-description loader of ``fs``'s session (an s3fs filesystem, once connected) for the
    signing clients this process and the processes it forks make later (`_session_with_kept_loader()`)."""
    global _KEPT_LOADER
    session = getattr(fs, "session", None)
    if session is None or _KEPT_LOADER is not None:
        return
    try:
        _KEPT_LOADER = (session.get_component("data_loader"), session.get_config_variable("data_path"))
    except Exception:  # noqa: BLE001 - a session of another shape: its clients load their own
        return


def _session_with_kept_loader(kwargs: dict) -> Any:
    """The session s3fs makes for a filesystem (``AioSession(**fs.kwargs)``), sharing the kept loader where it
    was made for the same ``data_path``; None (s3fs makes its own, and reports what is wrong with the options in
    its own words) when none is kept or this one cannot be made."""
    if _KEPT_LOADER is None:
        return None
    try:
        from aiobotocore.session import AioSession

        session = AioSession(**kwargs)
        loader, data_path = _KEPT_LOADER
        if session.get_config_variable("data_path") == data_path:
            session.register_component("data_loader", loader)
    except Exception:  # noqa: BLE001 - a profile or config file botocore refuses: s3fs's own session says so
        return None
    return session


class PresignedReader:
    """Range GETs of one s3fs filesystem's objects over presigned URLs (one per process, with its pool)."""

    def __init__(self, fs: Any):
        import urllib3

        self.fs = fs
        self.signer = _signer(fs)
        self.enabled = True
        self._urls: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        verify = (getattr(fs, "client_kwargs", None) or {}).get("verify", True)
        tls: dict[str, Any] = {"cert_reqs": "CERT_NONE"} if verify is False else {"ca_certs": _ca_bundle(verify)}
        self.pool = urllib3.PoolManager(maxsize=64, retries=False, **tls)

    def url(self, path: str, fresh: bool = False) -> str:
        """The presigned GET URL of ``path``, signed again when ``fresh`` or half its validity has passed."""
        now = time.monotonic()
        with self._lock:
            known = self._urls.get(path)
        if known is not None and not fresh and now - known[1] < RESIGN_AFTER:
            return known[0]
        url = str(self.signer.url(path, expires=EXPIRES))
        with self._lock:
            self._urls[path] = (url, now)
        return url

    def read(
        self, path: str, start: int, end: int, sink: list[bytes], timeout: float | None, heard: list
    ) -> int | None:
        """Append bytes ``[start, end)`` of ``path`` to ``sink`` as they arrive, and to ``heard`` the version the
        answer names (`object_version()`) once its headers are in; the object's size (None if not told).
        Raises `Refused` when the s3fs path should take over."""
        for fresh in (False, True):
            resp = self._get(self.url(path, fresh), start, end, timeout)
            if resp.status in (200, 206):
                heard.append(header_version(resp.headers))
                return _body(resp, start, end, sink)
            error = _error(resp, path)
            if resp.status == 404:
                raise FileNotFoundError(path) from error
            if resp.status >= 500 or resp.status == 429 or resp.status == 416:
                raise error  # transient (retried from here), or a range past the end (reported with the index's size)
            if resp.status not in (400, 403):
                break
        raise Refused(path)

    def _get(self, url: str, start: int, end: int, timeout: float | None) -> Any:
        """The GET; it may wait for a byte as long as the filesystem's read timeout, else ``timeout``."""
        import urllib3

        timeout = (getattr(self.fs, "config_kwargs", None) or {}).get("read_timeout") or timeout
        t = urllib3.Timeout(connect=timeout, read=timeout) if timeout else urllib3.Timeout(connect=60.0, read=60.0)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        return self.pool.request("GET", url, headers=headers, preload_content=False, timeout=t, redirect=False)


class Refused(StorageError):
    """The presigned GET was refused in a way the s3fs path may handle (a region redirect, a signature it
    signs differently): that filesystem reads through s3fs from now on."""


def _body(resp: Any, start: int, end: int, sink: list[bytes]) -> int | None:
    """Read the answer's body into ``sink``; the object's size (``Content-Range``).

    The bytes go from the socket straight into one buffer of the range's size (the underlying
    `http.client.HTTPResponse`'s ``readinto``): no piece is copied again to join them, which is copying done
    holding the GIL while the training loop waits for it. Where that is not at hand, ``read1`` pieces are joined."""
    fp = getattr(resp, "_fp", None)
    ok = False
    try:
        if hasattr(fp, "readinto") and not resp.headers.get("Content-Encoding"):
            _read_into(fp, end - start, sink, _plain_socket(resp, fp, end - start))
        else:
            _read_pieces(resp, end - start, sink)
        ok = True
    finally:
        if ok and (fp is None or fp.isclosed()):  # the whole answer was read: the connection is reused
            resp.release_conn()
        else:  # a broken body, or one longer than the range asked for: the connection is not reused
            resp.close()
    return range_total(resp.headers.get("Content-Range"))


class _Filling:
    """One answer's body as it arrives: a buffer of the range's size and how much of it is in."""

    def __init__(self, size: int):
        self.size, self.got = size, 0
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)

    def hand_over(self, sink: list[bytes]) -> None:
        """The whole buffer to ``sink``, or what arrived before a break (the retry resumes after it)."""
        if self.got == self.size:
            sink.append(self.buf)  # type: ignore[arg-type] # bytes-like: every reader of a chunk takes a buffer
        elif self.got:
            sink.append(bytes(self.view[: self.got]))
        self.view.release()


def _read_into(fp: Any, size: int, sink: list[bytes], sock: socket.socket | None = None) -> None:
    """``size`` bytes of ``fp`` (an `http.client.HTTPResponse`) into one buffer, a piece per call (with
    ``sock``, a plain-HTTP answer's socket, all but its last byte by `_receive_waiting()`); what arrived before
    a break goes to ``sink`` too. An answer cut before its ``Content-Length`` raises (transient)."""
    into = _Filling(size)
    try:
        if sock is not None:
            _receive_waiting(fp, sock, into)
        while into.got < size:
            n = fp.readinto(into.view[into.got : into.got + PIECE])
            if not n:
                if getattr(fp, "length", None):  # http.client ends a cut answer quietly: it is a broken request
                    raise ConnectionResetError(f"the answer ended {fp.length} bytes before its Content-Length")
                break
            into.got += n
    finally:
        into.hand_over(sink)


def _plain_socket(resp: Any, fp: Any, size: int) -> socket.socket | None:
    """The socket of a plain-HTTP answer whose body is exactly the ``size`` bytes asked for (not chunked, not TLS:
    an `ssl.SSLSocket` takes no ``recv`` flags), where `_WAITALL` holds; else None."""
    if not _WAITALL or getattr(fp, "chunked", True) or getattr(fp, "length", None) != size or size < 2:
        return None
    sock = getattr(getattr(resp, "connection", None), "sock", None)
    return sock if type(sock) is socket.socket and hasattr(getattr(fp, "fp", None), "peek") else None


def _receive_waiting(fp: Any, sock: socket.socket, into: _Filling) -> None:
    """All but the last byte of ``fp``'s body into ``into``: first what http.client has buffered, then straight
    from ``sock`` in calls that wait in the kernel until all their bytes are in (``MSG_WAITALL``), so the request
    thread comes back to the GIL once per answer instead of once per arrival (~190 KB on loopback) and the
    decoding thread loses it less often. The socket's read timeout still bounds a wait with nothing arriving
    (``SO_RCVTIMEO``: a `TimeoutError`, transient, what arrived kept); the last byte goes through
    http.client, which then ends the answer as it would (the connection back to the pool)."""
    head = fp.fp.peek(1)  # http.client's buffered bytes, or the first arrival
    if head:
        into.got += fp.readinto(into.view[: min(len(head), into.size - 1)])
    timeout = sock.gettimeout()
    sock.settimeout(None)  # blocking, so that the kernel waits; the timeout is the kernel's now
    _receive_timeout(sock, timeout)
    try:
        while into.got < into.size - 1:
            n = _recv_all(sock, into.view[into.got : into.size - 1])
            if not n:  # the answer ended early: a broken request
                raise ConnectionResetError(f"the answer ended {fp.length} bytes before its Content-Length")
            into.got += n
            fp.length -= n  # what http.client still expects of the body
    finally:
        _receive_timeout(sock, None)
        sock.settimeout(timeout)


def _receive_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Set (or clear, with None) the kernel's receive timeout of ``sock`` (at least 1 µs: 0 would be none)."""
    micro = max(round(seconds * 1e6), 1) if seconds else 0
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", micro // 10**6, micro % 10**6))


def _recv_all(sock: socket.socket, view: memoryview) -> int:
    """One receive into ``view`` that returns once it is full, at the end of the answer (0) or past the receive
    timeout with what arrived by then; nothing by then is a `TimeoutError` (transient)."""
    try:
        return sock.recv_into(view, len(view), socket.MSG_WAITALL)
    except BlockingIOError as e:  # SO_RCVTIMEO passed with nothing received
        raise TimeoutError("no byte of the answer arrived within the read timeout") from e


def _read_pieces(resp: Any, size: int, sink: list[bytes]) -> None:
    """``size`` bytes as ``read1`` delivers them (decoded as urllib3 decodes), each piece to ``sink`` at once."""
    left = size
    while left > 0:
        piece = resp.read1(min(PIECE, left))
        if not piece:
            break
        sink.append(piece)
        left -= len(piece)


def object_version(etag: Any, modified: float | None, version_id: Any = None) -> str | None:
    """One version of an object's bytes as its store names it: ``ETAG@SECONDS[#VERSIONID]`` (the ETag and the
    Last-Modified time change on every write); None without both."""
    if not etag or modified is None:
        return None
    return f"{str(etag).strip()}@{int(modified)}" + (f"#{version_id}" if version_id else "")


def same_bytes(a: str | None, b: str | None) -> bool:
    """Whether two answers' versions name the same bytes: their ETags (what the path that answered adds beside it
    may be written differently by s3fs and by a presigned answer)."""
    return (a or "").partition("@")[0] == (b or "").partition("@")[0]


def header_version(headers: Any) -> str | None:
    """`object_version()` of an HTTP answer's ``ETag``, ``Last-Modified`` and ``x-amz-version-id``."""
    try:
        modified = parsedate_to_datetime(headers.get("Last-Modified") or "").timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return object_version(headers.get("ETag"), modified, headers.get("x-amz-version-id"))


def range_total(content_range: str | None) -> int | None:
    """The size after the slash of ``bytes a-b/SIZE`` (None when the answer does not tell it)."""
    if not content_range or "/" not in content_range:
        return None
    tail = content_range.rsplit("/", 1)[1].strip()
    return int(tail) if tail.isdigit() else None


def _error(resp: Any, path: str) -> S3HTTPError:
    """The answer as an `S3HTTPError` (its body, up to 64 KiB, read for the S3 error code)."""
    try:
        body = resp.read(65536)
    except Exception:  # noqa: BLE001 - the status is enough
        body = b""
    finally:
        resp.close()
    m = _S3_CODE.search(body or b"")
    return S3HTTPError(resp.status, m.group(1).decode("utf-8", "replace") if m else "", path)


def _urllib3_reads_some() -> bool:
    """urllib3 2 (``read1``: the bytes that arrived, so a broken answer keeps them); botocore allows 1.26 too."""
    try:
        import urllib3
    except ImportError:
        return False
    return hasattr(urllib3.HTTPResponse, "read1")


def _ca_bundle(verify: Any) -> str | None:
    """The CA certificates botocore would use: ``verify`` when it names a file, else ``AWS_CA_BUNDLE``, else
    botocore's default bundle."""
    if isinstance(verify, str):
        return verify
    from botocore.httpsession import get_cert_path

    return os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)


_READERS: weakref.WeakKeyDictionary[Any, PresignedReader] = weakref.WeakKeyDictionary()
_READERS_LOCK = threading.Lock()


def reader_for(fs: Any) -> PresignedReader | None:
    """The presigned reader of an s3fs filesystem (made on first use), or None where `usable()` says no or
    it was switched off after a refusal."""
    with _READERS_LOCK:
        r = _READERS.get(fs)
        if r is None:
            if not usable(fs):
                return None
            r = _READERS[fs] = PresignedReader(fs)
    return r if r.enabled else None


def presigned_range(
    r: PresignedReader, path: str, start: int, end: int, sink: list[bytes], timeout: float | None, heard: list
) -> int | None:
    """Bytes ``[start, end)`` of ``path`` into ``sink`` over a presigned URL of ``r`` (`reader_for()`); raises
    `Refused` (and switches that filesystem to the s3fs path) when the store refuses the URL."""
    try:
        return r.read(path, start, end, sink, timeout, heard)
    except Refused:
        with _READERS_LOCK:
            was, r.enabled = r.enabled, False
        if was:  # once per filesystem, however many requests were refused together
            log.info("streambatch: %s: a presigned range request was refused; reading through s3fs from now on", path)
        raise
