"""A write sets its records aside in a temporary file (streambatch/write/spill.py) that never has a name: nothing
of it is left in TMPDIR after a write that succeeds, fails, or is killed; and keys whose hashes meet are told apart
by the keys themselves (no sample is dropped as a duplicate of another)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import six_field_manifest

from streambatch.write.records import Record
from streambatch.write.sources import same_keys

SHARDIFY = [sys.executable, "-m", "streambatch.cli", "write", "--no-progress"]


def _env(tmpdir) -> dict[str, str]:
    tmpdir.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmpdir)}


def test_a_write_that_succeeds_or_fails_leaves_nothing_in_tmpdir(tmp_path):
    src = six_field_manifest(tmp_path, 300)
    env = _env(tmp_path / "tmp")
    done = subprocess.run([*SHARDIFY, src, str(tmp_path / "out"), "--max-count", "50"], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert sum(n.endswith(".tar") for n in os.listdir(tmp_path / "out")) == 6
    with open(src, "a") as f:
        f.write("not json\n")
    failed = subprocess.run([*SHARDIFY, src, str(tmp_path / "bad")], env=env, capture_output=True)
    assert failed.returncode == 2
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.slow
def test_a_killed_write_leaves_nothing_in_tmpdir(tmp_path):
    src = six_field_manifest(tmp_path, 3000)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*SHARDIFY, src, str(out), "--max-count", "20"],
        env=_env(tmp_path / "tmp"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and any(n.endswith(".tar") for n in os.listdir(out))):  # writing: records set aside
            assert proc.poll() is None and time.monotonic() < deadline, "the write ended before its first shard"
            time.sleep(0.05)
        assert os.listdir(tmp_path / "tmp") == []  # while it runs, too: the file has no name
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path / "tmp") == []


def test_keys_whose_hashes_meet_are_compared_whole():
    records = [Record(key=k) for k in ("a", "b", "a", "c", "b")]
    # every hash the same: only the keys themselves say which records share one
    assert same_keys(records, [0, 1, 2, 3, 4], [7] * 5) == [[0, 2], [1, 4]]
    assert same_keys(records, [0, 1, 3], [7, 7, 7]) == []
