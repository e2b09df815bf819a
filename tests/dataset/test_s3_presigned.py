"""Shard range reads over presigned URLs (io/s3_direct.py), against the real S3-compatible server behind the
request-logging fault proxy: the same batches as local disk, a refused URL signed again or handed to s3fs, and
the storage options that keep the s3fs path."""

from __future__ import annotations

import logging

import pytest
from faultproxy import Rule

from streambatch import StreamBatchLoader
from streambatch.io import s3_direct

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR


@pytest.fixture(autouse=True)
def fresh_readers(monkeypatch):
    """Each test starts with no presigned reader made (a refusal switches a filesystem off for its process), and
    with obstore off: these are the fsspec path's tests (io/objstore.py reads S3 otherwise)."""
    monkeypatch.setenv("STREAMBATCH_OBSTORE", "0")
    s3_direct._READERS.clear()
    yield
    s3_direct._READERS.clear()


def keys_of(loader) -> list:
    return [b["keys"] for b in loader]


def shard_gets(proxy) -> list:
    return [r for r in proxy.requests if r[0] == "GET" and ".tar" in r[1].split("?")[0]]


def presigned(request) -> bool:
    return "Signature=" in request[1].partition("?")[2]  # query authentication (SigV2 or SigV4)


def read(s3_data, **kw):
    loader = StreamBatchLoader(s3_data.url, storage_options=s3_data.proxied, budget=BUDGET, seed=2, **kw)
    return loader, keys_of(loader)


def test_shards_are_read_over_presigned_urls(s3_data, proxy):
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2))
    loader, got = read(s3_data, chunk_size="16K")
    assert got == local
    gets = shard_gets(proxy)
    assert gets and all(presigned(r) for r in gets), gets[:3]
    assert loader.fault_stats()["bad_shards"] == 0


def test_a_refused_url_is_signed_again_once(s3_data, proxy):
    """One 403 (temporary credentials that ended before the URL): the URL is signed again and the read goes on
    over presigned URLs."""
    proxy.rules.append(Rule("error", match="Signature=", status=403, limit=1))
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2))
    loader, got = read(s3_data)
    assert got == local and loader.fault_stats()["bad_shards"] == 0
    gets = shard_gets(proxy)
    assert gets[0][3] == 403 and all(presigned(r) for r in gets)


def test_urls_are_signed_by_the_filesystem_that_read_the_index(s3_data, proxy):
    """One S3 client per process: the range requests' URLs are signed by fsspec's filesystem of the storage
    options (the one that read the index), and the reading filesystem (retries and timeouts of its own) never makes
    its client while nothing falls back to s3fs."""
    import fsspec

    from streambatch.io import storage

    storage._READ_FS.clear()  # this test's own reading filesystem, not one an earlier test made read through s3fs
    fsspec.get_filesystem_class("s3").clear_instance_cache()  # and only this test's filesystems in fsspec's cache
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2))
    loader, got = read(s3_data)
    assert got == local and all(presigned(r) for r in shard_gets(proxy))
    reading = [fs for fs in storage._READ_FS.values() if fs.protocol[0] == "s3"]
    assert reading and all(fs._s3 is None for fs in reading)  # no client of its own
    index_fs, _ = storage.filesystem(s3_data.url, s3_data.proxied)  # the one that read the index (its timeouts)
    assert all(s3_direct._READERS[fs].signer is index_fs for fs in reading)
    made = [fs for fs in type(index_fs)._cache.values() if fs._s3 is not None]
    assert made == [index_fs], made  # no second client: another signer would be a second S3FileSystem


@pytest.mark.parametrize("status", [403, 301])
def test_urls_the_store_refuses_hand_the_reads_to_s3fs(s3_data, proxy, caplog, status):
    """A store that refuses every presigned URL (403 even when signed again; 301, a region redirect s3fs follows
    and urllib3 is not asked to): the reads go through s3fs from then on, with the same batches, and the switch is
    logged once."""
    proxy.rules.append(Rule("error", match="Signature=", status=status))
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2))
    with caplog.at_level(logging.INFO, logger="streambatch"):
        loader, got = read(s3_data)
    assert got == local and loader.fault_stats()["bad_shards"] == 0
    gets = shard_gets(proxy)
    assert gets[0][3] == status and presigned(gets[0])  # refused
    assert not any(presigned(r) for r in gets[-3:]) and all(r[3] in (200, 206) for r in gets if not presigned(r))
    assert sum("reading through s3fs from now on" in m for m in caplog.messages) == 1


def test_throttling_is_retried_over_presigned_urls(s3_data, proxy):
    proxy.rules.append(Rule("error", match="Signature=", every=3, status=503))
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2))
    loader, got = read(s3_data, chunk_size="16K")
    assert got == local
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0 and stats["retries"] > 0
    assert all(presigned(r) for r in shard_gets(proxy))


def test_options_beyond_a_plain_get_keep_the_s3fs_path(s3_data, monkeypatch):
    import s3fs

    def fs(**kw):
        return s3fs.S3FileSystem(**s3_data.options, skip_instance_cache=True, **kw)

    assert s3_direct.usable(fs())
    assert not s3_direct.usable(fs(requester_pays=True))
    assert not s3_direct.usable(fs(s3_additional_kwargs={"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "k"}))
    assert not s3_direct.usable(fs(config_kwargs={"proxies": {"https": "http://127.0.0.1:9"}}))
    monkeypatch.setenv("STREAMBATCH_S3_PRESIGNED", "0")
    assert not s3_direct.usable(fs())
    monkeypatch.delenv("STREAMBATCH_S3_PRESIGNED")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert not s3_direct.usable(fs())


class _Loopback:
    """A loopback HTTP/1.1 server whose GET answers ``answer(handler)`` writes; ``released`` (also the handler's
    ``server.released``) is set when it stops: an answer may wait on it to hold its connection open."""

    def __init__(self, answer):
        import threading

        self.answer, self.released = answer, threading.Event()

    def __enter__(self):
        import http.server
        import threading

        answer = self.answer

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                answer(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.released = self.released  # type: ignore[attr-defined]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


ODD_BODY = bytes(range(200))


def _odd(h) -> None:
    """Ignores ``Range``: ``/long`` answers 200 bytes where 10 were asked for, ``/cut`` declares 200 bytes and
    closes the connection after 50."""
    h.send_response(206)
    h.send_header("Content-Length", str(len(ODD_BODY)))
    h.send_header("Content-Range", f"bytes 0-{len(ODD_BODY) - 1}/{len(ODD_BODY)}")
    h.end_headers()
    if h.path == "/cut":
        h.wfile.write(ODD_BODY[:50])
        h.wfile.flush()
        h.close_connection = True
    else:
        h.wfile.write(ODD_BODY)


def test_a_body_is_read_into_one_buffer_and_an_odd_answer_is_not_reused():
    """The bytes asked for, in one piece; an answer longer than the range does not leave its rest on a pooled
    connection for the next request to read as its own; an answer cut before its Content-Length raises a transient
    error with what arrived already in the sink (a retry resumes after it)."""
    import urllib3

    from streambatch.io.retry import is_transient

    pool = urllib3.PoolManager(maxsize=1, retries=False)
    with _Loopback(_odd) as url:
        for _ in range(3):  # each answer is 190 bytes longer than asked for: the next must start afresh
            sink: list = []
            total = s3_direct._body(pool.request("GET", f"{url}/long", preload_content=False), 0, 10, sink)
            assert len(sink) == 1 and bytes(sink[0]) == ODD_BODY[:10] and total == 200
        sink = []
        with pytest.raises(Exception) as e:  # noqa: B017 - which class is the HTTP stack's; that it is transient is ours
            s3_direct._body(pool.request("GET", f"{url}/cut", preload_content=False), 0, 200, sink)
        assert is_transient(e.value) and b"".join(sink) == ODD_BODY[:50]


def _worker_file_reads(s3_data, log, monkeypatch, keep: bool) -> tuple[list, list]:
    """One pass of a loader with two forked workers: its batches, and the botocore data files its workers read
    (each ``JSONFileLoader.load_file`` of a process other than this one, written to ``log`` with its pid)."""
    import os

    from botocore.loaders import JSONFileLoader

    me, load = os.getpid(), JSONFileLoader.load_file

    def counted(self, file_path, *a, **kw):
        if os.getpid() != me:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {file_path}\n")
        return load(self, file_path, *a, **kw)

    monkeypatch.setattr(JSONFileLoader, "load_file", counted)
    monkeypatch.setattr(s3_direct, "_KEPT_LOADER", None)
    if not keep:  # as before: a worker's signing client made its own session
        monkeypatch.setattr(s3_direct, "_session_with_kept_loader", lambda kwargs: None)
    loader = StreamBatchLoader(s3_data.url, storage_options=s3_data.proxied, budget=BUDGET, seed=2, num_workers=2)
    got = keys_of(loader)
    return got, log.read_text().splitlines() if log.exists() else []


def test_forked_workers_sign_with_the_service_descriptions_their_parent_loaded(s3_data, proxy, tmp_path, monkeypatch):
    """A worker's S3 client that signs its URLs (50-100 ms of CPU to make, most of it parsing botocore's JSON
    service descriptions) shares what the loader's own client parsed: the workers read no data file, sign their
    requests and yield the batches of local disk. The control, nothing kept: each worker reads them again."""
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2, num_workers=2))
    got, reads = _worker_file_reads(s3_data, tmp_path / "kept.txt", monkeypatch, keep=True)
    assert got == local and shard_gets(proxy) and all(presigned(r) for r in shard_gets(proxy))
    assert reads == []
    got, reads = _worker_file_reads(s3_data, tmp_path / "none.txt", monkeypatch, keep=False)
    assert got == local
    assert len({line.split()[0] for line in reads if "/s3/" in line}) == 2, reads  # each worker parsed S3's


def test_forked_workers_sign_with_the_profile_the_options_name(s3_data, proxy, tmp_path, monkeypatch):
    """Credentials from a named profile only: the workers' signing sessions (made with the kept loader) honour
    ``profile`` as s3fs's own would, so every shard request is presigned with the profile's key."""
    creds = tmp_path / "credentials"
    creds.write_text("[sb]\naws_access_key_id = fromprofile\naws_secret_access_key = s\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setattr(s3_direct, "_KEPT_LOADER", None)
    options = {"profile": "sb", "client_kwargs": {"endpoint_url": s3_data.proxy_url}}
    local = keys_of(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2, num_workers=2))
    got = keys_of(StreamBatchLoader(s3_data.url, storage_options=options, budget=BUDGET, seed=2, num_workers=2))
    assert got == local and s3_direct._KEPT_LOADER is not None
    gets = shard_gets(proxy)
    assert gets and all(presigned(r) and "fromprofile" in r[1] for r in gets), gets[:2]


TRICKLE_BODY = bytes(range(256)) * (3 << 12)


def _trickle(h) -> None:
    """``/big``: 3 MiB sent in 48 pieces of 64 KiB with a pause between them (many arrivals per answer);
    ``/stall``: the headers and 1,000 of its 3 MiB, then nothing until the server stops."""
    import time

    h.send_response(200)
    h.send_header("Content-Length", str(len(TRICKLE_BODY)))
    h.end_headers()
    if h.path == "/stall":
        h.wfile.write(TRICKLE_BODY[:1000])
        h.wfile.flush()
        h.server.released.wait(30)
        h.close_connection = True
        return
    for i in range(0, len(TRICKLE_BODY), 1 << 16):
        h.wfile.write(TRICKLE_BODY[i : i + (1 << 16)])
        h.wfile.flush()
        time.sleep(0.002)


@pytest.mark.skipif(not s3_direct._WAITALL, reason="the kernel-side wait is Linux's")
def test_a_plain_http_body_is_received_in_few_calls_and_its_connection_reused(monkeypatch):
    """A plain-HTTP answer arriving in 48 pieces is received in a few calls that wait in the kernel (each return
    from one is a return to the GIL the training loop pays for), whole and in order, and its connection serves
    the next request."""
    import socket

    import urllib3

    calls: list[int] = []
    receive = socket.socket.recv_into

    def counted(self, buffer, nbytes=0, flags=0):
        calls.append(flags)
        return receive(self, buffer, nbytes, flags)

    monkeypatch.setattr(socket.socket, "recv_into", counted)
    pool = urllib3.PoolManager(maxsize=1, retries=False)
    with _Loopback(_trickle) as url:
        for _ in range(2):
            sink: list = []
            resp = pool.request("GET", f"{url}/big", preload_content=False, timeout=urllib3.Timeout(read=10))
            s3_direct._body(resp, 0, len(TRICKLE_BODY), sink)
            assert len(sink) == 1 and bytes(sink[0]) == TRICKLE_BODY
        assert len(calls) <= 12, calls  # per answer: headers, what followed them, the rest at once, the last byte
        assert calls.count(socket.MSG_WAITALL) >= 2
        assert pool.connection_from_url(url).num_connections == 1  # the second answer came on the first's connection


@pytest.mark.skipif(not s3_direct._WAITALL, reason="the kernel-side wait is Linux's")
def test_a_plain_http_body_that_stalls_times_out_with_what_arrived():
    """An answer that stops arriving is a transient error after the read timeout, not a wait without end, with the
    bytes that did arrive in the sink for the retry to resume after."""
    import time

    import urllib3

    from streambatch.io.retry import is_transient

    pool = urllib3.PoolManager(maxsize=1, retries=False)
    with _Loopback(_trickle) as url:
        resp = pool.request("GET", f"{url}/stall", preload_content=False, timeout=urllib3.Timeout(read=0.5))
        sink: list = []
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:  # noqa: B017 - the class is the socket's; that it is transient is ours
            s3_direct._body(resp, 0, len(TRICKLE_BODY), sink)
        assert time.monotonic() - t0 < 10 and is_transient(e.value)
        assert b"".join(sink) == TRICKLE_BODY[:1000]
