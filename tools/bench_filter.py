#!/usr/bin/env python
"""What a ``where=`` filter adds to a whole pass of the loader: building it (the filter is checked and evaluated
once, in the engine's child process) and streaming one epoch, with 0 and 2 DataLoader workers, unfiltered and
with a filter that keeps about 70 % of the samples.

Writes a dataset of N short synthetic clips (WAV at 16 kHz, ``--seconds`` long, uniformly; ``speaker`` and
``snr`` columns in the sample table) with ``shardify``'s writer, then times each case ``--runs`` times, the
cases interleaved within a run (so a load that comes and goes on a shared machine falls on every case alike),
and prints the median and the fastest of each, and the filtered pass over the unfiltered one.

Usage: ``python tools/bench_filter.py [--samples 3000] [--seconds 0.5 2.0] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import machine, table  # noqa: E402

from streambatch import StreamBatchLoader  # noqa: E402
from streambatch.write.writer import write_shards  # noqa: E402

SR = 16000
WHERE = "snr < 7"  # snr is uniform over 0..10: keeps about 70 %


def build(folder: str, n: int, seconds: tuple[float, float], seed: int = 0) -> str:
    """A dataset of ``n`` clips (``seconds``: shortest and longest) with scalar columns; its folder."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "wavs"), exist_ok=True)
    manifest = os.path.join(folder, "manifest.jsonl")
    with open(manifest, "w") as f:
        for i in range(n):
            frames = int(rng.uniform(*seconds) * SR)
            path = f"wavs/c{i:06d}.wav"
            sf.write(os.path.join(folder, path), 0.1 * rng.standard_normal(frames).astype(np.float32), SR)
            row = {"audio_filepath": path, "duration": frames / SR, "speaker": f"s{i % 20}", "snr": rng.uniform(0, 10)}
            f.write(json.dumps(row) + "\n")
    out = os.path.join(folder, "ds")
    write_shards(manifest, out, max_count=100, progress=False)
    return out


def one_pass(ds: str, workers: int, where: str | None) -> tuple[float, int]:
    """(seconds from building the loader to the end of its first epoch, samples streamed)."""
    t0 = time.perf_counter()
    loader = StreamBatchLoader(ds, budget=8 * SR, num_workers=workers, where=where, seed=1)
    n = sum(len(b["keys"]) for b in loader)
    return time.perf_counter() - t0, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--seconds", type=float, nargs=2, default=(0.5, 2.0), metavar=("SHORTEST", "LONGEST"))
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args(argv)
    cases = [(w, f) for w in (0, 2) for f in (None, WHERE)]
    times: dict[tuple[int, str | None], list[float]] = {c: [] for c in cases}
    counts: dict[tuple[int, str | None], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ds = build(tmp, a.samples, tuple(a.seconds))
        one_pass(ds, 0, WHERE)  # the page cache and the imports warm, for every case alike
        for _ in range(a.runs):
            for c in cases:
                s, counts[c] = one_pass(ds, *c)
                times[c].append(s)
    rows = []
    for w in (0, 2):
        base = statistics.median(times[(w, None)])
        for f in (None, WHERE):
            t = times[(w, f)]
            med = statistics.median(t)
            rows.append([w, f or "(none)", f"{counts[(w, f)]:,}", f"{med:.2f}", f"{min(t):.2f}", f"{med / base:.2f}x"])
    lo, hi = a.seconds
    what = f"{a.samples:,} clips of {lo:g}-{hi:g} s, {a.runs} interleaved runs"
    print(f"# one pass (build + 1 epoch), {what} ({machine()})")
    print(table(rows, ["workers", "where", "samples", "median s", "fastest s", "vs unfiltered"], "rlrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
