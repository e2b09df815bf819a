"""Rewriting a version 2 index in place (``shardify index --overwrite``, a second ``merge``, ``ShardIndex.save`` over
an index) never breaks the one there: a write that fails or is interrupted before its header replaces the old one
leaves the old index whole, one interrupted after leaves the new one whole, and a finished one leaves only the
tables its header names."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from streambatch import OutputError, ShardIndex, ShardInfo
from streambatch.format import columnar, columnar_write
from streambatch.format.columnar_write import write_v2

SR = 8000


@pytest.fixture(autouse=True)
def small_files(monkeypatch):
    """Row groups of about 50 samples, files of about 200: several sample files from a small index."""
    monkeypatch.setattr(columnar, "ROWS_PER_GROUP", 50)
    monkeypatch.setattr(columnar, "ROWS_PER_FILE", 200)


def synthetic(seed: int, n_shards: int = 30) -> ShardIndex:
    rng = np.random.default_rng(seed)
    shards = [
        ShardInfo(f"shard-{i:06d}.tar", n, 100 + i, rng.integers(10, 5000, n), sha256=f"{i + seed:064x}")
        for i, n in enumerate(rng.integers(1, 30, n_shards).tolist())
    ]
    return ShardIndex(shards, "samples", SR, meta={"seed": seed})


def loaded(folder) -> tuple:
    ix = ShardIndex.load(str(folder))
    return ix.meta, ix.num_shards, ix.lengths.tolist()


def expected(ix: ShardIndex) -> tuple:
    return ix.meta, ix.num_shards, np.concatenate([s.lengths for s in ix.shards]).tolist()


def files(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names}


def named(folder) -> set[str]:
    """index.json and the tables its header names: all a finished write may leave."""
    tables = json.loads((folder / "index.json").read_text())["tables"]
    return {"index.json", tables["shards"]["path"], *(p["path"] for p in tables["samples"])}


def test_rewrites_leave_only_the_tables_their_header_names(tmp_path):
    for seed in range(4):
        ix = synthetic(seed, n_shards=30 - 5 * seed)  # fewer sample files each time: none of the last may stay
        ix.save(str(tmp_path), version=2)
        assert loaded(tmp_path) == expected(ix)
        assert files(tmp_path) == named(tmp_path)


def test_a_rewrite_that_fails_midway_keeps_the_index_in_place(tmp_path):
    old = synthetic(0)
    old.save(str(tmp_path), version=2)
    before = files(tmp_path)

    def shards_then_a_failure():
        yield from synthetic(1).shards[:20]
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        write_v2(str(tmp_path / "index.json"), shards_then_a_failure(), {"unit": "samples", "sample_rate": SR}, "int64")
    assert loaded(tmp_path) == expected(old)
    assert files(tmp_path) == before


def test_a_header_that_does_not_fit_keeps_the_index_in_place(tmp_path, monkeypatch):
    old = synthetic(0)
    old.save(str(tmp_path), version=2)
    before = files(tmp_path)

    def no_space(url, data, storage_options=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(columnar_write, "write_bytes_atomic", no_space)
    with pytest.raises(OutputError, match="no space left"):
        synthetic(1).save(str(tmp_path), version=2)
    assert loaded(tmp_path) == expected(old)
    assert files(tmp_path) == before


@pytest.mark.parametrize("in_place", [False, True], ids=["fresh", "rewrite"])
def test_an_interrupt_after_the_header_is_in_place_keeps_the_new_index(tmp_path, monkeypatch, in_place):
    if in_place:
        synthetic(0).save(str(tmp_path), version=2)
    real = columnar_write.write_bytes_atomic

    def then_interrupted(url, data, storage_options=None):
        real(url, data, storage_options)
        raise KeyboardInterrupt

    monkeypatch.setattr(columnar_write, "write_bytes_atomic", then_interrupted)
    new = synthetic(1)
    with pytest.raises(KeyboardInterrupt):
        new.save(str(tmp_path), version=2)
    assert loaded(tmp_path) == expected(new)
    monkeypatch.setattr(columnar_write, "write_bytes_atomic", real)
    last = synthetic(2, n_shards=8)  # the next rewrite clears what the interrupted one could not remove
    last.save(str(tmp_path), version=2)
    assert loaded(tmp_path) == expected(last)
    assert files(tmp_path) == named(tmp_path)


def test_a_table_that_does_not_fit_is_named(tmp_path, monkeypatch):
    old = synthetic(0)
    old.save(str(tmp_path), version=2)
    before = files(tmp_path)
    real = os.replace

    def sample_file_full(src, dst):
        if "samples" in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", sample_file_full)
    with pytest.raises(OutputError, match=r"index\.json: no space left .*\(.*index\.1\.samples/part-00000\.parquet\)"):
        synthetic(1).save(str(tmp_path), version=2)
    monkeypatch.setattr(os, "replace", real)
    assert loaded(tmp_path) == expected(old)
    assert files(tmp_path) == before


def test_a_killed_writers_temporary_tables_are_cleared(tmp_path):
    """A writer killed outright (no handler runs) leaves its temporary tables; the next write of the index clears
    them (under ``shardify``'s lock no other writer of it is alive)."""
    (tmp_path / "index.samples").mkdir()
    for rel in ("index.shards.parquet.tmp-deadbeef", "index.samples/part-00003.parquet.tmp-0badc0de"):
        (tmp_path / rel).write_bytes(b"half a table")
    (tmp_path / "shard-000000.tar.tmp-deadbeef").write_bytes(b"not an index file")  # not the index's: kept
    ix = synthetic(0)
    ix.save(str(tmp_path), version=2)
    assert loaded(tmp_path) == expected(ix)
    assert files(tmp_path) == named(tmp_path) | {"shard-000000.tar.tmp-deadbeef"}
