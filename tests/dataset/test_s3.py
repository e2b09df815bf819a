"""Object storage end to end against a real S3-compatible server on loopback (moto, see conftest_s3.py):
shardify write to s3:// → verify → stream gives exactly the batches the same data gives from local disk."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from faultproxy import byte_range, times_read

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.io import storage
from streambatch.write.verify import verify_dataset

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR


def batches(loader):
    return [b for b in loader]


def assert_same(a, b):
    assert [x["keys"] for x in a] == [x["keys"] for x in b]
    for x, y in zip(a, b):
        assert torch.equal(x["audio"], y["audio"])
        assert torch.equal(x["lengths"], y["lengths"])
        assert torch.equal(x["padding_mask"], y["padding_mask"])


def test_write_to_s3_then_verify(s3_data):
    ix = ShardIndex.load(s3_data.url, s3_data.options)
    local = ShardIndex.load(s3_data.local)
    assert ix.num_samples == local.num_samples == 80
    assert [s.sha256 for s in ix.shards] == [s.sha256 for s in local.shards]  # the very same bytes
    assert verify_dataset(ix, s3_data.options, progress=False) == []
    names = storage.listdir(s3_data.url, s3_data.options)
    assert "index.json" in names and not [n for n in names if "tmp" in n]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_from_s3_gives_the_local_batches(s3_data, num_workers):
    kw = dict(budget=BUDGET, buffer_size=30, seed=3, num_workers=num_workers)
    local = batches(StreamBatchLoader(s3_data.local, **kw))
    # small chunks: every shard takes many range requests
    loader = StreamBatchLoader(s3_data.url, storage_options=s3_data.options, chunk_size="16K", **kw)
    assert len(loader) == len(local)
    assert_same(batches(loader), local)
    stats = loader.fault_stats()
    assert stats["bad_shards"] == 0  # (retries may happen: a loaded machine breaks a connection now and then)
    assert stats["bytes_read"] >= sum(s.bytes for s in loader.index.shards) * 0.5


@pytest.mark.parametrize("read_ahead", [0, "64K"])
def test_ranged_chunked_reads(s3_data, proxy, read_ahead):
    """Each shard is read once, as range requests of at most chunk_size bytes (after one size request); a
    range resent by the transport or resumed by a retry is not another read."""
    ix = ShardIndex.load(s3_data.url, s3_data.options)
    loader = StreamBatchLoader(
        s3_data.url,
        storage_options=s3_data.proxied,
        chunk_size=32768,
        budget=BUDGET,
        read_ahead=read_ahead,
        shuffle=False,
    )
    assert_same(batches(loader), batches(StreamBatchLoader(s3_data.local, budget=BUDGET, shuffle=False)))
    for i, info in enumerate(ix.shards):
        gets = proxy.gets(f"shard-{i:06d}.tar")
        ranges = {byte_range(rng, info.bytes) for _, _, rng, _ in gets}
        assert all(rng for _, _, rng, _ in gets), "a whole-object GET"
        assert times_read(gets, info.bytes) == 1  # every byte once, none twice
        assert all(hi - lo + 1 <= 32768 for lo, hi in ranges)  # (a worker's first shard starts smaller)
        assert len({hi for _, hi in ranges}) <= math.ceil(info.bytes / 32768) + 3  # chunks, by their last byte


def test_aws_environment_variables(s3_data, monkeypatch):
    """No storage_options: credentials and the endpoint come from the usual AWS variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_data.endpoint)
    loader = StreamBatchLoader(s3_data.url, budget=BUDGET, seed=5)
    assert_same(batches(loader), batches(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=5)))


def test_plain_https_style_urls(s3_data):
    """Any fsspec URL: the same dataset over plain HTTP (moto serves objects without signatures)."""
    import json

    import boto3

    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::sb-test/ds/*"}
        ],
    }
    boto3.client(
        "s3",
        endpoint_url=s3_data.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).put_bucket_policy(Bucket="sb-test", Policy=json.dumps(policy))
    url = f"{s3_data.endpoint}/sb-test/ds"
    loader = StreamBatchLoader(url, budget=BUDGET, seed=2, chunk_size="32K")
    assert_same(batches(loader), batches(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2)))


def test_killed_write_leaves_no_index(s3_data, monkeypatch):
    """Objects appear only complete and the index last: a write that dies half way lists nothing missing."""
    from streambatch.write.writer import write_shards

    real = storage.put_file_atomic
    uploads = []

    def dying(src, url, storage_options=None):
        if len(uploads) == 3:
            raise KeyboardInterrupt("killed")
        uploads.append(url)
        real(src, url, storage_options)

    monkeypatch.setattr(storage, "put_file_atomic", dying)
    out = "s3://sb-test/killed"
    with pytest.raises(KeyboardInterrupt):
        write_shards(
            s3_data.audio, out, max_count=10, shuffle=True, seed=2, progress=False, storage_options=s3_data.options
        )
    monkeypatch.setattr(storage, "put_file_atomic", real)
    names = storage.listdir(out, s3_data.options)
    assert "index.json" not in names
    assert len([n for n in names if n.endswith(".tar")]) == 3
    local = {s.url: s.bytes for s in ShardIndex.load(s3_data.local).shards}
    for n in names:  # every object there is whole (the local write of the same input has the same sizes)
        assert storage.size(f"{out}/{n}", s3_data.options) == local[n]


EARLY_EXIT = """
import sys
from streambatch import StreamBatchLoader
from streambatch.read import fetch, reader, worker  # names a script may hold: they change the teardown order

url, endpoint = sys.argv[1], sys.argv[2]
options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
loader = StreamBatchLoader(url, storage_options=options, budget=%d, buffer_size=30, seed=3, chunk_size="16K")
batches = iter(loader)  # held to the end, as a script's global: it is closed while the modules are torn down
batch = next(batches)  # and exit with the pass open: its readers stand mid-shard
print(len(batch["keys"]))
"""


def test_a_script_that_stops_early_exits_quietly(s3_data, tmp_path):
    """A script that takes one batch and exits while its shards are half read: the streams close before the
    interpreter tears its modules down, so nothing is printed but the script's own output."""
    script = tmp_path / "early.py"
    script.write_text(EARLY_EXIT % BUDGET)
    done = subprocess.run(
        [sys.executable, str(script), s3_data.url, s3_data.endpoint], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 0
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
