"""``shardify inspect --plan`` reports freshness: the share of epoch 0's batch-mate pairs that are batch-mates again
in epoch 1, the same figure the loader's own plans of the two epochs give."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import text_dataset

from streambatch import StreamBatchLoader
from streambatch.plan.freshness import epoch_batches, pairs_kept

BUDGET = 2000


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("fresh"), 300, 3, max_count=30)


def _inspect(ds: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "streambatch.cli", "inspect", ds, "--plan", "--budget", str(BUDGET), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_inspect_plan_reports_the_pairs_kept_from_epoch_0_to_1(text_ds):
    out = _inspect(text_ds, "--num-workers", "2", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["pairs_kept_pct"]
    loader = StreamBatchLoader(text_ds, budget=BUDGET, num_workers=2)
    e0, e1 = epoch_batches(loader.plan(0)), epoch_batches(loader.plan(1))
    assert got == pytest.approx(100 * pairs_kept(e0, e1, 300))
    table = _inspect(text_ds, "--num-workers", "2")
    assert table.returncode == 0, table.stderr
    assert f"freshness  {got:.1f}% of the batch-mate pairs meet again in the next epoch" in table.stdout
