"""Rank-local planning with real torchrun ranks: the same step count as one process planning everything, and
each rank's memory and CPU follow its share of the dataset, not the dataset."""

from __future__ import annotations

import json
import os
import sys

from conftest import REPO, kill_tree, popen

sys.path.insert(0, str(REPO / "tools"))
from make_index import write_synthetic_index  # noqa: E402

SCRIPT = str(REPO / "tools" / "plan_job.py")
BUDGET = 200 * 16_000


def run(cmd: list[str], timeout: float = 240) -> None:
    """Run ``cmd`` to a clean end; a failure or a timeout ends it and every process below it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = popen(cmd, env=env)
    try:
        assert proc.wait(timeout=timeout) == 0
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()


def test_four_ranks_each_plan_a_quarter(tmp_path):
    index = write_synthetic_index(str(tmp_path / "ix"), 3_000_000, 1_000, progress=False)
    one, four = tmp_path / "one", tmp_path / "four"
    one.mkdir()
    four.mkdir()
    args = [SCRIPT, "--index", index, "--budget", str(BUDGET)]
    run([sys.executable, *args, "--out", str(one)])
    run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", *args, "--out", str(four)]
    )
    alone = json.loads((one / "plan-rank0.json").read_text())
    ranks = [json.loads((four / f"plan-rank{r}.json").read_text()) for r in range(4)]
    assert len({r["steps"] for r in ranks}) == 1  # equal steps, agreed by one all_gather
    for r in ranks:
        # a quarter of the lengths planned on each rank (plus the boundary shards' and pyarrow's noise)
        assert r["extra_mb"] < 0.5 * alone["extra_mb"], (r, alone)
        assert r["cpu_s"] < 0.6 * alone["cpu_s"], (r, alone)
