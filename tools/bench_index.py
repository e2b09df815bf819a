#!/usr/bin/env python
"""How fast the dataset index loads: 10 M samples (10,000 shards x 1,000 LibriSpeech-like lengths).

Builds a :class:`streambatch.ShardIndex`, saves it to a temporary folder, and prints the ``index.json``
size, the best of 3 ``ShardIndex.load`` times (target: well under a second) and the time to concatenate
``index.lengths`` (all 10 M lengths, as the planner needs them).

Usage: ``python tools/bench_index.py [--shards 10000] [--per-shard 1000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import best_of, machine, table  # noqa: E402

from streambatch.format.index import ShardIndex, ShardInfo  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, librispeech_like  # noqa: E402


def build(num_shards: int, per_shard: int, seed: int) -> ShardIndex:
    lengths = librispeech_like(num_shards * per_shard, seed)
    shards = []
    for i in range(num_shards):
        part = lengths[i * per_shard : (i + 1) * per_shard]
        shards.append(
            ShardInfo(
                url=f"shard-{i:06d}.tar",
                count=per_shard,
                bytes=int(part.sum()) * 2 // 3,  # roughly FLAC-sized
                lengths=part,
                sha256=f"{i:064x}",
                keys_sha1=f"{i:040x}",
            )
        )
    return ShardIndex(shards=shards, unit="samples", sample_rate=SAMPLE_RATE, meta={"source": "bench_index"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=10_000)
    p.add_argument("--per-shard", type=int, default=1_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    n = args.shards * args.per_shard
    print(f"streambatch bench_index  ({machine()})")
    print(f"index of {n:,} samples: {args.shards:,} shards x {args.per_shard:,} LibriSpeech-like lengths")

    t0 = time.perf_counter()
    index = build(args.shards, args.per_shard, args.seed)
    t_build = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="bench_index_") as tmp:
        t0 = time.perf_counter()
        path = index.save(tmp)
        t_save = time.perf_counter() - t0
        size = os.path.getsize(path)
        t_load, loaded = best_of(lambda: ShardIndex.load(tmp), args.repeat)
        with open(path, "rb") as f:
            raw = f.read()
        t_json, _ = best_of(lambda: json.loads(raw), args.repeat)
        t_lengths, all_lengths = best_of(lambda: loaded.lengths, args.repeat)
        t_stats, _ = best_of(lambda: (loaded.num_samples, loaded.total_length), args.repeat)
    ok = loaded.num_samples == n and np.array_equal(all_lengths, np.concatenate([s.lengths for s in index.shards]))
    rows = [
        ["build in memory", f"{t_build:.3f} s", ""],
        ["save (index.json)", f"{t_save:.3f} s", ""],
        ["file size", f"{size / 1e6:.1f} MB", f"{size / n:.2f} bytes/sample"],
        [
            f"ShardIndex.load, best of {args.repeat}",
            f"{t_load:.3f} s",
            "target well under 1 s: " + ("PASS" if t_load < 1.0 else "MISS"),
        ],
        [
            f"  of which json.loads alone, best of {args.repeat}",
            f"{t_json:.3f} s",
            "the rest: base64 + numpy per shard",
        ],
        [f"index.lengths (concatenate {n:,}), best of {args.repeat}", f"{t_lengths:.3f} s", f"{all_lengths.dtype}"],
        ["num_samples + total_length", f"{t_stats:.3f} s", ""],
        ["round trip identical", "yes" if ok else "NO", ""],
    ]
    print(table(rows, ["step", "time / size", "note"], "lrl"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
