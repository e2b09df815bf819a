"""An output that does not fit (issue #25, item 7): a real file size limit (RLIMIT_FSIZE, SIGXFSZ ignored, so a
write past it fails with EFBIG as on a full disk) while ``shardify`` writes shards or the index ends with one
line naming the file, exit 2, and nothing half-written left under a dataset's names."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

SHARDIFY = [sys.executable, "-m", "streambatch.cli"]


def _limited(max_bytes: int):
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


def _shardify(*args: str, max_bytes: int | None = None) -> subprocess.CompletedProcess:
    limit = _limited(max_bytes) if max_bytes is not None else None
    return subprocess.run([*SHARDIFY, *args], capture_output=True, text=True, timeout=300, preexec_fn=limit)


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"s{i}", "text": "word " * (20 + i)}) + "\n" for i in range(60)))
    return src


def _everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_a_shard_past_the_limit(tmp_path):
    out = tmp_path / "out"
    done = _shardify("write", str(_source(tmp_path)), str(out), "--no-progress", max_bytes=4096)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out / "shard-000000.tar") in lines[0] and "file too large" in lines[0], lines
    assert not [n for n in _everything(out) if n.endswith(".tar") or "tmp" in n or n.startswith("index")]


def test_the_index_past_the_limit(tmp_path):
    """The shards fit, the index tables do not (a merge writes only the index): no index.json, no table and no
    temporary file is left; the parts stay to merge again."""
    out = tmp_path / "out"
    assert _shardify("write", str(_source(tmp_path)), str(out), "--part", "0/1", "--no-progress").returncode == 0
    before = _everything(out)
    done = _shardify("merge", str(out), max_bytes=1000)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out / "index.json") in lines[0] and "file too large" in lines[0], lines
    left = [n for n in _everything(out) if n not in before]
    assert all(os.path.isdir(out / n) for n in left), left  # at most the empty folder of the sample table
    assert not (out / "index.json").exists()
    assert _shardify("merge", str(out)).returncode == 0
