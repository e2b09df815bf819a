"""The loader's options: its keywords split into batching and read options, each turned into its one object
(:class:`~streambatch.plan.config.BatchingConfig`, :class:`~streambatch.read.reader.ReadOptions`) once."""

from __future__ import annotations

from typing import Any

from .dataset import storage
from .dataset.index import ShardIndex
from .plan.config import OPTIONS as BATCHING_OPTIONS
from .plan.config import BatchingConfig
from .plan.cost import calibration_info
from .read.reader import ReadOptions
from .read.retry import RetryPolicy

#: read options the loader takes by name (the README's "Reading" table), with their defaults
READ_OPTIONS: dict[str, Any] = {
    "chunk_size": "8M", "read_ahead": "64M", "read_concurrency": 4, "retries": 8, "timeout": 60.0,
    "backoff": 0.25, "verify": "sha256", "max_bad_shards": 2, "cache_dir": None, "cache_size": None,
}


def read_options(**given: Any) -> ReadOptions:
    """:class:`ReadOptions` from the loader's read keywords (sizes like ``"8M"`` accepted)."""
    o = {**READ_OPTIONS, **given}
    return ReadOptions(
        chunk_size=storage.parse_bytes(o["chunk_size"], "chunk_size"),
        read_ahead=storage.parse_bytes(o["read_ahead"], "read_ahead"),
        read_concurrency=int(o["read_concurrency"]),
        retry=RetryPolicy(retries=int(o["retries"]), backoff=float(o["backoff"]), timeout=float(o["timeout"])),
        verify=o["verify"],
        max_bad_shards=int(o["max_bad_shards"]),
        cache_dir=o["cache_dir"],
        cache_size=storage.parse_bytes(o["cache_size"], "cache_size"),
    )


def batching_config(budget: float | None, index: ShardIndex | None, options: dict[str, Any]) -> BatchingConfig:
    """The loader's :class:`BatchingConfig`: a calibration file's budget, batch cap and unit check, and
    lengths rounded as the tensor will be when they count tensor elements."""
    if index is None and options.get("batch_order", "random") != "random":
        raise ValueError(f"batch_order={options['batch_order']!r} sorts each worker's planned batches, which needs "
                         "an index (write one with `shardify index`); without one batches leave as they form")
    cost = options.get("cost")
    calib = None if options.get("packed") else calibration_info(cost)
    if calib is not None:
        if index is not None and calib.get("unit") not in (None, index.unit):
            raise ValueError(f"{cost}: calibrated for lengths in {calib['unit']!r}, but this dataset's unit is {index.unit!r}")
        if options.get("max_batch_size") is None and calib.get("max_batch_size"):
            # the search stopped there: larger batches would be extrapolated, not measured
            options = {**options, "max_batch_size": int(calib["max_batch_size"])}
    if index is not None and index.unit == "seconds":
        options = {**options, "pad_to_multiple_of": None}
    # every length, streamed in bounded memory, read once where an option needs them
    stats = index.length_stats() if index is not None and options.get("num_buckets") else None
    config = BatchingConfig.make(budget, stats, **options)
    if hasattr(config.cost, "check_monotone") and index is not None:
        config.cost.check_monotone(stats if stats is not None else index.length_stats())
    return config


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The loader's ``**options`` as (batching, read) keywords; an unknown name is a ``TypeError``."""
    unknown = sorted(set(options) - set(BATCHING_OPTIONS) - set(READ_OPTIONS))
    if unknown:
        raise TypeError(f"StreamBatchLoader got unknown option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    batching = {k: v for k, v in options.items() if k in BATCHING_OPTIONS}
    return batching, {k: v for k, v in options.items() if k in READ_OPTIONS}
