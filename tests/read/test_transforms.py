"""Per-sample transforms: seeded by (seed, epoch, global sample id), so a job killed and resumed in fresh processes
(0 and 2 workers, and under torchrun on another world size) emits bit-identical augmented tensors, and epochs
differ. A transform that lengthens a sample is an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TESTS, audio_dataset, finish, kill_tree, popen

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.plan.perturb import sample_rng

SR = 16000
BUDGET = "14s"  # the longest utterance is 12 s, 13.3 s at speed 0.9: none is skipped
SCRIPT = str(TESTS / "ddp" / "run_augment.py")
TIMEOUT = 180


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("augment")
    return audio_dataset(root, 48, 3, SR, max_count=8, shuffle=True, seed=0)


def job(data: str, out: Path, *args: str, nproc: int = 0) -> subprocess.Popen:
    """run_augment.py in a fresh process (or under torchrun with ``nproc`` ranks); the test's teardown ends it."""
    out.mkdir(parents=True, exist_ok=True)
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    return popen(
        [*head, SCRIPT, "--data", data, "--out", str(out), "--budget", BUDGET, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def kill_when_stopped(proc: subprocess.Popen, out: Path, ranks: int) -> None:
    deadline = time.time() + TIMEOUT
    while len(list(out.glob("stopped-rank*"))) < ranks:
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc.pid)
            pytest.fail("the job did not reach its stop step")
        time.sleep(0.2)
    kill_tree(proc.pid, grace=0)  # a hard kill of the job and its workers
    proc.wait()


def logs(out: Path) -> dict[int, list[dict]]:
    return {
        int(f.stem.split("rank")[1]): [json.loads(x) for x in f.read_text().splitlines()]
        for f in sorted(out.glob("log-rank*.jsonl"))
    }


def batches(log: list[dict]) -> list[dict]:
    return [r for r in log if r["event"] == "batch"]


def per_sample(runs: dict[int, list[dict]]) -> dict[tuple[int, str], str]:
    """(epoch, key) → sha256 of the sample's emitted tensor, over every rank."""
    out = {}
    for log in runs.values():
        for b in batches(log):
            for k, h in zip(b["keys"], b["sample_sha"]):
                out[(b["epoch"], k)] = h
    return out


@pytest.mark.parametrize("num_workers,features", [(0, False), (2, True)])
def test_kill_and_resume_gives_bit_identical_augmented_batches(data, tmp_path, num_workers, features):
    """Transform and speed perturbation (and fbank features): the resumed run's remaining batches are the
    uninterrupted run's, tensor for tensor; the same sample differs between epochs."""
    args = ["--num-workers", str(num_workers), "--epochs", "2", "--speed", *(["--features"] if features else [])]
    finish(job(data, tmp_path / "full", *args), TIMEOUT)
    full = batches(logs(tmp_path / "full")[0])
    steps0 = sum(1 for b in full if b["epoch"] == 0)
    out = tmp_path / "killed"
    kill_when_stopped(job(data, out, *args, "--stop-after", str(steps0 - 2)), out, 1)
    finish(job(data, out, *args, "--resume"), TIMEOUT)
    resumed = batches(logs(out)[0])
    assert [b["step"] for b in resumed] == list(range(1, len(full) + 1))
    assert [(b["keys"], b["batch_sha"], b["speed"]) for b in resumed] == [
        (b["keys"], b["batch_sha"], b["speed"]) for b in full
    ]
    shas = per_sample({0: full})
    keys = {k for _, k in shas}
    assert all(shas[(0, k)] != shas[(1, k)] for k in keys), "an augmented sample was the same in two epochs"


@pytest.mark.cluster
def test_resume_on_another_world_size_keeps_every_augmented_tensor(data, tmp_path):
    """2 ranks under torchrun are killed mid-epoch, 3 ranks resume: every sample the resumed job emits is bit for
    bit the tensor the uninterrupted 2-rank job emitted for it, and none is lost or repeated."""
    args = ["--num-workers", "2", "--speed"]
    finish(job(data, tmp_path / "full", *args, nproc=2), TIMEOUT)
    full = per_sample(logs(tmp_path / "full"))
    out = tmp_path / "killed"
    kill_when_stopped(job(data, out, *args, "--stop-after", "2", nproc=2), out, 2)
    for f in out.glob("log-rank*.jsonl"):
        f.rename(f.with_suffix(".before"))
    (out / "state-rank2.json").write_text((out / "state-rank0.json").read_text())
    before = {}
    for f in out.glob("log-rank*.before"):
        for r in (json.loads(x) for x in f.read_text().splitlines()):
            before.update({(r["epoch"], k): h for k, h in zip(r["keys"], r["sample_sha"])})
    finish(job(data, out, *args, "--resume", nproc=3), TIMEOUT)
    after = per_sample(logs(out))
    assert before and after and not set(before) & set(after)
    assert len(before) + len(after) == ShardIndex.load(data).num_samples
    assert {**before, **after} == full


def test_transform_gets_the_sample_and_its_own_generator(data):
    seen = {}

    def record(sample, rng):
        seen[sample["__key__"]] = (sample["__id__"], rng.integers(1 << 62))
        return sample

    loader = StreamBatchLoader(data, budget=BUDGET, seed=7, transform=record)
    loader.set_epoch(3)
    got = [b for b in loader]
    assert sum(len(b["keys"]) for b in got) == len(seen) == ShardIndex.load(data).num_samples
    for gid, draw in seen.values():
        assert draw == sample_rng(7, 3, gid).integers(1 << 62)
    assert len({gid for gid, _ in seen.values()}) == len(seen)


def test_a_lengthening_transform_is_an_error_naming_it(data):
    def stretch(sample, rng):
        sample["audio"] = torch.cat([sample["audio"], sample["audio"][:10]])
        return sample

    loader = StreamBatchLoader(data, budget=BUDGET, transform=stretch)
    with pytest.raises(ValueError, match=r"transform .*stretch made sample .* longer than the \d+ steps planned"):
        next(iter(loader))


def test_a_shortening_transform_is_fine_and_lengths_follow(data):
    def halve(sample, rng):
        sample["audio"] = sample["audio"][: sample["audio"].shape[0] // 2]
        return sample

    for b in StreamBatchLoader(data, budget=BUDGET, transform=halve):
        index_lengths = np.round(np.array(b["duration"]) * SR).astype(np.int64)
        assert np.all(np.abs(b["lengths"].numpy() - index_lengths // 2) <= 1)
        assert int(b["lengths"].max()) == b["audio"].shape[1]
        assert torch.equal(b["padding_mask"], torch.arange(b["audio"].shape[1])[None] >= b["lengths"][:, None])


def test_transform_needs_an_index(data):
    urls = sorted(str(p) for p in Path(data).glob("*.tar"))
    with pytest.raises(ValueError, match="transform need an index"):
        StreamBatchLoader(urls, budget=8 * SR, transform=lambda s, r: s)


def test_transform_needs_decoded_samples(data):
    with pytest.raises(ValueError, match="decode='none' keeps them raw"):
        StreamBatchLoader(data, budget=BUDGET, decode="none", transform=lambda s, r: s)
