#!/usr/bin/env python
"""Write a synthetic, lengths-only dataset index (no tars; shard urls ``shard-XXXXXX.tar``) for benchmarks.

Version 2 (the default) is streamed in bounded memory, a block of shards at a time, with a progress bar;
``--version 1`` writes the same lengths as a version 1 ``index.json`` for side-by-side comparisons.

Usage: ``python tools/make_index.py OUT --samples 10000000 --per-shard 1000 [--version 2] [--unit samples]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from streambatch.format.index import ShardIndex, ShardInfo  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, librispeech_like, text_like  # noqa: E402

BLOCK_SAMPLES = 1 << 20
UNITS = ("samples", "seconds", "tokens")


def _block_lengths(n: int, unit: str, seed: int, block: int) -> np.ndarray:
    """Lengths of one block of samples: LibriSpeech-like audio (samples or seconds) or text-like tokens."""
    rng_seed = [seed, block]
    if unit == "tokens":
        return text_like(n, seed=rng_seed)  # type: ignore[arg-type]
    lengths = librispeech_like(n, seed=rng_seed)  # type: ignore[arg-type]
    return lengths / SAMPLE_RATE if unit == "seconds" else lengths


def synthetic_shards(num_samples: int, per_shard: int, unit: str = "samples", seed: int = 0) -> Iterator[ShardInfo]:
    """Shards of ``per_shard`` samples (the last one may be shorter), ``num_samples`` in all, generated a block
    of about 2²⁰ samples at a time; checksums are made-up hex numbers of the right size."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    num_shards = -(-num_samples // per_shard)
    per_block = max(1, BLOCK_SAMPLES // per_shard)
    for b, a in enumerate(range(0, num_shards, per_block)):
        stop = min(num_shards, a + per_block)
        lo, hi = a * per_shard, min(num_samples, stop * per_shard)
        lengths = _block_lengths(hi - lo, unit, seed, b)
        for i in range(a, stop):
            part = lengths[i * per_shard - lo : min(num_samples, (i + 1) * per_shard) - lo]
            size = int(part.sum() * (SAMPLE_RATE if unit == "seconds" else 1)) * 2 // 3
            yield ShardInfo(f"shard-{i:06d}.tar", len(part), size, part, sha256=f"{i:064x}", keys_sha1=f"{i:040x}")


def write_synthetic_index(
    out: str,
    num_samples: int,
    per_shard: int,
    unit: str = "samples",
    seed: int = 0,
    version: int = 2,
    progress: bool = True,
    storage_options: dict | None = None,
) -> str:
    """Write the synthetic index to the folder (or URL) ``out``; returns the index file's URL."""
    from streambatch.format.columnar import INDEX_NAME
    from streambatch.format.columnar_write import write_v2
    from streambatch.io.storage import join_url

    sample_rate = SAMPLE_RATE if unit == "samples" else None
    meta = {"source": "tools/make_index.py", "seed": seed}
    shards = synthetic_shards(num_samples, per_shard, unit, seed)
    total = -(-num_samples // per_shard)
    if version == 1:
        index = ShardIndex(
            list(tqdm(shards, total=total, desc="generating", unit="shard", disable=not progress)),
            unit=unit,
            sample_rate=sample_rate,
            meta=meta,
        )
        return index.save(out, storage_options)
    url = out if out.endswith(".json") else join_url(out, INDEX_NAME)
    length_type = "float64" if unit == "seconds" else "int64"
    with tqdm(total=total, desc="writing index", unit="shard", disable=not progress) as bar:
        write_v2(
            url,
            shards,
            {"unit": unit, "sample_rate": sample_rate, "meta": meta},
            length_type,
            storage_options,
            progress=bar,
        )
    return url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder or fsspec URL to write the index into")
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--per-shard", type=int, default=1_000)
    p.add_argument("--unit", choices=UNITS, default="samples")
    p.add_argument("--version", type=int, choices=(1, 2), default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    url = write_synthetic_index(args.out, args.samples, args.per_shard, args.unit, args.seed, args.version)
    print(url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
