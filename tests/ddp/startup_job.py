"""A DDP job for the start-up request test: every rank reads a dataset on S3 through its own request-logging proxy
(``--endpoints``, one per global rank) with a node cache folder (``--cache-dir``, one per node), so the test can
tell which rank of which node asked the store for what.

Each rank logs to OUT/log-rank{R}.jsonl its node, then per epoch ``len()`` and every batch's keys (as
tests/ddp/run_ddp.py logs them), all-reducing once per step as a DDP step would.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from streambatch import StreamBatchLoader
from streambatch.format import columnar
from streambatch.procs import watch_parent

# the test's sample table is small, and a sample file up to SMALL_PART_MAX is fetched whole (cheaper than its row
# groups): read it as a large table is read, a rank's own row groups only, which is what the test checks
columnar.SMALL_PART_MAX = 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--endpoints", required=True, help="comma-separated endpoint URLs, one per global rank")
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=1)
    a = p.parse_args()
    watch_parent(os.getppid())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    endpoint = a.endpoints.split(",")[rank]
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    loader = StreamBatchLoader(
        a.data,
        budget=a.budget,
        storage_options=options,
        cache_dir=a.cache_dir,
        num_workers=a.num_workers,
        buffer_size=40,
    )
    with open(os.path.join(a.out, f"log-rank{rank}.jsonl"), "a") as log:
        log.write(json.dumps({"event": "node", "node": int(os.environ["GROUP_RANK"]), "rank": rank}) + "\n")
        for epoch in range(a.epochs):
            loader.set_epoch(epoch)
            log.write(json.dumps({"event": "epoch", "epoch": epoch, "len": len(loader)}) + "\n")
            for batch in loader:
                dist.all_reduce(torch.ones(1))  # uneven steps would hang here
                cost = batch["audio"].shape[0] * batch["audio"].shape[1]
                log.write(json.dumps({"event": "batch", "epoch": epoch, "keys": batch["keys"], "cost": cost}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
