#!/usr/bin/env python
"""What a ``where=`` filter costs a loader: the one pass that streams the filter's columns and the lengths
of every row group (DuckDB evaluates the expression on each) to deal shards by the length they keep, and the
per-shard mask a rank asks for while planning.

Builds a version 2 index of N samples (1,000 per shard) with ``speaker``, ``language`` and ``snr`` columns
(no shards: only the index is read), then times ``PlanFilter`` (the pass, best of ``--repeat``) and the
filter of 1/64 of the shards, and prints the rate and what 10⁹ samples would take at that rate.

Usage: ``python tools/bench_filters.py [--samples 10000000] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import best_of, machine, table  # noqa: E402

from streambatch.format.index import ShardIndex, ShardInfo  # noqa: E402
from streambatch.select.where import PlanFilter  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, librispeech_like  # noqa: E402

PER_SHARD = 1000
WHERE = "language = 'de' AND snr > 10"


def build(n: int, seed: int) -> ShardIndex:
    lengths = librispeech_like(n, seed)
    rng = np.random.default_rng(seed)
    langs = np.array(["de", "en", "fr", "es"])[rng.integers(0, 4, n)]
    snr = rng.normal(12, 6, n)
    shards = []
    for i in range(0, n, PER_SHARD):
        j = min(n, i + PER_SHARD)
        cols = {
            "speaker": [f"spk{k % 997}" for k in range(i, j)],
            "language": langs[i:j].tolist(),
            "snr": snr[i:j].tolist(),
        }
        shards.append(
            ShardInfo(
                f"shard-{i // PER_SHARD:06d}.tar",
                j - i,
                1 << 20,
                lengths[i:j],
                f"{i:064x}",
                f"{i:040x}",
                keys=[f"k{k}" for k in range(i, j)],
                columns=cols,
            )
        )
    return ShardIndex(
        shards, "samples", SAMPLE_RATE, columns={"speaker": "string", "language": "string", "snr": "double"}
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--quick", action="store_true", help="1 M samples")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    n = 1_000_000 if args.quick else args.samples
    print(f"streambatch bench_filters  ({machine()})")
    print(f"index of {n:,} samples in {n // PER_SHARD:,} shards; where={WHERE!r}; DuckDB, 1 thread of Python")
    with tempfile.TemporaryDirectory(prefix="bench_filters_") as tmp:
        build(n, 0).save(os.path.join(tmp, "index.json"))
        index = ShardIndex.load(tmp)
        t_pass, flt = best_of(lambda: PlanFilter(ShardIndex.load(tmp), WHERE), args.repeat)
        shards = np.arange(0, index.num_shards, 64)
        flt.parts[0]._cache.clear()  # as a rank of a larger dataset: its shards' row groups evaluated on demand
        t0 = time.perf_counter()
        kept = sum(int(flt.keep(int(s)).sum()) for s in shards)
        t_mask = time.perf_counter() - t0
    rate = n / t_pass
    rows = [
        (
            "deal pass (columns + lengths, every row group)",
            f"{t_pass:.2f} s",
            f"{rate / 1e6:.1f} M samples/s",
            f"{1e9 / rate / 60:.1f} min",
        ),
        (f"mask of 1/64 of the shards ({len(shards):,})", f"{t_mask:.3f} s", f"{kept:,} kept", ""),
    ]
    print(table(rows, ["step", "time", "rate", "at 10^9 samples"]))
    print(f"kept {flt.kept:,} of {flt.total:,} ({flt.kept / flt.total:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
