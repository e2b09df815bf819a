"""A lightweight read-only S3-compatible server for the storage benchmark: one folder served as one bucket.

    python tools/_s3_lite.py --root DIR --bucket NAME [--latency 0.1] [--port 0] [--cert PEM --key PEM]

It prints its URL (``http://127.0.0.1:PORT``, ``https://`` with ``--cert``) on the first line of stdout once it
listens, then serves until it is stopped (SIGTERM or SIGINT). It answers what s3fs asks of a reader, path-style
(``/BUCKET/KEY``): HeadBucket, HeadObject, GetObject with or without ``Range`` (206 and ``Content-Range``),
ListObjectsV2 (prefix, delimiter, continuation); anything else gets an S3 error document. Signatures are not
checked. ``--latency`` seconds are slept inside the server before the first byte of every answer (no proxy
process), and object bodies go out with ``socket.sendfile`` (the kernel copies them), so the server spends
almost no CPU: on a 2-core machine it stands in for a remote store whose CPU is not the training node's.
With ``--cert`` and ``--key`` it speaks TLS, as cloud stores do (the bodies are then encrypted by this process, in
Python's ``ssl``: CPU on the same cores, unlike a remote store's). It does not model bandwidth limits, throttling
(503 SlowDown), broken connections or per-request pricing; tests/faultproxy.py does the faults.
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import os
import re
import signal
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_XML = "application/xml"
#: keys listed per ListObjectsV2 page at most (S3's own limit)
_MAX_KEYS = 1000


class LiteS3(ThreadingHTTPServer):
    """The server: ``root`` is the bucket's content, ``latency`` the seconds before every answer."""

    daemon_threads = True
    #: the listen backlog: socketserver's default of 5 drops the SYNs of a sixth client connecting at once, which
    #: then retries after the kernel's 1 s timeout (a worker opening 8 shard streams together would wait for it)
    request_queue_size = 128
    allow_reuse_address = True

    def __init__(self, root: str, bucket: str, latency: float, port: int = 0, tls: tuple[str, str] | None = None):
        super().__init__(("127.0.0.1", port), _Handler)
        self.scheme = "http"
        if tls is not None:  # (certificate, key) files: connections are accepted over TLS
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.socket = ctx.wrap_socket(self.socket, server_side=True)
            self.scheme = "https"
        self.root = os.path.realpath(root)
        self.bucket = bucket
        self.latency = latency
        self.requests = 0
        self._count_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}"

    def counted(self) -> None:
        """One more request answered (for the benchmark's own check)."""
        with self._count_lock:
            self.requests += 1

    def file_of(self, key: str) -> str | None:
        """The regular file that holds ``key``, or None (missing, a folder, or a key that leaves the root)."""
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
            return None
        path = os.path.realpath(os.path.join(self.root, key))
        if not path.startswith(self.root + os.sep) or not os.path.isfile(path):
            return None
        return path


class _Handler(BaseHTTPRequestHandler):
    """One connection (HTTP/1.1 keep-alive, as botocore's pool expects)."""

    protocol_version = "HTTP/1.1"
    server: LiteS3

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """Quiet: a benchmark server must not spend its time writing a log."""

    def _target(self) -> tuple[str, str, dict[str, list[str]]]:
        """(bucket, key, query) of the request's path."""
        parts = urlsplit(self.path)
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        return bucket, key, parse_qs(parts.query, keep_blank_values=True)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_PUT(self) -> None:
        self._refuse()

    do_POST = do_DELETE = do_PUT

    def _refuse(self) -> None:
        """Writes are not served: this is a read-only stand-in."""
        self._drain_body()
        self._wait_latency()
        self._error(405, "MethodNotAllowed", "this server is read-only", head=False)

    def _drain_body(self) -> None:
        """Read a request body the client sent, so the connection stays usable (bounded by its length)."""
        n = int(self.headers.get("Content-Length") or 0)
        while n > 0:
            got = self.rfile.read(min(n, 1 << 16))
            if not got:
                break
            n -= len(got)

    def _wait_latency(self) -> None:
        """The store's latency, before the first byte of the answer."""
        self.server.counted()
        if self.server.latency > 0:
            time.sleep(self.server.latency)

    def _answer(self, head: bool) -> None:
        """Route one HEAD or GET to the bucket or object operation it asks for."""
        self._wait_latency()
        bucket, key, query = self._target()
        if bucket != self.server.bucket:
            self._error(404, "NoSuchBucket", "The specified bucket does not exist", head)
        elif not key and query.get("list-type") == ["2"] and not head:
            self._list(query)
        elif not key and (head or not query):
            self._send(200, [("Content-Type", _XML)], b"" if head else _empty_list(bucket), head)
        elif not key:
            self._error(501, "NotImplemented", "only ListObjectsV2 is served on a bucket", head)
        else:
            self._object(key, head)

    def _object(self, key: str, head: bool) -> None:
        """HeadObject, or GetObject (ranged or whole) with the body sent by the kernel."""
        path = self.server.file_of(key)
        if path is None:
            self._error(404, "NoSuchKey", "The specified key does not exist.", head)
            return
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            span = _range(self.headers.get("Range"), st.st_size)
            if span is None:
                self._error(416, "InvalidRange", "The requested range is not satisfiable", head)
                return
            first, last = span
            headers = _object_headers(st, key)
            status = 200
            if self.headers.get("Range") is not None and not head:
                status = 206
                headers.append(("Content-Range", f"bytes {first}-{last}/{st.st_size}"))
            length = last - first + 1 if st.st_size else 0
            self._start(status, headers + [("Content-Length", str(length))])
            if not head and length:
                _send_body(self.connection, f, first, length)

    def _list(self, query: dict[str, list[str]]) -> None:
        """ListObjectsV2: the keys under ``prefix``, folded at ``delimiter``, a page at a time."""
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        after = query.get("continuation-token", query.get("start-after", [""]))[0]
        limit = max(1, min(_MAX_KEYS, int(query.get("max-keys", [str(_MAX_KEYS)])[0] or _MAX_KEYS)))
        entries = _listing(self.server.root, prefix, delimiter)
        page = [e for e in entries if e[0] > after][:limit]
        more = len(page) == limit and page[-1][0] != entries[-1][0]
        body = _list_xml(self.server.bucket, prefix, delimiter, page, more)
        self._send(200, [("Content-Type", _XML)], body, head=False)

    def _error(self, status: int, code: str, message: str, head: bool) -> None:
        """An S3 error document (a HEAD gets the status alone, as S3 does)."""
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>"
        ).encode()
        self._send(status, [("Content-Type", _XML)], body, head)

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes, head: bool) -> None:
        """A whole small answer (its length declared, so the connection is kept)."""
        self._start(status, headers + [("Content-Length", str(len(body)))])
        if not head and body:
            self.wfile.write(body)

    def _start(self, status: int, headers: list[tuple[str, str]]) -> None:
        """The status line and headers."""
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("x-amz-request-id", "lite")
        self.end_headers()


def _send_body(conn: object, f: object, first: int, length: int) -> None:
    """Bytes ``[first, first + length)`` of ``f``: by ``sendfile`` (the kernel copies them), or over TLS (which
    the kernel does not encrypt here) 1 MiB at a time, each written in one ``sendall``."""
    if not isinstance(conn, ssl.SSLSocket):
        conn.sendfile(f, first, length)  # type: ignore[attr-defined]
        return
    f.seek(first)  # type: ignore[attr-defined]
    while length > 0:
        piece = f.read(min(length, 1 << 20))  # type: ignore[attr-defined]
        if not piece:
            return
        conn.sendall(piece)
        length -= len(piece)


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(first, last)`` byte of a Range header on an object of ``size`` bytes (None: not satisfiable)."""
    if header is None:
        return (0, size - 1) if size else (0, -1)
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # the last N bytes
        n = int(m.group(2))
        return (max(0, size - n), size - 1) if n and size else None
    first = int(m.group(1))
    last = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
    return (first, last) if first < size and first <= last else None


def _object_headers(st: os.stat_result, key: str) -> list[tuple[str, str]]:
    """Headers every object answer carries; the ETag is derived from the key, size and mtime (not the bytes)."""
    tag = hashlib.md5(f"{key}:{st.st_size}:{st.st_mtime_ns}".encode(), usedforsecurity=False).hexdigest()
    return [
        ("Content-Type", "application/octet-stream"),
        ("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True)),
        ("ETag", f'"{tag}"'),
        ("Accept-Ranges", "bytes"),
    ]


def _listing(root: str, prefix: str, delimiter: str) -> list[tuple[str, os.stat_result | None]]:
    """Sorted (key, stat) under ``prefix``; with a delimiter, the folded common prefixes have stat None."""
    base = os.path.dirname(prefix) if "/" in prefix else ""
    top = os.path.realpath(os.path.join(root, base))
    if top != root and not top.startswith(root + os.sep):
        return []  # a prefix that leaves the root lists nothing
    found: dict[str, os.stat_result | None] = {}
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        rel = os.path.relpath(folder, root)
        rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for name in files:
            key = rel + name
            if not key.startswith(prefix):
                continue
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                found.setdefault(key[: cut + len(delimiter)], None)
            else:
                found[key] = os.stat(os.path.join(folder, name))
    return sorted(found.items())


def _list_xml(bucket: str, prefix: str, delimiter: str, page: list, more: bool) -> bytes:
    """The ListObjectsV2 result document of one page."""
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
        f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
        f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{_MAX_KEYS}</MaxKeys>",
        f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>",
    ]
    if delimiter:
        out.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
    if more:
        out.append(f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>")
    for key, st in page:
        if st is None:
            out.append(f"<CommonPrefixes><Prefix>{escape(key)}</Prefix></CommonPrefixes>")
            continue
        etag = _object_headers(st, key)[2][1]
        when = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
        out.append(
            f"<Contents><Key>{escape(key)}</Key><LastModified>{when}</LastModified>"
            f"<ETag>{escape(etag)}</ETag><Size>{st.st_size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
        )
    out.append("</ListBucketResult>")
    return "".join(out).encode()


def _empty_list(bucket: str) -> bytes:
    """A bucket GET without a query (ListObjects v1 of nothing): an empty, valid listing."""
    return _list_xml(bucket, "", "", [], False)


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; the first line of stdout is the URL."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="the folder served as the bucket's content")
    ap.add_argument("--bucket", required=True, help="the bucket's name")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before the first byte of every answer")
    ap.add_argument("--port", type=int, default=0, help="0: any free port")
    ap.add_argument("--cert", help="a PEM certificate: serve over TLS (with --key)")
    ap.add_argument("--key", help="the certificate's PEM private key")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.root):
        sys.exit(f"_s3_lite: {a.root}: not a folder")
    if bool(a.cert) != bool(a.key):
        sys.exit("_s3_lite: --cert and --key go together")
    server = LiteS3(a.root, a.bucket, a.latency, a.port, (a.cert, a.key) if a.cert else None)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(server.url, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
