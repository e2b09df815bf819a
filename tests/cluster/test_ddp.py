"""Real multi-process DDP runs (torchrun, gloo on CPU) over real shards with 2 DataLoader workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import free_port
from torchrun_jobs import BUDGET, SR, batches, check_epoch, kill_when_stopped, read_logs, run_job, torchrun, wait

from streambatch import ShardIndex
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards


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


#: the flags of the uninterrupted 2-rank run over 8 shards that two tests read: the standalone case (20, 2, split)
#: and the reference the killed and resumed job must reproduce (--train: a DDP model steps on every batch)
SHARED = ("--epochs", "2", "--even-batches", "split", "--persistent-workers", "--train")


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory) -> dict[int, list[dict]]:
    """One launch of the uninterrupted run (20 per shard, 2 ranks), shared by the tests that only read its logs."""
    return run_job(dataset(corpus, 20), tmp_path_factory.mktemp("full"), 2, *SHARED)


@pytest.mark.parametrize("max_count,nproc,even", [(20, 2, "split"), (40, 3, "drop"), (150, 2, "split"), (40, 3, "pad")])
def test_torchrun_standalone(corpus, tmp_path, request, max_count, nproc, even):
    """2 ranks over 8 shards, 3 ranks over 4 shards (uneven), 2 ranks over 1 shard; 2 workers each."""
    data = dataset(corpus, max_count)
    n = ShardIndex.load(data).num_samples
    if (max_count, nproc, even) == (20, 2, "split"):
        logs = request.getfixturevalue("full_run")  # the same flags: the shared launch
    else:
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


def test_kill_and_resume_gives_the_uninterrupted_sequence(corpus, tmp_path, full_run):
    """Killed mid-way through epoch 1 and resumed (DataLoader workers started afresh each epoch): the batches of
    the uninterrupted run."""
    data = dataset(corpus, 20)
    common = ["--data", data, "--budget", str(BUDGET), "--epochs", "2", "--train"]
    full = full_run
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
