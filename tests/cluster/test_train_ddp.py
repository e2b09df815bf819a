"""tools/train_ddp.py without SLURM: SIGUSR1 mid-epoch → checkpoint, STOPPED mark, exit 85; --resume continues
with exactly the batches an uninterrupted run has. (The SLURM tests run it under srun, requeued.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, popen

from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SCRIPT = REPO / "tools" / "train_ddp.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    write_audio_corpus(str(root / "audio"), 24, seed=4, sample_rate=8000)
    write_shards(str(root / "audio"), str(root / "ds"), max_count=8, shuffle=True, progress=False)
    return root / "ds"


def train(data: Path, run: Path, *extra: str) -> subprocess.Popen:
    """tools/train_ddp.py on CPU, output in a pipe; the test's teardown ends it (and its DataLoader worker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--data",
        str(data),
        "--budget",
        "8s",
        "--epochs",
        "2",
        "--num-workers",
        "1",
        "--threads",
        "1",
        "--channels",
        "8",
        "--log-every",
        "5",
        "--checkpoint-dir",
        str(run / "ckpt"),
        "--log-keys",
        str(run / "keys"),
        "--device",
        "cpu",
        *extra,
    ]
    return popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def keys(run: Path) -> list[list[str]]:
    lines = (run / "keys" / "keys-rank0.jsonl").read_text().splitlines()
    return [e["keys"] for e in map(json.loads, lines) if e["event"] == "batch"]


def test_usr1_saves_and_resume_continues_exactly(data, tmp_path):
    full = train(data, tmp_path / "full")
    out, _ = full.communicate(timeout=120)
    assert full.returncode == 0, out
    assert "steps/s" in out and "samples/s" in out and "audio-s/s" in out and "padding" in out
    expected = keys(tmp_path / "full")

    run = tmp_path / "stopped"
    p = train(data, run, "--resume", "--step-sleep", "0.1")
    deadline = time.time() + 120
    while not (run / "keys" / "keys-rank0.jsonl").exists() or len(keys(run)) < len(expected) // 2:
        assert p.poll() is None and time.time() < deadline, p.communicate()[0]
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 85, out
    assert "stopped by SIGUSR1" in out
    stopped = json.loads((run / "ckpt" / "STOPPED").read_text())
    first = len(keys(run))
    assert stopped["step"] == first < len(expected)

    p = train(data, run, "--resume")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert f"resumed from {run / 'ckpt' / 'checkpoint.pt'}: step {first}" in out
    assert keys(run) == expected
