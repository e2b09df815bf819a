"""Index version 2 (header + Parquet tables): upgrade from version 1, lazy and partial length reads, checks
that catch damaged tables, and the same loader plans and batches as version 1."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO, text_dataset

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.format import columnar
from streambatch.format.columnar import ColumnarIndex
from streambatch.format.columnar_write import write_v2
from streambatch.format.index import IndexFormatError, ShardInfo, upgrade
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

sys.path.insert(0, str(REPO / "tools"))
from make_index import write_synthetic_index  # noqa: E402

pytest_plugins = ["conftest_s3"]

SR = 8000
BUDGET = 12 * SR


@pytest.fixture(scope="module")
def audio_v1(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2audio")
    write_audio_corpus(str(root / "audio"), 60, seed=4, sample_rate=SR)
    write_shards(
        str(root / "audio"), str(root / "shards"), max_count=9, shuffle=True, seed=1, progress=False, index_version=1
    )
    return str(root / "shards")


@pytest.fixture(scope="module")
def text_v1(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("v2text"), 120, 0, max_tokens=90, max_count=16, index_version=1)


def upgraded(src: str, dst) -> str:
    shutil.copytree(src, dst)
    assert upgrade(str(dst), progress=False) == os.path.join(str(dst), "index.json")
    return str(dst)


@pytest.fixture
def small_groups(monkeypatch):
    """Row groups of about 50 samples, files of about 200: many groups and files from a small index."""
    monkeypatch.setattr(columnar, "ROWS_PER_GROUP", 50)
    monkeypatch.setattr(columnar, "ROWS_PER_FILE", 200)


def synthetic(n_shards=40, seed=0, empty=(3, 39), kind="i") -> ShardIndex:
    rng = np.random.default_rng(seed)
    shards = []
    for i in range(n_shards):
        n = 0 if i in empty else int(rng.integers(1, 30))
        x = rng.integers(10, 5000, n) if kind == "i" else rng.uniform(0.5, 20.0, n)
        shards.append(
            ShardInfo(f"shard-{i:06d}.tar", n, 100 + i, x, sha256=f"{i:064x}", keys_sha1=None if i % 3 else f"{i:040x}")
        )
    return ShardIndex(shards, "samples" if kind == "i" else "seconds", SR if kind == "i" else None, meta={"k": 1})


def assert_same_index(a: ShardIndex, b: ShardIndex) -> None:
    assert (a.num_shards, a.num_samples, a.total_length) == (b.num_shards, b.num_samples, b.total_length)
    assert (a.unit, a.sample_rate, a.meta) == (b.unit, b.sample_rate, b.meta)
    assert [os.path.basename(u) for u in a.shard_urls()] == [os.path.basename(u) for u in b.shard_urls()]
    assert b.shard_urls() == [os.path.join(b.root, s.url) for s in b.shards]
    for x, y in zip(a.shards, b.shards):
        assert (x.url, x.count, x.bytes, x.sha256, x.keys_sha1) == (y.url, y.count, y.bytes, y.sha256, y.keys_sha1)
        assert x.lengths.tolist() == y.lengths.tolist()
        assert (x.total_length, x.max_length) == (y.total_length, y.max_length)
    assert np.array_equal(a.lengths, b.lengths) and a.lengths.dtype == b.lengths.dtype
    assert a.stats() == b.stats()


def read_spy(monkeypatch) -> list[int]:
    """The row groups (global numbers) read from the sample files, in order."""
    seen: list[int] = []
    real = ColumnarIndex._read_group

    def spy(self, g, columns):
        seen.append(int(g))
        return real(self, g, columns)

    monkeypatch.setattr(ColumnarIndex, "_read_group", spy)
    return seen


# ---- upgrade --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ds", ["audio_v1", "text_v1"])
def test_upgrade_keeps_the_index(ds, request, tmp_path):
    src = request.getfixturevalue(ds)
    v1 = ShardIndex.load(src)
    out = upgraded(src, tmp_path / "ds")
    head = json.load(open(os.path.join(out, "index.json")))
    assert head["version"] == 2 and "shards" not in head
    assert set(head["columns"]) == {"shard", "key", "length", "offset", "size"}
    v2 = ShardIndex.load(out)
    assert (v1.version, v2.version) == (1, 2)
    assert_same_index(v1, v2)
    assert v2.sample_offsets(0) is None  # version 1 did not know them
    assert not [n for n in os.listdir(out) + os.listdir(os.path.join(out, "index.samples")) if "tmp" in n]


def test_upgrade_of_version_2_does_nothing(audio_v1, tmp_path, caplog):
    out = upgraded(audio_v1, tmp_path / "ds")
    before = open(os.path.join(out, "index.json"), "rb").read()
    with caplog.at_level(logging.INFO, logger="streambatch.format.index"):
        upgrade(out, progress=False)
    assert "already a version 2 index" in caplog.text
    assert open(os.path.join(out, "index.json"), "rb").read() == before


@pytest.mark.parametrize("ds", ["audio_v1", "text_v1"])
def test_loader_gives_the_same_plan_and_batches(ds, request, tmp_path):
    src = request.getfixturevalue(ds)
    out = upgraded(src, tmp_path / "ds")
    budget = BUDGET if ds == "audio_v1" else 600
    kw = dict(budget=budget, buffer_size=20, seed=5, decode="none")
    a, b = StreamBatchLoader(src, **kw), StreamBatchLoader(out, **kw)
    assert b.index.version == 2 and len(a) == len(b)
    pa_, pb = a.plan(0), b.plan(0)
    assert len(pa_.slots) == len(pb.slots)
    for x, y in zip(pa_.slots, pb.slots):
        assert x.pieces == y.pieces and np.array_equal(x.gids, y.gids)
        assert [z.tolist() for z in x.batches] == [z.tolist() for z in y.batches]
    got_a, got_b = list(a), list(b)
    assert [x["keys"] for x in got_a] == [x["keys"] for x in got_b]
    if ds == "audio_v1":  # DataLoader workers get the version 2 index too
        workers = StreamBatchLoader(out, num_workers=2, **kw)
        assert [x["keys"] for x in workers] == [x["keys"] for x in StreamBatchLoader(src, num_workers=2, **kw)]


# ---- layout and partial reads ----------------------------------------------------------------------
def test_many_files_and_groups_round_trip(small_groups, tmp_path):
    ix = synthetic()
    ix.save(str(tmp_path / "ds"), version=2)
    head = json.load(open(tmp_path / "ds" / "index.json"))
    parts = head["tables"]["samples"]
    assert len(parts) > 2 and sum(p["rows"] for p in parts) == ix.num_samples
    for p in parts:  # whole shards per file, whole shards per row group, about 50 rows each
        md = pq.ParquetFile(tmp_path / "ds" / p["path"]).metadata
        assert md.num_row_groups == p["row_groups"] > 0 and md.num_rows == p["rows"] <= 200 + 30
    v2 = ShardIndex.load(str(tmp_path / "ds"))
    assert_same_index(ix, v2)
    table = v2.shard_table()
    assert table["first"].tolist() == np.concatenate([[0], np.cumsum([s.count for s in ix.shards])[:-1]]).tolist()
    assert table["min_length"][0] == ix.shards[0].lengths.min() and table["count"][3] == 0
    assert [x.tolist() for x in v2.iter_lengths()] == [s.lengths.tolist() for s in ix.shards]


def test_float_lengths_round_trip(small_groups, tmp_path):
    ix = synthetic(kind="f")
    ix.save(str(tmp_path / "ds"), version=2)
    v2 = ShardIndex.load(str(tmp_path / "ds"))
    assert v2.lengths.dtype == np.float64 and v2.shards.reader.length_type == "float64"
    assert_same_index(ix, v2)


def test_shard_lengths_reads_only_the_row_groups_needed(small_groups, tmp_path, monkeypatch):
    ix = synthetic()
    ix.save(str(tmp_path / "ds"), version=2)
    seen = read_spy(monkeypatch)
    v2 = ShardIndex.load(str(tmp_path / "ds"))
    assert seen == []  # opening reads the header and the shard table only
    assert v2.total_length == ix.total_length and v2.shards[5].max_length == ix.shards[5].max_length
    assert seen == []
    reader = v2.shards.reader
    want = [1, 2, 30, 31, 20]
    got = v2.shard_lengths(want)
    assert [x.tolist() for x in got] == [ix.shards[i].lengths.tolist() for i in want]
    groups = sorted({int(reader.shard_group[i]) for i in want})
    assert sorted(seen) == groups and len(groups) < len(reader.group_start) // 2  # one read per group, no other
    assert not reader._cache  # the caller keeps what it asked for; the index keeps nothing (no growth per epoch)
    assert got[0].dtype == np.int32  # lengths that fit are held at 4 bytes a sample
    v2.shards[30].lengths
    g30 = int(reader.shard_group[30])
    assert list(reader._cache) == [g30]  # a shard's own lengths are cached with its row group
    seen.clear()
    v2.shards[31].lengths
    assert seen == []  # same row group: no read
    list(v2.iter_lengths())
    assert sorted(seen) == sorted(
        set(range(len(reader.group_start)))
        - {g30}
        - {g for g in range(len(reader.group_start)) if reader.group_rows[g] == 0}
    )
    assert list(reader._cache) == [g30]  # streaming does not fill the cache


def test_changed_lengths_and_saving_again(small_groups, tmp_path):
    ix = synthetic()
    ix.save(str(tmp_path / "a"), version=2)
    v2 = ShardIndex.load(str(tmp_path / "a"))
    v2.shards[7].lengths = v2.shards[7].lengths + 1
    v2.shards[8].lengths[0] += 1000  # in place: the cached row group holds the change
    assert v2.lengths[v2.shard_table()["first"][8]] == ix.shards[8].lengths[0] + 1000
    assert v2.total_length == ix.total_length + ix.shards[7].count  # shard 8 changed in place: the table's total
    v2.save(str(tmp_path / "b"), version=2)
    v1copy = ShardIndex.load(str(tmp_path / "b"))
    assert v1copy.shards[7].lengths.tolist() == (ix.shards[7].lengths + 1).tolist()
    assert v1copy.shards[8].lengths[0] == ix.shards[8].lengths[0] + 1000
    v2.save(str(tmp_path / "c"), version=1)  # version 1 from a version 2 index
    assert ShardIndex.load(str(tmp_path / "c")).lengths.tolist() == v2.lengths.tolist()


def test_sample_offsets_and_keys_when_the_writer_knows_them(tmp_path):
    shards = []
    for i, n in enumerate([3, 0, 2]):
        s = ShardInfo(
            f"s{i}.tar",
            n,
            n * 1024 + 1024,  # the samples' byte ranges end inside the shard (the index is refused otherwise)
            np.arange(1, n + 1),
            keys=[f"k{i}{j}" for j in range(n)],
            offsets=np.arange(n) * 1024,
            sizes=np.full(n, 1024),
        )
        shards.append(s)
    write_v2(str(tmp_path / "index.json"), shards, {"unit": "tokens", "sample_rate": None, "meta": {}}, "int64")
    ix = ShardIndex.load(str(tmp_path))
    offsets, sizes = ix.sample_offsets(2)
    assert offsets.tolist() == [0, 1024] and sizes.tolist() == [1024, 1024]
    keys = pq.read_table(tmp_path / "index.samples" / "part-00000.parquet").column("key").to_pylist()
    assert keys == ["k00", "k01", "k02", "k20", "k21"]
    assert pickle.loads(pickle.dumps(ix)).lengths.tolist() == [1, 2, 3, 1, 2]  # DataLoader workers (spawn)


def test_workers_get_the_planning_columns_and_resolve_urls_one_at_a_time(tmp_path):
    """What a DataLoader worker is sent: the counts and totals, not every shard's URL and checksums; it
    loads those again if it needs them, and the loader never lists every URL."""
    from streambatch.format.columnar import ShardColumns
    from streambatch.select.source import ShardURLs

    ix = synthetic()
    ix.save(str(tmp_path / "ds"), version=2)
    v2 = ShardIndex.load(str(tmp_path / "ds"))
    urls = ShardURLs(v2)
    assert len(urls) == ix.num_shards and list(urls) == v2.shard_urls()
    assert urls[3] == str(tmp_path / "ds" / ix.shards[3].url)
    v2.shards[3].sha256  # loads the other columns in this process
    clone = pickle.loads(pickle.dumps(v2))
    assert set(clone.shards.columns._values) <= set(ShardColumns.PLAN)
    assert ShardURLs(clone)[3] == urls[3] and clone.shards[3].sha256 == ix.shards[3].sha256
    loader = StreamBatchLoader(str(tmp_path / "ds"), budget=1e9)
    assert isinstance(loader.urls, ShardURLs)


def test_no_samples_at_all(tmp_path):
    ix = ShardIndex([ShardInfo("a.tar", 0, 0, np.zeros(0, np.int64))], unit="samples", sample_rate=SR)
    ix.save(str(tmp_path), version=2)
    v2 = ShardIndex.load(str(tmp_path))
    assert v2.num_samples == 0 and v2.lengths.tolist() == [] and v2.shards[0].lengths.tolist() == []
    assert v2.sample_offsets(0) is None
    ShardIndex([], unit="tokens").save(str(tmp_path / "none"), version=2)
    none = ShardIndex.load(str(tmp_path / "none"))
    assert none.num_shards == 0 and none.lengths.tolist() == [] and none.shard_table()["first"].tolist() == []


# ---- damaged tables ---------------------------------------------------------------------------------
def flip(path, at: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0xFF
    open(path, "wb").write(bytes(data))


def length_page(path) -> int:
    """A byte inside the data page of the length column of row group 0 (past its page header)."""
    col = pq.ParquetFile(path).metadata.row_group(0).column(2)
    return col.data_page_offset + col.total_compressed_size - 3


@pytest.fixture
def v2_folder(small_groups, tmp_path):
    synthetic().save(str(tmp_path / "ds"), version=2)
    return tmp_path / "ds"


def test_truncated_tables_are_named(v2_folder):
    part = v2_folder / "index.samples" / "part-00001.parquet"
    os.truncate(part, os.path.getsize(part) - 10)
    ix = ShardIndex.load(str(v2_folder))
    with pytest.raises(IndexFormatError, match=r"part-00001\.parquet: .*truncated"):
        ix.lengths
    table = v2_folder / "index.shards.parquet"
    os.truncate(table, os.path.getsize(table) // 2)
    with pytest.raises(IndexFormatError, match=r"index\.shards\.parquet: .*truncated"):
        ShardIndex.load(str(v2_folder))


def test_a_table_grown_past_its_size_is_named_without_reading_it_all(v2_folder):
    """A small table is read in one request of at most one byte more than the header says: one that grew (a
    replaced file, a hostile one of any size) is refused, and no more of it is read."""
    table = v2_folder / "index.shards.parquet"
    with open(table, "ab") as f:
        f.write(b"\0" * (1 << 20))
    with pytest.raises(IndexFormatError, match=r"index\.shards\.parquet: more than \d+ bytes, the index says"):
        ShardIndex.load(str(v2_folder))


def test_tampered_pages_are_named(v2_folder):
    part = v2_folder / "index.samples" / "part-00000.parquet"
    flip(part, length_page(part))
    ix = ShardIndex.load(str(v2_folder))
    assert ix.shard_lengths([ix.num_shards - 1])  # other files are fine
    with pytest.raises(IndexFormatError, match=r"part-00000\.parquet: row group 0 cannot be read .*CRC checksum"):
        ix.shard_lengths([0])
    table = v2_folder / "index.shards.parquet"
    col = pq.ParquetFile(table).metadata.row_group(0).column(1)  # count
    flip(table, col.data_page_offset + col.total_compressed_size - 3)
    with pytest.raises(IndexFormatError, match=r"index\.shards\.parquet: row group 0 cannot be read .*CRC checksum"):
        ShardIndex.load(str(v2_folder))


def test_row_count_mismatches_are_named(v2_folder):
    head_path = v2_folder / "index.json"
    head = json.load(open(head_path))
    head["tables"]["samples"][1]["rows"] += 1
    json.dump(head, open(head_path, "w"))
    ix = ShardIndex.load(str(v2_folder))
    with pytest.raises(IndexFormatError, match=r"part-00001\.parquet: \d+ rows, the index says"):
        ix.lengths
    head["tables"]["samples"][1]["rows"] -= 1
    head["num_samples"] += 5
    json.dump(head, open(head_path, "w"))
    with pytest.raises(IndexFormatError, match=r"index\.shards\.parquet: 40 shards of \d+ samples, the index says"):
        ShardIndex.load(str(v2_folder))


def test_tables_of_another_write_are_refused(v2_folder, tmp_path):
    synthetic().save(str(tmp_path / "other"), version=2)  # the very same content, another write
    shutil.copy(tmp_path / "other" / "index.samples" / "part-00002.parquet", v2_folder / "index.samples")
    ix = ShardIndex.load(str(v2_folder))
    with pytest.raises(IndexFormatError, match=r"part-00002\.parquet: written by another index write"):
        ix.lengths


@pytest.mark.parametrize("bad", [0, 35])
def test_a_failed_write_leaves_nothing(small_groups, tmp_path, bad):
    ix = synthetic()
    ix.shards[bad].lengths = ix.shards[bad].lengths[:-1]  # count no longer matches: after some files, or none
    with pytest.raises(ValueError, match="count"):
        ix.save(str(tmp_path), version=2)
    assert [n for n in os.listdir(tmp_path) if n != "index.samples"] == []
    assert not os.path.exists(tmp_path / "index.samples") or os.listdir(tmp_path / "index.samples") == []


# ---- the synthetic generator and object storage -------------------------------------------------------
def test_make_index_versions_agree(tmp_path):
    v2 = write_synthetic_index(str(tmp_path / "v2"), 2500, 300, progress=False)
    v1 = write_synthetic_index(str(tmp_path / "v1"), 2500, 300, version=1, progress=False)
    a, b = ShardIndex.load(v1), ShardIndex.load(v2)
    assert b.version == 2 and [s.count for s in b.shards][-1] == 100
    assert_same_index(a, b)


def test_version_2_on_s3(tmp_path, request):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    endpoint = request.getfixturevalue("moto_endpoint")
    from conftest_s3 import BUCKET, s3_options

    opts = s3_options(endpoint)
    ix = synthetic(seed=3)
    url = f"s3://{BUCKET}/index-v2"
    ix.save(url, opts)
    assert upgrade(url, opts, progress=False) == f"{url}/index.json"
    v2 = ShardIndex.load(url, opts)
    assert v2.version == 2
    assert_same_index(ix, v2)
    assert [x.tolist() for x in v2.shard_lengths([6, 5])] == [ix.shards[i].lengths.tolist() for i in (6, 5)]


def test_shardify_upgrade_command(audio_v1, tmp_path, capsys):
    from streambatch.cli import main

    ds = str(tmp_path / "ds")
    shutil.copytree(audio_v1, ds)
    assert main(["upgrade", ds, "--no-progress"]) == 0
    assert "to version 2" in capsys.readouterr().out
    assert ShardIndex.load(ds).version == 2
    assert main(["upgrade", ds]) == 0 and "already a version 2" in capsys.readouterr().out
    assert main(["verify", ds, "--no-progress"]) == 0
    with open(os.path.join(ds, "index.shards.parquet"), "r+b") as f:
        f.truncate(100)
    assert main(["inspect", ds]) == 2
    assert "index.shards.parquet" in capsys.readouterr().err


def test_a_rank_reads_only_its_row_groups_from_s3(tmp_path, request):
    """Through the proxy that logs every request: the byte ranges a planning rank fetches from the sample table
    lie in the footer or in the row groups that hold its own shards, never in another rank's."""
    pytest.importorskip("s3fs")
    proxy = request.getfixturevalue("proxy")
    endpoint = request.getfixturevalue("moto_endpoint")
    from conftest_s3 import BUCKET, s3_options

    from streambatch.plan.config import BatchingConfig
    from streambatch.plan.epoch import plan_rank_local
    from streambatch.plan.layout import Layout
    from streambatch.plan.lengths import index_lengths

    url = f"s3://{BUCKET}/rowgroups"
    write_synthetic_index(url, 600_000, 1_000, progress=False, storage_options=s3_options(endpoint))
    local = write_synthetic_index(str(tmp_path / "same"), 600_000, 1_000, progress=False)
    meta = pq.ParquetFile(os.path.join(os.path.dirname(local), "index.samples", "part-00000.parquet")).metadata
    spans = []
    for g in range(meta.num_row_groups):
        cols = [meta.row_group(g).column(c) for c in range(meta.num_columns)]
        starts = [min(x for x in (c.dictionary_page_offset, c.data_page_offset) if x is not None) for c in cols]
        spans.append((min(starts), max(s + c.total_compressed_size for s, c in zip(starts, cols))))
    assert len(spans) >= 8
    proxy.reset()
    index = ShardIndex.load(url, s3_options(proxy.url))
    lengths = index_lengths(index)
    world, workers = 16, 2
    plan_rank_local(lengths, BatchingConfig(budget=200 * 16_000.0), 0, 7, Layout(world, workers), lambda m: [m] * world)
    row_group = index.shards.column("row_group") if hasattr(index.shards, "column") else None
    mine = {int(row_group[s]) for s in lengths._arrays} if row_group is not None else set()
    assert mine and len(mine) < len(spans) // 2
    size = os.path.getsize(os.path.join(os.path.dirname(local), "index.samples", "part-00000.parquet"))
    for _, path, rng, _ in proxy.gets("part-00000.parquet"):
        assert rng, "a whole-object read of the sample table"
        lo, hi = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        if hi >= size - 1:  # the footer (pyarrow reads the last 64 KiB at once)
            assert hi - lo < (64 << 10) + meta.serialized_size
            continue
        touched = {g for g, (a, b) in enumerate(spans) if lo < b and hi >= a}
        assert touched <= mine, (rng, touched, mine)
