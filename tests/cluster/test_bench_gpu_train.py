"""tools/bench_gpu_train.py end to end: on CPU with ``--quick`` (a smoke test of every path it takes on a GPU:
corpus, calibration, the three loaders, the timed training), and on CUDA the calibrated loader's promise: one
epoch without an out-of-memory error that still fills at least 80 % of the calibration's memory limit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, popen

ROOT = REPO
TOOL = ROOT / "tools" / "bench_gpu_train.py"
METHODS = ("streambatch, calibrated", "webdataset, fixed B", "streambatch, B x longest")


def run_tool(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[str, dict]:
    """The tool in a process of its own; its output and its ``--json`` results."""
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = popen(
        [sys.executable, str(TOOL), *args, "--json", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output
    return output, json.loads(out.read_text())


def test_quick_run_on_cpu_prints_every_method_with_sane_figures(tmp_path):
    output, res = run_tool(tmp_path, "--device", "cpu", "--quick")
    lines = output.splitlines()
    for method in METHODS:
        assert any(line.startswith(method) for line in lines), output
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == set(METHODS)
    cal = res["calibration"]
    assert cal["budget"] > 0 and cal["limit"] > 0
    longest = max(cal["per_length"], key=lambda r: r["length"])
    assert (
        longest["max_batch_size"] >= 1 and rows["webdataset, fixed B"]["batching"] == f"B = {longest['max_batch_size']}"
    )
    for r in rows.values():
        assert r["error"] == "" and r["ooms"] == 0, r
        assert r["steps"] >= 1 and r["seconds"] > 0
        assert 0 < r["audio_s_per_s"] < math.inf
        assert 0 <= r["padding"] < 1 and 0 <= r["loader_wait"] <= 1
        assert r["peak_bytes"] > 0
    # budget batches of length-sorted samples pad far less than fixed batches in random order
    for name in ("streambatch, calibrated", "streambatch, B x longest"):
        assert rows[name]["padding"] < rows["webdataset, fixed B"]["padding"], rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrated_loader_never_runs_out_of_memory_and_fills_the_limit_on_cuda(tmp_path):
    """calibrate on the real model (8 GiB of the GPU, enforced by the allocator), then one epoch of the
    calibrated loader: no out-of-memory error, and its hardest batch uses >= 80 % of the limit."""
    output, res = run_tool(
        tmp_path, "--device", "cuda", "--check-epoch", "--device-memory", "8G", "--utterances", "1500", "--workers", "4"
    )
    assert res["ooms"] == 0 and res["split_batches"] == 0, output
    assert res["steps"] == res["planned"] > 0
    assert res["peak_share_of_limit"] >= 0.8, output
    assert res["hardest"]["peak"] <= res["device_memory"], output
