"""The node cache (``cache_dir``) when the cache, not the data, is what fails: eviction racing the read-ahead, a
full disk, a cache deleted or read-only. None of these is a shard's fault: no shard goes bad, no sample is lost,
and the batches are the ones local disk gives. Also: the advice ``TooManyBadShards`` gives follows what the bad
shards' errors were (the store's, or the data's).

Real shards on a loopback S3 server (conftest_s3.py); a full disk is a small tmpfs mounted for the test (root
only, else skipped) or an injected ``EDQUOT``."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess

import pytest
import torch
from conftest import error_of
from faultproxy import Rule

from streambatch import OptionError, ShardIndex, StreamBatchLoader
from streambatch.errors import ChecksumMismatch, RetriesExhausted, ShardReadError
from streambatch.io.cache import ShardCache
from streambatch.read import fetch
from streambatch.read.faults import FaultLog, TooManyBadShards

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR
FAST = dict(backoff=0.001, chunk_size="16K", timeout=5)


def run(loader, hook=None):
    out = []
    for b in loader:
        out.append(b)
        if hook is not None:
            hook(len(out))
    return out


def same(a, b):
    assert [x["keys"] for x in a] == [x["keys"] for x in b]
    for x, y in zip(a, b):
        assert torch.equal(x["audio"], y["audio"]) and torch.equal(x["lengths"], y["lengths"])


@pytest.fixture(scope="module")
def local_batches(s3_data):
    return {nw: run(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7, num_workers=nw)) for nw in (0, 2)}


@pytest.fixture(scope="module")
def largest(s3_data):
    return max(s.bytes for s in ShardIndex.load(s3_data.local).shards)


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(bytes) -> folder``: a tmpfs of that size, unmounted after the test (root only, else skipped)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[str] = []

    def mount(size: int) -> str:
        path = str(tmp_path / f"mnt{len(mounted)}")
        os.makedirs(path)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", path], check=False)


def fill(folder: str) -> None:
    """Write a file into ``folder`` until its disk is full."""
    with open(os.path.join(folder, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def cached_loader(s3_data, cache, num_workers=0, **kw):
    return StreamBatchLoader(
        s3_data.url,
        storage_options=s3_data.options,
        budget=BUDGET,
        seed=7,
        num_workers=num_workers,
        cache_dir=cache,
        **{**FAST, **kw},
    )


def warnings_of(caplog, words):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and words in r.getMessage()]


# ---- eviction and the read-ahead ----------------------------------------------------------------------------------
def test_a_shard_handed_out_stays_readable_when_evicted(tmp_path):
    c = ShardCache(str(tmp_path / "c"), 1000)
    f, downloaded = c.open("s3://b/a.tar", 600, lambda tmp: open(tmp, "wb").write(b"a" * 600))
    assert downloaded
    c.open("s3://b/b.tar", 600, lambda tmp: open(tmp, "wb").write(b"b" * 600))[0].close()  # evicts a.tar
    assert c.lookup("s3://b/a.tar", 600) is None
    with f:
        assert f.read() == b"a" * 600  # still whole: it was opened before anyone could evict it
    g, downloaded = c.open("s3://b/a.tar", 600, lambda tmp: open(tmp, "wb").write(b"a" * 600))
    with g:  # gone from the cache: fetched again
        assert downloaded and g.read() == b"a" * 600


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cache_smaller_than_the_shards_read_ahead_reads_them_all(
    s3_data, tmp_path, local_batches, largest, num_workers
):
    """Each lane prepares up to two shards ahead of the one it parses; a cache too small to hold them all evicts
    prepared shards before they are opened. They are read all the same (the cache holds more than cache_size on
    disk until they are closed)."""
    cache = str(tmp_path / "cache")
    loader = cached_loader(s3_data, cache, num_workers, interleave=2, cache_size=int(largest * 1.2))
    same(run(loader), local_batches[num_workers])
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0 and stats["cache_downloads"] >= 8


def test_shards_larger_than_cache_size_are_read_around_the_cache(s3_data, tmp_path, local_batches, largest, caplog):
    """A shard the whole cache cannot hold was a bad shard ("could not cache the shard"): two of them ended the
    epoch. It is read from storage as without a cache, warned once; the shards that fit are cached."""
    smallest = min(s.bytes for s in ShardIndex.load(s3_data.local).shards)
    assert smallest < largest
    loader = cached_loader(s3_data, str(tmp_path / "cache"), interleave=1, cache_size=smallest)
    with caplog.at_level(logging.WARNING, logger="streambatch"):
        same(run(loader), local_batches[0])
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0 and stats["cache_bypassed"] > 0 and stats["cache_downloads"] > 0, stats
    warned = warnings_of(caplog, f"do not fit cache_size={smallest}")
    assert len(warned) == 1 and "raise cache_size" in warned[0].getMessage()


# ---- a cache that cannot store shards ----------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_full_cache_disk_reads_the_shards_from_storage(s3_data, tmpfs, local_batches, largest, caplog, num_workers):
    cache = os.path.join(tmpfs(int(largest * 2.5)), "cache")  # room for two shards, no cache_size
    loader = cached_loader(s3_data, cache, num_workers)
    same(run(loader), local_batches[num_workers])
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0 and stats["lost_samples"] == 0
    assert stats["cache_downloads"] >= 1 and stats["cache_bypassed"] >= 1
    if num_workers == 0:  # (a worker's log goes to its own stderr)
        (warned,) = warnings_of(caplog, "cannot store shards")
        assert cache in warned.getMessage() and "No space left on device" in warned.getMessage()


def test_a_cache_disk_filled_mid_run_reads_the_rest_from_storage(s3_data, tmpfs, local_batches, largest):
    folder = tmpfs(largest * 20)
    # a shard at a time, in the plain order (a balanced order forms two rounds of batches before the first leaves,
    # reading further ahead): most shards are read after the first batch
    one_at_a_time = {"interleave": 1, "step_balance": None}
    loader = cached_loader(s3_data, os.path.join(folder, "cache"), **one_at_a_time)
    local = run(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7, **one_at_a_time))
    same(run(loader, hook=lambda n: n == 1 and fill(folder)), local)
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0 and stats["cache_bypassed"] >= 1


def remove(folder: str) -> None:
    """``rm -r folder``, at once for the processes using it (moved away, then deleted)."""
    os.rename(folder, folder + ".gone")
    shutil.rmtree(folder + ".gone", ignore_errors=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cache_deleted_mid_run_is_made_again(s3_data, tmp_path, num_workers):
    """The cache folder deleted after the first batch: the pass and the next one (whose workers start after the
    deletion, and find neither the shards nor the node copy of the index the loader opened) yield the batches
    local disk gives, and the shards are kept in the folders made again."""
    cache = str(tmp_path / "cache")
    # a shard at a time, on demand, in the plain order: most shards are read after the first batch
    one_at_a_time = {"interleave": 1, "step_balance": None, "read_ahead": 0}
    loader = cached_loader(s3_data, cache, num_workers, **one_at_a_time)
    local = StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7, num_workers=num_workers, **one_at_a_time)
    for epoch in (0, 1):  # a full pass moves both loaders to the next epoch
        same(run(loader, hook=lambda n, e=epoch: e == 0 and n == 1 and remove(cache)), run(local))
        assert loader.fault_stats()["bad_shards"] == 0
    assert os.listdir(os.path.join(cache, "objects"))  # the folders were made again, and shards kept in them


def test_a_cache_over_quota_is_read_around_and_warned_once(s3_data, tmp_path, local_batches, caplog, monkeypatch):
    def over_quota(self, job, tmp):
        with open(tmp, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), tmp)

    monkeypatch.setattr(fetch._Cached, "_download", over_quota)
    cache = str(tmp_path / "cache")
    loader = cached_loader(s3_data, cache)
    same(run(loader), local_batches[0])
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0 and stats["cache_downloads"] == 0 and stats["cache_bypassed"] >= 8
    (warned,) = warnings_of(caplog, "cannot store shards")
    assert cache in warned.getMessage() and "EDQUOT" in warned.getMessage()
    assert not [f for f in os.listdir(os.path.join(cache, "objects"))]  # no half-written download left


# ---- a cache_dir that cannot be written at all -------------------------------------------------------------------
@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process cannot write: a tmpfs mounted read-only (root), or one without write permission."""
    path = str(tmp_path / "ro")
    os.makedirs(path)
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        yield path
        os.chmod(path, 0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", path], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", path], check=False)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_read_only_cache_dir_is_an_option_error(s3_data, read_only_folder, where):
    source = s3_data.url if where == "s3" else s3_data.local
    for cache in (read_only_folder, os.path.join(read_only_folder, "cache")):
        kind, message = error_of(
            lambda c=cache: StreamBatchLoader(source, storage_options=s3_data.options, budget=BUDGET, cache_dir=c)
        )
        assert kind is OptionError and issubclass(kind, ValueError)
        assert message.startswith(f"cache_dir={cache!r} cannot be written: ") and "\n" not in message
        assert "read-only file system" in message or "permission denied" in message


def test_no_room_for_the_index_copy_reads_the_index_from_the_store(s3_data, tmpfs, local_batches, caplog):
    folder = tmpfs(256 << 10)
    os.makedirs(os.path.join(folder, "cache", "locks"))
    fill(folder)
    loader = cached_loader(s3_data, os.path.join(folder, "cache"))
    assert warnings_of(caplog, "no room for the node copy of the index")
    same(run(loader), local_batches[0])
    assert loader.fault_stats()["bad_shards"] == 0


# ---- the advice on too many bad shards ---------------------------------------------------------------------------
STORE = "The store did not answer or refused"


@pytest.mark.parametrize(
    "rule",
    [
        Rule("error", match=".tar", status=503, methods=("GET", "HEAD")),  # down for good: every retry fails
        Rule("error", match=".tar", status=403, code="AccessDenied", methods=("GET", "HEAD")),  # refused
    ],
    ids=["down", "refused"],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_store_that_fails_is_not_blamed_on_the_data(s3_data, proxy, rule, num_workers):
    proxy.reset(rule)
    loader = StreamBatchLoader(
        s3_data.url,
        storage_options=s3_data.proxied,
        budget=BUDGET,
        seed=7,
        num_workers=num_workers,
        retries=1,
        max_bad_shards=0,
        **FAST,
    )
    kind, message = error_of(lambda: run(loader))
    assert issubclass(kind, ShardReadError)  # the first bad shard ends the pass (max_bad_shards=0)
    assert STORE in message and "credentials" in message and "shardify verify" not in message


def test_data_that_does_not_match_the_index_keeps_the_verify_advice(s3_data, proxy):
    ix = ShardIndex.load(s3_data.local)
    proxy.reset(Rule("truncate", match="shard-000001.tar", size=ix.shards[1].bytes // 3, methods=("GET", "HEAD")))
    loader = StreamBatchLoader(
        s3_data.url, storage_options=s3_data.proxied, budget=BUDGET, seed=7, max_bad_shards=0, **FAST
    )
    kind, message = error_of(lambda: run(loader))
    assert issubclass(kind, ShardReadError)
    assert "Check the data with `shardify verify`" in message and STORE not in message


def test_the_advice_names_both_kinds_when_both_failed():
    faults = FaultLog(max_bad_shards=1)
    try:
        raise ShardReadError("s3://b/a.tar: bytes 0-9 failed 9 times") from RetriesExhausted("GET", 9, TimeoutError())
    except ShardReadError as e:
        faults.bad_shard(0, "s3://b/a.tar", str(e))  # the error being handled is the one judged
    with pytest.raises(TooManyBadShards) as got:
        faults.bad_shard(1, "s3://b/b.tar", "sha256 differs", ChecksumMismatch("s3://b/b.tar: sha256 differs"))
    message = str(got.value)
    assert "1 of them failed in the store" in message and "1 in the data" in message and "shardify verify" in message
    assert faults.total("bad_shards_storage") == 1
