"""verify="sha256" checks every shard an epoch reads, in the pass that read it: a local shard written to in place
while it is read by position is counted bad (its hash vouches only for the version it was taken on) and hashed
again next pass; a stream reads the shards it still has open to the end once its last batch is out, so the last
shard of each worker's stream is checked too; a pass stopped early reads no further."""

from __future__ import annotations

import io
import logging
import os
import shutil
import tarfile
import time
import uuid

import numpy as np
import pytest

from streambatch import StreamBatchLoader
from streambatch.io import verified
from streambatch.plan.shards import Piece
from streambatch.plan.slot import SlotEpoch
from streambatch.read import direct
from streambatch.read.execute import execute_plan

pytest_plugins = ["conftest_s3"]

SR = 8000
BUDGET = 13 * SR
CHANGED = "the file changed while it was read"


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    """60 WAV clips: a byte flipped in their samples still decodes (a corrupt shard nothing but its hash shows)."""
    from streambatch.synthetic import write_audio_corpus

    folder = str(tmp_path_factory.mktemp("verify_coverage") / "audio")
    write_audio_corpus(folder, 60, seed=5, sample_rate=SR, fmt="wav")
    return folder


@pytest.fixture(scope="module")
def source(audio, tmp_path_factory):
    """The clips in 5 local shards of 12."""
    from streambatch.write.writer import write_shards

    out = str(tmp_path_factory.mktemp("verify_coverage_shards"))
    write_shards(audio, out, max_count=12, seed=2, progress=False)
    return out


@pytest.fixture
def ds(source, tmp_path, monkeypatch):
    """A fresh copy of the dataset; no node record, nothing remembered in the process."""
    monkeypatch.setenv(verified.RECORD_ENV, "off")
    verified.forget_in_process()
    copy = str(tmp_path / "ds")
    shutil.copytree(source, copy)
    yield copy
    verified.forget_in_process()


def _corrupt(data: bytearray) -> None:
    """Flip a byte in the samples of each clip of a shard: same size, every header intact, every clip decodes."""
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as t:
        for m in t.getmembers():
            if m.name.endswith(".wav") and m.size > 1000:
                data[m.offset_data + m.size // 2] ^= 0x55


def _corrupt_in_place(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        _corrupt(data)
        f.seek(0)
        f.write(data)


def _shards_of(folder: str) -> dict[str, str]:
    """Each sample key's shard file."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(folder, name)) as t:
                out.update({m.name.split(".")[0]: os.path.join(folder, name) for m in t.getmembers()})
    return out


def _read_again(batches: list[list[str]], shard_of: dict[str, str]) -> str:
    """A shard with samples in the first batch and in a later one: read before the change and after it."""
    later = {shard_of[k] for b in batches[1:] for k in b}
    return next(shard_of[k] for k in batches[0] if shard_of[k] in later)


def _wait_hashed(path: str, timeout: float = 30.0) -> None:
    """Until this process's background hash of ``path`` (as it is now) is done."""
    deadline = time.monotonic() + timeout
    while verified.recorded_sha256(path, os.stat(path)) is None:
        assert time.monotonic() < deadline, f"{path} was not hashed within {timeout}s"
        time.sleep(0.01)


@pytest.mark.parametrize("open_shards", [direct.OPEN_SHARDS, 1])
@pytest.mark.parametrize("vouched_by", ["its hash", "the record"])
def test_a_shard_written_to_while_read_by_position_is_counted_bad(ds, monkeypatch, caplog, open_shards, vouched_by):
    """After the first batch a shard it read, and a later batch reads again, is overwritten in place (same size,
    same headers). Its hash (or the record's) was of the version before: the shard is counted bad in this pass
    (when its file is closed, opened again or the pass ends), and hashed again, found wrong, the next."""
    monkeypatch.setattr(direct, "OPEN_SHARDS", open_shards)  # 1: every other shard closes it, and opens it again
    kw = dict(budget=BUDGET, seed=3, max_bad_shards=10)
    reference = [list(b["keys"]) for b in StreamBatchLoader(ds, **kw)]
    path = _read_again(reference, _shards_of(ds))
    if vouched_by == "its hash":
        verified.forget_in_process()  # the loader below hashes every shard again
    loader = StreamBatchLoader(ds, **kw)
    it = iter(loader)
    assert list(next(it)["keys"]) == reference[0]
    _wait_hashed(path)
    time.sleep(0.05)  # the write a clock tick after the shard was opened: its mtime and ctime move
    _corrupt_in_place(path)
    with caplog.at_level(logging.INFO, logger="streambatch"):  # each skipped shard's cause: INFO
        rest = [list(b["keys"]) for b in it]
    stats = loader.fault_stats()
    assert len(rest) == len(reference) - 1
    assert stats["bad_shard_urls"] == [path] and CHANGED in caplog.text
    assert (stats["sha256_hashed"], stats["sha256_reused"]) == ((5, 0) if vouched_by == "its hash" else (0, 5))
    list(loader)  # the next pass: the new version is hashed (it is not what the index says)
    stats = loader.fault_stats()
    assert stats["bad_shard_urls"] == [path] and (stats["sha256_hashed"], stats["sha256_reused"]) == (1, 4)


def test_a_shard_left_alone_is_not_counted_bad(ds, monkeypatch):
    """Reading by position with a shard open at a time (closed and opened again all the time) counts no shard bad."""
    monkeypatch.setattr(direct, "OPEN_SHARDS", 1)
    loader = StreamBatchLoader(ds, budget=BUDGET, seed=3, num_workers=2)
    keys = sorted(k for b in loader for k in b["keys"])
    stats = loader.fault_stats()
    assert len(keys) == 60 and stats["bad_shards"] == 0 and stats["sha256_hashed"] == 5


def _positions(n: int, tail: list[str]):
    """``n`` positioned samples, then ``tail.append("end")`` once the stream is read past them (where a stream
    reads its last shard to the end, and checks it)."""
    for i in range(n):
        yield i, i, {"__key__": f"k{i}", "__url__": "u"}
    tail.append("end")


def _plan(n: int) -> SlotEpoch:
    return SlotEpoch([Piece(0, 0, n)], np.arange(n), [np.arange(0, n - 1), np.arange(n - 1, n)], [False, False])


def test_a_stream_is_read_to_its_end_once_its_last_batch_is_out():
    tail: list[str] = []
    out = execute_plan(_positions(4, tail), _plan(4), 0, np.ones(4))
    assert [len(b) for b in out] == [3, 1] and tail == ["end"]


def test_a_pass_stopped_early_reads_no_further():
    tail: list[str] = []
    out = execute_plan(_positions(4, tail), _plan(4), 0, np.ones(4))
    assert [len(next(out)), len(next(out))] == [3, 1]  # every batch out, but the next one never asked for
    out.close()
    assert tail == []


# ---- remote shards streamed without a cache --------------------------------------------------------------------
@pytest.fixture
def remote(audio, s3_data, tmp_path, monkeypatch):
    """The clips in 6 shards in the bucket (a dataset of this test's own: a test changes one), a node record of its
    own."""
    from conftest_s3 import BUCKET, s3_options

    from streambatch.write.writer import write_shards

    monkeypatch.setenv(verified.RECORD_ENV, str(tmp_path / "record"))
    verified.forget_in_process()
    url = f"s3://{BUCKET}/coverage-{uuid.uuid4().hex[:8]}"
    write_shards(audio, url, storage_options=s3_options(s3_data.endpoint), max_count=10, seed=2, progress=False)
    yield url, s3_options(s3_data.endpoint)
    verified.forget_in_process()


@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize("interleave,num_workers,read_ahead", [(1, 0, 0), (8, 0, "256K"), (1, 2, "256K"), (8, 2, 0)])
def test_every_remote_shard_streamed_is_checked(remote, interleave, num_workers, read_ahead):
    url, options = remote
    kw = dict(budget=12 * SR, seed=4, interleave=interleave, num_workers=num_workers, chunk_size="16K")
    loader = StreamBatchLoader(url, storage_options=options, read_ahead=read_ahead, **kw)
    keys = sorted(k for b in loader for k in b["keys"])
    stats = loader.fault_stats()
    assert len(keys) == 60 and stats["bad_shards"] == 0
    assert stats["sha256_hashed"] + stats["sha256_reused"] == len(loader.index.shards) == 6


@pytest.mark.usefixtures("watchdog")
def test_the_last_shard_of_a_stream_is_checked(remote, caplog):
    """One shard after another (``shuffle=False``), one worker: the shard read last is the last one, corrupt."""
    import s3fs

    url, options = remote
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    last = url[len("s3://") :] + "/shard-000005.tar"
    data = bytearray(fs.cat_file(last))
    _corrupt(data)
    fs.pipe_file(last, bytes(data))
    loader = StreamBatchLoader(
        url, storage_options=options, budget=12 * SR, shuffle=False, chunk_size="16K", max_bad_shards=2
    )
    with caplog.at_level(logging.INFO, logger="streambatch"):  # each skipped shard's cause: INFO
        batches = list(loader)
    stats = loader.fault_stats()
    assert len(batches) == len(loader) and stats["bad_shard_urls"] == [f"s3://{last}"] and "sha256" in caplog.text
    assert stats["sha256_hashed"] == 6
