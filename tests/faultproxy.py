"""A fault-injecting HTTP reverse proxy for tests and benchmarks, loopback only.

It sits between an S3 client (s3fs, with ``endpoint_url`` = the proxy) and an S3-compatible server, forwards
every request, and on the requests that match its rules it misbehaves:

* ``Rule("latency", seconds=0.1)``: answer every request that much later;
* ``Rule("error", every=3, status=503)``: answer every 3rd matching GET with ``503 SlowDown`` (``code``: another
  S3 error code, e.g. ``Rule("error", status=403, code="AccessDenied")``);
* ``Rule("drop", drop_after=5000)``: send the headers and 5000 bytes of the body, then cut the connection
  (``reset=True``: with an RST); ``min_offset``: only requests whose Range starts at or after that byte;
* ``Rule("truncate", match="shard-000002.tar", size=9000)``: the object looks truncated to 9000 bytes
  (HEAD, plain and ranged GETs agree, as if the object itself were cut);
* ``Rule("stall", seconds=30)``: accept the request and answer nothing for that long;
* ``Rule("whole")``: answer a ranged GET with ``200`` and the whole object (HTTP allows a server to ignore Range);
* ``Rule("shift", size=100)``: answer a ranged GET with a ``206`` of another range, ``size`` bytes later (its
  Content-Range says so, truthfully);
* ``Rule("short", size=100)``: send the whole body but a Content-Length ``size`` bytes smaller (the rest of the
  body lands on the connection as garbage before the next answer);
* ``Rule("long", size=100)``: a Content-Length ``size`` bytes larger than the body, then close the connection;
* ``Rule("outage", seconds=5)``: from the first matching request on, for that long, the store is gone: every
  request (any method, any path) has its connection reset before an answer.

``match`` is a substring of the request path (``""``: every object request; ``buckets=True``: a bucket's too);
``every`` picks every k-th matching GET; ``limit`` stops a rule after it acted that often. The proxy logs every request
(``proxy.requests``: method, path, Range header, status) for assertions, and each request's client
(``proxy.clients``: its path, ``User-Agent`` and the access key its ``Authorization`` names).

Run as a program to put it in its own process (benchmarks): ``python tests/faultproxy.py --upstream URL
--port P [--latency S]``.
"""

from __future__ import annotations

import argparse
import http.client
import re
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "upgrade"}
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)")


@dataclass
class Rule:
    action: str  # latency | error | drop | truncate | stall | whole | shift | short | long | outage
    match: str = ""
    every: int = 1
    limit: int | None = None
    seconds: float = 0.0
    status: int = 503
    code: str = "SlowDown"  # the S3 error code of an "error" answer
    drop_after: int = 0
    size: int = 0
    reset: bool = False
    min_offset: int = 0
    methods: tuple[str, ...] = ("GET",)
    #: also requests for a bucket (listings, a bulk delete: ``POST /bucket?delete``), not only for an object
    buckets: bool = False
    seen: int = field(default=0, init=False)
    acted: int = field(default=0, init=False)
    since: float | None = field(default=None, init=False)  # an outage's start (time.monotonic())

    def applies(self, method: str, path: str, rng: str | None = None) -> bool:
        """Count a matching request; True when this one is hit."""
        if self.action == "outage" and self.since is not None:
            return time.monotonic() - self.since < self.seconds
        if method not in self.methods or self.match not in path or not (self.buckets or _is_object(path)):
            return False
        if self.min_offset:
            m = _RANGE.fullmatch((rng or "").strip())
            if (int(m.group(1)) if m else 0) < self.min_offset:
                return False
        self.seen += 1
        if self.every > 1 and self.seen % self.every:
            return False
        if self.limit is not None and self.acted >= self.limit:
            return False
        self.acted += 1
        if self.action == "outage":
            self.since = time.monotonic()
        return True


def _is_object(path: str) -> bool:
    """A request for an object (``/bucket/key``), not for a bucket or a listing."""
    p = urlsplit(path).path.strip("/")
    return "/" in p


def byte_range(rng: str | None, size: int) -> tuple[int, int]:
    """``(first, last)`` byte of a Range header (``None``: the whole object) of an object of ``size`` bytes."""
    m = _RANGE.fullmatch((rng or "").strip())
    if m is None:
        return 0, size - 1
    return int(m.group(1)), min(size - 1, int(m.group(2))) if m.group(2) else size - 1


def times_read(requests: list[tuple[str, str, str | None, int]], size: int) -> int:
    """How often an object was fetched whole, from the log of its GETs: the fewest answered requests that cover
    any one byte. A transport's resend of a range adds to its bytes only; a second download adds to all."""
    deltas: dict[int, int] = {0: 0}
    for _, _, rng, status in requests:
        if status in (200, 206):
            lo, hi = byte_range(rng, size)
            deltas[lo] = deltas.get(lo, 0) + 1
            deltas[hi + 1] = deltas.get(hi + 1, 0) - 1
    level, least = 0, None
    for at in sorted(deltas):
        if at >= size:
            break
        level += deltas[at]
        least = level if least is None else min(least, level)
    return least or 0


class _Server(ThreadingHTTPServer):
    """The proxy's listener: a backlog of 128 (socketserver's default of 5 drops the SYN of a sixth client that
    connects at once, which then waits the kernel's 1 s retry: a worker streaming 8 shards at once would)."""

    daemon_threads = True
    request_queue_size = 128


class FaultProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0):
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str, str | None, int]] = []
        self.clients: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.keep_log = True
        handler = type("Handler", (_Handler,), {"proxy": self})
        self.server = _Server((host, port), handler)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self.thread = threading.Thread(target=self.server.serve_forever, name="faultproxy", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self, *rules: Rule) -> None:
        with self.lock:
            self.rules = list(rules)
            self.requests = []
            self.clients = []

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def gets(self, match: str = "") -> list[tuple[str, str, str | None, int]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "GET" and match in r[1] and _is_object(r[1])]

    def _pick(self, method: str, path: str, rng: str | None) -> list[Rule]:
        with self.lock:
            return [r for r in self.rules if r.applies(method, path, rng)]

    def _log(self, method: str, path: str, rng: str | None, status: int) -> None:
        if not self.keep_log:
            return
        with self.lock:
            self.requests.append((method, path, rng, status))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
            self._conn = conn
        return conn

    def _body(self) -> bytes | None:
        n = self.headers.get("Content-Length")
        if n is not None:
            return self.rfile.read(int(n))
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                out.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(out)
        return None

    def _forward(self, body: bytes | None, rng: str | None = None) -> tuple[int, list[tuple[str, str]], bytes]:
        """Forward the request upstream (with ``rng`` as its Range header instead of the client's where given: "" for
        none)."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if rng is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "range"}
            if rng:
                headers["Range"] = rng
        if body is not None:
            headers["Content-Length"] = str(len(body))
        for attempt in range(2):
            conn = self._upstream()
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                keep = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
                if self.command == "HEAD":  # no body, but the size the client wants to know
                    keep += [(k, v) for k, v in resp.getheaders() if k.lower() == "content-length"]
                return resp.status, keep, data
            except (http.client.HTTPException, OSError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _send(
        self,
        status: int,
        headers: list[tuple[str, str]],
        data: bytes,
        length: int | None = None,
        cut_after: int | None = None,
        reset: bool = False,
    ) -> None:
        self.send_response(status)
        for k, v in headers:
            if not (k.lower() == "content-length" and length is not None):
                self.send_header(k, v)
        if length is not None or self.command != "HEAD" or not any(k.lower() == "content-length" for k, _ in headers):
            self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut_after is None:
            self.wfile.write(data)
            return
        self.wfile.write(data[:cut_after])
        self.wfile.flush()
        self._cut(reset)

    def _cut(self, reset: bool = False) -> None:
        """Close the client's connection mid-response: FIN (what was sent arrives, then an early end of
        stream), or with ``reset`` an RST (the peer may lose bytes still in its receive buffer)."""
        try:
            if reset:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close_connection = True

    def _handle(self) -> None:
        px = self.proxy
        body = self._body() if self.command in ("PUT", "POST") else None
        rng = self.headers.get("Range")
        with px.lock:
            key = _CREDENTIAL.search(self.headers.get("Authorization") or "")
            px.clients.append((self.path, self.headers.get("User-Agent") or "", key.group(1) if key else ""))
        rules = px._pick(self.command, self.path, rng)
        if any(r.action == "outage" for r in rules):  # once begun, an outage holds every request (Rule.applies)
            px._log(self.command, self.path, rng, 0)
            self._cut(reset=True)
            return
        for r in rules:
            if r.action == "latency":
                time.sleep(r.seconds)
        for r in rules:
            if r.action == "stall":
                time.sleep(r.seconds)
                px._log(self.command, self.path, rng, 0)
                self._cut()
                return
            if r.action == "error":
                said = "Please reduce your request rate." if r.code == "SlowDown" else r.code
                msg = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{r.code}</Code>'
                    f"<Message>{said}</Message></Error>"
                ).encode()
                px._log(self.command, self.path, rng, r.status)
                self._send(r.status, [("Content-Type", "application/xml")], msg)
                return
        status, headers, data = self._forward(body, _asked(rules, self.command, rng))
        trunc = [r for r in px.rules if r.action == "truncate" and r.match and r.match in self.path]
        if trunc and status in (200, 206):
            status, headers, data, length = _truncate(self.command, status, headers, data, rng, trunc[0].size)
        else:
            length = None
        drop = next((r for r in rules if r.action == "drop"), None)
        px._log(self.command, self.path, rng, status)
        lying = next((r for r in rules if r.action in ("short", "long")), None)
        if lying is not None and self.command == "GET" and status in (200, 206) and len(data) > lying.size:
            declared = len(data) + (lying.size if lying.action == "long" else -lying.size)
            self._send(status, headers, data, length=declared, cut_after=len(data) if lying.action == "long" else None)
            return
        if drop is not None and self.command == "GET" and status in (200, 206) and len(data) > drop.drop_after:
            self._send(status, headers, data, cut_after=drop.drop_after, reset=drop.reset)
            return
        self._send(status, headers, data, length=length)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


def _asked(rules: list[Rule], method: str, rng: str | None) -> str | None:
    """The Range to ask upstream for where a rule answers another than the client asked (None: the client's)."""
    m = _RANGE.fullmatch((rng or "").strip())
    if method != "GET" or m is None:
        return None
    for r in rules:
        if r.action == "whole":
            return ""
        if r.action == "shift":
            lo, hi = int(m.group(1)) + r.size, (int(m.group(2)) + r.size if m.group(2) else None)
            return f"bytes={lo}-{'' if hi is None else hi}"
    return None


def _truncate(method, status, headers, data, rng, size):
    """Rewrite a response as if the object were ``size`` bytes long."""
    headers = [(k, v) for k, v in headers if k.lower() not in ("content-range", "etag")]
    if method == "HEAD":
        return status, headers, b"", size
    m = _RANGE.fullmatch(rng.strip()) if rng else None
    if m is None:
        return 200, headers, data[:size], None
    start = int(m.group(1))
    if start >= size:
        err = b"<Error><Code>InvalidRange</Code><Message>The requested range is not satisfiable</Message></Error>"
        return 416, [("Content-Type", "application/xml"), ("Content-Range", f"bytes */{size}")], err, None
    data = data[: max(0, size - start)]
    headers.append(("Content-Range", f"bytes {start}-{start + len(data) - 1}/{size}"))
    return 206, headers, data, None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added to every request")
    a = ap.parse_args(argv)
    px = FaultProxy(a.upstream, port=a.port)
    px.keep_log = False
    if a.latency:
        px.rules.append(Rule("latency", seconds=a.latency, methods=("GET", "HEAD", "PUT", "POST", "DELETE")))
    print(px.url, flush=True)
    try:
        px.server.serve_forever()
    except KeyboardInterrupt:  # pragma: no cover
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
