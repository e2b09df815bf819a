"""One rank of a planning-only job (used by tools/bench_scale.py --torchrun and tests/cluster/test_scale.py): open a
large lengths-only index, ask len(loader), report time and memory.

Run under torchrun (the loader plans rank-locally over the process group) or alone (the whole epoch).
Prints one JSON line per rank to --out/plan-rank{R}.json: steps, extra peak RSS above imports, CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, required=True)
    a = p.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    import pyarrow.parquet  # noqa: F401 - imports before the baseline

    from streambatch import StreamBatchLoader
    from streambatch.fit.memory import proc_status

    base, cpu0 = proc_status("VmRSS")["VmRSS"], resource.getrusage(resource.RUSAGE_SELF).ru_utime
    loader = StreamBatchLoader(a.index, budget=a.budget, num_workers=2)
    steps = len(loader)
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {
        "rank": rank,
        "steps": steps,
        "extra_mb": (proc_status("VmHWM")["VmHWM"] - base) / 2**20,
        "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu0,
        "mode": loader.planning,
    }
    with open(os.path.join(a.out, f"plan-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
