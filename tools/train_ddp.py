#!/usr/bin/env python
"""Reference DDP training on StreamBatchLoader: a small speech model (strided 1-D convolutions + a CTC head
over characters), run under srun (one task per GPU, as slurm/train_ddp.sbatch does), torchrun, or alone.

    srun python tools/train_ddp.py --data /data/ds --budget 200s --epochs 10 --checkpoint-dir ckpt --resume
    torchrun --nproc_per_node=4 tools/train_ddp.py --data /data/ds --budget 200s --device cuda

Who am I: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else SLURM's SLURM_PROCID / SLURM_STEP_NUM_TASKS (or
SLURM_NTASKS) / SLURM_LOCALID; MASTER_ADDR and MASTER_PORT from the environment. gloo on CPU, nccl on CUDA.

Checkpoints (``--checkpoint-dir``): rank 0 writes DIR/checkpoint.pt (model, optimizer, ``loader.state_dict()``,
step) atomically at the end of every epoch, every ``--checkpoint-every`` steps, and when stopped by a
signal; ``--resume`` continues from it when it exists (mid-epoch, exactly at the next batch).

Signals: SIGUSR1 (SLURM sends it before the time limit with ``--signal=B:USR1@120``; the batch script forwards
it) or SIGTERM set a flag. At the next step boundary all ranks agree (one all-reduce per step) to stop, rank 0
saves the checkpoint and writes DIR/STOPPED, all ranks meet at a barrier and exit with code 85
(``REQUEUE_EXIT_CODE``); the batch script sees either and ``scontrol requeue``s the job. SIGTERM is best effort: SLURM sends it to every process of the
job, DataLoader workers too, and torch's workers die on it, so if a worker is gone before the step boundary the
script saves only when it was between steps (else the last checkpoint stands) and exits 85 without the
collectives.

Logs: rank 0 prints steps/s, samples/s, audio-seconds/s, padding % (all ranks summed) and, on CUDA, peak
memory, every ``--log-every`` steps; ``--log-keys DIR`` appends each batch's keys to DIR/keys-rank{R}.jsonl
(the tests compare these sequences across a preemption).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from streambatch import StreamBatchLoader
from streambatch.procs import watch_parent

REQUEUE_EXIT_CODE = 85
VOCAB = " abcdefghijklmnopqrstuvwxyz'"  # CTC blank is 0, these are 1..len
CHECKPOINT = "checkpoint.pt"
#: written by rank 0 beside the checkpoint when it stopped on a signal: the batch script requeues when it sees it
#: (the exit code alone is not enough: srun --kill-on-bad-exit may kill the other ranks as rank 0 exits)
STOPPED = "STOPPED"


# ---- the model -----------------------------------------------------------------------------------
class SpeechModel(nn.Module):
    """Strided 1-D convolutions over the waveform (80 samples per output frame: 100 frames/s at 8 kHz,
    200 at 16 kHz) and a linear CTC head over characters."""

    LAYERS = ((10, 5), (8, 4), (4, 2), (4, 2))  # (kernel, stride)

    def __init__(self, channels: int = 64, vocab: int = len(VOCAB) + 1):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 1
        for k, s in self.LAYERS:
            layers += [nn.Conv1d(c_in, channels, k, stride=s), nn.GELU()]
            c_in = channels
        self.frontend = nn.Sequential(*layers)
        self.head = nn.Linear(channels, vocab)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """[B, T] waveform → [T', B, vocab] log-probabilities (CTC layout)."""
        x = self.frontend(audio[:, None, :])  # [B, C, T']
        return self.head(x.transpose(1, 2)).log_softmax(-1).transpose(0, 1)

    @classmethod
    def output_lengths(cls, lengths: torch.Tensor) -> torch.Tensor:
        for k, s in cls.LAYERS:
            lengths = torch.div(lengths - k, s, rounding_mode="floor") + 1
        return lengths.clamp(min=1)


def ctc_targets(texts: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [[VOCAB.index(c) + 1 for c in (t or "").lower() if c in VOCAB] for t in texts]
    return torch.tensor([i for row in ids for i in row], dtype=torch.long), torch.tensor([len(r) for r in ids])


# ---- processes -------------------------------------------------------------------------------------
def who_am_i() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables, else SLURM's (inside an srun step)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # an srun step (not the batch script itself)
        world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
        rank, local = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
        return rank, world, local
    return 0, 1, 0


def init_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    rank, world, local = who_am_i()
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    if device_arg == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to this process")
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise SystemExit(f"{var} is not set: the launcher (torchrun, or the sbatch script) must set it")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    return rank, world, device


class StopFlag:
    """Set by SIGUSR1/SIGTERM; the training loop acts on it at the next step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, sig: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = sig

    @property
    def requested(self) -> bool:
        return self.signal is not None


def all_ranks_agree_to_stop(stop: StopFlag, device: torch.device, world: int) -> bool:
    if world == 1:
        return stop.requested
    flag = torch.tensor([1.0 if stop.requested else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# ---- checkpoints -------------------------------------------------------------------------------------
def save_checkpoint(
    path: str, model: nn.Module, opt: torch.optim.Optimizer, loader: StreamBatchLoader, step: int, extra: dict[str, Any]
) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "loader": loader.state_dict(),
            "step": step,
            **extra,
        },
        tmp,
    )
    os.replace(tmp, path)


# ---- the run -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--data",
        required=True,
        help="dataset folder or URL written by `shardify write` (with index.json), or a "
        "mixture file (.yaml/.json) naming several datasets and their weights",
    )
    p.add_argument(
        "--shard-root",
        action="append",
        default=[],
        metavar="ROOT",
        help="a folder or URL prefix the dataset's shards may lie in besides its own folder (repeatable; the "
        "loader's shard_roots), e.g. the tars a `shardify index --out` dataset points back at",
    )
    p.add_argument(
        "--budget",
        default="200s",
        help="batch budget: padded length per batch in the dataset's unit, or seconds with an s suffix (default 200s)",
    )
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps in all (0: no limit)")
    p.add_argument("--num-workers", type=int, default=4, help="DataLoader workers per rank (default 4)")
    p.add_argument("--buffer-size", type=int, default=2000, help="StreamBatchLoader buffer_size")
    p.add_argument("--num-buckets", type=int, default=None, help="buckets (default: the loader's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--channels", type=int, default=64, help="model width")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint-dir", help="where rank 0 keeps checkpoint.pt")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also save every N steps (0: only at epoch ends and on a signal)",
    )
    p.add_argument("--resume", action="store_true", help="continue from CHECKPOINT_DIR/checkpoint.pt if it exists")
    p.add_argument("--log-every", type=int, default=50, help="print throughput every N steps (default 50)")
    p.add_argument("--log-keys", metavar="DIR", help="append every batch's keys to DIR/keys-rank{R}.jsonl")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="sleep this long per step (simulates a bigger model in demos and tests)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank (0: torch's default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    stop = StopFlag()  # first, so a signal during start-up is not lost
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's rank: end with torchrun, even when it is SIGKILLed
        watch_parent(os.getppid())
    if a.threads:
        torch.set_num_threads(a.threads)
    rank, world, device = init_distributed(a.device)
    try:
        return train(a, rank, world, device, stop)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[train_ddp] {msg}", flush=True)


def train(a: argparse.Namespace, rank: int, world: int, device: torch.device, stop: StopFlag) -> int:
    from streambatch.cli.inspect import parse_budget
    from streambatch.select.mixture import open_index

    index = open_index(a.data, None, a.shard_root)  # a dataset, or a mixture file naming several
    budget = parse_budget(a.budget, index, a.data)
    seconds_per_sample = 1.0 / (index.sample_rate or 16000)  # batch["lengths"] count decoded samples
    torch.manual_seed(a.seed)
    model = SpeechModel(a.channels).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    loader = StreamBatchLoader(
        a.data,
        budget=budget,
        num_workers=a.num_workers,
        buffer_size=a.buffer_size,
        num_buckets=a.num_buckets,
        seed=a.seed,
        pin_memory=device.type == "cuda",
        persistent_workers=a.num_workers > 0,
        shard_roots=a.shard_root,
    )
    ckpt = os.path.join(a.checkpoint_dir, CHECKPOINT) if a.checkpoint_dir else None
    step = 0
    restart = int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0)
    if a.resume and ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu", weights_only=True)  # tensors and plain values: no code runs
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        step = int(state["step"])
        say(
            rank,
            f"resumed from {ckpt}: step {step}, epoch {loader.epoch}, "
            f"{state['loader']['batches_consumed']} batches of it done",
        )
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    keys_log = None
    if a.log_keys:
        os.makedirs(a.log_keys, exist_ok=True)
        keys_log = open(os.path.join(a.log_keys, f"keys-rank{rank}.jsonl"), "a")
    say(
        rank,
        f"{world} rank(s) on {device.type}, {index.num_samples} samples in {index.num_shards} shards, "
        f"budget {budget:g} {index.unit}, {a.num_workers} workers per rank",
    )

    def checkpoint() -> None:
        if ckpt and rank == 0:
            save_checkpoint(ckpt, model, opt, loader, step, {"world_size": world, "epoch": loader.epoch})

    def mark_stopped() -> None:
        if a.checkpoint_dir and rank == 0:
            os.makedirs(a.checkpoint_dir, exist_ok=True)
            with open(os.path.join(a.checkpoint_dir, STOPPED), "w") as f:
                f.write(
                    json.dumps(
                        {"step": step, "signal": stop.signal, "job": os.environ.get("SLURM_JOB_ID"), "restart": restart}
                    )
                    + "\n"
                )

    meter = torch.zeros(4, dtype=torch.float64)  # samples, audio samples, padded elements, batches
    t_log, steps_log = time.perf_counter(), 0
    phase = "between"  # "fetch": waiting for a batch; "train": inside a step; "between": at a boundary
    stopped = preempted = False
    try:
        while loader.epoch < a.epochs and not stopped:
            epoch = loader.epoch
            loader.set_epoch(epoch)
            if keys_log:
                keys_log.write(
                    json.dumps(
                        {
                            "event": "epoch",
                            "epoch": epoch,
                            "len": len(loader),
                            "world_size": world,
                            "surplus": loader.plan().surplus_samples,
                            "skipped": loader.plan().skipped_samples,
                            "restart": restart,
                        }
                    )
                    + "\n"
                )
            say(rank, f"epoch {epoch}: {len(loader)} steps per rank")
            it = iter(loader)
            while True:
                phase = "fetch"
                try:
                    batch = next(it)
                except StopIteration:
                    break
                phase = "train"
                audio = batch["audio"].to(device, non_blocking=True)
                lengths = batch["lengths"]
                targets, target_lengths = ctc_targets(batch.get("text") or [None] * len(lengths))
                logp = ddp(audio)
                loss = nn.functional.ctc_loss(
                    logp,
                    targets.to(device),
                    SpeechModel.output_lengths(lengths).to(device),
                    target_lengths.to(device),
                    zero_infinity=True,
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if a.step_sleep:
                    time.sleep(a.step_sleep)
                step += 1
                phase = "between"
                meter += torch.tensor(
                    [len(lengths), float(lengths.sum()), audio.shape[0] * audio.shape[1], 1.0], dtype=torch.float64
                )
                steps_log += 1
                if keys_log:
                    keys_log.write(
                        json.dumps(
                            {"event": "batch", "epoch": epoch, "step": step, "keys": batch["keys"], "restart": restart}
                        )
                        + "\n"
                    )
                    keys_log.flush()
                if a.log_every and step % a.log_every == 0:
                    t_log, steps_log = log_throughput(
                        rank,
                        world,
                        device,
                        step,
                        epoch,
                        float(loss.detach()),
                        meter,
                        t_log,
                        steps_log,
                        seconds_per_sample,
                    )
                    meter.zero_()
                if all_ranks_agree_to_stop(stop, device, world):
                    stopped = preempted = True
                    break
                if a.checkpoint_every and step % a.checkpoint_every == 0:
                    checkpoint()
                if a.max_steps and step >= a.max_steps:
                    stopped = True
                    break
            if not stopped:
                checkpoint()  # the end of an epoch (the loader's state points at the next one)
    except RuntimeError as e:
        # SIGTERM reaches DataLoader workers too, and torch's workers die on it: treat a worker lost after a
        # stop request as the stop, without collectives (other ranks may already be gone)
        if not stop.requested or "DataLoader worker" not in str(e):
            raise
        say(rank, f"stopping on {signal.Signals(stop.signal).name} with DataLoader workers gone ({phase})")
        if phase in ("fetch", "between"):
            checkpoint()
        mark_stopped()
        if keys_log:
            keys_log.close()
        sys.stdout.flush()
        os._exit(REQUEUE_EXIT_CODE)
    if keys_log:
        keys_log.close()
    if preempted:
        name = signal.Signals(stop.signal).name if stop.signal else "a signal on another rank"
        checkpoint()
        mark_stopped()
        if world > 1:
            dist.barrier()  # nobody exits before rank 0 has saved
        say(
            rank,
            f"stopped by {name} at step {step} (epoch {loader.epoch}, "
            f"{loader.state_dict()['batches_consumed']} batches of it done); checkpoint saved, exit "
            f"{REQUEUE_EXIT_CODE} to be requeued",
        )
        return REQUEUE_EXIT_CODE
    if world > 1:
        dist.barrier()  # before destroy_process_group: a rank leaving early crashes the others at exit
    say(rank, f"done: {step} steps")
    return 0


def log_throughput(
    rank: int,
    world: int,
    device: torch.device,
    step: int,
    epoch: int,
    loss: float,
    meter: torch.Tensor,
    t0: float,
    steps: int,
    seconds_per_sample: float,
) -> tuple[float, int]:
    totals = meter.clone()
    if world > 1:
        t = totals.to(device)
        dist.all_reduce(t)
        totals = t.cpu()
    now = time.perf_counter()
    dt = max(now - t0, 1e-9)
    samples, units, padded, _ = totals.tolist()
    msg = (
        f"step {step} epoch {epoch} loss {loss:.3f} | {steps / dt:.2f} steps/s, {samples / dt:.1f} samples/s, "
        f"{units * seconds_per_sample / dt:.1f} audio-s/s, padding {100 * (1 - units / max(padded, 1)):.1f}%"
    )
    if device.type == "cuda":
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
        if world > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        msg += f", peak memory {float(peak):.2f} GiB"
    say(rank, msg)
    return now, 0


if __name__ == "__main__":
    sys.exit(main())
