"""``loader.metrics()``: the figures agree with what the batches themselves say."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import text_dataset
from faultproxy import Rule

from streambatch import StreamBatchLoader

pytest_plugins = ["conftest_s3"]

BUDGET = 2000


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("metrics"), 200, 4, max_count=30)


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

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "streambatch.cli",
            "inspect",
            text_ds,
            "--plan",
            "--budget",
            str(BUDGET),
            "--world-size",
            "2",
            "--num-workers",
            "2",
            "--json",
            "--plot",
            str(tmp_path / "plan.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    loaders = [StreamBatchLoader(text_ds, budget=BUDGET, rank=r, world_size=2, num_workers=2) for r in range(2)]
    assert p["steps"] == len(loaders[0]) == len(loaders[1])
    assert sum(p["batch_sizes"]["counts"]) == p["batches"]
    assert sum(p["samples_per_rank"]) + p["left_out"] == 200
    assert (tmp_path / "plan.png").stat().st_size > 0
    bad = subprocess.run(
        [sys.executable, "-m", "streambatch.cli", "inspect", text_ds, "--plan"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--plan needs --budget" in bad.stderr


# ---- time the readers waited on storage -----------------------------------------------------------------
AUDIO_BUDGET = 12 * 8000
DELAY = 0.08  # seconds the proxy adds to every shard request


def audio_loader(source, workers, **kw):
    return StreamBatchLoader(source, budget=AUDIO_BUDGET, seed=7, num_workers=workers, chunk_size="64K", **kw)


def storage_pass(loader):
    """One pass; its metrics, checked: a figure per reader that add up to the total."""
    n = len(list(loader))
    m = loader.metrics()
    assert m["batches"] == n and len(m["waited_on_storage_per_worker_s"]) == max(1, loader.num_workers)
    assert m["waited_on_storage_s"] == pytest.approx(sum(m["waited_on_storage_per_worker_s"]))
    return m


@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize("workers", [0, 2])
def test_time_waited_on_storage(s3_data, proxy, workers, caplog):
    """Reading on demand through a proxy that answers each shard request ``DELAY`` s late, the readers wait at
    least for every request, and the next pass, not delayed, starts from 0 and waits less; read-ahead hides part
    of it (its background requests are not the readers' wait); local shards in page cache cost next to nothing."""
    local = audio_loader(s3_data.local, workers)
    storage_pass(local)  # warms the page cache
    near = storage_pass(local)
    caplog.set_level("INFO", logger="streambatch")
    on_demand = audio_loader(s3_data.url, workers, storage_options=s3_data.proxied, read_ahead=0)
    proxy.reset(Rule("latency", match=".tar", seconds=DELAY))
    slow = storage_pass(on_demand)
    blocking = len(proxy.gets(".tar"))  # read on demand: a reader waits for each of its requests itself
    proxy.reset()
    undelayed = storage_pass(on_demand)
    proxy.reset(Rule("latency", match=".tar", seconds=DELAY))
    ahead = storage_pass(audio_loader(s3_data.url, workers, storage_options=s3_data.proxied))
    print(
        f"\nworkers={workers}: {blocking} requests x {DELAY} s; waited on storage: on demand "
        f"{slow['waited_on_storage_s']:.3f} s {[round(x, 3) for x in slow['waited_on_storage_per_worker_s']]}, "
        f"not delayed {undelayed['waited_on_storage_s']:.3f} s, read-ahead {ahead['waited_on_storage_s']:.3f} s, "
        f"local {near['waited_on_storage_s']:.4f} s"
    )
    assert blocking >= 8 and slow["waited_on_storage_s"] >= 0.5 * blocking * DELAY
    assert min(slow["waited_on_storage_per_worker_s"]) >= 0.5 * DELAY  # every reader waited for its own
    assert undelayed["waited_on_storage_s"] < slow["waited_on_storage_s"]  # per pass, not since construction
    assert min(ahead["waited_on_storage_per_worker_s"]) >= 0.5 * DELAY  # at least for its first request
    assert ahead["waited_on_storage_s"] < slow["waited_on_storage_s"]  # requests in flight while it parsed
    assert near["waited_on_storage_s"] < min(0.25 * blocking * DELAY, slow["waited_on_storage_s"])
    assert any("readers waited on storage" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("watchdog")
def test_time_waited_on_the_node_cache(s3_data, proxy, tmp_path):
    """With a node cache, the reader waits for a shard's download (at least the first one's); the next pass
    reads the cached copies from local disk and waits less."""
    loader = audio_loader(s3_data.url, 0, storage_options=s3_data.proxied, cache_dir=str(tmp_path / "cache"))
    proxy.reset(Rule("latency", match=".tar", seconds=DELAY))
    downloading = storage_pass(loader)
    cached = storage_pass(loader)
    print(
        f"\ncache: waited on storage {downloading['waited_on_storage_s']:.3f} s downloading "
        f"({len(proxy.gets('.tar'))} requests x {DELAY} s), {cached['waited_on_storage_s']:.4f} s from the cache"
    )
    assert downloading["storage"]["cache_downloads"] == 8 and cached["storage"]["cache_hits"] == 8
    assert downloading["waited_on_storage_s"] >= 0.5 * DELAY
    assert cached["waited_on_storage_s"] < downloading["waited_on_storage_s"]
