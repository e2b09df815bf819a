#!/usr/bin/env python
"""Batching under the three cost models: padded, quadratic and packed.

For the LibriSpeech-like and text length distributions (``streambatch.synthetic.DISTRIBUTIONS``, N lengths
each in random stream order), ``plan_batches(..., buffer_size=10_000)`` under

* ``cost="padded"``: ``n × max_len ≤ budget`` (the distribution's budget: 200 s @ 16 kHz, 16,384 tokens);
* ``cost="quadratic"``: ``n × (max_len + max_len² / q) ≤ budget'``, with ``q`` where an attention model's
  ``L²`` term is as large as its linear one (LibriSpeech-like: 20 s; text: 512 tokens), and the budget scaled
  by ``1 + median/q`` so that a batch of median-length samples holds as many samples as under ``padded``;
* ``packed=True``: padding-free batches, ``Σ lengths ≤ budget`` (the padded budget).

Columns: batches; padding % = 1 - Σ real / Σ tensor elements, where a padded batch's tensor has
``n × max_len`` elements and a packed batch's ``Σ lengths`` (``[total]`` plus ``cu_seqlens``, which is not
payload); real share % = Σ real / Σ tensor elements (its complement); budget utilisation % = Σ real /
(batches × budget) — how much of each batch's budget carries real data; cost fill % = mean of
``cost(batch) / budget`` under the batch's own cost model; the largest batch and the mean longest sample.
Targets: every batch within its budget, every sample in one batch, and for packed batches a real share and
a budget utilisation of at least 99 % (PASS/MISS).

Usage: ``python tools/bench_cost.py [--n 200000] [--quick] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import machine, table

from streambatch.plan.batcher import plan_batches
from streambatch.plan.cost import QuadraticCost
from streambatch.synthetic import DISTRIBUTIONS, SAMPLE_RATE

LABELS = {"librispeech": "LibriSpeech-like", "text": "text"}
#: quadratic factor per distribution, in its unit: the length where the L² term equals the linear one
QUADRATIC_FACTOR = {"librispeech": 20 * SAMPLE_RATE, "text": 512}
BUFFER_SIZE = 10_000
TARGET_PACKED = 0.99


def fmt_len(name: str, x: float) -> str:
    if DISTRIBUTIONS[name][2] == "samples":
        return f"{x / SAMPLE_RATE:.2f} s"
    return f"{x:,.0f} tok"


def fmt_budget(name: str, budget: float) -> str:
    if DISTRIBUTIONS[name][2] == "samples":
        return f"{budget / SAMPLE_RATE:,.1f} s"
    return f"{budget:,.0f} tok"


def stats(
    batches: list[np.ndarray], lengths: np.ndarray, budget: float, mode: str, q: float | None
) -> dict[str, float]:
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    flat = np.concatenate(batches)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    maxlen = np.maximum.reduceat(lengths[flat], starts).astype(np.float64)
    real_per = np.add.reduceat(lengths[flat], starts).astype(np.float64)
    real = float(real_per.sum())
    if mode == "packed":
        tensor = real  # the samples concatenated, no padding
        cost = real_per
    else:
        tensor = float((sizes * maxlen).sum())
        cost = QuadraticCost(q).cost(sizes, maxlen) if mode == "quadratic" else sizes * maxlen
    return {
        "batches": len(batches),
        "samples": int(sizes.sum()),
        "distinct": int(np.unique(flat).size),
        "padding": 1 - real / tensor,
        "share": real / tensor,
        "util": real / (len(batches) * budget),
        "fill": float(np.mean(cost / budget)),
        "over": int((cost > budget * (1 + 1e-12)).sum()),
        "max_size": int(sizes.max()),
        "mean_max": float(maxlen.mean()),
    }


def run(n: int, seed: int) -> tuple[str, list[str]]:
    rows, verdicts = [], []
    for name in ("librispeech", "text"):
        gen, budget, _ = DISTRIBUTIONS[name]
        lengths = gen(n, seed)
        q = float(QUADRATIC_FACTOR[name])
        median = float(np.median(lengths))
        q_budget = budget * (1 + median / q)
        modes = [
            ("padded", "padded", budget, {}),
            (f"quadratic q={fmt_len(name, q)}", "quadratic", q_budget, {"cost": "quadratic", "quadratic_factor": q}),
            ("packed", "packed", budget, {"packed": True}),
        ]
        first = True
        for label, mode, b, kwargs in modes:
            t0 = time.perf_counter()
            plan = plan_batches(lengths, b, buffer_size=BUFFER_SIZE, seed=seed, **kwargs)
            dt = time.perf_counter() - t0
            s = stats(list(plan), lengths, b, mode, q if mode == "quadratic" else None)
            ok_all = s["distinct"] == s["samples"] == n and s["over"] == 0
            verdict = "-"
            if mode == "packed":
                good = ok_all and s["share"] >= TARGET_PACKED and s["util"] >= TARGET_PACKED
                verdict = "PASS" if good else "MISS"
                verdicts.append(
                    f"{LABELS[name]:<17} packed: real share {100 * s['share']:.2f} %, budget utilisation "
                    f"{100 * s['util']:.2f} % (target >= {100 * TARGET_PACKED:.0f} %), over budget "
                    f"{s['over']}, seen {s['distinct']:,}/{n:,} -> {verdict}"
                )
            elif not ok_all:
                verdict = "MISS"
            rows.append(
                [
                    LABELS[name] if first else "",
                    label,
                    fmt_budget(name, b),
                    f"{s['batches']:,}",
                    f"{100 * s['padding']:.2f}",
                    f"{100 * s['share']:.2f}",
                    f"{100 * s['util']:.2f}",
                    f"{100 * s['fill']:.2f}",
                    f"{s['over']}",
                    f"{s['max_size']:,}",
                    fmt_len(name, s["mean_max"]),
                    f"{dt:.2f}",
                    verdict,
                ]
            )
            first = False
        rows.append([""] * 13)
    rows.pop()
    header = [
        "distribution",
        "cost",
        "budget",
        "batches",
        "padding %",
        "real share %",
        "budget util %",
        "cost fill %",
        "over",
        "max batch",
        "mean max len",
        "plan s",
        "check",
    ]
    return table(rows, header, "lllrrrrrrrrrl"), verdicts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="lengths per distribution (default 200,000)")
    p.add_argument("--quick", action="store_true", help="20,000 lengths")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n = 20_000 if args.quick else args.n
    print(f"# bench_cost: N={n:,} per distribution, buffer_size={BUFFER_SIZE:,}, seed={args.seed}; {machine()}")
    print()
    text, verdicts = run(n, args.seed)
    print(text)
    print()
    for v in verdicts:
        print(v)


if __name__ == "__main__":
    main()
