#!/usr/bin/env python
"""Step balance: how long the slowest rank makes every other rank wait, step by step, in simulated DDP epochs.

A data-parallel step lasts as long as its slowest rank. For each length distribution (LibriSpeech-like and
CommonVoice-like speech at 25 frames/s, text tokens; ``streambatch.synthetic``) and each rank count (8, 64,
1,024 simulated ranks, 2 workers each), the real planner (`make_epoch_plan`) plans one epoch, and each rank's
batches are timed, in the order the rank yields them, by two step-time models:

* ``encoder``: a small transformer encoder (width 256, 2 layers, 4 heads, ff 1024, padded with a key padding
  mask), its forward and backward pass timed on this machine with torch (one thread) on a grid of batch shapes
  and fitted by ``streambatch.fit.calibrate.fit_step_time`` (a + b·n + e·n·max + f·n·max², in frames or tokens);
* ``ΣL²``: Σ(L² + 50·L) per batch (an attention-dominated model), L in frames or tokens.

The balanced rows span as many batcher rounds as ``BatchingConfig.make`` picks from the samples' stored bytes
(16-bit audio, 4 bytes a token, plus 1.5 KiB of tar headers and .json each; `balance_rounds`): two or four for
audio, more for text; a 1-round row is shown too, and where the span slides (2 to ``BAND_ROUNDS`` rounds, plan
rule 7) the same span as rule 6's whole groups of rounds (what a rule-6 checkpoint's epoch keeps).

Rows: today's order (``step_balance=None``), the balanced order (``step_balance`` = the model the row times) and
lhotse's ``DynamicBucketingSampler`` order with ``sync_buckets=True`` on the same lengths (its bucketer fed one
stream for all ranks, which is what every rank's sampler draws: ``world_size`` batches per step, the rank's at
its place; the same padded budget ``n × max``, 10 buckets, a 20,000-cut buffer, shuffled). Columns: the mean over
steps of the slowest rank's step time over the mean rank's (``max/mean``) and the share of rank-time spent
waiting (``idle``). Each rank streams ``--windows`` of its batcher's window (a window of ``--speech-buffer`` /
``--text-buffer`` samples): balance moves batches only within a window's rounds, so a run much shorter than a few
windows would flatter it. lhotse is run for ``--lhotse-steps`` steps at most per row (1,024 ranks draw 1,024
batches a step), and for at most ``--lhotse-batches`` batches (at least 3 steps): lhotse forms some 400 batches a
second here.

Usage: ``python tools/bench_balance.py [--ranks 8 64 1024] [--windows 3] [--quick] [--no-lhotse]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _bench_common import machine, table  # noqa: E402

from streambatch.fit.calibrate import fit_step_time, time_steps  # noqa: E402
from streambatch.plan.balance import BAND_ROUNDS, StepBalance, StepTime, rank_step_times, step_balance  # noqa: E402
from streambatch.plan.config import PLAN_VERSION, BatchingConfig, with_plan_version  # noqa: E402
from streambatch.plan.epoch import make_epoch_plan  # noqa: E402
from streambatch.plan.layout import Layout  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, commonvoice_like, librispeech_like, text_like  # noqa: E402

FRAMES_PER_SECOND = 25  # a speech encoder's frame rate after subsampling
SHARD = 500  # samples per shard
WORKERS = 2
TARGET = {"speech": 1.05, "text": 1.10}
# name: (generator, budget in the index's unit, index units per frame/token, kind, stored bytes per unit)
DATA = {
    "LibriSpeech-like": (librispeech_like, 200 * SAMPLE_RATE, SAMPLE_RATE / FRAMES_PER_SECOND, "speech", 2.0),
    "CommonVoice-like": (commonvoice_like, 60 * SAMPLE_RATE, SAMPLE_RATE / FRAMES_PER_SECOND, "speech", 2.0),
    "text": (text_like, 16384, 1.0, "text", 4.0),
}
TAR_BYTES = 1536  # a sample's tar headers and .json, besides its payload


def in_units(model: StepTime, per: float) -> StepTime:
    """``model`` (lengths in frames or tokens) for lengths in index units, ``per`` of them a frame/token."""
    return StepTime(model.a, model.b, model.c / per, model.d / per**2, model.e / per, model.f / per**2)


def encoder_model(quick: bool) -> tuple[StepTime, str]:
    """The small transformer encoder's step time, timed on a grid of padded shapes and fitted."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = 256
    layer = nn.TransformerEncoderLayer(d, 4, 1024, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tokens = 1024 if quick else 2048  # padded frames per timed batch

    def step(lengths):
        n, t = len(lengths), int(max(lengths))
        x = torch.randn(n, t, d)
        mask = torch.arange(t)[None, :] >= torch.tensor(lengths, dtype=torch.int64)[:, None]
        opt.zero_grad()
        model(x, src_key_padding_mask=mask).float().pow(2).mean().backward()
        opt.step()

    grid = []
    for t in (16, 32, 64, 128, 256, 512) if quick else (16, 32, 64, 128, 256, 512, 1024):
        for n in sorted({max(1, tokens // t), max(1, tokens // (2 * t))}):
            grid.append([t] * n)
    timed = time_steps(step, grid, warmup=1, repeat=3 if quick else 5)
    fit = fit_step_time(timed, ("a", "b", "e", "f"))
    err = max(abs(fit.of(len(x), sum(x), sum(v * v for v in x), max(x)) / s - 1) for x, s in timed)
    how = (
        f"encoder fit (s, frames/tokens): a={fit.a:.3g} b={fit.b:.3g} e={fit.e:.3g}·n·max f={fit.f:.3g}·n·max², "
        f"{len(timed)} shapes up to {tokens} padded frames, worst error {100 * err:.0f} %"
    )
    return fit, how


def lhotse_times(lengths: np.ndarray, world: int, budget: float, model: StepTime, steps: int) -> np.ndarray:
    """lhotse's step times (ranks × steps) with sync_buckets, on the same lengths (seconds = index units)."""
    from lhotse import MonoCut
    from lhotse.dataset.sampling.dynamic_bucketing import DynamicBucketer, estimate_duration_buckets

    cuts = (MonoCut(id=str(i), start=0.0, duration=float(v), channel=0) for i, v in enumerate(lengths.tolist()))
    sample = [MonoCut(id=str(i), start=0.0, duration=float(v), channel=0) for i, v in enumerate(lengths[:10_000])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bins = estimate_duration_buckets(sample, num_buckets=10)
        bucketer = DynamicBucketer(
            cuts,
            duration_bins=bins,
            world_size=world,
            max_duration=budget,
            buffer_size=20_000,
            shuffle=True,
            rng=random.Random(0),
            bucket_rng=random.Random(1234),  # what sync_buckets=True seeds on every rank
        )
        got = []
        for batch in bucketer:
            got.append(np.array([int(c.id) for c in batch], dtype=np.int64))
            if len(got) >= steps * world:
                break
    k = len(got) // world
    out = np.zeros((world, k))
    times = model.times(got[: k * world], lengths)
    for s in range(k):
        out[:, s] = times[s * world : (s + 1) * world]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    p.add_argument("--windows", type=float, default=3.2, help="batcher windows each slot streams")
    p.add_argument("--speech-buffer", type=int, default=2000)
    p.add_argument("--text-buffer", type=int, default=4000)
    p.add_argument("--lhotse-steps", type=int, default=200)
    p.add_argument("--lhotse-batches", type=int, default=2400, help="lhotse's batches per row (at least 3 steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small, fast run (8 and 64 ranks, coarse timing)")
    p.add_argument("--no-lhotse", action="store_true")
    p.add_argument("--encoder", help="the encoder's fitted a,b,e,f (seconds; frames/tokens) instead of timing it")
    p.add_argument("--lengths", nargs="+", default=list(DATA), choices=list(DATA), help="which length distributions")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.windows, args.lhotse_steps = [8, 64], 2.5, 60
    t0 = time.perf_counter()
    if args.encoder:
        a, b, e, f = (float(v) for v in args.encoder.split(","))
        encoder, how = StepTime(a=a, b=b, e=e, f=f), f"encoder fit given: a={a:.3g} b={b:.3g} e={e:.3g} f={f:.3g}"
    else:
        encoder, how = encoder_model(args.quick)
    models = {"encoder": encoder, "ΣL²": StepTime(c=50.0, d=1.0)}
    print(f"machine: {machine()}, {time.strftime('%Y-%m-%d')}")
    print(how, f"({time.perf_counter() - t0:.0f} s)", flush=True)
    rows, verdicts = [], []
    for name in args.lengths:
        gen, budget, per, kind, unit_bytes = DATA[name]
        buf = args.speech_buffer if kind == "speech" else args.text_buffer
        for world in args.ranks:
            n = int(world * WORKERS * buf * args.windows)
            lengths = gen(n, args.seed)
            shards = [lengths[i : i + SHARD] for i in range(0, n, SHARD)]
            today = None  # the random order's plan: the same for every model
            for mname, model in models.items():
                unit_model = in_units(model, per)
                t1 = time.perf_counter()
                found = {}
                nbytes = float(lengths.mean()) * unit_bytes + TAR_BYTES
                auto = BatchingConfig.make(
                    budget, lengths, buffer_size=buf, step_balance=unit_model, sample_bytes=nbytes
                )
                rounds = auto.balance.rounds  # what the loader picks from the index's sample bytes
                orders = [
                    ("today", None, PLAN_VERSION),
                    (f"balanced, {rounds} round{'s' * (rounds > 1)}", auto.balance, PLAN_VERSION),
                ]
                if rounds > 1:
                    orders.insert(1, ("balanced, 1 round", StepBalance(unit_model, 1), PLAN_VERSION))
                if 2 <= rounds <= BAND_ROUNDS:  # rule 6 matched whole groups of these rounds
                    orders.insert(-1, (f"groups (rule 6), {rounds} rounds", auto.balance, 6))
                for label, balance, version in orders:
                    cfg = BatchingConfig.make(budget, lengths, seed=args.seed, buffer_size=buf, step_balance=balance)
                    cfg = with_plan_version(cfg, version)
                    if balance is None and today is not None:
                        plan = today
                    else:
                        plan = make_epoch_plan(shards, cfg, 0, Layout(world, WORKERS))
                    if balance is None:
                        today = plan
                    found[label] = (step_balance(rank_step_times(plan, lengths, unit_model)), plan.steps)
                if not args.no_lhotse:
                    most = min(args.lhotse_steps, found["today"][1], max(3, -(-args.lhotse_batches // world)))
                    lt = lhotse_times(lengths, world, budget, unit_model, most)
                    found["lhotse sync_buckets"] = (step_balance(lt), lt.shape[1])
                for label, (b, steps) in found.items():
                    rows.append(
                        [
                            name,
                            f"{world:,}",
                            mname,
                            label,
                            f"{steps:,}",
                            f"{b['max_mean']:.3f}",
                            f"{100 * b['idle']:.1f}",
                        ]
                    )
                mine = found[orders[-1][0]][0]["max_mean"]
                other = found.get("lhotse sync_buckets", (None,))[0]
                ok = mine <= TARGET[kind] and (other is None or mine <= other["max_mean"] + 1e-9)
                verdicts.append(
                    f"{name:<17} {world:>5} ranks {mname:<8} balanced {mine:.3f}"
                    + (f" vs lhotse {other['max_mean']:.3f}" if other else "")
                    + f" (goal <= {TARGET[kind]:.2f}{' and <= lhotse' if other else ''}) -> {'PASS' if ok else 'MISS'}"
                    + f"  [{time.perf_counter() - t1:.0f} s]"
                )
                print(verdicts[-1], flush=True)
    print()
    header = ["lengths", "ranks", "step time", "order", "steps", "max/mean", "idle %"]
    print(table(rows, header, "lrllrrr"))
    print()
    print("\n".join(verdicts))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
