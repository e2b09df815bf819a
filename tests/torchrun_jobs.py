"""DDP jobs for the tests: tests/ddp/run_ddp.py under torchrun (gloo on CPU) in a session of its own, and the
checks on the per-rank logs it writes (used by the DDP, mixing and adopt tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TESTS, finish, kill_tree, popen

SR = 8000
BUDGET = 10 * SR
SCRIPT = str(TESTS / "ddp" / "run_ddp.py")
TIMEOUT = 120


def torchrun(args: list[str], nproc: int, extra: list[str] | None = None, script: str = SCRIPT) -> subprocess.Popen:
    """A torchrun job (``script``: run_ddp.py unless said) in a session of its own; the test's teardown ends it,
    its ranks and their workers."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(extra or ["--standalone"]),
        f"--nproc_per_node={nproc}",
        script,
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


def kill_when_stopped(proc: subprocess.Popen, out: Path, nproc: int) -> None:
    deadline = time.time() + TIMEOUT
    while len(list(out.glob("stopped-rank*"))) < nproc:
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc.pid)
            pytest.fail("the job did not reach its stop step")
        time.sleep(0.2)
    kill_tree(proc.pid, grace=0)  # a hard kill of torchrun, its ranks and their workers, like a node failure
    proc.wait()
