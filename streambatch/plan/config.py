"""BatchingConfig: the one object that says which batches form.

Every part that forms batches takes it — :func:`plan_batches`, :class:`BucketBatcher`, the epoch planner and
the loader's workers — so the options are spelled out once, here, and a plan and a run cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BudgetError
from .buckets import DEFAULT_BUFFER, default_buffer_size, estimate_boundaries
from .cost import CostModel, PackedCost, PaddedCost, resolve_cost


@dataclass(frozen=True)
class BatchingConfig:
    """Everything that decides which batches form; identical on every rank and worker.

    ``budget`` bounds each batch's cost (``n × max_len`` for the default padded cost) in the dataset's unit;
    the README's "Batching options" table describes every field.
    """

    budget: float
    bucket_boundaries: np.ndarray | None = None
    max_batch_size: int | None = None
    batch_size_multiple_of: int = 1
    buffer_size: int | None = None
    refill: int | None = None
    min_length: float = 0
    max_length: float | None = None
    drop_last: bool = False
    strict: bool = False
    shuffle: bool = True
    seed: int | Sequence[int] = 0
    pad_to_multiple_of: int | None = None
    batch_order: str = "random"
    output_budget: float | None = None
    batch_by: str | None = None
    cost: CostModel = field(default_factory=PaddedCost)

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.buffer_size is None:  # nothing known of the lengths here: the floor (make() sizes it from them)
            object.__setattr__(self, "buffer_size", DEFAULT_BUFFER)
        if self.buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {self.buffer_size}")
        if self.batch_size_multiple_of < 1:
            raise ValueError(f"batch_size_multiple_of must be at least 1, got {self.batch_size_multiple_of}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if self.output_budget is not None:
            check_budget(self.output_budget)
            if self.cost.packed:
                raise ValueError(
                    "output_budget bounds padded batches (n × max output length); packed batches have none"
                )
        if self.batch_by is not None and self.batch_by not in BATCH_BY:
            raise ValueError(f"batch_by must be None or one of {', '.join(map(repr, BATCH_BY))}, got {self.batch_by!r}")
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(
                f"batch_order must be one of {', '.join(map(repr, BATCH_ORDERS))}, got {self.batch_order!r}"
            )
        if self.bucket_boundaries is not None:
            edges = np.asarray(sorted(float(b) for b in self.bucket_boundaries), dtype=np.float64)
            object.__setattr__(self, "bucket_boundaries", edges)

    @classmethod
    def make(
        cls,
        budget: float | str | None,
        lengths: np.ndarray | None = None,
        *,
        num_buckets: int | None = None,
        bucket_spacing: str = "quantile",
        cost: Any = None,
        quadratic_factor: float | None = None,
        packed: bool = False,
        mean_length: float | None = None,
        sample_bytes: float | None = None,
        **options: Any,
    ) -> BatchingConfig:
        """A config from user-facing options: ``cost`` by name, callable or calibration file (whose budget
        is used when ``budget`` is None), ``packed`` batches, and ``num_buckets`` boundaries estimated from
        ``lengths``, spaced by ``bucket_spacing`` (:data:`BUCKET_SPACINGS`). Without ``buffer_size`` the window
        is sized from the mean length (``mean_length``, else that of ``lengths``) and the mean stored bytes of a
        sample (``sample_bytes``, where known): :func:`default_buffer_size`. ``options`` are the other fields;
        an unknown name is a clear ``TypeError``."""
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown batching option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
        model, calibrated = (PackedCost(), None) if packed else resolve_cost(cost, quadratic_factor)
        if budget is None:
            budget = calibrated
        budget = parse_budget(budget)  # a number; a string without the dataset's unit only as a plain number
        if bucket_spacing not in BUCKET_SPACINGS:
            raise ValueError(
                f"bucket_spacing must be one of {', '.join(map(repr, BUCKET_SPACINGS))}, got {bucket_spacing!r}"
            )
        if bucket_spacing != "quantile" and not num_buckets:
            raise ValueError(
                f"bucket_spacing={bucket_spacing!r} spaces the boundaries num_buckets asks for; give num_buckets"
            )
        if options.get("bucket_boundaries") is None and num_buckets:
            if lengths is None:
                raise ValueError("num_buckets estimates boundaries from the index; without one pass bucket_boundaries")
            options["bucket_boundaries"] = estimate_boundaries(lengths, budget, num_buckets, spacing=bucket_spacing)
        if options.get("buffer_size") is None:
            options["buffer_size"] = _auto_buffer(
                model,
                budget,
                options.get("max_batch_size"),
                _mean(lengths) if mean_length is None else mean_length,
                sample_bytes,
            )
        return cls(budget=budget, cost=model, **options)  # type: ignore[arg-type]

    def replace(self, **changes: Any) -> BatchingConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _mean(lengths: Any) -> float | None:
    """The mean of an array of lengths or of :class:`LengthStats` (None without any)."""
    if lengths is None:
        return None
    if isinstance(lengths, np.ndarray):
        return float(lengths.mean()) if lengths.size else None
    return float(lengths.mean) if lengths.count else None


def _auto_buffer(
    model: CostModel, budget: float, max_batch_size: int | None, mean: float | None, sample_bytes: float | None
) -> int:
    """The default window for samples of ``mean`` length (the floor when it is unknown)."""
    if mean is None or not math.isfinite(mean) or mean <= 0 or model.packed:
        return DEFAULT_BUFFER
    cap = model.capacity(np.array([float(mean)]), float(budget), int(max_batch_size) if max_batch_size else 1 << 40)
    return default_buffer_size(float(cap[0]), sample_bytes)


#: emission orders of a slot's batches: ``random`` (seeded), or sorted by each batch's longest sample
BATCH_ORDERS = ("random", "ascending", "descending")
#: what ``batch_by`` may group batches by: each batch from one dataset of a mixture (None: any samples)
BATCH_BY = ("dataset",)
#: how ``num_buckets`` boundaries are spaced: equal counts of samples, or equal ratios of length
BUCKET_SPACINGS = ("quantile", "exponential")

BUDGET_ERROR = (
    "budget must be a positive finite number in the dataset's unit, a duration like '60s' for audio, or come "
    "from a calibration file given as cost=...; got {budget!r}"
)

#: duration suffixes a budget string may carry (audio only), in seconds
DURATIONS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "min": 60.0}
#: length units a budget string may name (it must be the dataset's own)
UNITS = ("samples", "seconds", "tokens", "frames")
_BUDGET_TEXT = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|[-+]?nan|[-+]?inf(?:inity)?)\s*([a-z]*)$")


def check_budget(budget: Any) -> float:
    """``budget`` as a float once it is a positive finite number, else a :class:`BudgetError`."""
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise BudgetError(BUDGET_ERROR.format(budget=budget)) from None
    if isinstance(budget, bool) or not math.isfinite(value) or value <= 0:
        raise BudgetError(BUDGET_ERROR.format(budget=budget))
    return value


def parse_budget(value: Any, unit: str | None = None, sample_rate: int | None = None) -> float:
    """A budget in the dataset's ``unit`` from a number or a string: ``"960000"``, ``"960000 samples"``, or a
    duration of audio (``"60s"``, ``"1.5min"``, ``"500ms"``), converted with ``sample_rate`` when lengths count
    samples. The one parser for ``shardify inspect --budget`` and ``StreamBatchLoader(budget=...)``."""
    if not isinstance(value, str):
        return check_budget(value)
    m = _BUDGET_TEXT.match(value.strip().lower())
    if m is None:
        raise BudgetError(f"budget {value!r}: expected a number in the dataset's unit, or a duration like '60s'")
    number, suffix = float(m.group(1)), m.group(2)
    if suffix in DURATIONS and suffix != unit:
        number = _seconds_to_unit(value, number * DURATIONS[suffix], unit, sample_rate)
    elif suffix and not any(suffix in (u, u[:-1]) for u in ([unit] if unit else UNITS)):
        known = f"not this dataset's unit, {unit}" if unit else f"not one of {', '.join(UNITS)}"
        raise BudgetError(f"budget {value!r}: {suffix!r} is {known} (durations: 60s, 500ms, 1.5min)")
    if not math.isfinite(number) or number <= 0:
        raise BudgetError(BUDGET_ERROR.format(budget=value))
    return number


def _seconds_to_unit(text: str, seconds: float, unit: str | None, sample_rate: int | None) -> float:
    """A duration in the dataset's unit: seconds as they are, samples at the index's sample rate."""
    if unit == "seconds":
        return seconds
    if unit == "samples" and sample_rate:
        return seconds * float(sample_rate)
    if unit is None:
        raise BudgetError(
            f"budget {text!r}: a duration needs the dataset's unit and sample rate from its index; "
            "without one give the budget in the dataset's unit"
        )
    raise BudgetError(
        f"budget {text!r}: seconds only make sense for audio, this dataset's lengths are in {unit}"
        + (" without a sample rate" if unit == "samples" else "")
    )


#: the option names BatchingConfig takes as fields (``make`` takes these plus num_buckets/cost/packed)
FIELDS = tuple(f.name for f in dataclasses.fields(BatchingConfig) if f.name not in ("budget", "cost"))
#: every keyword :meth:`BatchingConfig.make` understands besides ``budget`` and ``lengths``
OPTIONS = FIELDS + ("num_buckets", "bucket_spacing", "cost", "quadratic_factor", "packed")


def slot_seed(seed: Any, epoch: int, slot: int) -> list[int]:
    """The batcher seed of one (rank, worker) slot in one epoch: the same on every rank."""
    return [int(seed) & 0xFFFFFFFF, int(epoch), int(slot)]
