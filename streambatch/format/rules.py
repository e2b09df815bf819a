"""The on-disk contract's small rules: the fingerprint of a shard's keys and the names of a dataset folder's files.

The size and checksum checks shards get against their index entry are `streambatch.io.digest`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from .index import INDEX_NAME


def keys_sha1(keys: Iterable[str]) -> str:
    """The index's fingerprint of a shard's sample keys in tar order."""
    return hashlib.sha1("\n".join(keys).encode("utf-8")).hexdigest()


# ---- file names: what a write leaves in its output folder ------------------------------------------
# (``index.json`` itself is `streambatch.format.index.INDEX_NAME`)
SHARD_NAME = "shard-{:06d}.tar"
ERRORS_NAME = "errors.jsonl"
PART_SHARD_NAME = "shard-p{:04d}-{:06d}.tar"
PART_INDEX_NAME = "index.part-{:04d}.json"
PART_ERRORS_NAME = "errors.part-{:04d}.jsonl"
PART_INDEX_GLOB = "index.part-*.json"
#: the files ``--overwrite`` removes: only what the writer makes
OUR_FILES = (
    "shard-*.tar",
    INDEX_NAME,
    ERRORS_NAME,
    "index.part-*.json",
    "errors.part-*.jsonl",
    "*.tmp*",
    "index.shards.parquet",
    "index.samples",
    "index.1.shards.parquet",  # the tables of a rewritten index (format/index_swap.py)
    "index.1.samples",
    "index.part-*.shards.parquet",
    "index.part-*.samples",
)
