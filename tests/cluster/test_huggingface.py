"""Hugging Face accelerate and transformers.Trainer over StreamBatchLoader: a run stopped mid-epoch (after the
checkpoint of step k) and resumed by fresh objects from that checkpoint trains on exactly the batches the
uninterrupted run trained on after step k, in the same order, and ends where it ends.

The runs are tests/huggingface/hf_runs.py in this process (importing transformers costs more than a run), over
real shards: a tiny local model, nothing downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import free_port, text_dataset  # noqa: E402
from huggingface import hf_runs  # noqa: E402

from streambatch import ShardIndex, StreamBatchLoader  # noqa: E402


def batches(path: Path) -> list[list[str]]:
    """The sample keys of each batch a run trained on, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    shards = text_dataset(root, 60, seed=3, max_count=10)
    return {"root": root, "shards": shards, "samples": ShardIndex.load(shards).num_samples}


def per_epoch(shards: str, num_workers: int = 0) -> list[int]:
    """The batches of epochs 0 and 1 as planned (the plan deals shards to the workers: it depends on them)."""
    loader = StreamBatchLoader(shards, 400, seed=3, num_workers=num_workers)
    return [loader.schedule(e).steps for e in range(2)]


def test_accelerate_passes_the_loader_through_and_resumes_exactly(data):
    root, shards = data["root"] / "acc", data["shards"]
    root.mkdir()
    epochs = per_epoch(shards)
    n0 = epochs[0]
    total, weights = hf_runs.run_accelerate(shards, root / "full.jsonl")  # prepare() returned the loader (asserted)
    full = batches(root / "full.jsonl")
    assert total == len(full) == sum(epochs)
    for epoch in (full[:n0], full[n0:]):  # each epoch: every sample once
        keys = [k for b in epoch for k in b]
        assert len(keys) == len(set(keys)) == data["samples"]
    for k in (n0 // 2, n0):  # mid-epoch 0, and after its last batch
        run = root / f"stop-{k}"
        run.mkdir()
        assert hf_runs.run_accelerate(shards, run / "a.jsonl", ckpt_dir=run, stop_at=k)[0] == k
        done, after_weights = hf_runs.run_accelerate(shards, run / "b.jsonl", resume=run / f"step-{k}")
        before, after = batches(run / "a.jsonl"), batches(run / "b.jsonl")
        assert before == full[:k] and after == full[k:] and done == total
        same_weights(after_weights, weights)


@pytest.mark.parametrize(
    ("accumulate", "workers", "stops"),
    [(1, 0, ("mid-epoch", "end of epoch 0")), (5, 2, ("mid-epoch", "across the epochs"))],
)
def test_trainer_resumes_from_the_loader_state_exactly(data, accumulate, workers, stops):
    root = data["root"] / f"trainer-{accumulate}"
    root.mkdir()
    epochs = per_epoch(data["shards"], workers)
    n0, total = epochs[0], sum(epochs)
    steps = -(-total // accumulate)  # optimizer steps: the last one may take fewer batches
    assert accumulate == 1 or total % accumulate, "the last optimizer step takes fewer batches (a case to test)"
    run = dict(accumulate=accumulate, num_workers=workers)
    state, weights = hf_runs.run_trainer(data["shards"], root / "full.jsonl", **run)
    full = batches(root / "full.jsonl")
    assert len(full) == total and state.global_step == state.max_steps == steps and state.epoch == 2
    for stop in stops:
        k = stop_step(stop, n0, accumulate)
        ckpt = root / f"stop-{k}"
        hf_runs.run_trainer(data["shards"], ckpt / "a.jsonl", ckpt_dir=ckpt, stop_at=k, **run)
        saved = json.loads((ckpt / f"checkpoint-{k}" / "trainer_state.json").read_text())
        assert saved["global_step"] == k
        assert saved["epoch"] == pytest.approx(k * accumulate / n0)  # the loader's epoch, as the Trainer logs it
        resumed, after_weights = hf_runs.run_trainer(
            data["shards"], ckpt / "b.jsonl", ckpt_dir=ckpt, resume=ckpt / f"checkpoint-{k}", **run
        )
        before, after = batches(ckpt / "a.jsonl"), batches(ckpt / "b.jsonl")
        assert before == full[: k * accumulate] and after == full[k * accumulate :]  # nothing replayed nor lost
        assert resumed.global_step == resumed.max_steps == steps and resumed.epoch == 2
        same_weights(after_weights, weights)


def stop_step(stop: str, n0: int, accumulate: int) -> int:
    """The optimizer step a run stops after: half-way through epoch 0 (of ``n0`` batches), after its last batch,
    or the first step whose batches come from both epochs."""
    batches = {"mid-epoch": n0 // 2, "end of epoch 0": n0, "across the epochs": n0 + 1}[stop]
    return -(-batches // accumulate) if stop == "across the epochs" else batches // accumulate


def same_weights(resumed: dict, uninterrupted: dict) -> None:
    """The same optimizer steps on the same batches from the same start: the same model."""
    for name, w in uninterrupted.items():
        torch.testing.assert_close(resumed[name], w, msg=name)


def test_a_run_of_max_steps_crosses_epochs_and_keeps_its_place(data):
    from streambatch.hf import TrainerLoader

    n0, n1 = per_epoch(data["shards"])
    loader = StreamBatchLoader(data["shards"], 400, seed=3)
    whole = [b["keys"] for e in range(2) for b in (loader.set_epoch(e) or loader)]
    loader = StreamBatchLoader(data["shards"], 400, seed=3)
    view = TrainerLoader(loader, batches=n0 + 2)  # a run of max_steps: into epoch 1, ending mid-epoch
    assert len(view) == n0 + 2 and view.position == 0
    assert [b["keys"] for b in view] == whole[: n0 + 2]
    assert (loader.epoch, loader.consumed, view.position, view.epoch) == (1, 2, n0 + 2, 1 + 2 / n1)
    restored = TrainerLoader(StreamBatchLoader(data["shards"], 400, seed=3), epochs=2)
    restored.load_state_dict(view.state_dict())  # the rest of the two epochs, from there
    assert restored.position == n0 + 2 and len(restored) == n0 + n1
    assert [b["keys"] for b in restored] == whole[n0 + 2 :]


def test_a_checkpoint_without_the_loader_state_is_refused_by_name(tmp_path):
    from streambatch.errors import StreamBatchError
    from streambatch.hf import read_loader_state, write_loader_state

    state = {"epoch": 1, "batches_consumed": 3}
    write_loader_state(str(tmp_path / "checkpoint-4"), 1, state)
    assert read_loader_state(str(tmp_path / "checkpoint-4"), 1) == state
    with pytest.raises(StreamBatchError, match=r"checkpoint-4 holds no loader state for rank 0"):
        read_loader_state(str(tmp_path / "checkpoint-4"), 0)
    (tmp_path / "checkpoint-4" / "streambatch-loader-rank1.json").write_text("[1, 2")
    with pytest.raises(StreamBatchError, match="unreadable loader state"):
        read_loader_state(str(tmp_path / "checkpoint-4"), 1)
    (tmp_path / "checkpoint-4" / "streambatch-loader-rank1.json").write_text("[1, 2]")
    with pytest.raises(StreamBatchError, match="a loader state is a JSON object"):
        read_loader_state(str(tmp_path / "checkpoint-4"), 1)


def test_the_package_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['accelerate'] = None\n"
        "import streambatch, streambatch.loader\n"
        "try:\n    import streambatch.hf\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "pip install 'streambatch[hf-train]'" in out.stdout, out.stderr


def test_trainer_under_torchrun_resumes_each_rank_exactly(data, tmp_path):
    """Two ranks (gloo on CPU): each rank's loader state is in the checkpoint, and each resumes exactly."""
    from torchrun_jobs import torchrun, wait

    shards = data["shards"]
    plans = [StreamBatchLoader(shards, 400, seed=3, rank=r, world_size=2) for r in range(2)]
    n0 = plans[0].schedule(0).steps
    assert n0 == plans[1].schedule(0).steps  # equal steps on every rank
    k = n0 // 2
    script = str(Path(hf_runs.__file__).with_name("torchrun_trainer.py"))
    wait(torchrun(["--data", shards, "--out", str(tmp_path), "--stop-at", str(k)], 2, script=script), timeout=300)
    assert sorted(p.name for p in (tmp_path / "ckpt" / f"checkpoint-{k}").glob("streambatch-loader-*")) == [
        "streambatch-loader-rank0.json",
        "streambatch-loader-rank1.json",
    ]
    seen = []
    for r in range(2):
        full = batches(tmp_path / f"full-rank{r}.jsonl")
        before, after = batches(tmp_path / f"a-rank{r}.jsonl"), batches(tmp_path / f"b-rank{r}.jsonl")
        assert before == full[:k] and after == full[k:]
        result = json.loads((tmp_path / f"result-rank{r}.json").read_text())
        assert result["full"] == result["resumed"] == [len(full), len(full)] and result["same_weights"]
        seen += [key for b in full[:n0] for key in b]
    assert len(seen) == len(set(seen)) == data["samples"]  # epoch 0: every sample once over the two ranks


def test_accelerate_launch_multi_process_on_cpu_splits_the_epoch(data, tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` with ``Accelerator(cpu=True)`` (the guide's command):
    two processes in one gloo group, each yielding its own rank's share, the same number of batches on each."""
    from conftest import finish, popen

    port = free_port()  # on loopback, for the process group's rendezvous
    script = str(Path(hf_runs.__file__).with_name("accelerate_ranks.py"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    finish(popen([*cmd, script, data["shards"], str(tmp_path)], env=env), 300, "accelerate launch")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 and "MULTI_CPU" in r["distributed_type"] for r in ranks), ranks
    assert all(r["same_object"] for r in ranks)  # prepare() passes the loader through
    steps = [len(r["batches"]) for r in ranks]
    assert steps[0] == steps[1] == ranks[0]["len"] == ranks[1]["len"] > 0
    seen = [k for r in ranks for b in r["batches"] for k in b]
    assert len(seen) == len(set(seen))  # the ranks' shares are disjoint
    planned = StreamBatchLoader(data["shards"], 400, seed=3, rank=0, world_size=2).plan()
    assert len(seen) + planned.surplus_samples == data["samples"]  # every sample once but the counted surplus
