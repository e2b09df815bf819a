"""Faults between the loader and its storage: transient ones change nothing, permanent ones cost exactly the
broken shard (skipped, logged, counted) and never the equal number of steps; nothing hangs.

Faults come from our proxy (tests/faultproxy.py) in front of a loopback S3 server, or from damaged local
files. The node-local cache downloads each shard once per node."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import shutil
import time

import pytest
import torch
from faultproxy import Rule, times_read

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.io.cache import ShardCache, cache_name
from streambatch.io.retry import RetriesExhausted, RetryPolicy, call_with_retry, is_transient
from streambatch.plan.shards import Piece
from streambatch.read.faults import FaultLog, TooManyBadShards
from streambatch.read.reader import ReadOptions, read_pieces, read_shard

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR
FAST = dict(backoff=0.001, chunk_size="16K")  # quick retries, many range requests per shard


def run(loader):
    return [b for b in loader]


def keys_of(batches):
    return [k for b in batches for k in b["keys"]]


def same(a, b):
    assert [x["keys"] for x in a] == [x["keys"] for x in b]
    for x, y in zip(a, b):
        assert torch.equal(x["audio"], y["audio"]) and torch.equal(x["lengths"], y["lengths"])


def shard_keys(path: str) -> list[str]:
    return [s["__key__"] for s in read_shard(path)]


@pytest.fixture(scope="module")
def local_batches(s3_data):
    return {nw: run(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7, num_workers=nw)) for nw in (0, 2)}


def check_budget_and_steps(loader, batches):
    assert len(batches) == len(loader)  # equal steps: the planned number of batches, faults or not
    for b in batches:
        B, T = b["audio"].shape
        assert B * T <= BUDGET
        assert len(set(b["keys"])) == B


# ---- transient faults: exactly the same batches -----------------------------------------------------
@pytest.mark.parametrize("num_workers,read_ahead,chunk_size", [(0, "64M", "16K"), (2, "64K", "16K"), (0, 0, "64K")])
def test_transient_faults_give_the_same_batches(s3_data, proxy, local_batches, num_workers, read_ahead, chunk_size):
    proxy.reset(
        Rule("latency", seconds=0.002, methods=("GET", "HEAD")),
        Rule("error", match=".tar", every=5),  # 503 SlowDown
        Rule("error", match=".tar", every=3, methods=("HEAD",), status=500),
        Rule("drop", match=".tar", every=4, drop_after=3000),  # connection closed after 3000 bytes
        Rule("drop", match=".tar", every=7, drop_after=100, reset=True),  # connection reset
    )
    loader = StreamBatchLoader(
        s3_data.url,
        storage_options=s3_data.proxied,
        budget=BUDGET,
        seed=7,
        num_workers=num_workers,
        read_ahead=read_ahead,
        backoff=0.001,
        chunk_size=chunk_size,
    )
    same(run(loader), local_batches[num_workers])
    st = loader.fault_stats()
    assert st["bad_shards"] == st["lost_samples"] == st["redrawn_samples"] == 0
    assert st["retries"] > 0


def test_every_request_broken_still_completes(s3_data, proxy, local_batches):
    """Every GET is cut after 6000 bytes: each retry continues at the byte where the last one broke."""
    proxy.reset(Rule("drop", match=".tar", drop_after=6000))
    loader = StreamBatchLoader(
        s3_data.url, storage_options=s3_data.proxied, budget=BUDGET, seed=7, backoff=0.0, chunk_size="32K"
    )
    same(run(loader), local_batches[0])
    assert loader.fault_stats()["retries"] >= sum(s.bytes for s in loader.index.shards) // 32768


def test_retry_classification():
    import errno

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(errno.EBUSY, "Please reduce your request rate."))  # s3fs's 503 SlowDown
    assert not is_transient(FileNotFoundError("gone"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(ValueError("bad"))
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert call_with_retry(flaky, RetryPolicy(retries=3, backoff=0), "x") == "ok" and len(calls) == 3
    with pytest.raises(RetriesExhausted, match="failed 2 times"):
        call_with_retry(lambda: (_ for _ in ()).throw(TimeoutError("t")), RetryPolicy(retries=1, backoff=0), "x")
    delays = [RetryPolicy(backoff=1, max_backoff=5).delay(i) for i in range(10)]
    assert all(0 <= d <= 5 for d in delays)


# ---- permanent faults: exactly the broken shard, equal steps ----------------------------------------------
def _bad_shard_case(s3_data, proxy, rule_for, shard, **kw):
    ix = ShardIndex.load(s3_data.local)
    proxy.reset(rule_for(f"shard-{shard:06d}.tar", ix.shards[shard].bytes))
    loader = StreamBatchLoader(
        s3_data.url, storage_options=s3_data.proxied, budget=BUDGET, seed=7, retries=2, max_bad_shards=2, **FAST, **kw
    )
    batches = run(loader)
    check_budget_and_steps(loader, batches)
    st = loader.fault_stats()
    assert st["bad_shards"] == 1 and st["bad_shard_urls"] == [f"{s3_data.url}/shard-{shard:06d}.tar"]
    keys = keys_of(batches)
    everything = set(keys_of(run(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7))))
    broken = set(shard_keys(os.path.join(s3_data.local, f"shard-{shard:06d}.tar")))
    assert set(keys) <= everything
    assert everything - broken <= set(keys)  # nothing but the broken shard's samples is missing
    assert len(keys) - len(set(keys)) == st["redrawn_samples"]  # re-draws are the only repeats
    return st, set(keys) & broken, broken


def test_truncated_object_is_skipped_and_counted(s3_data, proxy):
    st, got, broken = _bad_shard_case(
        s3_data, proxy, lambda m, n: Rule("truncate", match=m, size=n // 2, methods=("GET", "HEAD")), 3
    )
    assert not got  # the size check rejects it before a sample is emitted
    assert st["lost_samples"] == len(broken)
    assert st["redrawn_samples"] + st["shrunk_batches"] > 0


def test_shard_breaking_for_good_half_way(s3_data, proxy):
    """The connection to one shard breaks for good past its middle: its first samples arrive, the rest
    are lost and re-drawn; the run goes on."""
    st, got, broken = _bad_shard_case(
        s3_data, proxy, lambda m, n: Rule("drop", match=m, drop_after=0, min_offset=n // 2), 5
    )
    assert 0 < len(got) < len(broken)
    assert st["lost_samples"] == len(broken) - len(got)


def test_stalled_server_times_out(s3_data, proxy):
    t = time.monotonic()
    st, got, broken = _bad_shard_case(
        s3_data, proxy, lambda m, n: Rule("stall", match=m, seconds=4, methods=("GET", "HEAD")), 1, timeout=0.3
    )
    assert time.monotonic() - t < 30


def test_bad_shard_on_one_rank_keeps_equal_steps(s3_data, proxy):
    ix = ShardIndex.load(s3_data.local)
    proxy.reset(Rule("truncate", match="shard-000002.tar", size=ix.shards[2].bytes - 1, methods=("GET", "HEAD")))
    counts = []
    for rank in range(2):
        loader = StreamBatchLoader(
            s3_data.url,
            storage_options=s3_data.proxied,
            budget=BUDGET,
            seed=7,
            rank=rank,
            world_size=2,
            max_bad_shards=2,
            **FAST,
        )
        batches = run(loader)
        check_budget_and_steps(loader, batches)
        counts.append(len(batches))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_too_many_bad_shards_is_a_clear_error(s3_data, proxy, num_workers):
    ix = ShardIndex.load(s3_data.local)
    proxy.reset(
        *[
            Rule("truncate", match=f"shard-00000{i}.tar", size=ix.shards[i].bytes // 3, methods=("GET", "HEAD"))
            for i in (1, 4)
        ]
    )
    loader = StreamBatchLoader(
        s3_data.url,
        storage_options=s3_data.proxied,
        budget=BUDGET,
        seed=7,
        num_workers=num_workers,
        max_bad_shards=1,
        **FAST,
    )
    kind, message = error_of(lambda: run(loader))
    assert kind is TooManyBadShards
    assert re.search(r"max_bad_shards=\d.*shard-00000[14]\.tar", message)


def error_of(fn):
    """(type, message) of what ``fn()`` raises. Unlike pytest.raises this keeps no traceback, so a DataLoader
    iterator that the error passed through is released (and its workers shut down) right away."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, ""


# ---- damaged local files --------------------------------------------------------------------------------
@pytest.fixture
def damaged(s3_data, tmp_path):
    """A copy of the local dataset to damage."""
    out = tmp_path / "ds"
    shutil.copytree(s3_data.local, out)
    return str(out)


def _member_offsets(path):
    import tarfile

    with tarfile.open(path) as t:
        return [(m.name, m.offset, m.offset_data, m.size) for m in t.getmembers()]


def test_corrupt_member_header(damaged):
    path = os.path.join(damaged, "shard-000004.tar")
    members = _member_offsets(path)
    name, off, _, _ = members[len(members) // 2]
    with open(path, "r+b") as f:  # garbage in a tar header half way: its checksum fails
        f.seek(off + 100)
        f.write(b"\xff" * 8)
    loader = StreamBatchLoader(damaged, budget=BUDGET, seed=7, max_bad_shards=2)
    batches = run(loader)
    check_budget_and_steps(loader, batches)
    st = loader.fault_stats()
    assert st["bad_shard_urls"] == [path] and st["lost_samples"] > 0


def test_checksum_mismatch_found_after_reading(damaged, caplog):
    path = os.path.join(damaged, "shard-000006.tar")
    with open(path, "r+b") as f:  # a byte of the closing zero blocks: a valid tar, same size, another sha256
        f.seek(-100, os.SEEK_END)
        f.write(b"\x01")
    loader = StreamBatchLoader(damaged, budget=BUDGET, seed=7, max_bad_shards=2)
    with caplog.at_level(logging.INFO, logger="streambatch"):  # each skipped shard's cause: INFO
        batches = run(loader)
    check_budget_and_steps(loader, batches)
    assert loader.fault_stats()["bad_shard_urls"] == [path]
    assert "sha256" in caplog.text
    # verify="none" trusts the bytes: nothing is reported
    loader = StreamBatchLoader(damaged, budget=BUDGET, seed=7, verify="none")
    assert [b["keys"] for b in run(loader)] == [
        b["keys"] for b in run(StreamBatchLoader(damaged, budget=BUDGET, seed=7, verify="size"))
    ]
    assert loader.fault_stats()["bad_shards"] == 0


def test_undecodable_member(damaged):
    path = os.path.join(damaged, "shard-000006.tar")
    name, _, data, size = next(m for m in _member_offsets(path) if m[0].endswith(".flac"))
    with open(path, "r+b") as f:  # garbage in the middle of one FLAC payload
        f.seek(data + size // 2)
        f.write(os.urandom(64))
    for verify in ("sha256", "none"):
        loader = StreamBatchLoader(damaged, budget=BUDGET, seed=7, verify=verify, max_bad_shards=2)
        batches = run(loader)
        check_budget_and_steps(loader, batches)
        st = loader.fault_stats()
        assert st["bad_shard_urls"] == [path] and st["bad_shards"] == 1


def test_missing_shard(damaged):
    os.remove(os.path.join(damaged, "shard-000000.tar"))
    loader = StreamBatchLoader(damaged, budget=BUDGET, seed=7, num_workers=2, max_bad_shards=2)
    batches = run(loader)
    check_budget_and_steps(loader, batches)
    assert loader.fault_stats()["bad_shards"] == 1


# ---- node-local cache ---------------------------------------------------------------------------------
def test_cache_downloads_each_shard_once(s3_data, proxy, tmp_path, local_batches):
    cache = str(tmp_path / "cache")
    kw = dict(storage_options=s3_data.proxied, budget=BUDGET, seed=7, cache_dir=cache, **FAST)
    first = StreamBatchLoader(s3_data.url, num_workers=2, **kw)
    same(run(first), local_batches[2])
    ix = ShardIndex.load(s3_data.local)
    for i, info in enumerate(ix.shards):  # every byte of every shard fetched once (a resent range aside)
        assert times_read(proxy.gets(f"shard-{i:06d}.tar"), info.bytes) == 1
    assert first.fault_stats()["cache_downloads"] == ix.num_shards
    proxy.reset()
    again = StreamBatchLoader(s3_data.url, **kw)
    same(run(again), local_batches[0])
    assert proxy.gets(".tar") == [] and again.fault_stats()["cache_hits"] == ix.num_shards


def test_times_read_counts_downloads_not_requests():
    """The measure the cache tests use: a range resent or resumed is not another read, a second download is."""

    def get(rng, status=206):
        return ("GET", "/sb-test/ds/shard-000000.tar", rng, status)

    once = [get("bytes=0-9"), get("bytes=10-19")]
    assert times_read(once, 20) == 1
    assert times_read([*once, get("bytes=10-19"), get("bytes=15-19")], 20) == 1
    assert times_read(once * 2, 20) == 2 and times_read([get(None, 200), *once], 20) == 2
    assert times_read([get("bytes=0-9"), get("bytes=10-19", 503)], 20) == 0  # bytes 10-19 never arrived


def _read_through_cache(args):
    url, opts, cache, info_bytes, info_sha = args
    from types import SimpleNamespace

    ro = ReadOptions(chunk_size=16384, cache_dir=cache, backoff=0.001)
    shards = [SimpleNamespace(bytes=info_bytes, sha256=info_sha)]
    faults = FaultLog()
    keys = [s["__key__"] for s in read_pieces([url], [Piece(0, 0, 1 << 62)], opts, ro, shards, faults)]
    return keys, faults.total("cache_downloads"), faults.total("cache_hits")


def test_cache_one_download_per_node_across_processes(s3_data, proxy, tmp_path):
    ix = ShardIndex.load(s3_data.local)
    proxy.reset(Rule("latency", seconds=0.01))  # slow enough that the processes overlap
    url = f"{s3_data.url}/shard-000002.tar"
    args = (url, s3_data.proxied, str(tmp_path / "cache"), ix.shards[2].bytes, ix.shards[2].sha256)
    with mp.get_context("spawn").Pool(3) as pool:
        results = pool.map(_read_through_cache, [args] * 3)
    keys = [r[0] for r in results]
    assert keys[0] == keys[1] == keys[2] == shard_keys(os.path.join(s3_data.local, "shard-000002.tar"))
    # the promise: one download per node (the others read the cached copy), every byte fetched once (the
    # number of GETs is not: a transport resends a range after a broken pipe)
    assert sum(r[1] for r in results) == 1 and sum(r[2] for r in results) == 2
    assert times_read(proxy.gets("shard-000002.tar"), ix.shards[2].bytes) == 1


def test_cache_lru_eviction_keeps_the_limit(s3_data, tmp_path, local_batches):
    ix = ShardIndex.load(s3_data.local)
    limit = int(max(s.bytes for s in ix.shards) * 2.5)
    cache = str(tmp_path / "cache")
    opts = dict(storage_options=s3_data.options, budget=BUDGET, seed=7, cache_dir=cache, cache_size=limit, **FAST)
    # one stream per worker: the limit holds beyond the shards a worker reads at once (interleave of them)
    loader = StreamBatchLoader(s3_data.url, interleave=1, **opts)
    same(run(loader), [b for b in StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7, interleave=1)])
    c = ShardCache(cache, limit)
    assert 0 < c.usage() <= limit and len(c.entries()) < ix.num_shards


def test_downloads_in_progress_count_at_their_full_size(tmp_path):
    """Two downloads at once: the second makes room for the first one's whole size, not for the few bytes it has
    written so far, so the cache keeps its limit once both are done."""
    import threading

    c = ShardCache(str(tmp_path / "c"), 1300)
    c.get("s3://b/old.tar", 600, lambda tmp: open(tmp, "wb").write(b"o" * 600))
    started, go_on = threading.Event(), threading.Event()

    def slow(tmp):
        with open(tmp, "wb") as f:
            f.write(b"s" * 10)
            f.flush()
            started.set()
            go_on.wait(10)
            f.write(b"s" * 590)

    t = threading.Thread(target=c.get, args=("s3://b/slow.tar", 600, slow))
    t.start()
    assert started.wait(10)
    c.get("s3://b/new.tar", 300, lambda tmp: open(tmp, "wb").write(b"n" * 300))
    go_on.set()
    t.join(10)
    assert c.usage() <= 1300
    assert c.lookup("s3://b/old.tar", 600) is None  # the least recently used made room


def test_cache_cleans_up_after_killed_downloads(tmp_path):
    c = ShardCache(str(tmp_path / "c"))
    dead = os.path.join(c.objects, f".{cache_name('s3://b/x.tar')}.tmp-1f-deadbeef")
    live = os.path.join(c.objects, f".{cache_name('s3://b/y.tar')}.tmp-2f-cafecafe")
    for p in (dead, live):
        open(p, "wb").write(b"partial")
    import fcntl

    with open(c._lock_path(cache_name("s3://b/y.tar")), "w") as held:  # a download still running
        fcntl.flock(held, fcntl.LOCK_EX)
        assert c.sweep() == 1
        assert not os.path.exists(dead) and os.path.exists(live)

    # a download that dies leaves nothing behind, and the next one works
    def boom(tmp):
        open(tmp, "wb").write(b"half")
        raise ConnectionError("killed")

    with pytest.raises(ConnectionError):
        c.get("s3://b/z.tar", 4, boom)
    assert [f for f in os.listdir(c.objects) if "z.tar" in f] == []
    path, fresh = c.get("s3://b/z.tar", 4, lambda tmp: open(tmp, "wb").write(b"full"))
    assert fresh and open(path, "rb").read() == b"full"
    assert c.get("s3://b/z.tar", 4, lambda tmp: 1 / 0) == (path, False)
