#!/usr/bin/env python
"""End to end on a GPU: a transformer CTC encoder trained for a fixed wall time on synthetic speech shards, fed three ways.

The model (tools/_ctc_encoder.py): log-mel features (fp32), two strided convolutions (4x subsampling), a pre-norm
``nn.TransformerEncoder`` and a CTC head over synthetic token targets; 26.1 M parameters (d_model 512, 8 layers,
8 heads, ff 2048), bf16 autocast on CUDA. The data: synthetic speech-like WAV utterances with CommonVoice-like lengths (0.5-20 s),
written as streambatch shards with an index. Each method trains a fresh copy of the model (same seed) for
``--seconds`` after ``--warmup`` untimed steps:

(a) ``streambatch, calibrated``: the budget and cost model ``streambatch.calibrate`` measured for this model
    on this device (``cost="calib.json"``);
(b) ``webdataset, fixed B``: ``webdataset.WebDataset`` with the largest fixed batch size that fits the
    longest utterance (B: what calibrate's search measured at the longest length), shuffled, decoded with the
    same soundfile code and padded with the same collate;
(c) ``streambatch, B x longest``: streambatch with that fixed batch's budget, B x the longest length
    (``cost="padded"``).

Reported per method: steps, audio seconds trained per second, padding, the share of the time spent waiting
for the loader, peak memory as a share of the device and out-of-memory errors caught (``OOMGuard`` restarts
such a batch in pieces and counts it). The device's memory is capped at ``--device-memory`` (default 8 GiB,
``torch.cuda.set_per_process_memory_fraction``: past it the allocator raises out-of-memory as a smaller GPU
would) so that the synthetic corpus (12 h) holds many batches per epoch; calibration fills
``--memory-fraction`` (0.9) of it. On CPU the peak is the rise of the process's peak RSS over
``--device-memory``: a smoke test of the code path, not a measurement. ``--check-epoch`` instead calibrates and trains one epoch
of the calibrated loader, recording each step's peak memory against the calibration limit
(tests/cluster/test_bench_gpu_train.py runs it on CUDA).

Usage: ``python tools/bench_gpu_train.py [--device cuda] [--seconds 60] [--utterances 2000] [--json OUT]``;
``python tools/bench_gpu_train.py --device cpu --quick`` is a tiny float32 model for a few seconds (the
smoke test).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# before torch allocates on the GPU: fewer fragmentation failures with batches of changing shapes
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import machine, table  # noqa: E402
from _ctc_encoder import FULL, HOP, TINY, CTCEncoder, ModelConfig, Trainer, count_parameters, make_trainer  # noqa: E402

from streambatch.synthetic import SAMPLE_RATE, commonvoice_like, speech_like  # noqa: E402


# ---- the data ----------------------------------------------------------------------------------------
def make_corpus(folder: str, n: int, max_seconds: float, seed: int = 0, per_shard: int = 50) -> str:
    """``n`` speech-like WAV utterances with CommonVoice-like lengths scaled to at most ``max_seconds``
    (0.5-20 s at 20), written as shards with an index; returns the shard folder."""
    import soundfile as sf

    from streambatch.write.writer import write_shards

    audio = os.path.join(folder, "audio")
    os.makedirs(audio, exist_ok=True)
    rng = np.random.default_rng(seed)
    seconds = commonvoice_like(n, seed) / SAMPLE_RATE * (max_seconds / 20.0)
    lengths = np.maximum(np.round(seconds * SAMPLE_RATE), HOP * 4).astype(np.int64)
    voices = [speech_like(int(lengths.max()) * 2, rng) for _ in range(4)]
    for i, length in enumerate(lengths):
        voice = voices[i % len(voices)]
        start = int(rng.integers(0, len(voice) - length))
        sf.write(
            os.path.join(audio, f"utt-{i:06d}.wav"),
            voice[start : start + length],
            SAMPLE_RATE,
            format="WAV",
            subtype="PCM_16",
        )
    shards = os.path.join(folder, "shards")
    write_shards(audio, shards, max_count=per_shard, progress=False)
    shutil.rmtree(audio)  # the shards hold every byte
    return shards


def corpus(folder: str, args: argparse.Namespace) -> str:
    """The shards in ``folder``/shards, written first unless an index is already there."""
    shards = os.path.join(folder, "shards")
    if os.path.exists(os.path.join(shards, "index.json")):
        return shards
    per_shard = max(4, args.utterances // (4 * max(1, args.workers)))  # every worker gets several shards
    return make_corpus(folder, args.utterances, args.max_seconds, args.seed, per_shard=per_shard)


def _collate_audio(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A webdataset batch decoded and padded by the same code as streambatch's (soundfile, ``collate``)."""
    from streambatch.read.collate import collate

    return collate(samples, "audio")


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)


def webdataset_batches(urls: list[str], batch_size: int, workers: int, pin: bool, seed: int) -> Iterator[dict]:
    """Fixed-size batches from ``webdataset.WebDataset`` (shard shuffle, a 1,000-sample shuffle buffer), epoch
    after epoch."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False)
        .shuffle(1000, seed=seed)
        .decode()
        .batched(batch_size, collation_fn=_collate_audio, partial=True)
    )
    extra = {"persistent_workers": True, "prefetch_factor": 4, "worker_init_fn": _one_thread} if workers else {}
    dl = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=pin, **extra)
    while True:
        yield from dl


def streambatch_batches(shards: str, workers: int, pin: bool, seed: int, **options: Any) -> Iterator[dict]:
    """Budget batches from ``StreamBatchLoader`` (``options``: ``budget`` or ``cost``), epoch after epoch."""
    from streambatch import StreamBatchLoader

    loader = StreamBatchLoader(
        shards,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        seed=seed,
        worker_init_fn=_one_thread if workers else None,
        prefetch_factor=4 if workers else None,
        **options,
    )
    while True:
        yield from loader


# ---- memory ----------------------------------------------------------------------------------------
class PeakMemory:
    """Peak memory since :meth:`reset`: CUDA ``max_memory_allocated``; CPU the rise of this process's peak RSS
    (``VmHWM`` after ``/proc/self/clear_refs``) over its RSS at the reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        from streambatch.fit.memory import proc_status

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = proc_status("VmRSS").get("VmRSS", 0)

    def peak(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device))
        from streambatch.fit.memory import proc_status

        return float(max(0, proc_status("VmHWM").get("VmHWM", 0) - self.base))


def cap_device_memory(device: torch.device, size: str | None) -> float:
    """The memory the run may use, in bytes: on CUDA the device's, or ``size`` of it (enforced by the caching
    allocator: allocating past it raises an out-of-memory error, as a smaller GPU would); on CPU ``size``."""
    from streambatch.units import parse_bytes

    cap = parse_bytes(size, "memory") if size else None
    if device.type != "cuda":
        return float(cap)
    total = torch.cuda.get_device_properties(device).total_memory
    if cap and cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        return float(cap)
    return float(total)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    return f"cpu ({machine()})"


# ---- training for a fixed wall time -------------------------------------------------------------------
@dataclass
class Run:
    """What one method did in its timed window."""

    method: str
    batching: str
    steps: int = 0
    audio_seconds: float = 0.0
    real: int = 0
    padded: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    peak: float = 0.0
    ooms: int = 0
    error: str = ""

    def row(self, device_total: float) -> dict[str, Any]:
        return {
            "method": self.method,
            "batching": self.batching,
            "steps": self.steps,
            "audio_s_per_s": self.audio_seconds / self.seconds if self.seconds else 0.0,
            "padding": 1 - self.real / self.padded if self.padded else 0.0,
            "loader_wait": self.wait / self.seconds if self.seconds else 0.0,
            "peak_share": self.peak / device_total,
            "peak_bytes": self.peak,
            "ooms": self.ooms,
            "seconds": self.seconds,
            "error": self.error,
        }


def train_for(
    run: Run, batches: Iterator[dict], trainer: Trainer, device: torch.device, seconds: float, warmup: int
) -> Run:
    """``warmup`` untimed steps, then steps until ``seconds`` have passed, their peak memory measured; every
    step through ``OOMGuard`` (an out-of-memory restarts the batch in pieces and is counted)."""
    from streambatch.fit.memory import is_oom
    from streambatch.fit.oom import OOMGuard

    guard = OOMGuard(trainer.forward_backward, reset=lambda: trainer.opt.zero_grad(set_to_none=True), device=device)
    memory = PeakMemory(device)
    try:
        for _ in range(warmup):
            guard(next(batches))
            trainer.opt.step()
            trainer.opt.zero_grad(set_to_none=True)
        memory.reset()  # after the warm-up: on CPU the first steps also page in what the process keeps
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            tw = time.perf_counter()
            batch = next(batches)
            run.wait += time.perf_counter() - tw
            guard(batch)  # the loss comes back as a float: the step has finished on the device
            trainer.opt.step()
            trainer.opt.zero_grad(set_to_none=True)
            run.steps += 1
            run.audio_seconds += float(batch["lengths"].sum()) / SAMPLE_RATE
            run.real += int(batch["lengths"].sum())
            run.padded += batch["audio"].numel()
        run.seconds = time.perf_counter() - t0
    except Exception as e:  # an out-of-memory on a single sample ends the method, and is reported
        if not is_oom(e):
            raise
        run.error = f"stopped: {type(e).__name__}"
    run.peak, run.ooms = memory.peak(), guard.ooms
    return run


# ---- calibration ------------------------------------------------------------------------------------
def run_calibration(shards: str, cfg: ModelConfig, device: torch.device, out: str, args: argparse.Namespace) -> dict:
    """``streambatch.calibrate`` on a throwaway copy of the model (its trials update the weights), filling
    ``--memory-fraction`` of the device memory (on CPU: of ``--device-memory``, memory a step may add)."""
    from streambatch import ShardIndex, calibrate
    from streambatch.fit.calibrate import probe_lengths

    lengths = probe_lengths(ShardIndex.load(shards).lengths, count=args.probes)
    trainer = make_trainer(cfg, device, seed=args.seed + 1)
    cal = calibrate(
        trainer.step,
        shards,
        device=device,
        out=out,
        lengths=lengths,
        max_batch_size=args.max_batch_size,
        rel_tol=args.rel_tol,
        memory_limit=int(args.memory_fraction * args.device_bytes),
    )
    del trainer
    free(device)
    return cal


def longest_fixed_batch(cal: dict) -> tuple[int, float]:
    """(B, longest length): the largest batch calibration measured to fit at the dataset's longest length."""
    row = max(cal["per_length"], key=lambda r: r["length"])
    if row["max_batch_size"] < 1:
        raise SystemExit(
            f"not even one utterance of the longest length ({row['length']:g} samples) fits in "
            f"{cal['limit'] / 2**30:.2f} GiB"
        )
    return int(row["max_batch_size"]), float(row["length"])


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the three methods, and the one-epoch check -----------------------------------------------------
def run_methods(
    shards: str, cal: dict, calib_path: str, cfg: ModelConfig, device: torch.device, args: argparse.Namespace
) -> list[Run]:
    """Train a fresh model with each way of batching for ``args.seconds``."""
    from streambatch import ShardIndex

    urls = ShardIndex.load(shards).shard_urls()
    b, longest = longest_fixed_batch(cal)
    w, pin, seed, buf = args.workers, device.type == "cuda", args.seed, args.buffer_size
    unit = "quadratic" if cal["cost"] == "quadratic" else "padded"
    methods = [
        (
            "streambatch, calibrated",
            f"cost {unit}, budget {cal['budget'] / SAMPLE_RATE:,.1f} s",
            lambda: streambatch_batches(shards, w, pin, seed, budget=None, cost=calib_path, buffer_size=buf),
        ),
        ("webdataset, fixed B", f"B = {b}", lambda: webdataset_batches(urls, b, w, pin, seed)),
        (
            "streambatch, B x longest",
            f"budget {b} x {longest / SAMPLE_RATE:.1f} s = {b * longest / SAMPLE_RATE:,.1f} s",
            lambda: streambatch_batches(shards, w, pin, seed, budget=b * longest, buffer_size=buf),
        ),
    ]
    runs = []
    for name, batching, make in methods:
        trainer = make_trainer(cfg, device, seed)
        batches = make()
        runs.append(train_for(Run(name, batching), batches, trainer, device, args.seconds, args.warmup))
        batches.close()  # the loader and its DataLoader workers go with the generator
        del trainer, batches
        free(device)
    return runs


def check_epoch(
    shards: str, calib_path: str, cal: dict, cfg: ModelConfig, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One epoch of the calibrated loader with a fresh model, after one warm-up step on a synthetic batch: each
    step's peak memory (a full step, as calibration measured it) and the out-of-memory errors caught."""
    from streambatch import StreamBatchLoader
    from streambatch.fit.calibrate import default_make_batch
    from streambatch.fit.oom import OOMGuard

    trainer = make_trainer(cfg, device, args.seed)
    guard = OOMGuard(trainer.forward_backward, reset=lambda: trainer.opt.zero_grad(set_to_none=True), device=device)
    loader = StreamBatchLoader(
        shards,
        cost=calib_path,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        seed=args.seed,
        buffer_size=args.buffer_size,
        worker_init_fn=_one_thread if args.workers else None,
    )
    memory = PeakMemory(device)
    warm = default_make_batch("samples", SAMPLE_RATE)(1, min(r["length"] for r in cal["per_length"]))
    trainer.step(warm)  # one-time allocations (optimizer state, workspaces), as calibration's own warm-up step
    steps = []
    for batch in loader:
        memory.reset()
        guard(batch)
        trainer.opt.step()
        trainer.opt.zero_grad(set_to_none=True)
        steps.append({"n": len(batch["lengths"]), "max_length": int(batch["lengths"].max()), "peak": memory.peak()})
    hardest = max(steps, key=lambda s: s["peak"])
    return {
        "limit": cal["limit"],
        "steps": len(steps),
        "planned": len(loader),
        "ooms": guard.ooms,
        "split_batches": guard.split_batches,
        "hardest": hardest,
        "peak_share_of_limit": hardest["peak"] / cal["limit"],
        "per_step": steps,
    }


# ---- the report ---------------------------------------------------------------------------------------
def corpus_line(shards: str) -> str:
    from streambatch import ShardIndex

    ix = ShardIndex.load(shards)
    secs = np.asarray(ix.lengths) / SAMPLE_RATE
    return (
        f"corpus: {ix.num_samples:,} synthetic WAV utterances, {secs.sum() / 3600:.2f} h, median {np.median(secs):.1f} s, "
        f"longest {secs.max():.1f} s, in {ix.num_shards} shards"
    )


def calibration_line(cal: dict) -> str:
    b, longest = longest_fixed_batch(cal)
    model = (
        f"cost='quadratic', quadratic_factor={cal['quadratic_factor']:.0f}"
        if cal["cost"] == "quadratic"
        else "cost='padded'"
    )
    return (
        f"calibrate: limit {gib(cal['limit'])}, {model}, budget {cal['budget'] / SAMPLE_RATE:,.1f} s of "
        f"audio; {len(cal['measurements'])} trials in {cal['seconds']:.0f} s; at the longest utterance "
        f"({longest / SAMPLE_RATE:.1f} s) the largest batch that fits is B = {b}"
    )


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def results_table(runs: list[Run], total: float) -> str:
    rows = []
    for r in runs:
        d = r.row(total)
        rows.append(
            [
                d["method"],
                d["batching"],
                f"{d['steps']:,}",
                f"{d['audio_s_per_s']:,.1f}",
                f"{100 * d['padding']:.1f}",
                f"{100 * d['loader_wait']:.0f}",
                f"{100 * d['peak_share']:.1f}",
                str(d["ooms"]) + (f" ({d['error']})" if d["error"] else ""),
            ]
        )
    header = ["method", "batching", "steps", "audio s/s", "padding %", "loader wait %", "peak mem %", "OOMs"]
    return table(rows, header, "llrrrrrl")


# ---- main -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model (d 64, 2 layers), 96 utterances up to 3 s, 3 s per method, no workers, 3 probe lengths; "
        "on CPU a 14M memory limit",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="timed training per method (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--utterances", type=int, default=8000, help="synthetic utterances (default 8,000, about 12 h)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="longest utterance, seconds (default 20)")
    p.add_argument(
        "--data",
        help="keep the synthetic corpus here (written when DATA/shards has no index yet) instead of a temporary folder",
    )
    p.add_argument(
        "--buffer-size",
        type=int,
        default=4000,
        help="streambatch buffer_size (default 4,000: tens of batches at a budget of a few hundred utterances)",
    )
    p.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default: min(8, cores - 2); 0 with --quick)"
    )
    p.add_argument(
        "--device-memory",
        default=None,
        help="CUDA: cap this process's GPU memory here (default 8G; 0 = the whole GPU), so that the synthetic "
        "corpus holds many batches; CPU: memory a step may add (default 1G, 14M with --quick)",
    )
    p.add_argument("--memory-fraction", type=float, default=0.9, help="share of the device memory calibration fills")
    p.add_argument("--max-batch-size", type=int, default=4096, help="calibration's largest batch searched")
    p.add_argument("--rel-tol", type=float, default=0.01, help="calibration's precision per length")
    p.add_argument("--probes", type=int, default=7, help="calibration's probe lengths (quantiles, default 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check-epoch",
        action="store_true",
        help="calibrate, then train one epoch of the calibrated loader: OOMs and each step's peak memory",
    )
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.seconds, a.warmup, a.utterances, a.max_seconds, a.buffer_size = min(a.seconds, 3.0), 1, 96, 3.0, 200
        a.max_batch_size, a.rel_tol, a.probes = 256, 0.05, 3
    if a.workers is None:
        a.workers = 0 if a.quick else max(1, min(8, (os.cpu_count() or 2) - 2))
    return a


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    cfg = TINY if args.quick else FULL
    if device.type == "cpu":
        torch.set_num_threads(1)  # calibration forks trials; OpenMP hangs in a child of a multi-threaded parent
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    default_memory = "8G" if device.type == "cuda" else "14M" if args.quick else "1G"
    args.device_bytes = cap_device_memory(device, args.device_memory or default_memory)
    params = count_parameters(CTCEncoder(cfg))
    print(
        f"streambatch bench_gpu_train on {device_name(device)}, torch {torch.__version__}; device memory for the run: "
        f"{gib(args.device_bytes)}"
    )
    print(
        f"model: transformer CTC encoder, {params / 1e6:.1f} M parameters (d {cfg.d_model}, {cfg.layers} layers, "
        f"{cfg.heads} heads, ff {cfg.ff}), {'bf16 autocast' if device.type == 'cuda' else 'float32'}; "
        f"{args.workers} DataLoader workers; PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_gpu_train_") as tmp:
        t0 = time.perf_counter()
        shards = corpus(args.data or tmp, args)
        print(corpus_line(shards) + f" (ready in {time.perf_counter() - t0:.0f} s)")
        calib_path = os.path.join(tmp, "calib.json")
        cal = run_calibration(shards, cfg, device, calib_path, args)
        print(calibration_line(cal))
        print()
        if args.check_epoch:
            result = check_epoch(shards, calib_path, cal, cfg, device, args)
            h = result["hardest"]
            print(
                f"one epoch of the calibrated loader: {result['steps']} steps of {result['planned']} planned, "
                f"{result['ooms']} OOMs; hardest batch {h['n']} x {h['max_length'] / SAMPLE_RATE:.2f} s peaked at "
                f"{gib(h['peak'])} = {100 * result['peak_share_of_limit']:.1f} % of the limit"
            )
        else:
            runs = run_methods(shards, cal, calib_path, cfg, device, args)
            total = args.device_bytes
            print(f"{args.seconds:g} s of training per method after {args.warmup} untimed steps:")
            print(results_table(runs, total))
            print(
                "audio s/s: seconds of real (unpadded) audio trained per wall-clock second; loader wait: share of the"
            )
            print(
                f"  time spent waiting for the next batch; peak mem: {'max_memory_allocated' if device.type == 'cuda' else 'peak RSS rise'} / the device memory for the run;"
            )
            print("  OOMs: out-of-memory errors caught by OOMGuard (each restarts the batch in pieces).")
            result = {"rows": [r.row(total) for r in runs]}
    result["device_memory"] = args.device_bytes
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device_name(device),
                    "parameters": params,
                    "calibration": {
                        k: cal[k] for k in ("cost", "quadratic_factor", "budget", "limit", "device", "per_length")
                    },
                    **result,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
