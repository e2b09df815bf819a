"""The suite's distributed processes talk to 127.0.0.0/8 only: a two-rank torchrun job on gloo, traced with strace
(every connect and sendto of torchrun, its agent store and both ranks), sends nothing to another address -- not
even the reverse DNS query that naming a loopback peer would make (tests/netguard)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import finish, popen
from netguard import outside, traced


def traced_already() -> bool:
    """Whether this process runs under a tracer (a whole run under ``python -m netguard``): strace cannot trace
    what another tracer already traces, and that outer trace then checks the same promise for every test."""
    with open("/proc/self/status") as f:
        return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f)


pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to see every connection"),
    pytest.mark.skipif(traced_already(), reason="the whole run is traced (python -m netguard) and checked there"),
]

JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.barrier()
dist.destroy_process_group()
"""


def test_a_two_rank_torchrun_job_stays_on_loopback(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    log = tmp_path / "connections.strace"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    finish(popen(traced(cmd, log)), 180, "torchrun under strace")
    text = log.read_text()
    assert "connect(" in text, "strace saw no connection at all: the trace is not working"
    assert outside(text) == []
