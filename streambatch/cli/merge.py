"""``shardify merge``: the part indexes of ``shardify write --part I/N`` runs into one index.json."""

from __future__ import annotations

import argparse

from ..format.describe import total_text, unit_text
from ..format.trust import allow_line, roots_for
from .args import add_shared, add_storage, shard_roots, storage_options

HELP = "merge the part indexes of `write --part I/N` runs into index.json"
DESCRIPTION = (
    "Merge the part indexes (index.part-*.json) that `shardify write SRC OUT --part I/N` wrote "
    "into OUT/index.json (and OUT/errors.jsonl from the parts' errors.part-*.jsonl). Checks that all N parts "
    "are there once each, written from the same source with the same options, and that the shards they "
    "list exist; a missing part is an error that names it (exit 2, nothing written). errors.jsonl is written "
    "before index.json; a merge that fails writing the index leaves both as they were. The merged dataset "
    "has the same samples, order, lengths and totals as a single `shardify write` of SRC."
)


def add_arguments(mg: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify merge`` (read back by `run()`)."""
    add_shared(mg, "out", "the folder or URL the parts were written to")
    mg.add_argument(
        "parts",
        metavar="PART_INDEX",
        nargs="*",
        help="part index files to merge (default: every index.part-*.json in OUT)",
    )
    mg.add_argument(
        "--verify",
        action="store_true",
        help="also re-read every shard and check it against its part index (as `shardify verify`) "
        "before writing index.json",
    )
    add_shared(mg, "no_progress", "no progress bar (with --verify)")
    add_shared(mg, "shard_root")
    add_storage(mg)


def run(args: argparse.Namespace) -> int:
    """Merge the parts and say what the merged dataset holds."""
    from ..write.parts import merge_parts

    index = merge_parts(
        args.out,
        args.parts or None,
        storage_options(args),
        verify=args.verify,
        progress=not args.no_progress,
        shard_roots=shard_roots(args),
    )
    skipped = index.meta.get("skipped", 0)
    print(
        f"merged {index.meta['parts']} parts: {index.num_samples} samples in {index.num_shards} shards "
        f"({total_text(index)})"
        + (f", {skipped} bad inputs skipped (errors.jsonl)" if skipped else "")
        + f"; index: {unit_text(index)}"
    )
    outside = roots_for(index.shard_urls(), args.out)
    if outside:
        print(allow_line(outside, args.out))
    return 0
