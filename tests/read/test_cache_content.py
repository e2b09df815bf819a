"""The node cache (``cache_dir``) is keyed by a shard's content, not its name or size: a dataset rewritten in place
at the same S3 URL (same shard sizes, other transcripts) is read anew by the next job on a warm cache, whether the
index names the shards' sha256 or only the store's version (ETag) tells them apart. And ``cache_size`` holds at rest,
however many of a worker's downloads overlapped, over two datasets.

Real shards on the loopback S3 server of conftest_s3.py."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import pytest

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.plan.shards import Piece
from streambatch.read.faults import FaultLog
from streambatch.read.reader import ReadOptions, read_pieces
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR
FAST = dict(backoff=0.001, chunk_size="16K", timeout=5)


def texts(url, options, cache):
    """{key: transcript} of one pass over the dataset at ``url``, read through the node cache ``cache``."""
    loader = StreamBatchLoader(url, storage_options=options, budget=BUDGET, seed=5, cache_dir=cache, **FAST)
    return {k: t for b in loader for k, t in zip(b["keys"], b["text"])}


def shard_texts(url, options, cache, size, sha256):
    """{key: transcript in the .json member} of the one shard ``url``, read through the node cache ``cache``
    (``sha256``: the index's, or None for an index that names none)."""
    ro = ReadOptions(cache_dir=cache, **FAST)
    shards = [SimpleNamespace(bytes=size, sha256=sha256)]
    samples = read_pieces([url], [Piece(0, 0, 1 << 62)], options, ro, shards, FaultLog())
    return {s["__key__"]: s["json"]["text"] for s in samples}


def folder_bytes(folder):
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(folder) for f in fs)


def test_a_dataset_rewritten_in_place_is_read_anew_on_a_warm_cache(s3_data, tmp_path):
    audio = str(tmp_path / "audio")
    write_audio_corpus(audio, 30, seed=4, sample_rate=SR)
    url = f"s3://sb-test/rewritten-{os.getpid()}"
    kw = dict(storage_options=s3_data.options, max_count=10, seed=1, progress=False)
    write_shards(audio, url, **kw)
    old = ShardIndex.load(url, s3_data.options)
    cache = str(tmp_path / "cache")
    shard = f"{url}/{old.shards[0].url.rsplit('/', 1)[-1]}"
    before = texts(url, s3_data.options, cache)
    by_etag = shard_texts(shard, s3_data.options, cache, old.shards[0].bytes, None)
    assert len(before) == 30 and by_etag

    # the corrected transcripts: the same length, so every member and every shard keeps its size
    for p in glob.glob(os.path.join(audio, "*.txt")):
        with open(p) as f:
            fixed = f.read().upper()
        with open(p, "w") as f:
            f.write(fixed)
    write_shards(audio, url, overwrite=True, **kw)
    new = ShardIndex.load(url, s3_data.options)
    assert [s.bytes for s in new.shards] == [s.bytes for s in old.shards]
    assert [s.sha256 for s in new.shards] != [s.sha256 for s in old.shards]

    # a new job on the warm cache: every transcript in its new form
    assert texts(url, s3_data.options, cache) == {k: t.upper() for k, t in before.items()}
    # an index without sha256: the store's version (ETag) keys the copy
    again = shard_texts(shard, s3_data.options, cache, new.shards[0].bytes, None)
    assert again == {k: t.upper() for k, t in by_etag.items()}


def test_cache_size_holds_at_rest_over_two_datasets(s3_data, tmp_path):
    audio = str(tmp_path / "audio")
    write_audio_corpus(audio, 40, seed=6, sample_rate=SR)
    other = f"s3://sb-test/second-{os.getpid()}"
    write_shards(audio, other, storage_options=s3_data.options, max_count=5, progress=False)
    sizes = [s.bytes for s in ShardIndex.load(s3_data.url, s3_data.options).shards]
    sizes += [s.bytes for s in ShardIndex.load(other, s3_data.options).shards]
    limit = int(max(sizes) * 3.5)  # room for three shards and the node copies of both indexes
    assert sum(sizes) > 2 * limit  # a cache that kept what it downloaded would hold twice its limit
    cache = str(tmp_path / "cache")
    for url in (s3_data.url, other):
        # two workers, each with shards interleaved and read ahead: many downloads overlap
        loader = StreamBatchLoader(
            url,
            storage_options=s3_data.options,
            budget=BUDGET,
            seed=5,
            num_workers=2,
            cache_dir=cache,
            cache_size=limit,
            **FAST,
        )
        assert sum(len(b["keys"]) for b in loader) > 0
        assert folder_bytes(cache) <= limit
