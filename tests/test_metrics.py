"""``loader.metrics()``: the figures agree with what the batches themselves say."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streambatch import StreamBatchLoader
from streambatch.write.writer import write_shards

BUDGET = 2000


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    rng = np.random.default_rng(4)
    with open(root / "t.jsonl", "w") as f:
        for i in range(200):
            ids = rng.integers(1, 1000, size=int(rng.integers(1, 120))).tolist()
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n")
    write_shards(str(root / "t.jsonl"), str(root / "ds"), max_count=30, progress=False)
    return str(root / "ds")


@pytest.mark.parametrize("workers", [0, 2])
def test_metrics_agree_with_the_batches(text_ds, workers):
    loader = StreamBatchLoader(text_ds, budget=BUDGET, num_workers=workers, buffer_size=50)
    batches = list(loader)
    m = loader.metrics(planned=True)
    real = sum(int(b["lengths"].sum()) for b in batches)
    padded = sum(b["input_ids"].shape[0] * b["input_ids"].shape[1] for b in batches)
    assert m["batches"] == len(batches) == m["planned"]["batches"]
    assert m["samples"] == sum(len(b["keys"]) for b in batches) == 200
    assert m["padding_pct"] == pytest.approx(100 * (1 - real / padded))
    used = [b["input_ids"].shape[0] * b["input_ids"].shape[1] / BUDGET for b in batches]
    assert m["budget_utilisation_pct"] == pytest.approx(100 * np.mean(used))
    # text is not padded further than its longest sample: the plan's figures are the delivered ones
    assert m["planned"]["padding_pct"] == pytest.approx(m["padding_pct"])
    assert m["time_to_first_batch_s"] is not None and 0 < m["time_to_first_batch_s"] <= m["seconds"]
    assert 0 <= m["waited_on_loader_s"] <= m["seconds"]
    assert m["batches_per_s"] == pytest.approx(m["batches"] / m["seconds"])


def test_progress_bar_and_epoch_log(text_ds, capsys, caplog):
    caplog.set_level("INFO", logger="streambatch")
    loader = StreamBatchLoader(text_ds, budget=BUDGET, progress=True)
    n = len(list(loader))
    assert f"{n}/{n}" in capsys.readouterr().err
    assert any("padding" in r.getMessage() and f"{n} batches" in r.getMessage() for r in caplog.records)


def test_inspect_plan_shows_the_planned_epoch(text_ds, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "streambatch.cli", "inspect", text_ds, "--plan", "--budget",
                          str(BUDGET), "--world-size", "2", "--num-workers", "2", "--json",
                          "--plot", str(tmp_path / "plan.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    loaders = [StreamBatchLoader(text_ds, budget=BUDGET, rank=r, world_size=2, num_workers=2) for r in range(2)]
    assert p["steps"] == len(loaders[0]) == len(loaders[1])
    assert sum(p["batch_sizes"]["counts"]) == p["batches"]
    assert sum(p["samples_per_rank"]) + p["left_out"] == 200
    assert (tmp_path / "plan.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "streambatch.cli", "inspect", text_ds, "--plan"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--plan needs --budget" in bad.stderr
