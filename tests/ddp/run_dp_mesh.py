"""Data parallelism inside a model-parallel mesh, run by tests/cluster/test_dp_mesh.py under torchrun (gloo, CPU).

Every process is data-parallel rank ``rank // 2`` of ``world // 2`` (two tensor-parallel peers each) and writes
OUT/rank{R}.json with, per loader, each batch's keys and a hash of its tensors:

* ``full``: an uninterrupted epoch (``dp_rank=``/``dp_size=``), with ``len()`` and the planning log lines;
* ``head``/``tail``: the same epoch stopped after ``--stop`` batches (``state_dict()``), then a new loader that
  ``load_state_dict()``-s it and yields the rest;
* ``elastic``: that state resumed by a loader of ``dp_size=1`` (every process a peer of the one rank);
* ``mesh``: the epoch through ``dp_mesh=`` a 2-D CPU DeviceMesh ``("dp", "tp")``, and ``mesh_1d``: through its
  1-D data-parallel sub-mesh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from streambatch import StreamBatchLoader
from streambatch.procs import watch_parent


class Lines(logging.Handler):
    """The streambatch log lines of this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def digest(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch's keys and a hash of every tensor in it (name, dtype, shape and bytes)."""
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        if isinstance(value, torch.Tensor):
            h.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            h.update(value.contiguous().numpy().tobytes())
    return {"keys": list(batch["keys"]), "hash": h.hexdigest()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--stop", type=int, default=3)
    a = p.parse_args()
    watch_parent(os.getppid())  # torchrun killed: this rank ends too instead of waiting forever
    lines = Lines()
    logging.getLogger("streambatch").addHandler(lines)
    logging.getLogger("streambatch").setLevel(logging.INFO)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = dict(budget=a.budget, num_workers=a.num_workers, buffer_size=40, seed=0)
    dp = dict(dp_rank=rank // 2, dp_size=world // 2)
    out: dict[str, Any] = {"rank": rank}

    full = StreamBatchLoader(a.data, **dp, **opts)
    out["len"] = len(full)
    out["full"] = [digest(b) for b in full]
    out["plan_log"] = [line for line in lines.lines if " planned " in line]
    out["data_parallel"] = {"rank": full.data_parallel.rank, "size": full.data_parallel.size}

    first = StreamBatchLoader(a.data, **dp, **opts)
    it = iter(first)
    out["head"] = [digest(next(it)) for _ in range(a.stop)]
    state = first.state_dict()
    it.close()  # the killed run: its workers end, its state is all that is left
    out["state_world_size"] = state["world_size"]
    second = StreamBatchLoader(a.data, **dp, **opts)
    second.load_state_dict(state)
    out["resumed_len"] = len(second)
    out["tail"] = [digest(b) for b in second]

    elastic = StreamBatchLoader(a.data, dp_rank=0, dp_size=1, **opts)
    elastic.load_state_dict(state)
    out["elastic"] = [digest(b) for b in elastic]

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    by_mesh = StreamBatchLoader(a.data, dp_mesh=mesh, **opts)
    out["mesh_len"] = len(by_mesh)
    out["mesh"] = [digest(b) for b in by_mesh]
    out["mesh_1d_len"] = len(StreamBatchLoader(a.data, dp_mesh=mesh["dp"], **opts))

    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
