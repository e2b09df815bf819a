"""verify="sha256" hashes a remote shard streamed without a cache once per node: its bytes are fetched every pass,
but a later pass, process or loader whose range answers name the version of the object this node already hashed
takes that hash; an object rewritten in the bucket names another version and is hashed again (and counted bad
if it no longer matches the index); answers naming different versions within one read are refused. Against the
real S3-compatible server on loopback."""

from __future__ import annotations

import uuid

import pytest

from streambatch import StreamBatchLoader
from streambatch.errors import ShardReadError
from streambatch.io import objstore, ranges, verified
from streambatch.io.retry import RetryPolicy

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR


@pytest.fixture
def remote(s3_data, tmp_path, monkeypatch):
    """A dataset of this test's own in the bucket (it rewrites an object), and a node record of its own."""
    from conftest_s3 import BUCKET, s3_options

    from streambatch.write.writer import write_shards

    monkeypatch.setenv(verified.RECORD_ENV, str(tmp_path / "record"))
    verified.forget_in_process()
    url = f"s3://{BUCKET}/verify-once-{uuid.uuid4().hex[:8]}"
    write_shards(s3_data.audio, url, storage_options=s3_options(s3_data.endpoint), max_count=10, seed=2, progress=False)
    yield url, s3_options(s3_data.endpoint)
    verified.forget_in_process()


def one_pass(url: str, options: dict) -> tuple[list, dict]:
    loader = StreamBatchLoader(url, storage_options=options, budget=BUDGET, seed=4, interleave=1, max_bad_shards=2)
    keys = sorted(k for b in loader for k in b["keys"])
    return keys, loader.fault_stats()


def test_each_remote_shard_is_hashed_once_per_node(remote):
    url, options = remote
    keys, first = one_pass(url, options)
    # every shard is checked in the pass that read it (the last one read to its end once the last batch is out)
    assert len(keys) == 80 and first["sha256_reused"] == 0 and first["sha256_hashed"] == 8
    verified.forget_in_process()  # another process of the node sees only the node record
    again, second = one_pass(url, options)
    assert again == keys and second["bad_shards"] == 0
    assert (second["sha256_hashed"], second["sha256_reused"]) == (0, 8)


def test_a_rewritten_object_is_hashed_again_and_counted_bad(remote):
    import s3fs

    url, options = remote
    one_pass(url, options)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    shard = url[len("s3://") :] + "/shard-000001.tar"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x55  # a payload byte: same size, another sha256, every header intact
    fs.pipe_file(shard, bytes(data))
    verified.forget_in_process()
    _, stats = one_pass(url, options)
    assert stats["bad_shard_urls"] == [f"s3://{shard}"]  # its new version was hashed, not taken from the record


def test_answers_naming_two_versions_are_refused(monkeypatch):
    """A read that breaks and resumes on a rewritten object: the resumed answer names another version, so the
    bytes before and after the break are of different objects."""
    import threading

    answers = iter([("abc", '"etag-1"@100'), ("def", '"etag-2"@200')])

    def fake(store, path, url, start, end, sink, heard):
        data, version = next(answers)
        heard.append(version)
        sink.append(data.encode())
        if version.startswith('"etag-1"'):
            raise ConnectionResetError("cut")  # a transient break after three bytes
        return None

    monkeypatch.setattr(objstore, "read_range", fake)  # the store's answers, which this test stands in for
    monkeypatch.setattr(objstore, "store_for", lambda url, opts, timeout=None: (None, url))
    reader = ranges.RangeReader(None, RetryPolicy(retries=2, backoff=0), "sha256", lambda *a: None, threading.Event())
    with pytest.raises(ShardReadError, match="changed while it was read"):
        reader.read_versioned("s3://b/x.tar", 0, 6, None)
