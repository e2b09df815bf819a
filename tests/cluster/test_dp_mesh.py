"""Data parallelism inside a model-parallel mesh: torchrun with 4 gloo ranks as 2 data-parallel groups × 2
tensor-parallel peers (``dp_rank=rank // 2, dp_size=2``, and the same through a CPU DeviceMesh), one launch."""

from __future__ import annotations

import json

import pytest
from conftest import TESTS
from torchrun_jobs import BUDGET, SR, torchrun, wait

from streambatch import ShardIndex
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SCRIPT = str(TESTS / "ddp" / "run_dp_mesh.py")
STOP = 3  # batches the interrupted run yields before its state is saved


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[dict[int, dict], int]:
    """One launch of tests/ddp/run_dp_mesh.py on 4 ranks over 8 shards: every rank's report and the sample count."""
    root = tmp_path_factory.mktemp("dp_mesh")
    write_audio_corpus(str(root / "audio"), 150, seed=2, sample_rate=SR)
    data = str(root / "shards")
    write_shards(str(root / "audio"), data, max_count=20, shuffle=True, seed=0, progress=False)
    out = root / "out"
    out.mkdir()
    args = ["--data", data, "--out", str(out), "--budget", str(BUDGET), "--stop", str(STOP)]
    wait(torchrun(args, 4, script=SCRIPT))
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    return reports, ShardIndex.load(data).num_samples


def keys(batches: list[dict]) -> list[str]:
    return [k for b in batches for k in b["keys"]]


def test_peers_get_identical_batches_and_groups_disjoint_samples(job):
    reports, n = job
    assert [reports[r]["data_parallel"] for r in range(4)] == [{"rank": r // 2, "size": 2} for r in range(4)]
    for peer, other in ((0, 1), (2, 3)):
        assert reports[peer]["full"] == reports[other]["full"]  # keys and tensor hashes, step by step
    steps = {r: len(reports[r]["full"]) for r in range(4)}
    assert set(steps.values()) == {reports[0]["len"]} and all(reports[r]["len"] == steps[r] for r in range(4))
    group0, group1 = keys(reports[0]["full"]), keys(reports[2]["full"])
    assert not set(group0) & set(group1)
    assert len(group0) + len(group1) == len(set(group0) | set(group1)) == n  # every sample once (split: no surplus)


def test_planning_is_rank_local_over_the_data_parallel_ranks(job):
    reports, _ = job
    for r in range(4):
        (line,) = reports[r]["plan_log"][:1]
        assert "rank-local" in line and "on 2 ranks" in line and f"rank {r // 2} planned" in line, line


def test_a_resumed_loader_yields_the_rest_of_the_uninterrupted_epoch(job):
    reports, _ = job
    for r in range(4):
        rep = reports[r]
        assert rep["state_world_size"] == 2  # the checkpoint's layout counts data-parallel ranks
        assert rep["head"] + rep["tail"] == rep["full"]
        assert rep["resumed_len"] == rep["len"]


def test_resuming_on_one_data_parallel_rank_loses_and_repeats_nothing(job):
    reports, n = job
    before = keys(reports[0]["head"]) + keys(reports[2]["head"])
    after = [keys(reports[r]["elastic"]) for r in range(4)]
    assert after[0] == after[1] == after[2] == after[3]  # every process is a peer of the one rank
    assert len(before) + len(after[0]) == len(set(before) | set(after[0])) == n


def test_a_device_mesh_gives_the_same_batches(job):
    reports, _ = job
    for r in range(4):
        assert reports[r]["mesh"] == reports[r]["full"]
        assert reports[r]["mesh_len"] == reports[r]["mesh_1d_len"] == reports[r]["len"]
