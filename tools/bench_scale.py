#!/usr/bin/env python
"""What one rank pays to plan its epoch, by index version and layout: seconds and peak RSS above imports.

For each dataset size, a synthetic lengths-only index (``tools/make_index.py``; no audio) is written as version
1 (one JSON) and version 2 (columnar). Each measured rank runs in a fresh process that imports streambatch,
then opens the index and plans the rank's epoch:

* ``v2 rank-local``: the shard table, the lengths of the shards its slots touch, its own slots' batches
  (what a rank does under torch.distributed; the one all_gather of two integers is replaced by this rank's own
  summary, which costs nothing to measure);
* ``v1 whole-epoch``: the JSON index and every slot of every rank (what every rank did before rank-local
  planning, and still does without a process group).

Usage: ``python tools/bench_scale.py [--samples 10000000 100000000] [--per-shard 1000] [--ranks 8 64 1024]
[--workers 8] [--v1-max 10000000] [--dir DIR]``. Indexes are kept in ``--dir`` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUDGET = 200 * 16_000  # 200 s of 16 kHz audio per batch, as in bench_padding


def child(index_url: str, world: int, workers: int, rank: int, mode: str) -> dict:
    """Runs in a fresh process: open the index and plan one rank's epoch; seconds and peak RSS above imports."""
    import numpy as np  # noqa: F401 - imported before the baseline, as a training script has them
    import pyarrow.parquet  # noqa: F401

    from streambatch.dataset.index import ShardIndex
    from streambatch.fit.memory import proc_status
    from streambatch.plan.config import BatchingConfig
    from streambatch.plan.epoch import RankSchedule, make_epoch_plan, plan_rank_local
    from streambatch.plan.lengths import index_lengths

    base = proc_status("VmRSS")["VmRSS"]
    t0 = time.perf_counter()
    index = ShardIndex.load(index_url)
    t_open = time.perf_counter() - t0
    lengths = index_lengths(index)
    config = BatchingConfig(budget=float(BUDGET))
    if mode == "local":
        sched = plan_rank_local(lengths, config, 0, rank, world, workers, lambda mine: [mine] * world)
    else:
        sched = RankSchedule.of(make_epoch_plan(lengths, config, 0, world, workers, "split"), rank)
    seconds = time.perf_counter() - t0
    return {"open_s": t_open, "seconds": seconds, "peak_mb": (proc_status("VmHWM")["VmHWM"] - base) / 2**20,
            "batches": sched.steps, "lengths_read": lengths.loaded}


def measure(index_url: str, world: int, workers: int, mode: str) -> dict:
    rank = world // 2  # a rank in the middle of the shard order
    cmd = [sys.executable, os.path.abspath(__file__), "--child", index_url, str(world), str(workers), str(rank), mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def make(folder: str, n: int, per_shard: int, version: int) -> str:
    from make_index import write_synthetic_index

    path = os.path.join(folder, f"v{version}-{n}")
    url = os.path.join(path, "index.json")
    if not os.path.exists(url):
        t0 = time.perf_counter()
        write_synthetic_index(path, n, per_shard, version=version, progress=False)
        print(f"wrote v{version} index of {n:,} samples in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return url


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, url, world, workers, rank, mode = sys.argv
        print(json.dumps(child(url, int(world), int(workers), int(rank), mode)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=float, nargs="+", default=[1e7])
    p.add_argument("--per-shard", type=int, default=1_000)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--v1-max", type=float, default=1e7, help="largest size also measured with a v1 index")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="bench_scale-")
    print(f"{'samples':>13} {'ranks':>5} x{args.workers} {'index / plan':<18} {'open s':>7} {'open+plan s':>11} "
          f"{'peak MB':>8} {'lengths read':>13} {'batches':>7}")
    for n in [int(x) for x in args.samples]:
        versions = [(2, "local")] + ([(1, "global")] if n <= args.v1_max else [])
        urls = {v: make(folder, n, args.per_shard, v) for v, _ in versions}
        for world in args.ranks:
            for v, mode in versions:
                r = measure(urls[v], world, args.workers, mode)
                label = "v2 rank-local" if mode == "local" else "v1 whole-epoch"
                print(f"{n:>13,} {world:>5} x{args.workers} {label:<18} {r['open_s']:>7.2f} {r['seconds']:>11.2f} "
                      f"{r['peak_mb']:>8.0f} {r['lengths_read']:>13,} {r['batches']:>7,}", flush=True)
    print(f"indexes in {folder}; peak MB = VmHWM - VmRSS after imports (numpy, pyarrow, streambatch), one fresh "
          "process per row; batches = the measured rank's own count before the ranks agree on the step count")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
