#!/usr/bin/env python
"""What a ``where=`` filter costs: a whole pass of the loader with and without one, and the filter's one pass
over a large index, in one table.

Part 1, a whole pass (building the loader, then one epoch) with 0 and 2 DataLoader workers, on datasets of N
synthetic WAV clips at 16 kHz (``--clips``: one dataset per range of lengths, written by ``write_shards``, 100 a
shard, with ``speaker`` and ``snr`` columns): unfiltered, with ``snr < 7`` (plain comparisons: the short path,
Arrow in the loader's process) and with ``abs(snr) < 7`` (the same samples, about 70 %, through a function: the
engine, DuckDB in a child process). The cases are interleaved within each of ``--runs`` runs (so a load that
comes and goes on a shared machine falls on every case alike); the table has the median and the fastest of each
and the filtered median over the unfiltered one with the same workers.

Part 2, the filter's pass over a version 2 index of ``--index-samples`` samples (1,000 a shard; ``speaker``,
``language`` and ``snr`` columns; no shards, only the index is read): `IndexFilter` streams the columns and
lengths of every row group and evaluates the expression on each (best of ``--repeat``), by each path; the rate
and what 10^9 samples would take at it.

Usage: ``python tools/bench_filter.py [--samples 3000] [--clips 0.5-2 0.1-0.6] [--runs 3]
[--index-samples 1000000] [--repeat 2]``.
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
from streambatch.format.index import ShardIndex, ShardInfo  # noqa: E402
from streambatch.select.where import IndexFilter  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, librispeech_like  # noqa: E402
from streambatch.units import Unit  # noqa: E402
from streambatch.write.writer import write_shards  # noqa: E402

SR = 16000
#: (label, expression): none, the short path's, the engine's; the two filters keep the same samples (snr >= 0)
FILTERS = [("(none)", None), ("Arrow", "snr < 7"), ("DuckDB", "abs(snr) < 7")]
#: the index part's filters: the same samples, by each path
INDEX_FILTERS = [("Arrow", "language = 'de' AND snr > 10"), ("DuckDB", "lower(language) = 'de' AND snr > 10")]
PER_SHARD = 1000


def build_clips(folder: str, n: int, seconds: tuple[float, float], seed: int = 0) -> str:
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


def build_index(n: int, seed: int = 0) -> ShardIndex:
    """A version 2 index of ``n`` samples with ``speaker``, ``language`` and ``snr`` columns (no shards)."""
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
        info = ShardInfo(
            f"shard-{i // PER_SHARD:06d}.tar",
            j - i,
            1 << 20,
            lengths[i:j],
            f"{i:064x}",
            f"{i:040x}",
            keys=[f"k{k}" for k in range(i, j)],
            columns=cols,
        )
        shards.append(info)
    return ShardIndex(
        shards, Unit.SAMPLES, SAMPLE_RATE, columns={"speaker": "string", "language": "string", "snr": "double"}
    )


def passes(a: argparse.Namespace) -> list[list[str]]:
    """Part 1's rows."""
    rows = []
    for lo, hi in a.clips:
        cases = [(w, f) for w in (0, 2) for _, f in FILTERS]
        times: dict[tuple[int, str | None], list[float]] = {c: [] for c in cases}
        counts: dict[tuple[int, str | None], int] = {}
        with tempfile.TemporaryDirectory(prefix="bench_filter_") as tmp:
            ds = build_clips(tmp, a.samples, (lo, hi))
            for _, f in FILTERS:  # the page cache and the imports warm, for every case alike
                one_pass(ds, 0, f)
            for _ in range(a.runs):
                for c in cases:
                    s, counts[c] = one_pass(ds, *c)
                    times[c].append(s)
        for w in (0, 2):
            base = statistics.median(times[(w, None)])
            for path, f in FILTERS:
                t = times[(w, f)]
                med = statistics.median(t)
                rows.append(
                    [
                        f"pass, {lo:g}-{hi:g} s clips, {w} workers",
                        f or "(none)",
                        path if f else "",
                        f"{counts[(w, f)]:,}",
                        f"{med:.2f}",
                        f"{min(t):.2f}",
                        f"{med / base:.2f}x",
                    ]
                )
    return rows


def index_passes(a: argparse.Namespace) -> list[list[str]]:
    """Part 2's rows."""
    n, rows = a.index_samples, []
    with tempfile.TemporaryDirectory(prefix="bench_filter_index_") as tmp:
        build_index(n).save(os.path.join(tmp, "index.json"))
        for path, expr in INDEX_FILTERS:
            times, flt = [], None
            for _ in range(a.repeat):
                index = ShardIndex.load(tmp)
                t0 = time.perf_counter()
                flt = IndexFilter(index, expr)
                times.append(time.perf_counter() - t0)
            assert flt is not None
            rate = n / min(times)
            rows.append(
                [
                    f"filter pass, index of {n:,} samples",
                    expr,
                    path,
                    f"{flt.kept:,}",
                    f"{statistics.median(times):.2f}",
                    f"{min(times):.2f}",
                    f"{rate / 1e6:.1f} M/s, {1e9 / rate / 60:.1f} min at 10^9",
                ]
            )
    return rows


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    try:
        out = float(lo), float(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a range of seconds is SHORTEST-LONGEST, like 0.5-2; got {text!r}") from None
    if not 0 < out[0] <= out[1]:
        raise argparse.ArgumentTypeError(f"a range of seconds needs 0 < SHORTEST <= LONGEST; got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=3000, help="clips in each dataset of part 1")
    p.add_argument("--clips", type=_range, nargs="+", default=[(0.5, 2.0), (0.1, 0.6)], metavar="SHORTEST-LONGEST")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs of part 1")
    p.add_argument("--index-samples", type=int, default=1_000_000, help="samples of part 2's index (0: no part 2)")
    p.add_argument("--repeat", type=int, default=2, help="filter passes of part 2, by each path")
    a = p.parse_args(argv)
    if a.samples < 1 or a.runs < 1 or a.index_samples < 0 or a.repeat < 1:
        p.error("--samples, --runs and --repeat must be at least 1, --index-samples at least 0")
    rows = passes(a) + (index_passes(a) if a.index_samples else [])
    print(f"# where= filters: {a.samples:,} clips a dataset, {a.runs} interleaved runs ({machine()})")
    header = ["case", "where", "path", "samples", "median s", "fastest s", "vs unfiltered"]
    print(table(rows, header, "lllrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
