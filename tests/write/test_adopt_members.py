"""`shardify index` on tars whose members do not all become samples: every member not indexed is listed in
``errors.jsonl`` with its reason, ``index`` refuses what ``verify`` refuses, and a header never chooses what is
allocated."""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from streambatch import StreamBatchLoader
from streambatch.cli import main

SR = 8000


def wav(frames: int, seed: int) -> bytes:
    buf = io.BytesIO()
    x = (0.1 * np.random.default_rng(seed).standard_normal(frames)).astype("float32")
    sf.write(buf, x, SR, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", **fields) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in fields.items():
        setattr(info, k, v)
    tar.addfile(info, io.BytesIO(data) if data else None)


def index(src: Path, *extra: str) -> int:
    return main(["index", str(src), "--no-progress", *extra])


def listed(src: Path) -> list[dict]:
    return [json.loads(line) for line in (src / "errors.jsonl").read_text().splitlines()]


def streamed(src: Path) -> collections.Counter:
    loader = StreamBatchLoader(str(src), budget=4 * SR, seed=1)
    seen: collections.Counter = collections.Counter()
    for batch in loader:
        seen.update(batch["keys"])
    return seen


def npy_header_only(shape: tuple[int, ...], dtype: str) -> bytes:
    """A ``.npy`` whose header claims ``shape`` but holds 16 bytes of data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * 16


def test_npy_header_claiming_terabytes_is_a_listed_sample_not_a_memory_error(tmp_path, capsys):
    src = tmp_path / "text"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tar:
        add(tar, "t0.input_ids.npy", _npy([5, 6, 7]))
        add(tar, "t1.input_ids.npy", npy_header_only((2**41,), "<i4"))  # 8 TiB claimed
        add(tar, "t2.input_ids.npy", _npy([1, 2]))
    capsys.readouterr()
    assert index(src) == 2
    err = capsys.readouterr().err
    assert "t1.input_ids.npy" in err and "MemoryError" not in err
    assert index(src, "--on-error", "skip") == 0
    (row,) = listed(src)
    assert row["key"] == "t1" and str(2**41) in row["error"]
    assert main(["verify", str(src), "--no-progress"]) == 0


def _npy(ids: list[int]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(ids, dtype=np.int32))
    return buf.getvalue()


def test_a_key_repeated_in_a_tar_is_refused_as_verify_refuses_it(tmp_path, capsys):
    src = tmp_path / "dup"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tar:
        for name, seed in (("s0", 0), ("s1", 1), ("s2", 2), ("s1", 3), ("s3", 4)):
            add(tar, f"{name}.wav", wav(600 + 50 * seed, seed))
    capsys.readouterr()
    assert index(src) == 2
    assert "s1" in capsys.readouterr().err and not (src / "index.json").exists()
    assert index(src, "--on-error", "skip") == 0
    assert sorted(r["key"] for r in listed(src)) == ["s1", "s1"]
    assert main(["verify", str(src), "--no-progress"]) == 0
    assert streamed(src) == collections.Counter(["s0", "s2", "s3"])


def test_two_adjacent_members_of_one_name_are_listed_not_merged(tmp_path, capsys):
    src = tmp_path / "adjacent"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tar:
        add(tar, "s0.wav", wav(700, 0))
        add(tar, "s1.wav", wav(900, 1))
        add(tar, "s1.wav", wav(600, 2))
        add(tar, "s2.wav", wav(800, 3))
    capsys.readouterr()
    assert index(src) == 2
    assert "s1.wav" in capsys.readouterr().err
    assert index(src, "--on-error", "skip") == 0
    assert [r["key"] for r in listed(src)] == ["s1"]
    assert main(["verify", str(src), "--no-progress"]) == 0
    assert streamed(src) == collections.Counter(["s0", "s2"])


def _sparse_file(path: Path, data: bytes, pieces: int = 8) -> None:
    """``data`` written in ``pieces`` stretches with 64 KiB holes between them (a sparse file where the file
    system supports it)."""
    step = -(-len(data) // pieces)
    with open(path, "wb") as f:
        for i in range(pieces):
            f.write(data[i * step : (i + 1) * step])
            f.seek(65536, os.SEEK_CUR)
        f.truncate()


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar for a sparse member")
def test_links_and_sparse_members_are_listed_and_the_members_after_them_indexed(tmp_path, capsys):
    """A GNU sparse member (with sparse map blocks after its header: more than four stretches), a hard link and a
    symbolic link: each listed with its reason; the members after them are read in step and streamed."""
    files = tmp_path / "files"
    files.mkdir()
    _sparse_file(files / "s1.wav", wav(4000, 1))
    src = tmp_path / "links"
    src.mkdir()
    sparse = subprocess.run(
        ["tar", "--format=gnu", "--sparse", "-cf", "-", "-C", str(files), "s1.wav"], capture_output=True, check=True
    ).stdout
    assert sparse[156:157] == b"S" and sparse[482] != 0  # a sparse member whose map spills into more blocks
    with tarfile.open(src / "a.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        add(tar, "s0.wav", wav(700, 0))
        add(tar, "s2.wav", type=tarfile.LNKTYPE, linkname="s0.wav")
        add(tar, "s3.wav", type=tarfile.SYMTYPE, linkname="s0.wav")
        add(tar, "s4.wav", wav(800, 4))
    with tarfile.open(tmp_path / "tail.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        add(tar, "s5.wav", wav(900, 5))
    tail = (tmp_path / "tail.tar").read_bytes()
    (src / "b.tar").write_bytes(sparse[: _end_of_members(sparse)] + tail)
    capsys.readouterr()
    assert index(src) == 2
    assert "(and 2 more)" in capsys.readouterr().err
    assert index(src, "--on-error", "skip") == 0
    why = {r["key"]: r["error"] for r in listed(src)}
    assert set(why) == {"s1.wav", "s2.wav", "s3.wav"}
    assert "sparse" in why["s1.wav"] and "hard link" in why["s2.wav"] and "symbolic link" in why["s3.wav"]
    assert main(["verify", str(src), "--no-progress"]) == 0
    assert streamed(src) == collections.Counter(["s0", "s4", "s5"])


def _end_of_members(tar: bytes) -> int:
    """Where the two zero blocks that end a tar begin."""
    end = len(tar.rstrip(b"\0"))
    return -(-end // 512) * 512
