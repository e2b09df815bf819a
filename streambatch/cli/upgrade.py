"""``shardify upgrade``: a version 1 index.json rewritten as the columnar version 2, in place."""

from __future__ import annotations

import argparse

from .args import add_shared, add_storage, opened

HELP = "rewrite a version 1 index.json as the columnar version 2, in place"
DESCRIPTION = (
    "Rewrite the dataset's version 1 index.json (one JSON file with every length) as version 2: "
    "index.json holds the header and points to Parquet tables beside it (index.shards.parquet, "
    "index.samples/part-*.parquet), so a DDP rank reads only the lengths of its own shards. The tables are "
    "written first and index.json last (atomically): a killed upgrade leaves the version 1 index in place. "
    "Shards are not touched. A version 2 index is left as it is. Like write, index and merge, it holds the "
    "folder's lock: refused while another shardify writes the folder (and a write is refused while it runs)."
)


def add_arguments(u: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify upgrade`` (read back by `run()`)."""
    add_shared(u, "out")
    add_shared(u, "no_progress")
    add_storage(u)


def run(args: argparse.Namespace) -> int:
    """Upgrade the index (a version 2 one is left as it is) and say so."""
    from ..write.upgrade import upgrade_dataset

    progress = not args.no_progress
    before, url = opened(lambda out, options, _: upgrade_dataset(out, options, progress=progress), args)
    if url is None:
        print(f"{args.out}: already a version {before.version} index; nothing to do")
        return 0
    print(f"upgraded {url} to version 2 ({before.num_shards:,} shards, {before.num_samples:,} samples)")
    return 0
