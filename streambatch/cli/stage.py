"""``shardify stage``: a dataset copied to node-local disk, checked and resumable."""

from __future__ import annotations

import argparse

from .args import add_dest_storage, add_shared, add_storage, dest_storage_options, shared_keywords

HELP = "copy a dataset (shards + index) to node-local disk, resumably"
DESCRIPTION = (
    "Copy the dataset at SRC (a folder, fsspec URL or index.json) to DEST, typically node-local "
    "disk ($TMPDIR, /local/scratch/...). Each shard goes to a temporary name, is checked against the "
    "index (byte size, and sha256 computed while copying) and renamed; index.json is written last, so DEST has an "
    "index only once every shard it lists is complete. Run it again to finish an interrupted copy: where DEST "
    "holds this dataset (its index, or a copy of it cut short), shards there with the index's size are kept "
    "(re-hashed with --verify). A DEST holding another dataset is refused unless --overwrite; then, as for files "
    "of unknown origin, a shard there is kept only when its sha256 is the index's, the old dataset stays "
    "readable until every shard is copied and is then swapped for the new one, and the replaced dataset's "
    "files this one does not list are removed after its index is written. Nothing else in DEST is touched. "
    "Train from DEST afterwards."
)


def add_arguments(st: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify stage`` (read back by `run()`)."""
    st.add_argument("src", metavar="SRC", help="dataset folder or URL (s3://bucket/ds, ...) or its index.json")
    st.add_argument("dest", metavar="DEST", help="destination folder (node-local disk) or URL")
    st.add_argument(
        "--verify",
        action="store_true",
        help="re-hash shards already in DEST against the index's sha256 (default: their size, where DEST holds "
        "this dataset)",
    )
    add_shared(
        st, "overwrite", "replace another dataset already in DEST (its shards are kept only where their sha256 matches)"
    )
    add_shared(st, "workers", "shards copied at a time (threads; default 4)", default=4)
    add_shared(st, "no_progress")
    add_shared(st, "shard_root")
    add_storage(
        st,
        "fsspec storage option for SRC and its shards only (repeatable; dotted keys nest, values are JSON when they "
        "parse), e.g. --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000",
    )
    add_dest_storage(
        st,
        "fsspec storage option for DEST only (repeatable, as --storage-option is for SRC), e.g. "
        "--dest-storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000",
    )


def run(args: argparse.Namespace) -> int:
    """Copy the dataset and say what was copied and what was already there."""
    from ..write.stage import stage_dataset

    res = stage_dataset(
        args.src,
        args.dest,
        verify=args.verify,
        dest_storage_options=dest_storage_options(args),
        **shared_keywords(args),
    )
    print(
        f"staged {res.index.num_shards} shards to {res.dest}: copied {len(res.copied)} "
        f"({res.bytes_copied / 2**20:,.1f} MiB), kept {len(res.kept)} already complete"
    )
    return 0
