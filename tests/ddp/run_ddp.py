"""A DDP job over StreamBatchLoader, run by the tests under torchrun (gloo, CPU).

Every rank logs each batch (epoch, step, keys, padded cost) to OUT/log-rank{R}.jsonl and all-reduces once
per step, so ranks stepping unevenly would hang (and the test's timeout would fail loudly). With
``--stop-after N`` each rank saves model, optimizer and ``loader.state_dict()`` after global step N, writes
OUT/stopped-rank{R} and waits to be killed; ``--resume`` continues from those checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from streambatch import StreamBatchLoader
from streambatch.procs import watch_parent


class TinySpeechModel(nn.Module):
    """A few strided 1-D convolutions over the padded waveform and a classification head."""

    def __init__(self, classes: int = 8):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 8, 16, stride=8), nn.ReLU(), nn.Conv1d(8, 16, 8, stride=4), nn.ReLU(), nn.AdaptiveAvgPool1d(1)
        )
        self.head = nn.Linear(16, classes)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(audio[:, None, :]).squeeze(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="a dataset folder or a mixture file")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--buffer-size", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--even-batches", default="split")
    p.add_argument("--stop-after", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--train", action="store_true")
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--batch-by", default=None, help="batch_by of a mixture: 'dataset'")
    a = p.parse_args()
    watch_parent(os.getppid())  # torchrun killed by SIGKILL: this rank ends too instead of waiting forever

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinySpeechModel()
    ddp = nn.parallel.DistributedDataParallel(model) if a.train else None
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = StreamBatchLoader(
        a.data,
        budget=a.budget,
        num_workers=a.num_workers,
        buffer_size=a.buffer_size,
        seed=a.seed,
        even_batches=a.even_batches,
        persistent_workers=a.persistent_workers,
        **({"batch_by": a.batch_by} if a.batch_by else {}),
    )
    ckpt = os.path.join(a.out, f"ckpt-rank{rank}.pt")
    step = 0
    if a.resume:
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
    log = open(os.path.join(a.out, f"log-rank{rank}.jsonl"), "a")
    start_epoch = loader.epoch
    for epoch in range(start_epoch, a.epochs):
        loader.set_epoch(epoch)
        planned = len(loader)
        log.write(
            json.dumps(
                {
                    "event": "epoch",
                    "epoch": epoch,
                    "len": planned,
                    "world_size": world,
                    "surplus": loader.plan().surplus_samples,
                }
            )
            + "\n"
        )
        for batch in loader:
            audio = batch["audio"]
            if ddp is not None:
                target = torch.tensor([len(k) % 8 for k in batch["keys"]])
                loss = nn.functional.cross_entropy(ddp(audio), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
            t = torch.ones(1)
            dist.all_reduce(t)  # a collective every step: uneven steps would hang here
            step += 1
            log.write(
                json.dumps(
                    {
                        "event": "batch",
                        "epoch": epoch,
                        "step": step,
                        "keys": batch["keys"],
                        "dataset": batch.get("dataset"),
                        "text": batch.get("text"),
                        "cost": audio.shape[0] * audio.shape[1],
                    }
                )
                + "\n"
            )
            log.flush()
            if step == a.stop_after:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "loader": loader.state_dict(),
                        "step": step,
                    },
                    ckpt,
                )
                open(os.path.join(a.out, f"stopped-rank{rank}"), "w").close()
                while True:  # wait to be killed, like a preempted job
                    time.sleep(1)
    log.write(json.dumps({"event": "done", "steps": step}) + "\n")
    log.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
