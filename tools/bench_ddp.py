"""DDP planning benchmark: 8, 64 and 512 ranks × 4 workers over 1 M LibriSpeech-like lengths, planner only.

Prints, per layout and even_batches mode: steps per rank, samples left out per epoch, batches split or
samples repeated, padding %, and the planning time one rank spends (each rank plans every slot, so this
is also the per-rank cost). Then the resume time for a mid-epoch restart of a real local dataset against
reading the epoch from its start up to the same point (what a loader without a plan must do).

    python tools/bench_ddp.py [--n 1000000] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from streambatch.plan.config import BatchingConfig  # noqa: E402
from streambatch.plan.epoch import make_epoch_plan  # noqa: E402
from streambatch.plan.layout import Layout  # noqa: E402
from streambatch.synthetic import librispeech_like  # noqa: E402

BUDGET = 200 * 16000


def padding(plan, lengths) -> float:
    real = padded = 0.0
    for sp in plan.slots:
        for b in sp.batches:
            x = lengths[sp.gids[b]]
            real += x.sum()
            padded += len(b) * x.max()
    return 100 * (1 - real / padded)


def planner_table(n: int, per_shard: int, worlds: list[int], workers: int) -> None:
    lengths = librispeech_like(n, seed=0)
    shards = [lengths[i : i + per_shard] for i in range(0, n, per_shard)]
    cfg = BatchingConfig(budget=BUDGET, buffer_size=2000, seed=0)
    print(
        f"\nPlanner: {n:,} LibriSpeech-like lengths in {len(shards)} shards, budget 200 s, buffer 2000, "
        f"{workers} workers per rank"
    )
    head = f"{'ranks':>6} {'mode':>6} {'steps/rank':>10} {'left out':>9} {'left %':>7} {'split':>6} {'repeated':>8} {'pad %':>6} {'plan s':>7}"
    print(head)
    print("-" * len(head))
    for world in worlds:
        for mode in ("split", "drop", "pad"):
            t = time.perf_counter()
            plan = make_epoch_plan(shards, cfg, 0, Layout(world, workers, mode))
            dt = time.perf_counter() - t
            print(
                f"{world:>6} {mode:>6} {plan.steps:>10} {plan.surplus_samples:>9} "
                f"{100 * plan.surplus_samples / n:>6.3f}% {plan.split_batches:>6} {plan.repeated_samples:>8} "
                f"{padding(plan, lengths):>5.2f}% {dt:>7.2f}"
            )
    print("targets: samples left out ≤ 0.1 % (split: none by construction), planning ≤ 1 s per rank for 1 M")


def resume_table(num: int) -> None:
    from streambatch import StreamBatchLoader
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    with tempfile.TemporaryDirectory() as tmp:
        write_audio_corpus(os.path.join(tmp, "a"), num, seed=0, sample_rate=8000)
        write_shards(os.path.join(tmp, "a"), os.path.join(tmp, "s"), max_count=50, progress=False)
        ds = os.path.join(tmp, "s")
        kw = dict(budget=60 * 8000, buffer_size=200, seed=0, decode="none")
        steps = len(StreamBatchLoader(ds, **kw))
        half = steps // 2
        # a loader without a plan: read the epoch from the start and throw away the first half
        t = time.perf_counter()
        it = iter(StreamBatchLoader(ds, **kw))
        for _ in range(half + 1):
            next(it)
        naive = time.perf_counter() - t
        del it
        state = {
            "epoch": 0,
            "batches_consumed": half,
            "seed": 0,
            "world_size": 1,
            "num_workers": 1,
            "even_batches": "split",
            "num_samples": None,
            "excluded": None,
        }
        t = time.perf_counter()
        loader = StreamBatchLoader(ds, **kw)
        loader.load_state_dict(state)
        next(iter(loader))
        planned = time.perf_counter() - t
    print(f"\nResume at step {half} of {steps} ({num} utterances, local shards, decode='none'):")
    print(f"  fast-forward by reading from the epoch start: {naive:.2f} s to the next batch")
    print(
        f"  streambatch load_state_dict (plan, skip finished shards): {planned:.2f} s  ({naive / planned:.1f}× faster)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--quick", action="store_true", help="100 k lengths, a small resume dataset")
    a = p.parse_args()
    n = 100_000 if a.quick else a.n
    planner_table(n, 1000, [8, 64, 512], 4)
    resume_table(300 if a.quick else 1500)


if __name__ == "__main__":
    main()
