#!/usr/bin/env python
"""Freshness of batches from epoch to epoch: streambatch against lhotse's DynamicBucketingSampler on the same lengths.

Of the batch-mate pairs of epoch 0 (two samples one batch holds), the share that are batch-mates again in epoch 1
(``streambatch.plan.freshness.pairs_kept``), beside the batch count against the globally sorted greedy oracle
(``sorted_oracle``) and the padding: a curve of streambatch's ``level_width`` (cut each window at length levels that
wide, :data:`WIDTHS` seconds, a level's samples in a random order per epoch) beside lhotse's points in each
configuration of :data:`LHOTSE` (buckets, buffer), and for each lhotse point whether the curve lies below it (a
``level_width`` whose batches are at most lhotse's in number keeps at most its pairs). LibriSpeech-like lengths
(``streambatch.synthetic.librispeech_like``, budget 200 s at 16 kHz) in shards of 500 in id order, on one rank with
4 workers, at 20k and 100k lengths. Everything is planned, nothing is read: streambatch's rows are
``make_epoch_plan`` (the default rule, ``PLAN_VERSION``: 8 shards interleaved per worker, batch-mates traded, and a
worker's stream of at most two windows cut at level tops; rule 4: without the level cut, which changes nothing at
20k and 100k in shards of 500; rule 2: traded only, one shard after another; rule 1: neither; ``level_width=w s``:
the default rule with the knob); ``--shard 1000 --sizes 1000,2000,4000`` is a small dataset in shards of shardify's
default size, where each worker's stream fits its window; lhotse's are its sampler over a ``CutSet`` of ``MonoCut``s
with the same durations and no audio, one sampler per worker over that worker's shards (the shards in a seeded order
per epoch, dealt round robin, as a sharded iterable dataset streams them), ``max_duration=200``, ``shuffle=True``,
``set_epoch(e)``, ``num_buckets`` and ``buffer_size`` as :data:`LHOTSE` lists them: its defaults (10 buckets, 20,000
cuts), streambatch's window (2,000), and 30 buckets (as recipes pick for finer buckets) with a 10,000 or 2,000
buffer.

A third table is a bound, not a sampler: each worker's batches of at least ``k`` samples (the short samples, whose
large batches weigh most) pooled over the worker's whole epoch and cut again in a random order, which no
streaming window can do. It shows what mixing lengths in those batches costs in batches for the pairs it frees.

A second table splits epoch 0's pairs by the size of the batch that holds them: a batch of ``k`` holds
``k (k - 1) / 2`` pairs, so the few large batches of short samples weigh most in the share kept.

Usage: ``python tools/bench_freshness.py [--sizes 20000,100000] [--shard 500] [--seed 0] [--no-lhotse]
[--widths 0.25,0.5,1,2,4]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import machine, table  # noqa: E402

from streambatch.plan.batcher import sorted_oracle  # noqa: E402
from streambatch.plan.config import PLAN_VERSION, BatchingConfig, with_plan_version  # noqa: E402
from streambatch.plan.epoch import make_epoch_plan  # noqa: E402
from streambatch.plan.freshness import batch_labels, epoch_batches, pairs, pairs_kept  # noqa: E402
from streambatch.plan.layout import Layout  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, librispeech_like  # noqa: E402

SHARD = 500
WORKERS = 4
BUDGET_S = 200.0
#: streambatch's ``level_width`` values on the curve, in seconds
WIDTHS = (0.25, 0.5, 1.0, 2.0, 4.0)
#: lhotse's configurations: (num_buckets, buffer_size)
LHOTSE = ((10, 20_000), (10, 2_000), (30, 10_000), (30, 2_000))


def streambatch_epochs(
    lengths: np.ndarray, seed: int, version: int, level_width: float | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Epochs 0 and 1 planned by streambatch (batches of sample ids) under batching rule ``version``, with
    ``level_width`` in length units (None: off)."""
    shards = [lengths[i : i + SHARD] for i in range(0, len(lengths), SHARD)]
    cfg = BatchingConfig.make(BUDGET_S * SAMPLE_RATE, lengths, seed=seed, level_width=level_width)
    cfg = with_plan_version(cfg, version)
    layout = Layout(1, WORKERS)
    e0, e1 = (epoch_batches(make_epoch_plan(shards, cfg, e, layout)) for e in (0, 1))
    return e0, e1


def random_cut(ids: np.ndarray, lengths: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """``ids`` in a random order, cut greedily where the next sample would take the batch over the budget."""
    out: list[np.ndarray] = []
    batch: list[int] = []
    longest = 0
    for i in rng.permutation(ids).tolist():
        widest = max(longest, int(lengths[i]))
        if batch and widest * (len(batch) + 1) > BUDGET_S * SAMPLE_RATE:
            out.append(np.array(batch, dtype=np.int64))
            batch, widest = [], int(lengths[i])
        batch.append(i)
        longest = widest
    return out + ([np.array(batch, dtype=np.int64)] if batch else [])


def pooled_epoch(lengths: np.ndarray, seed: int, epoch: int, k: int) -> list[np.ndarray]:
    """The bound: streambatch's epoch with each worker's batches of ``k`` or more samples pooled over the whole
    epoch and cut again in a random order (the other batches as they were)."""
    shards = [lengths[i : i + SHARD] for i in range(0, len(lengths), SHARD)]
    cfg = with_plan_version(BatchingConfig.make(BUDGET_S * SAMPLE_RATE, lengths, seed=seed), 3)
    rng = np.random.default_rng([seed, epoch, k])
    out: list[np.ndarray] = []
    for sp in make_epoch_plan(shards, cfg, epoch, Layout(1, WORKERS)).slots:
        batches = [sp.gids[b] for b, rep in zip(sp.batches, sp.repeat) if not rep]
        large = [b for b in batches if len(b) >= k]
        out += [b for b in batches if len(b) < k]
        out += random_cut(np.concatenate(large), lengths, rng) if large else []
    return out


def lhotse_epoch(lengths: np.ndarray, seed: int, epoch: int, buffer_size: int, buckets: int) -> list[np.ndarray]:
    """One epoch of lhotse's DynamicBucketingSampler, one sampler per worker over the worker's shards."""
    from lhotse import CutSet, MonoCut
    from lhotse.dataset import DynamicBucketingSampler

    order = np.random.default_rng([seed, epoch]).permutation(len(lengths) // SHARD)
    out: list[np.ndarray] = []
    for w in range(WORKERS):
        if not len(order[w::WORKERS]):  # fewer shards than workers: this worker reads none
            continue
        ids = np.concatenate([np.arange(s * SHARD, (s + 1) * SHARD) for s in order[w::WORKERS]])
        cuts = CutSet.from_cuts(
            MonoCut(id=str(i), start=0.0, duration=float(lengths[i]) / SAMPLE_RATE, channel=0) for i in ids.tolist()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an eagerly read CutSet: the same batches as a lazy one, faster
            sampler = DynamicBucketingSampler(
                cuts, max_duration=BUDGET_S, shuffle=True, seed=seed, buffer_size=buffer_size, num_buckets=buckets
            )
            sampler.set_epoch(epoch)
            out += [np.array([int(c.id) for c in batch], dtype=np.int64) for batch in sampler]
    return out


def row(label: str, e0: list[np.ndarray], e1: list[np.ndarray], lengths: np.ndarray, oracle: int, t: float) -> list:
    n = len(lengths)
    padded = sum(len(b) * int(lengths[b].max()) for b in e0)
    assert len(np.unique(np.concatenate(e0))) == n, label  # every sample once
    return [
        f"{n:,}",
        label,
        f"{100 * pairs_kept(e0, e1, n):.2f}",
        f"{len(e0):,}",
        f"{len(e0) / oracle:.4f}",
        f"{100 * (1 - lengths.sum() / padded):.2f}",
        f"{t:.1f}",
    ]


SIZE_BINS = [(2, 15), (15, 30), (30, 60), (60, 10_000)]
#: the smallest batch size pooled in each row of the bound
POOLED_FROM = (40, 30, 20)


def size_rows(n: int, epochs: dict[str, tuple[list[np.ndarray], list[np.ndarray]]]) -> list[list[str]]:
    """Per sampler: epoch 0's pairs split by batch size (:data:`SIZE_BINS`), each bin's share of them and the
    share of its pairs kept in epoch 1."""
    out = []
    for label, (e0, e1) in epochs.items():
        second = batch_labels(e1, n)
        k = np.array([len(b) for b in e0])
        total = (k * (k - 1) // 2).astype(np.float64)
        kept = np.array([pairs(second[b]) for b in e0], dtype=np.float64)
        cells = []
        for lo, hi in SIZE_BINS:
            m = (k >= lo) & (k < hi)
            share = 100 * total[m].sum() / total.sum()
            cells.append(f"{share:.1f} / {100 * kept[m].sum() / total[m].sum():.1f}" if total[m].sum() else "-")
        out.append([f"{n:,}", label, *cells])
    return out


def below(curve: list[tuple[float, float]], point: tuple[float, float]) -> tuple[float, float] | None:
    """The curve's point (pairs kept, batches/oracle) with the fewest pairs kept among those with at most
    ``point``'s batches, where it keeps at most ``point``'s pairs; else None."""
    kept, ratio = point
    fits = [c for c in curve if c[1] <= ratio]
    best = min(fits) if fits else None
    return best if best is not None and best[0] <= kept else None


def main(argv: list[str] | None = None) -> int:
    global SHARD
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="20000,100000", help="numbers of lengths (default 20000,100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-lhotse", action="store_true", help="streambatch rows only")
    p.add_argument("--shard", type=int, default=500, help="samples per shard (default 500)")
    p.add_argument(
        "--widths", default=",".join(f"{w:g}" for w in WIDTHS), help="level_width values in seconds (the curve)"
    )
    args = p.parse_args(argv)
    SHARD = args.shard
    widths = [float(w) for w in args.widths.split(",") if w]
    print(f"streambatch bench_freshness  ({machine()})")
    print(
        f"LibriSpeech-like lengths, budget {BUDGET_S:g} s, shards of {SHARD}, 1 rank x {WORKERS} workers, "
        f"seed {args.seed}"
    )
    rows, verdicts, by_size, bound = [], [], [], []
    for n in [int(x) for x in args.sizes.split(",")]:
        lengths = librispeech_like(n, args.seed)
        oracle = len(sorted_oracle(lengths, BUDGET_S * SAMPLE_RATE))
        found, sizes, curve = {}, {}, []
        runs = [("streambatch (level_width None, the default)", PLAN_VERSION, None)]
        runs += [(f"streambatch level_width={w:g} s", PLAN_VERSION, w * SAMPLE_RATE) for w in widths]
        runs += [
            ("streambatch rule 4 (no level cut)", 4, None),
            ("streambatch rule 2 (one shard at a time)", 2, None),
            ("streambatch rule 1 (no trades)", 1, None),
        ]
        for label, version, width in runs:
            t0 = time.perf_counter()
            e0, e1 = streambatch_epochs(lengths, args.seed, version, width)
            rows.append(row(label, e0, e1, lengths, oracle, time.perf_counter() - t0))
            found[label] = (pairs_kept(e0, e1, n), len(e0) / oracle)
            if version == PLAN_VERSION:
                curve.append(found[label])
                if width is None or width == 2 * SAMPLE_RATE:
                    sizes[label] = (e0, e1)
        if not args.no_lhotse:
            for buckets, buf in LHOTSE:
                label = f"lhotse ({buckets} buckets, buffer {buf:,})"
                t0 = time.perf_counter()
                e0, e1 = (lhotse_epoch(lengths, args.seed, e, buf, buckets) for e in (0, 1))
                rows.append(row(label, e0, e1, lengths, oracle, time.perf_counter() - t0))
                found[label] = (pairs_kept(e0, e1, n), len(e0) / oracle)
                sizes[label] = (e0, e1)
        by_size += size_rows(n, sizes)
        for k in POOLED_FROM:
            t0 = time.perf_counter()
            e0, e1 = (pooled_epoch(lengths, args.seed, e, k) for e in (0, 1))
            bound.append(
                row(f"batches of {k}+ pooled per worker epoch", e0, e1, lengths, oracle, time.perf_counter() - t0)
            )
        bound.append([""] * 7)
        for other in [k for k in found if k.startswith("lhotse")]:
            kept, ratio = found[other]
            ours = below(curve, found[other])
            verdicts.append(
                f"{n:>7,}: {other} keeps {100 * kept:.2f}% at {ratio:.4f}x oracle -> "
                + (
                    f"BELOW: streambatch keeps {100 * ours[0]:.2f}% at {ours[1]:.4f}x"
                    if ours
                    else "ABOVE: no point of the curve keeps as few pairs with as few batches"
                )
            )
        rows.append([""] * 7)
    rows.pop()
    header = ["lengths", "sampler", "pairs kept %", "batches", "/oracle", "padding %", "s (2 epochs)"]
    print(table(rows, header, "llrrrrr"))
    print("pairs kept % = of epoch 0's batch-mate pairs, the share that are batch-mates again in epoch 1.")
    print("/oracle = batches of epoch 0 / batches of sorted_oracle (all lengths sorted, cut greedily).")
    print("the curve: the default and each level_width; each lhotse point against it:")
    for line in verdicts:
        print("  " + line)
    print()
    print("epoch 0's pairs by the size of the batch holding them: share of all pairs, and the share kept in epoch 1")
    bins = [f"size {lo}-{hi - 1}" for lo, hi in SIZE_BINS]
    print(table(by_size, ["lengths", "sampler", *bins], "ll" + "r" * len(SIZE_BINS)))
    print("each cell: % of epoch 0's pairs in batches of that size / % of those pairs kept; '-' no such batch")
    print()
    print("a bound, not a sampler: each worker's large batches pooled over its whole epoch, cut again at random")
    print(table(bound[:-1], header, "llrrrrr"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
