#!/usr/bin/env python
"""What one rank pays to plan its epoch, by index version and layout: seconds and peak RSS above imports.

For each dataset size, a synthetic lengths-only index (``tools/make_index.py``; no audio) is written as version
1 (one JSON) and version 2 (columnar). Each measured rank runs in a fresh process that imports streambatch,
then opens the index and plans the rank's epoch:

* ``v2 rank-local``: the shard table, the lengths of the shards its slots touch, its own slots' batches
  (what a rank does under torch.distributed; the one all_gather of two integers is replaced by this rank's own
  summary, which costs nothing to measure);
* ``v1 whole-epoch``: the JSON index and every slot of every rank (what every rank did before rank-local
  planning, and still does without a process group);
* ``v2 resume from 2W`` / ``from W/2``: a rank of W resuming an epoch saved on 2W (or W/2) ranks after half its
  steps: it batches only the old slots that held its own shards, each only up to the batches it yielded (a
  resume on the same layout plans exactly the fresh plan, then skips the consumed steps);
* ``v1/v2 inspect stats``: ``shardify inspect``'s numbers, every length streamed into a bounded summary;
* ``requests``: the storage requests of one epoch's start on the largest ``--ranks`` as ``--ranks-per-node`` ranks a
  node (1,024 ranks on 128 nodes by default), counted by ``tools/startup_requests.py`` over a ``--requests-samples``
  index: each rank reading the index itself, against one copy per node (``cache_dir``).

Usage: ``python tools/bench_scale.py [--samples 10000000 100000000] [--per-shard 1000] [--ranks 8 64 1024]
[--workers 8] [--v1-max 10000000] [--torchrun 4] [--only local resume grown global stats requests] [--ranks-per-node 8]
[--requests-samples 1000000] [--dir DIR]``. Indexes are kept in ``--dir`` (default: a temporary folder), and an index
already there is reused (a large one takes minutes to write).
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
    """Runs in a fresh process: open the index and do one rank's work; seconds and peak RSS above imports."""
    import numpy as np  # noqa: F401 - imported before the baseline, as a training script has them
    import pyarrow.parquet  # noqa: F401

    from streambatch.fit.memory import proc_status
    from streambatch.format.index import ShardIndex

    base = proc_status("VmRSS")["VmRSS"]
    t0, c0 = time.perf_counter(), time.process_time()
    index = ShardIndex.load(index_url)
    t_open = time.perf_counter() - t0
    out = STEPS[mode](index, world, workers, rank)
    out.update(
        open_s=t_open,
        seconds=time.perf_counter() - t0,
        cpu_s=time.process_time() - c0,  # what a shared machine's load changes least
        peak_mb=(proc_status("VmHWM")["VmHWM"] - base) / 2**20,
    )
    return out


def plan_local(index, world: int, workers: int, rank: int) -> dict:
    """One rank's epoch from its own slots (the all_gather is replaced by this rank's own summary)."""
    from streambatch.plan.epoch import plan_rank_local
    from streambatch.plan.layout import Layout
    from streambatch.plan.lengths import index_lengths

    lengths = index_lengths(index)
    sched = plan_rank_local(lengths, _config(), 0, rank, Layout(world, workers), lambda mine: [mine] * world)
    return {"batches": sched.steps, "lengths_read": lengths.loaded}


def plan_global(index, world: int, workers: int, rank: int) -> dict:
    """Every slot of every rank (what each rank did before rank-local planning, and without a process group)."""
    from streambatch.plan.epoch import RankSchedule, make_epoch_plan
    from streambatch.plan.layout import Layout
    from streambatch.plan.lengths import index_lengths

    lengths = index_lengths(index)
    sched = RankSchedule.of(make_epoch_plan(lengths, _config(), 0, Layout(world, workers, "split")), rank)
    return {"batches": sched.steps, "lengths_read": lengths.loaded}


def resume_local(index, world: int, workers: int, rank: int, old_world: int | None = None) -> dict:
    """One rank of ``world`` resuming an epoch that ran on ``old_world`` ranks (default ``2 × world``) until half
    its steps: the rank marks what the old slots that held its shards consumed. The checkpoint's part — the old
    step count and every old rank's equalisation — comes from another process (`checkpoint()`, not measured), as
    a state_dict() would. ``BENCH_NO_EQUALISED=1``: a checkpoint of an older version, which holds no
    equalisation (the old ranks are re-planned in full)."""
    from streambatch.plan.epoch import RankEqualised, plan_rank_local
    from streambatch.plan.layout import Layout
    from streambatch.plan.lengths import index_lengths
    from streambatch.plan.resume import EarlierRun, Resumed

    old_world = old_world or 2 * world
    with open(os.environ["BENCH_CHECKPOINT"]) as f:
        saved = json.load(f)
    lengths, config = index_lengths(index), _config()
    old_layout = Layout(old_world, workers, "split")
    equalised = tuple(RankEqualised.of_ints(r) for r in saved["equalised"])
    if os.environ.get("BENCH_NO_EQUALISED"):
        equalised = ()
    done = Resumed(0, (EarlierRun(old_layout, saved["steps"], saved["steps"] // 2, equalised),))
    sched = plan_rank_local(
        lengths,
        config,
        0,
        rank,
        Layout(world, workers, "split"),
        lambda mine: [mine] * world,
        done.consumed(lengths, config),
    )
    return {"batches": sched.steps, "lengths_read": lengths.loaded}


def resume_grown(index, world: int, workers: int, rank: int) -> dict:
    """`resume_local()` from an epoch saved on ``world // 2`` ranks (a job restarted on more nodes)."""
    return resume_local(index, world, workers, rank, max(1, world // 2))


def checkpoint(index_url: str, old_world: int, workers: int, world: int, rank: int) -> dict:
    """What a checkpoint saved on ``old_world`` ranks holds for the resume of rank ``rank`` of ``world``: the step
    count (the first old rank's own) and every old rank's equalisation — planned from batch counts for the old
    ranks that hold the resuming rank's shards (a sample's old and new slots follow from the same running total,
    so with a whole ratio of ranks they are exactly these), the rest stood in for by the first of them (never
    asked about)."""
    from streambatch.format.index import ShardIndex
    from streambatch.plan.epoch import RankSummary, plan_rank, rank_raw_slots
    from streambatch.plan.layout import Layout
    from streambatch.plan.lengths import index_lengths

    lengths, config = index_lengths(ShardIndex.load(index_url)), _config()
    layout = Layout(old_world, workers, "split")

    def counted(r):
        return rank_raw_slots(lengths, config, 0, r, layout, counted=True)

    near = range(rank * old_world // world, max(rank * old_world // world + 1, -(-(rank + 1) * old_world // world)))
    steps = RankSummary.of(counted(near[0])).batches
    eq = {r: plan_rank(counted(r), steps, layout, config, 0, r, lengths).equalised for r in near}
    return {"steps": steps, "equalised": [eq.get(r, eq[near[0]]).to_ints() for r in range(layout.world_size)]}


def stats(index, world: int, workers: int, rank: int) -> dict:
    """``shardify inspect``'s numbers: every length streamed into a bounded summary (v2: a row group at a time)."""
    summary = index.length_stats()
    return {"batches": 0, "lengths_read": summary.count}


def _config():
    from streambatch.plan.config import BatchingConfig

    return BatchingConfig(budget=float(BUDGET))


STEPS = {"local": plan_local, "global": plan_global, "resume": resume_local, "grown": resume_grown, "stats": stats}
LABELS = {
    "local": "v2 rank-local",
    "global": "v1 whole-epoch",
    "resume": "v2 resume from 2W",
    "grown": "v2 resume from W/2",
    "stats": "{v} inspect stats",
}


def measure(index_url: str, world: int, workers: int, mode: str, folder: str) -> dict:
    rank = world // 2  # a rank in the middle of the shard order
    env = dict(os.environ)
    if mode in ("resume", "grown"):
        old_world = 2 * world if mode == "resume" else max(1, world // 2)
        path = os.path.join(folder, f"checkpoint-{old_world}.json")
        saved = _run("--checkpoint", index_url, str(old_world), str(workers), str(world), str(rank))
        with open(path, "w") as f:
            f.write(saved)
        env["BENCH_CHECKPOINT"] = path
    return json.loads(_run("--child", index_url, str(world), str(workers), str(rank), mode, env=env))


def _run(*args: str, env: dict | None = None) -> str:
    """This script in a fresh process; its last line of output."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True, check=True, env=env
    )
    return out.stdout.strip().splitlines()[-1]


def torchrun_ratio(index_url: str, nproc: int, folder: str) -> None:
    """Real torchrun ranks (gloo) planning one epoch each through the loader (``tools/plan_job.py``), beside
    one process planning it alone: each rank's CPU seconds and peak memory as a share of the lone process's."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {}
    for label, launcher in (
        ("alone", []),
        ("ranks", ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]),
    ):
        out = tempfile.mkdtemp(prefix=f"plan-{label}-", dir=folder)
        subprocess.run(
            [sys.executable, *launcher, script, "--index", index_url, "--budget", str(BUDGET), "--out", out],
            check=True,
            env=env,
            capture_output=True,
        )
        results[label] = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
    alone = results["alone"][0]
    print(
        f"\n{nproc} torchrun ranks vs one process ({alone['steps']:,} steps planned alone): "
        f"alone {alone['cpu_s']:.2f} CPU s, {alone['extra_mb']:.0f} MB"
    )
    for r in results["ranks"]:
        print(
            f"  rank {r['rank']}: {r['steps']:,} steps, {r['cpu_s']:.2f} CPU s ({r['cpu_s'] / alone['cpu_s']:.2f}x), "
            f"{r['extra_mb']:.0f} MB ({r['extra_mb'] / alone['extra_mb']:.2f}x)"
        )


def make(folder: str, n: int, per_shard: int, version: int) -> str:
    from make_index import write_synthetic_index

    path = os.path.join(folder, f"v{version}-{n}")
    url = os.path.join(path, "index.json")
    if not os.path.exists(url):
        t0 = time.perf_counter()
        write_synthetic_index(path, n, per_shard, version=version, progress=False)
        print(f"wrote v{version} index of {n:,} samples in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return url


def requests_table(folder: str, n: int, per_shard: int, world: int, per_node: int, workers: int) -> None:
    """The storage requests of one epoch's start on ``world`` ranks, ``per_node`` a node (simulated and counted)."""
    from startup_requests import simulate

    index, nodes = make(folder, n, per_shard, 2), -(-world // per_node)
    print(
        f"\nstart-up requests of one epoch, {nodes * per_node:,} ranks on {nodes:,} nodes x{workers} workers, "
        f"{n:,} samples ({per_shard:,} a shard; counted as an object store is asked):"
    )
    print(f"  {'index read':<22} {'header':>8} {'shard table':>12} {'sample table':>13} {'total':>8}")
    for label, shared in (("by every rank", False), ("once per node", True)):
        r = simulate(index, nodes, per_node, workers, shared)
        row = f"{r['header']:>8,} {r['shard table']:>12,} {r['samples']:>13,} {r['total']:>8,}"
        print(f"  {label:<22} {row}", flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--checkpoint":
        _, _, url, old_world, workers, world, rank = sys.argv
        print(json.dumps(checkpoint(url, int(old_world), int(workers), int(world), int(rank))))
        return 0
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
    p.add_argument(
        "--torchrun",
        type=int,
        default=0,
        metavar="N",
        help="also run N real torchrun ranks against one process on the first size (CPU and memory ratios)",
    )
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks a node, for the start-up requests")
    p.add_argument("--requests-samples", type=float, default=1e6, help="index size for the start-up requests")
    kinds = [*STEPS, "requests"]
    p.add_argument("--only", nargs="+", default=kinds, choices=kinds, help="which rows to measure")
    args = p.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="bench_scale-")
    print(
        f"{'samples':>13} {'ranks':>5} x{args.workers} {'index / plan':<18} {'open s':>7} {'open+plan s':>11} "
        f"{'CPU s':>7} {'peak MB':>8} {'lengths read':>13} {'batches':>7}"
    )
    for n in [int(x) for x in args.samples]:
        versions = [2] + ([1] if n <= args.v1_max else [])
        urls = {v: make(folder, n, args.per_shard, v) for v in versions}
        rows = [(world, 2, mode) for world in args.ranks for mode in ("local", "resume", "grown")]
        rows = [r for r in rows if r[2] != "grown" or r[0] >= 2]  # from W/2 needs two ranks at least
        rows += [(world, 1, "global") for world in args.ranks if 1 in versions]
        rows += [(1, v, "stats") for v in versions]
        rows = [r for r in rows if r[2] in args.only]
        for world, v, mode in sorted(rows, key=lambda r: (r[2] == "stats", r[0], r[1] == 1)):
            r = measure(urls[v], world, args.workers, mode, folder)
            label = LABELS[mode].format(v=f"v{v}")
            shown = "-" if mode == "stats" else f"{world:>5}"
            print(
                f"{n:>13,} {shown:>5} x{args.workers} {label:<18} {r['open_s']:>7.2f} {r['seconds']:>11.2f} "
                f"{r['cpu_s']:>7.2f} {r['peak_mb']:>8.0f} {r['lengths_read']:>13,} {r['batches']:>7,}",
                flush=True,
            )
    if "requests" in args.only:
        n = int(args.requests_samples)
        requests_table(folder, n, args.per_shard, max(args.ranks), args.ranks_per_node, args.workers)
    if args.torchrun:
        torchrun_ratio(make(folder, int(args.samples[0]), args.per_shard, 2), args.torchrun, folder)
    print(
        f"indexes in {folder}; peak MB = VmHWM - VmRSS after imports (numpy, pyarrow, streambatch), one fresh "
        "process per row; CPU s = the process's CPU seconds over open+plan; batches = the measured rank's own "
        "count before the ranks agree on the step count"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
