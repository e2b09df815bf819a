"""A Lightning Trainer over StreamBatchDataModule, run by tests/cluster/test_lightning.py in a process of its own.

Every batch a step sees is appended to OUT as a JSON line (train: epoch, global step, batch index, keys;
validation: the keys, and whether it was the sanity check). ``--ckpt-dir`` keeps a checkpoint after every
``--save-every`` steps (``step=N.ckpt``: the state after N steps); ``--crash-at S`` raises in the step
with global step S, as a preempted or crashed job would stop; ``--resume CKPT`` restores from a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from streambatch.lightning import StreamBatchDataModule
from streambatch.procs import watch_parent


class Crash(RuntimeError):
    """The simulated failure."""


class KeyRecorder(pl.LightningModule):
    """A one-weight model that logs the keys of every batch it trains or validates on."""

    def __init__(self, out: str, crash_at: int | None):
        super().__init__()
        self.out, self.crash_at = out, crash_at
        self.net = nn.Linear(1, 1)

    def _record(self, row: dict) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    def training_step(self, batch, batch_idx):
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise Crash(f"simulated crash at step {self.global_step}")
        self._record(
            {
                "train": True,
                "epoch": self.current_epoch,
                "step": self.global_step,
                "batch_idx": batch_idx,
                "keys": batch["keys"],
            }
        )
        return self.net(batch["audio"].mean(1, keepdim=True)).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self._record(
            {"val": True, "sanity": self.trainer.sanity_checking, "epoch": self.current_epoch, "keys": batch["keys"]}
        )

    def configure_optimizers(self):
        # a schedule over the whole run reads trainer.estimated_stepping_batches, which sets up the train loader
        # before Lightning restores the loop state (Lightning issue 20550: the fit loop's copy of the loader
        # state is then not loaded; the DataModule's is)
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        total = self.trainer.estimated_stepping_batches
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=int(total) + 10),
                "interval": "step",
            },
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget", default="13s")  # the longest utterance is 12 s: none is skipped
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--ckpt-dir")
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--crash-at", type=int)
    p.add_argument("--resume")
    a = p.parse_args()
    watch_parent(os.getppid())
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    dm = StreamBatchDataModule(
        a.data, a.budget, val_source=a.data, num_workers=a.num_workers, buffer_size=40, seed=3, persistent_workers=True
    )
    callbacks = []
    if a.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(dirpath=a.ckpt_dir, filename="{step}", every_n_train_steps=a.save_every, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_epochs=a.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2,
        callbacks=callbacks,
        enable_checkpointing=bool(a.ckpt_dir),
    )
    try:
        trainer.fit(KeyRecorder(a.out, a.crash_at), datamodule=dm, ckpt_path=a.resume)
    except Crash as e:
        print(f"run_lightning: {e}", flush=True)
        raise SystemExit(3)


if __name__ == "__main__":
    main()
