"""What per-sample stages cost: the loader's throughput (seconds of audio per second, one process, no workers)
with a transform, speed perturbation, fbank features and all three, against plain decoding; and what planning
on perturbed lengths costs (an epoch planned from N lengths with and without speed_perturb / frames).

    python tools/bench_augment.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _bench_common import machine, table  # noqa: E402

from streambatch import BatchingConfig, StreamBatchLoader  # noqa: E402
from streambatch.plan.epoch import make_epoch_plan  # noqa: E402
from streambatch.plan.layout import Layout  # noqa: E402
from streambatch.plan.lengths import Lengths  # noqa: E402
from streambatch.plan.perturb import LengthTransform, SpeedPerturb, planned_lengths  # noqa: E402
from streambatch.read.features import Fbank  # noqa: E402
from streambatch.synthetic import commonvoice_like, write_audio_corpus  # noqa: E402
from streambatch.write.writer import write_shards  # noqa: E402

SR = 16000


def add_noise(sample: dict, rng: np.random.Generator) -> dict:
    wav = sample["audio"]
    sample["audio"] = wav + torch.from_numpy(rng.normal(0, 0.005, wav.shape[0]).astype(np.float32))
    return sample


def throughput(shards: str, **options) -> tuple[float, float]:
    """(seconds of audio per wall second, padding %) over one epoch."""
    loader = StreamBatchLoader(shards, budget=options.pop("budget", "60s"), seed=0, **options)
    audio, real, padded = 0.0, 0, 0
    t0 = time.perf_counter()
    for b in loader:
        audio += float(np.sum(b["duration"]))
        x = b["features"] if "features" in b else b["audio"]
        real += int(b["lengths"].sum())
        padded += x.shape[0] * x.shape[1]
    return audio / (time.perf_counter() - t0), 100.0 * (1 - real / padded)


def planning(n: int) -> list[list[object]]:
    lengths = commonvoice_like(n, seed=1)
    shards = [lengths[i : i + 1000] for i in range(0, n, 1000)]
    rows, base = [], None
    for name, plan in [
        ("index lengths", None),
        ("speed_perturb", LengthTransform(SR, SpeedPerturb.make((0.9, 1.0, 1.1)))),
        ("speed + fbank frames", LengthTransform(SR, SpeedPerturb.make((0.9, 1.0, 1.1)), Fbank())),
    ]:
        cfg = BatchingConfig(budget=6000 if plan is not None and plan.in_frames else 60 * SR, buffer_size=2000)
        t0 = time.perf_counter()
        make_epoch_plan(planned_lengths(Lengths.of(shards), plan, 0, 0), cfg, 0, Layout(1, 1))
        s = time.perf_counter() - t0
        base = base or s
        rows.append([name, f"{n:,}", f"{s:.2f}", f"{s / base:.2f}x"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    n_utts, n_plan = (120, 200_000) if a.quick else (400, 1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        write_audio_corpus(os.path.join(tmp, "audio"), n_utts, seed=0, sample_rate=SR)
        shards = os.path.join(tmp, "shards")
        write_shards(os.path.join(tmp, "audio"), shards, max_count=40, progress=False)
        cases = [
            ("decode only", {}),
            ("transform (noise)", {"transform": add_noise}),
            ("speed_perturb 0.9/1.0/1.1", {"speed_perturb": (0.9, 1.0, 1.1)}),
            ("features=fbank", {"features": "fbank", "budget": 6000}),
            (
                "all three",
                {"transform": add_noise, "speed_perturb": (0.9, 1.0, 1.1), "features": "fbank", "budget": 6000},
            ),
        ]
        throughput(shards)  # warm the page cache and the imports
        rows, base = [], None
        for name, opts in cases:
            rate, pad = throughput(shards, **opts)
            base = base or rate
            rows.append([name, f"{rate:,.0f}", f"{rate / base:.2f}x", f"{pad:.1f}"])
    print(f"# per-sample stages, {n_utts} utterances ({machine()}; one process, torch threads 1)")
    print(table(rows, ["stages", "audio s / s", "vs decode", "padding %"]))
    print()
    print("# planning an epoch (1 rank, 1 worker) on index lengths vs perturbed lengths")
    print(table(planning(n_plan), ["lengths", "samples", "seconds", "ratio"]))


if __name__ == "__main__":
    main()
