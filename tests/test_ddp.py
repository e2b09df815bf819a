"""Real multi-process DDP runs (torchrun, gloo on CPU) over real shards with 2 DataLoader workers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import finish, kill_tree, popen

from streambatch import ShardIndex
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SR = 8000
BUDGET = 10 * SR
SCRIPT = str(Path(__file__).parent / "ddp" / "run_ddp.py")
TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    write_audio_corpus(str(root / "audio"), 150, seed=2, sample_rate=SR)
    return root


def dataset(corpus: Path, max_count: int) -> str:
    out = corpus / f"shards-{max_count}"
    if not (out / "index.json").exists():
        write_shards(str(corpus / "audio"), str(out), max_count=max_count, shuffle=True, seed=0, progress=False)
    return str(out)


def torchrun(args: list[str], nproc: int, extra: list[str] | None = None) -> subprocess.Popen:
    """A torchrun job in a session of its own; the test's teardown ends it, its ranks and their workers."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(extra or ["--standalone"]),
        f"--nproc_per_node={nproc}",
        SCRIPT,
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return popen(cmd, env=env)


def wait(proc: subprocess.Popen, timeout: float = TIMEOUT) -> None:
    finish(proc, timeout, "torchrun", " (a hang: ranks stepping unevenly?)")


def run_job(data: str, out: Path, nproc: int, *args: str) -> dict[int, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    wait(torchrun(["--data", data, "--out", str(out), "--budget", str(BUDGET), *args], nproc))
    return read_logs(out)


def read_logs(out: Path) -> dict[int, list[dict]]:
    logs = {}
    for f in sorted(out.glob("log-rank*.jsonl")):
        logs[int(f.stem.split("rank")[1])] = [json.loads(line) for line in f.read_text().splitlines()]
    return logs


def batches(log: list[dict], epoch: int | None = None) -> list[dict]:
    return [e for e in log if e["event"] == "batch" and (epoch is None or e["epoch"] == epoch)]


def check_epoch(logs: dict[int, list[dict]], epoch: int, num_samples: int) -> None:
    """Equal steps = len(loader), no batch over budget, every sample once but the counted surplus."""
    steps = {r: len(batches(log, epoch)) for r, log in logs.items()}
    heads = {r: next(e for e in log if e["event"] == "epoch" and e["epoch"] == epoch) for r, log in logs.items()}
    assert len(set(steps.values())) == 1, steps
    assert all(h["len"] == steps[r] for r, h in heads.items()), (heads, steps)
    keys = [k for log in logs.values() for b in batches(log, epoch) for k in b["keys"]]
    assert len(keys) == len(set(keys)), "a sample was seen twice in one epoch"
    surplus = heads[0]["surplus"]
    assert len(keys) + surplus == num_samples
    assert all(b["cost"] <= BUDGET for log in logs.values() for b in batches(log, epoch))


@pytest.mark.parametrize("max_count,nproc,even", [(20, 2, "split"), (40, 3, "drop"), (150, 2, "split"), (40, 3, "pad")])
def test_torchrun_standalone(corpus, tmp_path, max_count, nproc, even):
    """2 ranks over 8 shards, 3 ranks over 4 shards (uneven), 2 ranks over 1 shard; 2 workers each."""
    data = dataset(corpus, max_count)
    n = ShardIndex.load(data).num_samples
    logs = run_job(data, tmp_path, nproc, "--epochs", "2", "--even-batches", even, "--persistent-workers")
    assert len(logs) == nproc
    for epoch in (0, 1):
        if even == "pad":
            steps = {r: len(batches(log, epoch)) for r, log in logs.items()}
            assert len(set(steps.values())) == 1
            keys = {k for log in logs.values() for b in batches(log, epoch) for k in b["keys"]}
            assert len(keys) == n  # every sample at least once; the repeats top up the short ranks
        else:
            check_epoch(logs, epoch, n)
    order = [[b["keys"] for b in batches(logs[0], e)] for e in (0, 1)]
    assert order[0] != order[1]  # another epoch, another order


def test_two_nodes_on_loopback(corpus, tmp_path):
    data = dataset(corpus, 20)
    port = free_port()
    procs = [
        torchrun(
            ["--data", data, "--out", str(tmp_path), "--budget", str(BUDGET)],
            1,
            ["--nnodes=2", f"--node_rank={r}", "--master_addr=127.0.0.1", f"--master_port={port}"],
        )
        for r in (0, 1)
    ]
    for p in procs:
        wait(p)
    logs = read_logs(tmp_path)
    assert sorted(logs) == [0, 1]
    check_epoch(logs, 0, ShardIndex.load(data).num_samples)


def kill_when_stopped(proc: subprocess.Popen, out: Path, nproc: int) -> None:
    deadline = time.time() + TIMEOUT
    while len(list(out.glob("stopped-rank*"))) < nproc:
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc.pid)
            pytest.fail("the job did not reach its stop step")
        time.sleep(0.2)
    kill_tree(proc.pid, grace=0)  # a hard kill of torchrun, its ranks and their workers, like a node failure
    proc.wait()


def test_kill_and_resume_gives_the_uninterrupted_sequence(corpus, tmp_path):
    data = dataset(corpus, 20)
    common = ["--data", data, "--budget", str(BUDGET), "--epochs", "2", "--train"]
    full = run_job(data, tmp_path / "full", 2, *common[2:])
    steps0 = len(batches(full[0], 0))
    stop = steps0 + 3  # mid-way through epoch 1
    out = tmp_path / "killed"
    out.mkdir()
    kill_when_stopped(torchrun([*common, "--out", str(out), "--stop-after", str(stop)], 2), out, 2)
    wait(torchrun([*common, "--out", str(out), "--resume"], 2))
    resumed = read_logs(out)
    for r in (0, 1):
        # the log holds the killed run's batches up to the stop step, then the resumed run's
        assert [b["keys"] for b in batches(resumed[r])] == [b["keys"] for b in batches(full[r])]


def test_resume_on_another_world_size_loses_and_repeats_nothing(corpus, tmp_path):
    data = dataset(corpus, 20)
    n = ShardIndex.load(data).num_samples
    common = ["--data", data, "--budget", str(BUDGET), "--out", str(tmp_path)]
    kill_when_stopped(torchrun([*common, "--stop-after", "4"], 2), tmp_path, 2)
    before = [k for r, log in read_logs(tmp_path).items() for b in batches(log) for k in b["keys"]]
    for f in tmp_path.glob("log-rank*.jsonl"):
        f.rename(f.with_suffix(".before"))
    # restart on 3 ranks from rank 0/1's checkpoints (rank 2 takes rank 0's: the state is the same on all ranks)
    (tmp_path / "ckpt-rank2.pt").write_bytes((tmp_path / "ckpt-rank0.pt").read_bytes())
    wait(torchrun([*common, "--resume"], 3))
    logs = read_logs(tmp_path)
    after = [k for log in logs.values() for b in batches(log) for k in b["keys"]]
    steps = {r: len(batches(log)) for r, log in logs.items()}
    assert len(set(steps.values())) == 1, steps
    assert len(before) == len(set(before)) and len(after) == len(set(after))
    assert not set(before) & set(after), "a sample was seen twice"
    assert len(before) + len(after) == n, "a sample was lost"
