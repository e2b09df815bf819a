"""The loader's options: its keywords split into batching and read options, each turned into its one object
(:class:`~streambatch.plan.config.BatchingConfig`, :class:`~streambatch.read.reader.ReadOptions`) once."""

from __future__ import annotations

import math
from typing import Any

from ..dataset import storage
from ..dataset.index import ShardIndex
from ..dataset.mixture import datasets_of
from ..plan.config import OPTIONS as BATCHING_OPTIONS
from ..plan.config import BatchingConfig, parse_budget
from ..plan.cost import calibration_info
from ..plan.perturb import LengthPlan, SpeedPerturb
from ..plan.stats import stream_stats
from ..read.reader import ReadOptions
from ..read.retry import RetryPolicy

#: read options the loader takes by name (the README's "Reading" table), with their defaults
READ_OPTIONS: dict[str, Any] = {
    "chunk_size": "8M",
    "read_ahead": "64M",
    "read_concurrency": 4,
    "retries": 8,
    "timeout": 60.0,
    "backoff": 0.25,
    "verify": "sha256",
    "max_bad_shards": 2,
    "cache_dir": None,
    "cache_size": None,
}


#: per-sample options the loader takes by name (the README's "Transforms", "Speed perturbation", "Features")
SAMPLE_OPTIONS: dict[str, Any] = {"transform": None, "speed_perturb": None, "features": None}


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


def batching_config(
    budget: float | None, index: ShardIndex | None, options: dict[str, Any], length_plan: LengthPlan | None = None
) -> BatchingConfig:
    """The loader's :class:`BatchingConfig`: a calibration file's budget, batch cap and unit check, and
    lengths rounded as the tensor will be when they count tensor elements (feature frames when planning in them)."""
    if options.get("batch_by") is not None and not hasattr(index, "dataset_of_shard"):
        raise ValueError(
            f"batch_by={options['batch_by']!r} keeps every batch within one dataset of a mixture; this "
            "loader reads one dataset (name several: a {name: folder} mapping, a list of folders with "
            "weights=, or a mixture file), or leave batch_by=None"
        )
    if index is None and options.get("batch_order", "random") != "random":
        raise ValueError(
            f"batch_order={options['batch_order']!r} sorts each worker's planned batches, which needs "
            "an index (write one with `shardify index`); without one batches leave as they form"
        )
    cost = options.get("cost")
    calib = None if options.get("packed") else calibration_info(cost)
    unit = "frames" if length_plan is not None and length_plan.in_frames else index.unit if index is not None else None
    if calib is not None:
        if index is not None and calib.get("unit") not in (None, unit):
            raise ValueError(
                f"{cost}: calibrated for lengths in {calib['unit']!r}, but this dataset's unit is {unit!r}"
            )
        if options.get("max_batch_size") is None and calib.get("max_batch_size"):
            # the search stopped there: larger batches would be extrapolated, not measured
            options = {**options, "max_batch_size": int(calib["max_batch_size"])}
    if index is not None and index.unit == "seconds":
        options = {**options, "pad_to_multiple_of": None}
    # every length, streamed in bounded memory, read once where an option needs them
    stats = _stats(index, length_plan) if index is not None and options.get("num_buckets") else None
    config = BatchingConfig.make(budget, stats, **options, **_window_figures(index, length_plan))
    if hasattr(config.cost, "check_monotone") and index is not None:
        config.cost.check_monotone(stats if stats is not None else _stats(index, length_plan))
    return config


def _window_figures(index: ShardIndex | None, length_plan: LengthPlan | None) -> dict[str, float | None]:
    """The mean length (in the plan's unit) and mean stored bytes of a sample that size the default window."""
    if index is None or not index.num_samples:
        return {}
    indexes = [ix for _, ix in datasets_of(index)]  # a mixture: its datasets' own figures
    count = sum(ix.num_samples for ix in indexes)
    mean = sum(ix.total_length for ix in indexes) / count if count else None
    if mean is not None and length_plan is not None and length_plan.in_frames:
        mean = float(length_plan.frames(int(mean)))
    sizes = [ix.total_bytes for ix in indexes]
    # an index that does not say its bytes (written before its header carried them): the floor, not a guess
    return {"mean_length": mean, "sample_bytes": sum(sizes) / count if None not in sizes else math.inf}


def _stats(index: ShardIndex, length_plan: LengthPlan | None) -> Any:
    """Statistics of every length in the plan's unit (frames when planning in them; speed factors aside)."""
    if length_plan is None or not length_plan.in_frames:
        return index.length_stats()
    return stream_stats(length_plan.frames(x) for x in index.iter_lengths())


def pop_sample_options(options: dict[str, Any]) -> dict[str, Any]:
    """The per-sample options (:data:`SAMPLE_OPTIONS`) taken out of the loader's ``**options``."""
    return {k: options.pop(k) for k in list(options) if k in SAMPLE_OPTIONS}


def sample_plan(
    given: dict[str, Any], index: ShardIndex | None, decode: Any, seed: Any
) -> tuple[LengthPlan | None, Any]:
    """The :class:`LengthPlan` the epochs are planned with and the per-sample stages of the workers
    (:class:`~streambatch.read.transforms.SampleOps`; each worker sets the epoch), from the per-sample options."""
    from ..read.features import plans_in_frames, resolve_features
    from ..read.transforms import SampleOps, require_soxr

    o = {**SAMPLE_OPTIONS, **given}
    speed, features, transform = SpeedPerturb.make(o["speed_perturb"]), resolve_features(o["features"]), o["transform"]
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be a callable fn(sample, rng) -> sample, got {transform!r}")
    if speed is None and features is None and transform is None:
        return None, None
    which = ", ".join(k for k in ("transform", "speed_perturb", "features") if o[k] is not None)
    if index is None:
        raise ValueError(f"{which} need an index: each sample's randomness and planned length follow its global id")
    if decode == "none":
        raise ValueError(f"{which} work on decoded samples; decode='none' keeps them raw")
    if speed is not None or features is not None:
        if index.unit != "samples" or not index.sample_rate:
            raise ValueError(
                f"speed_perturb and features need audio lengths in samples with a sample rate; this "
                f"index counts {index.unit}" + ("" if index.sample_rate else " without a sample rate")
            )
        if decode not in ("auto", "audio"):
            raise ValueError(f"speed_perturb and features work on decoded audio; decode={decode!r}")
    if speed is not None:
        require_soxr()
    frames = features if plans_in_frames(features) else None
    plan = LengthPlan(int(index.sample_rate or 0), speed, frames) if speed is not None or frames is not None else None
    return plan, SampleOps(transform, speed, features, seed, 0, index.sample_rate)


def plan_budget(budget: Any, index: ShardIndex | None, length_plan: LengthPlan | None) -> float | None:
    """The budget in the plan's unit: the dataset's, or feature frames when planning in them (a number counts
    frames; a duration is the frames of that much audio)."""
    if budget is None:
        return None
    if index is None:
        return parse_budget(budget)
    if length_plan is None or not length_plan.in_frames:
        return parse_budget(budget, index.unit, index.sample_rate)
    try:
        return parse_budget(budget, "frames")
    except ValueError:  # a duration: its samples, then their frames
        samples = parse_budget(budget, index.unit, index.sample_rate)
        return float(parse_budget(float(length_plan.frames(int(samples)))))


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The loader's ``**options`` as (batching, read) keywords; an unknown name is a ``TypeError``."""
    unknown = sorted(set(options) - set(BATCHING_OPTIONS) - set(READ_OPTIONS))
    if unknown:
        raise TypeError(f"StreamBatchLoader got unknown option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    batching = {k: v for k, v in options.items() if k in BATCHING_OPTIONS}
    return batching, {k: v for k, v in options.items() if k in READ_OPTIONS}
