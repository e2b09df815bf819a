#!/usr/bin/env python
"""How many storage requests a job's start-up makes: index header, shard table and each rank's sample-table row
groups, counted for many simulated nodes × ranks in one process (used by ``tools/bench_scale.py``).

The index lies on local disk but is opened as ``counted://PATH``: a filesystem that reads the local file and counts
what an object store would be asked, as s3fs asks it for the index (a size request when a file is opened, one GET
per read of an opened file, one ranged GET per ``cat_file``). Each simulated rank runs the loader's start-up path:
the index through its node's cache folder (:mod:`streambatch.format.shared_index`: one folder per node, one job per
node) or, for comparison, directly as without ``cache_dir``; then its rank-local plan of the epoch (the lengths of
the shards its slots touch) and, per DataLoader worker, the sample offsets of the shards that worker streams (each
worker its own copy of the index, as a pickled one is).

Usage: ``python tools/startup_requests.py [--samples 1000000] [--nodes 128] [--ranks-per-node 8] [--workers 8]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
import tempfile
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import register_implementation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROTOCOL = "counted"
COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()  # (what, request) -> count


class CountingFS(LocalFileSystem):
    """Local files read as an object store would be asked for them, every request counted in :data:`COUNTS`."""

    protocol = PROTOCOL

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return super()._strip_protocol(path[len(PROTOCOL) + 3 :] if path.startswith(PROTOCOL + "://") else path)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        count(path, "HEAD")
        return super().info(path, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        count(path, "GET")
        with open(self._strip_protocol(path), "rb") as f:
            f.seek(start or 0)
            return f.read(-1 if end is None else end - (start or 0))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        count(path, "HEAD")  # s3fs asks an object's size when it opens it
        return CountedFile(open(self._strip_protocol(path), mode), path)


class CountedFile:
    """An open file whose every read is one counted GET (s3fs with ``cache_type="none"``)."""

    def __init__(self, f: Any, path: str) -> None:
        self.f, self.path = f, path

    def read(self, n: int = -1) -> bytes:
        count(self.path, "GET")
        return self.f.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> CountedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()


def count(path: str, request: str) -> None:
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    what = "header" if name.endswith(".json") else "shard table" if name.endswith(".shards.parquet") else "samples"
    COUNTS[(what, request)] += 1


register_implementation(PROTOCOL, CountingFS, clobber=True)


def simulate(index_path: str, nodes: int, per_node: int, workers: int, shared: bool) -> dict[str, int]:
    """Requests of one epoch's start on ``nodes × per_node`` ranks (``shared``: through a node cache folder each),
    by what was asked for: ``header``, ``shard table``, ``samples`` (footers and row groups), and ``total``."""
    from streambatch.format.index import ShardIndex
    from streambatch.format.shared_index import load_shared
    from streambatch.plan.config import BatchingConfig
    from streambatch.plan.epoch import plan_rank_local
    from streambatch.plan.layout import Layout
    from streambatch.plan.lengths import index_lengths
    from streambatch.plan.shards import plan_slots

    url, world = f"{PROTOCOL}://{os.path.abspath(index_path)}", nodes * per_node
    layout, config = Layout(world, workers), BatchingConfig(budget=200 * 16_000.0)
    COUNTS.clear()
    with tempfile.TemporaryDirectory(prefix="startup-requests-") as caches:
        for rank in range(world):
            node = os.path.join(caches, f"node{rank // per_node}")
            ix = load_shared(url, node, job=f"node{rank // per_node}") if shared else ShardIndex.load(url)
            lengths = index_lengths(ix)
            plan_rank_local(lengths, config, 0, rank, layout, lambda mine: [mine] * world)
            dealt = plan_slots(lengths, layout.num_slots, config.epoch_seed, 0, True, None, layout.rank_slots(rank))
            for slot in layout.rank_slots(rank):  # each DataLoader worker with its own copy of the index
                copy = pickle.loads(pickle.dumps(ix))
                for piece in dealt[slot]:
                    copy.sample_offsets(piece.shard)
    out = {what: sum(n for (w, _), n in COUNTS.items() if w == what) for what in ("header", "shard table", "samples")}
    out["total"] = sum(out.values())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--per-shard", type=int, default=1_000)
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    a = p.parse_args()
    from make_index import write_synthetic_index

    with tempfile.TemporaryDirectory(prefix="startup-index-") as folder:
        index = write_synthetic_index(folder, a.samples, a.per_shard, progress=False)
        for shared in (False, True):
            r = simulate(index, a.nodes, a.ranks_per_node, a.workers, shared)
            print(("cache_dir (node copies) " if shared else "no cache_dir (per rank)  ") + str(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
