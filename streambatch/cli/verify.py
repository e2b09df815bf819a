"""``shardify verify``: every shard re-read and checked against the index (exit 1 on a mismatch)."""

from __future__ import annotations

import argparse

from .args import add_shared, add_storage, load_index, storage_options

HELP = "re-read every shard and check it against index.json"
DESCRIPTION = (
    "Read the index's tables in full as the loader does (header, shard table, sample tables, their sizes and page "
    "checksums), then re-read every shard and check it against index.json: it exists, byte size, sha256, "
    "sample count, keys and their order, a .json and a payload per sample, and each .json length equal "
    "to the index's. With --decode, also decode every audio member as the loader does and check its "
    "length (catches a member damaged after writing whose checksum was recomputed). Exit 0 if all match, "
    "1 with the list of mismatches otherwise (SHARD: KEY.EXT: problem for a member that does not decode; "
    "TABLE: problem for a damaged index table, and no shard is read)."
)


def add_arguments(v: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify verify`` (read back by `run()`)."""
    add_shared(v, "out")
    v.add_argument(
        "--decode",
        action="store_true",
        help="also decode every audio member and compare its decoded length with the index's",
    )
    workers = "check N shards at a time, in processes (default: 1, or every CPU with --decode)"
    add_shared(v, "workers", workers, default=None)
    add_shared(v, "no_progress")
    add_shared(v, "shard_root")
    add_storage(v)


def run(args: argparse.Namespace) -> int:
    """Check the dataset; print ``ok`` (exit 0) or every mismatch (exit 1)."""
    from ..format.index_check import table_problems
    from ..write.verify import verify_dataset

    index = load_index(args)
    damaged = table_problems(index)
    if damaged:
        print("the index is damaged (the loader refuses it; write or index the dataset again):")
        for p in damaged:
            print(f"  {p}")
        return 1
    problems = verify_dataset(
        index,
        storage_options(args),
        progress=not args.no_progress,
        decode=args.decode,
        workers=args.workers,
        tables=False,
    )
    if problems:
        print(f"{len(problems)} mismatch{'es' if len(problems) != 1 else ''} between the shards and the index:")
        for p in problems:
            print(f"  {p}")
        return 1
    decoded = " (every audio member decodes to its length)" if args.decode else ""
    print(f"ok: {index.num_shards} shards, {index.num_samples} samples match {args.out}{decoded}")
    return 0
