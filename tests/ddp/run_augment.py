"""A job over StreamBatchLoader with per-sample stages (transform, speed_perturb, features), run by the tests as a
plain process or under torchrun (gloo, CPU).

Every rank logs each batch to OUT/log-rank{R}.jsonl: keys, the sha256 of the whole padded payload, each sample's
unpadded tensor's sha256, its length and speed factor, and the padded cost. With ``--stop-after N`` each rank
saves ``loader.state_dict()`` after step N, writes OUT/stopped-rank{R} and waits to be killed; ``--resume``
continues from that state in a fresh process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np
import torch

from streambatch import StreamBatchLoader
from streambatch.procs import watch_parent


def add_noise(sample: dict, rng: np.random.Generator) -> dict:
    """Gain and white noise from the sample's own generator, then a random cut of up to 5 % at the end."""
    wav = sample["audio"]
    noisy = wav * float(rng.uniform(0.5, 1.5)) + torch.from_numpy(rng.normal(0, 0.01, wav.shape[0]).astype(np.float32))
    sample["audio"] = noisy[: wav.shape[0] - int(rng.integers(0, wav.shape[0] // 20 + 1))]
    return sample


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def record(batch: dict, epoch: int, step: int) -> dict:
    """What the log keeps of a batch: enough to tell two runs' tensors apart bit for bit."""
    name = "features" if "features" in batch else "audio"
    x, lengths = batch[name], batch["lengths"].tolist()
    return {
        "event": "batch",
        "epoch": epoch,
        "step": step,
        "keys": batch["keys"],
        "batch_sha": sha(x),
        "sample_sha": [sha(x[i, :n]) for i, n in enumerate(lengths)],
        "lengths": lengths,
        "speed": batch["speed"].tolist() if "speed" in batch else None,
        "durations": batch.get("duration"),
        "cost": int(x.shape[0] * x.shape[1]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--buffer-size", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", action="store_true")
    p.add_argument("--features", action="store_true")
    p.add_argument("--stop-after", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    watch_parent(os.getppid())
    torch.set_num_threads(1)
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    loader = StreamBatchLoader(
        a.data,
        budget=a.budget,
        num_workers=a.num_workers,
        buffer_size=a.buffer_size,
        seed=a.seed,
        transform=add_noise,
        speed_perturb=(0.9, 1.0, 1.1) if a.speed else None,
        features="fbank" if a.features else None,
    )
    rank = loader.rank
    ckpt = os.path.join(a.out, f"state-rank{rank}.json")
    step = 0
    if a.resume:
        with open(ckpt) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["loader"])
        step = saved["step"]
    log = open(os.path.join(a.out, f"log-rank{rank}.jsonl"), "a")
    for epoch in range(loader.epoch, a.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            if distributed:
                dist.all_reduce(torch.ones(1))  # a collective every step: uneven steps would hang here
            step += 1
            log.write(json.dumps(record(batch, epoch, step)) + "\n")
            log.flush()
            if step == a.stop_after:
                with open(ckpt, "w") as f:
                    json.dump({"loader": loader.state_dict(), "step": step}, f)
                open(os.path.join(a.out, f"stopped-rank{rank}"), "w").close()
                while True:  # wait to be killed, like a preempted job
                    time.sleep(1)
    log.write(json.dumps({"event": "done", "steps": step}) + "\n")
    log.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
