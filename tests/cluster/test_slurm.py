"""The slurm/ templates, submitted as they are to a real SLURM (tests/slurm/cluster.sh: munged, slurmctld and two
emulated slurmd nodes on this machine), with CPU settings passed as sbatch options and environment variables.

- shardify as an array job + a merge job (afterok) = a single-process `shardify write`; a failing task → no merge;
- DDP training, 2 tasks, 2 epochs: equal steps per rank, no sample twice;
- preemption: USR1 to the batch script (as --signal=B:USR1@120 sends it) mid-epoch, and later USR1 to the tasks →
  the job saves, requeues itself twice, resumes, and the batch keys over the three runs are the uninterrupted run's.

Skipped with the reason when SLURM cannot be started here (no root, no apt); a failure in CI (CI=true).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import soundfile as sf
from conftest import REPO, assert_same_dataset

from streambatch import ShardIndex
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
SLURM_DIR = REPO / "slurm"
SR = 8000
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
JOB_TIMEOUT = 180


class Slurm:
    def __init__(self, env: dict[str, str]):
        self.env = env

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        p = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr or p.stdout}")
        return p

    def sbatch(self, script: Path, *options: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        out = self.run("sbatch", "--parsable", *options, str(script), cwd=cwd, env={**self.env, **(env or {})})
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job -o`` as dicts (one per array task)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait(self, job_id: str, timeout: float = JOB_TIMEOUT, log: Path | None = None) -> dict[str, str]:
        """Poll until the job (every task of an array) has ended. (``sbatch --wait`` polls with doubling
        intervals up to 32 s and follows requeues the same way; polling here keeps the suite short.)"""
        deadline = time.time() + timeout
        while True:
            jobs = self.job(job_id)
            if jobs and all(j.get("JobState") in TERMINAL for j in jobs):
                return jobs[0]
            if time.time() > deadline:
                self.run("scancel", job_id, check=False)
                pytest.fail(f"job {job_id} did not end in {timeout} s: {jobs}\n{_tail(log)}")
            time.sleep(0.5)


def _tail(path: Path | None, n: int = 60) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="session")
def slurm():
    env = dict(os.environ)
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    was_up = subprocess.run(["bash", str(CLUSTER), "check"], env=env, capture_output=True).returncode == 0
    if not was_up:
        p = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            reason = f"a SLURM test cluster could not be started: {(p.stderr or p.stdout).strip()[-1500:]}"
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(reason)
            pytest.skip(reason)
    conf = subprocess.run(["bash", str(CLUSTER), "env"], capture_output=True, text=True, check=True).stdout
    env["SLURM_CONF"] = conf.strip().split("=", 1)[1]
    # the jobs run this Python and this shardify, whether or not the venv is activated
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update(PYTHON=sys.executable, SHARDIFY=os.path.join(bindir, "shardify"), OMP_NUM_THREADS="1")
    for var in ("SLURM_JOB_ID", "SLURM_JOBID", "SBATCH_ARRAY_INX", "PARTS"):  # when pytest itself runs in a job
        env.pop(var, None)
    yield Slurm(env)
    if not was_up:
        subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slurm")
    write_audio_corpus(str(root / "audio"), 120, seed=3, sample_rate=SR)
    return root


# ---- shardify as an array job -------------------------------------------------------------------------
SHARDIFY_OPTIONS = ["--max-count", "7", "--shuffle", "--seed", "2"]


def test_array_job_and_merge_equal_a_single_process_write(slurm, corpus, tmp_path):
    out = tmp_path / "ds"
    env = {**slurm.env, "SBATCH_ARGS": "--cpus-per-task=1 --time=10", "MERGE_SBATCH_ARGS": "--time=10"}
    p = slurm.run(
        str(SLURM_DIR / "shardify.sh"), str(corpus / "audio"), str(out), "3", *SHARDIFY_OPTIONS, cwd=tmp_path, env=env
    )
    merge_id = p.stdout.strip().splitlines()[-1]
    array_id = re.search(r"array job (\d+)", p.stdout).group(1)
    merge = slurm.wait(merge_id, log=next(iter(tmp_path.glob("shardify-merge-*.out")), None))
    tasks = slurm.job(array_id)
    assert [t["JobState"] for t in tasks] == ["COMPLETED"] * 3, tasks
    assert merge["JobState"] == "COMPLETED", _tail(next(tmp_path.glob("shardify-merge-*.out")))
    assert sorted(f.name for f in out.glob("index.part-*.json")) == [f"index.part-{i:04d}.json" for i in range(3)]

    single = tmp_path / "single"
    write_shards(str(corpus / "audio"), str(single), max_count=7, shuffle=True, seed=2, progress=False)
    assert_same_dataset(out, single)
    assert ShardIndex.load(str(out)).meta["parts"] == 3


def test_a_failing_array_task_means_no_merge(slurm, tmp_path):
    m = tmp_path / "m.jsonl"
    audio = tmp_path / "a"
    write_audio_corpus(str(audio), 4, seed=1, sample_rate=SR)
    rows = [{"audio_filepath": str(p), "duration": sf.info(str(p)).duration} for p in sorted(audio.glob("*.flac"))]
    rows.append({"audio_filepath": str(audio / "missing.flac"), "duration": 1.0})  # the last part's record
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    env = {**slurm.env, "SBATCH_ARGS": "--cpus-per-task=1 --time=10", "MERGE_SBATCH_ARGS": "--time=10"}
    p = slurm.run(str(SLURM_DIR / "shardify.sh"), str(m), str(out), "2", cwd=tmp_path, env=env)
    merge_id = p.stdout.strip().splitlines()[-1]
    array_id = re.search(r"array job (\d+)", p.stdout).group(1)
    merge = slurm.wait(merge_id)
    tasks = {t["JobId"]: t for t in slurm.job(array_id)}
    states = sorted(t["JobState"] for t in tasks.values())
    assert states == ["COMPLETED", "FAILED"], tasks
    assert merge["JobState"] == "CANCELLED" and "Dependency" in merge.get("Reason", ""), merge
    assert not (out / "index.json").exists()
    failed = next(f for f in tmp_path.glob("shardify-*_1.out"))
    assert "audio file not found" in failed.read_text()


# ---- DDP training --------------------------------------------------------------------------------------
BUDGET = "10s"


def train_job(
    slurm: Slurm, corpus: Path, run: Path, *sbatch_options: str, step_sleep: float = 0.0, stage_dir: Path | None = None
) -> str:
    """Submit slurm/train_ddp.sbatch unedited: CPU settings by sbatch options, the run by environment."""
    data = corpus / "ds"
    if not (data / "index.json").exists():
        write_shards(str(corpus / "audio"), str(data), max_count=12, shuffle=True, seed=0, progress=False)
    run.mkdir(parents=True, exist_ok=True)
    env = {
        "DATA": str(data),
        "BUDGET": BUDGET,
        "EPOCHS": "2",
        "NUM_WORKERS": "2",
        "DEVICE": "cpu",
        "TRAIN_SCRIPT": str(REPO / "tools" / "train_ddp.py"),
        "CKPT_DIR": str(run / "ckpt"),
        "TRAIN_ARGS": f"--threads 1 --channels 16 --log-every 10 --log-keys {run / 'keys'} --step-sleep {step_sleep}",
    }
    if stage_dir is not None:
        env["STAGE_DIR"] = str(stage_dir)
    return slurm.sbatch(
        SLURM_DIR / "train_ddp.sbatch",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=10",
        f"--output={run}/job-%j.out",
        *sbatch_options,
        cwd=run,
        env=env,
    )


def read_keys(run: Path) -> dict[int, list[dict]]:
    logs = {}
    for f in sorted((run / "keys").glob("keys-rank*.jsonl")):
        logs[int(f.stem.split("rank")[1])] = [json.loads(line) for line in f.read_text().splitlines()]
    return logs


def batches(log: list[dict], epoch: int | None = None) -> list[dict]:
    return [e for e in log if e["event"] == "batch" and (epoch is None or e["epoch"] == epoch)]


@pytest.fixture(scope="module")
def uninterrupted(slurm, corpus, tmp_path_factory) -> dict[int, list[dict]]:
    """2 tasks on one node, 2 epochs, not interrupted."""
    run = tmp_path_factory.mktemp("uninterrupted")
    job = train_job(slurm, corpus, run, "--nodes=1", "--ntasks-per-node=2")
    log = next(iter(run.glob("job-*.out")), None)
    info = slurm.wait(job, log=log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _tail(next(run.glob("job-*.out")))
    assert info["Restarts"] == "0"
    return read_keys(run)


def test_ddp_job_two_tasks_two_epochs(uninterrupted, corpus):
    logs = uninterrupted
    assert sorted(logs) == [0, 1]
    index = ShardIndex.load(str(corpus / "ds"))
    n, too_long = index.num_samples, int((index.lengths > 10 * SR).sum())
    for epoch in (0, 1):
        heads = {r: next(e for e in log if e["event"] == "epoch" and e["epoch"] == epoch) for r, log in logs.items()}
        steps = {r: len(batches(log, epoch)) for r, log in logs.items()}
        assert len(set(steps.values())) == 1 and all(heads[r]["len"] == steps[r] > 0 for r in logs), (steps, heads)
        assert all(h["world_size"] == 2 for h in heads.values())
        keys = [k for log in logs.values() for b in batches(log, epoch) for k in b["keys"]]
        assert len(keys) == len(set(keys)), "a sample was seen twice in one epoch"
        assert heads[0]["skipped"] == too_long > 0  # longer than the budget: never emitted, counted
        assert len(keys) + heads[0]["surplus"] + too_long == n
    assert [b["keys"] for b in batches(logs[0], 0)] != [b["keys"] for b in batches(logs[0], 1)]


def _wait_for_batches(slurm: Slurm, job: str, run: Path, restart: int, epoch: int, count: int) -> None:
    deadline = time.time() + JOB_TIMEOUT
    while True:
        logs = read_keys(run)
        done = [b for b in batches(logs.get(0, []), epoch) if b["restart"] == restart]
        if len(done) >= count:
            return
        info = slurm.job(job)
        if time.time() > deadline or (info and info[0].get("JobState") in TERMINAL):
            slurm.run("scancel", job, check=False)
            pytest.fail(
                f"job {job} did not reach {count} batches of epoch {epoch} in run {restart}: {info}\n"
                + _tail(next(iter(run.glob("job-*.out")), None))
            )
        time.sleep(0.1)


def test_preempted_job_requeues_and_resumes_exactly(slurm, corpus, uninterrupted, tmp_path):
    """Two nodes x one task. USR1 to the batch script in epoch 0 (what --signal=B:USR1@120 does before the time
    limit), then USR1 to the tasks themselves in epoch 1 of the requeued run: two checkpoints, two requeues.
    The job stages the dataset to "node-local" disk first (one task per node; both emulated nodes share this
    host's disk, so the two copies race, safely); the requeued runs find it complete."""
    run = tmp_path / "preempted"
    job = train_job(
        slurm, corpus, run, "--nodes=2", "--ntasks-per-node=1", step_sleep=0.15, stage_dir=tmp_path / "local" / "ds"
    )
    steps0 = len(batches(uninterrupted[0], 0))
    _wait_for_batches(slurm, job, run, restart=0, epoch=0, count=steps0 // 3)
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    _wait_for_batches(slurm, job, run, restart=1, epoch=1, count=3)
    slurm.run("scancel", "--signal=USR1", job)  # to the job steps, not the batch script
    log = run / f"job-{job}.out"
    info = slurm.wait(job, log=log)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _tail(log)
    assert info["Restarts"] == "2", info
    assert text.count("checkpoint saved; requeueing") == 2 and "got SIGUSR1" in text, text
    assert "MASTER_ADDR=127.0.0.1" in text  # NodeAddr of the first node
    staged = re.findall(r"staged \d+ shards to \S+: copied (\d+) .*, kept (\d+)", text)
    assert len(staged) == 6, text  # 2 nodes x 3 runs
    assert all(int(c) + int(k) == 10 for c, k in staged) and all(int(c) == 0 for c, _ in staged[2:])
    assert ShardIndex.load(str(tmp_path / "local" / "ds")).num_samples == 120

    logs = read_keys(run)
    assert sorted(logs) == [0, 1]
    for r in (0, 1):
        runs = [[b for b in batches(logs[r]) if b["restart"] == k] for k in (0, 1, 2)]
        assert all(runs), "every run trained some batches"
        # the first run stopped mid-epoch 0, the second mid-epoch 1
        assert runs[0][-1]["epoch"] == 0 and runs[1][0]["epoch"] == 0 and runs[1][-1]["epoch"] == 1
        assert runs[2][0]["epoch"] == 1 and len(batches(logs[r], 1)) == len(batches(uninterrupted[r], 1))
        assert [b["keys"] for b in batches(logs[r])] == [b["keys"] for b in batches(uninterrupted[r])]
        assert [b["step"] for b in batches(logs[r])] == list(range(1, len(batches(logs[r])) + 1))
    assert (run / "ckpt" / "checkpoint.pt").exists()


def test_scancel_cancels_for_good(slurm, corpus, tmp_path):
    """SIGTERM from SLURM (scancel) reaches the batch script: the tasks stop, and the job is not requeued."""
    run = tmp_path / "cancelled"
    job = train_job(slurm, corpus, run, "--nodes=1", "--ntasks-per-node=2", step_sleep=0.1)
    _wait_for_batches(slurm, job, run, restart=0, epoch=0, count=3)
    slurm.run("scancel", job)
    log = run / f"job-{job}.out"
    info = slurm.wait(job, log=log)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    deadline = time.time() + 30  # the job is CANCELLED while its batch script still finishes
    while "not requeueing" not in log.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert "not requeueing" in log.read_text(), _tail(log)
    assert not (run / "ckpt" / "STOPPED").exists()
