"""Lightning: a Trainer over StreamBatchDataModule stopped mid-epoch and restored from its checkpoint in a fresh
process sees exactly the batches the uninterrupted run saw after that point, and every epoch moves on.

Each run is tests/lightning/run_lightning.py in a process of its own, over real shards, with two DataLoader
workers; it logs the keys of every batch its steps see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from conftest import REPO, TESTS, popen  # noqa: E402

from streambatch import ShardIndex  # noqa: E402
from streambatch.synthetic import write_audio_corpus  # noqa: E402
from streambatch.write.writer import write_shards  # noqa: E402

SCRIPT = TESTS / "lightning" / "run_lightning.py"
ROOT = REPO


def run(data: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """One Trainer run in a fresh process; its output is kept for the assertion messages."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = popen(
        [sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_batches(rows: list[dict], before_step: int | None = None) -> list[tuple[int, list[str]]]:
    """(epoch, keys) of each training step, in order; with ``before_step`` only the steps before it."""
    return [
        (r["epoch"], r["keys"]) for r in rows if r.get("train") and (before_step is None or r["step"] < before_step)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real shards; one uninterrupted 2-epoch run; one run checkpointing every step that crashes two steps into
    epoch 1 (the steps after its last checkpoint are lost, as in a preempted job)."""
    root = tmp_path_factory.mktemp("lightning")
    write_audio_corpus(str(root / "audio"), 60, seed=5, sample_rate=8000)
    data = root / "shards"
    write_shards(str(root / "audio"), str(data), max_count=10, progress=False)
    full = run(data, root / "full.jsonl")
    assert full.returncode == 0, full.stdout
    first_epoch = len(train_batches([r for r in records(root / "full.jsonl") if r["epoch"] == 0]))
    crash = run(data, root / "crash.jsonl", "--ckpt-dir", str(root / "ckpt"), "--crash-at", str(first_epoch + 2))
    assert crash.returncode == 3 and "simulated crash" in crash.stdout, crash.stdout
    return {"root": root, "data": data, "first_epoch": first_epoch}


@pytest.mark.parametrize("where", ["mid-epoch", "end of epoch 0"])
def test_restored_trainer_sees_exactly_the_remaining_batches(runs, where):
    root, n0 = runs["root"], runs["first_epoch"]
    step = n0 // 2 if where == "mid-epoch" else n0
    ckpt = root / "ckpt" / f"step={step}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (root / "ckpt").iterdir())
    out = root / f"resumed-{step}.jsonl"
    resumed = run(runs["data"], out, "--resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stdout
    before = train_batches(records(root / "crash.jsonl"), before_step=step)  # what the checkpoint holds
    after = train_batches(records(out))
    full = train_batches(records(root / "full.jsonl"))
    assert len(before) == step
    assert before + after == full  # same batches in the same order: none repeated, none lost
    assert after[0][0] == (0 if step < n0 else 1)


def test_every_epoch_and_validation_run_sees_each_sample_once(runs):
    rows = records(runs["root"] / "full.jsonl")
    epochs = {e: [k for ep, ks in train_batches(rows) if ep == e for k in ks] for e in (0, 1)}
    total = ShardIndex.load(str(runs["data"])).num_samples
    assert len(epochs[0]) == len(set(epochs[0])) == total == 60
    assert Counter(epochs[0]) == Counter(epochs[1])
    assert epochs[0] != epochs[1]  # the second epoch is planned afresh, not replayed nor empty
    for e in (0, 1):
        val = [k for r in rows if r.get("val") and not r["sanity"] and r["epoch"] == e for k in r["keys"]]
        assert sorted(val) == sorted(epochs[0])
    sanity = [r for r in rows if r.get("val") and r["sanity"]]
    assert len(sanity) == 2  # num_sanity_val_steps=2 cut a validation pass short; the next runs are whole


def test_a_plain_trainer_fit_over_the_loader_trains_every_epoch(tmp_path):
    """``trainer.fit(model, train_dataloaders=loader)`` without the DataModule: every Lightning epoch trains the
    loader's next epoch (before, every second epoch trained no batch), batches in the loader's order."""
    import lightning.pytorch as pl
    import torch

    from streambatch import StreamBatchLoader

    write_audio_corpus(str(tmp_path / "audio"), 40)
    write_shards(str(tmp_path / "audio"), str(tmp_path / "shards"), max_count=10, progress=False)
    reference = StreamBatchLoader(str(tmp_path / "shards"), budget="30s", seed=5)
    expected = []
    for epoch in range(4):
        reference.set_epoch(epoch)
        expected += [list(b["keys"]) for b in reference]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[int, list[str]]] = []

        def training_step(self, batch, i):
            self.seen.append((self.current_epoch, list(batch["keys"])))
            return (self.w * batch["audio"].mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    trainer = pl.Trainer(
        max_epochs=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, train_dataloaders=StreamBatchLoader(str(tmp_path / "shards"), budget="30s", seed=5))
    per_epoch = Counter(epoch for epoch, _ in model.seen)
    assert sorted(per_epoch) == [0, 1, 2, 3] and min(per_epoch.values()) > 0, per_epoch
    got = [keys for _, keys in model.seen]
    assert got == expected[: len(got)] and len(got) >= len(expected) - max(per_epoch.values())
