"""BatchingConfig: the one object that says which batches form.

Every part that forms batches takes it — `plan_batches()`, `BucketBatcher`, the epoch planner and
the loader's workers — so the options are spelled out once, here, and a plan and a run cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import OptionError, bool_option, choice_option, int_option, number_option, shown
from ..stats import LengthStats
from .balance import StepBalance, balance_rounds, resolve_step_time
from .buckets import DEFAULT_BUFFER, MAX_BUCKETS, default_buffer_size, estimate_boundaries
from .budget import check_budget, parse_budget
from .cost import CostModel, PackedCost, PaddedCost, resolve_cost

#: the batching rule planned epochs follow (`BatchingConfig.plan_version`)
PLAN_VERSION = 7

#: the largest seed: every random stream is keyed by the seed's low 32 bits (`slot_seed()`), so a larger one
#: would repeat a smaller one's plans without saying so
MAX_SEED = 2**32 - 1
#: the most samples in one batch (``max_batch_size``, ``batch_size_multiple_of``): what a 32-bit count holds
MAX_BATCH_SIZE = 2**31 - 1

#: the most shards a worker may stream at once (``interleave``): each is an open file or request stream
MAX_INTERLEAVE = 64


@dataclass(frozen=True)
class BatchingConfig:
    """Everything that decides which batches form; identical on every rank and worker.

    Each value is checked once, when the config is built (an `OptionError` naming the
    option). `make()` builds it from the options as the loader takes them.
    """

    budget: float
    """The largest cost of a batch (``n × max_len`` for the default padded cost), in the dataset's unit."""
    bucket_boundaries: np.ndarray | None = None
    """Lengths no batch straddles (sorted); None: each batch is cut from the length-sorted window directly."""
    max_batch_size: int | None = None
    """At most this many samples per batch."""
    batch_size_multiple_of: int = 1
    """Batch sizes are multiples of this (8, 16 for tensor cores) where the budget leaves room for that many."""
    buffer_size: int | None = None
    """The window of samples each worker's batches are formed from (it bounds memory); None: sized from the
    lengths by `make()` (`default_buffer_size()`), else the floor."""
    refill: int | None = None
    """Samples that must leave the window before it waits for new ones; None (or 0): ``buffer_size // 4``. A refill
    of ``buffer_size`` or more cuts the whole window into batches each time."""
    min_length: float = 0
    """Shorter samples are never emitted (counted as skipped)."""
    max_length: float | None = None
    """Longer samples are never emitted (counted as skipped); None: only the budget limits them."""
    drop_last: bool = False
    """Drop each worker's last incomplete batch (counted)."""
    strict: bool = False
    """Raise `SampleTooLongError` instead of skipping a sample that can never fit."""
    shuffle: bool = True
    """Shard order and batch order follow ``(seed, epoch)``; False keeps the index's order."""
    seed: int | Sequence[int] = 0
    """The seed of every random choice (with the epoch): the same on every rank; 0 to `MAX_SEED`."""
    pad_to_multiple_of: int | None = None
    """Pad ``T`` up to a multiple of this; the budget holds for the padded tensor, so one sample padded to this
    length must fit the budget (else no batch could form: refused)."""
    batch_order: str = "random"
    """The order a worker's batches leave in (`BATCH_ORDERS`): seeded random, or sorted by longest sample."""
    output_budget: float | None = None
    """A second budget: every batch also holds ``n × max output length ≤ output_budget``."""
    batch_by: str | None = None
    """``"dataset"``: every batch holds samples of one dataset of a mixture (`BATCH_BY`); None: any."""
    cost: CostModel = field(default_factory=PaddedCost)
    """What a batch costs against the budget (`cost`)."""
    interleave: int = 8
    """Each worker streams this many of its shards at once, their samples merged in a seeded random order that
    changes with the epoch (each shard's own in tar order), so one shard's samples meet other shards' in its
    window and batches change more from epoch to epoch; 1 streams one shard after another. Planned epochs of an
    index only (at most `MAX_INTERLEAVE`); ``shuffle=False`` streams one shard after another."""
    level_width: float | None = None
    """Fresher batch-mates for more batches (`mates`): each worker's window is cut at the tops of length levels
    this many length units apart (the dataset's unit, edges shifted by a seeded phase each epoch), a level's
    samples in a random order that changes with the epoch; a batch is sized for its level's top, so padding grows
    by up to one level. Wider levels keep fewer of an epoch's batch-mate pairs and cost more batches (the curve in
    the benchmarks); None cuts by the samples' own lengths (a stream of at most two windows still at fine levels).
    Above 0; padded batches with shuffling only, no buckets, no ``output_budget``."""
    step_balance: Any = "attention"
    """Order each worker's planned batches so that step k takes about the same time on every rank (`balance`):
    the time model of a step, a name of `STEP_TIMES` (``"attention"``: padded transformers, ``"conv"``,
    ``"tokens"``), a `StepTime` fitted by ``calibrate``, a dict of its coefficients, or a `StepBalance` (a
    time model and how many batcher rounds a batch may move within); None keeps the random order. Batches move
    only among those a few consecutive batcher rounds formed (the same batches and steps; `make()` spans as many
    rounds as keep the samples a worker holds for it within `BALANCE_BYTES` where the samples' bytes are known,
    else one round, which costs no memory); planned epochs of an index with ``shuffle`` and
    ``batch_order="random"`` only. Held as a dict of the coefficients and ``rounds`` (`balance` gives the
    `StepBalance`)."""

    #: the batching rule's version (not an option): 7 slides a balanced span of 2 to 8 rounds (`band_order`;
    #: 6 matched whole groups of rounds), 6 orders a worker's batches for balanced steps
    #: (``step_balance``), 5 cuts a short stream (at most two windows) at level tops,
    #: a level's samples in random order (`LevelCut`), 4 has ``even_batches="split"`` repeat what
    #: splits cannot reach (3 left it out), 3 streams ``interleave`` shards at once per worker, 2 trades
    #: batch-mates among near runs (`mates`), 1 does neither; a checkpoint resumes its epoch by the rule it
    #: was saved with (`with_plan_version()`)
    plan_version: ClassVar[int] = PLAN_VERSION

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if not isinstance(self.cost, CostModel):  # a name, callable or file goes through make()
            raise OptionError(
                f"cost must be a cost model here, got {shown(self.cost)}: give a name, callable or calibration "
                "file to BatchingConfig.make(budget, cost=...)"
            )
        if self.buffer_size is None:  # nothing known of the lengths here: the floor (make() sizes it from them)
            object.__setattr__(self, "buffer_size", DEFAULT_BUFFER)
        window = int_option("buffer_size", self.buffer_size, 1)
        if window > MAX_BUFFER:  # the window's arrays are allocated whole, per worker
            raise OptionError(
                f"buffer_size={window} would hold that many samples in each worker's window "
                f"(≈ {window * WINDOW_SLOT_BYTES / 2**30:,.0f} GiB of arrays before any sample's bytes); "
                f"at most {MAX_BUFFER:,}"
            )
        _optional(int_option, "refill", self.refill, 0)
        _optional(int_option, "max_batch_size", self.max_batch_size, 1, MAX_BATCH_SIZE)
        int_option("batch_size_multiple_of", self.batch_size_multiple_of, 1, MAX_BATCH_SIZE)
        if self.max_batch_size is not None and self.batch_size_multiple_of > self.max_batch_size:
            raise OptionError(
                f"batch_size_multiple_of={self.batch_size_multiple_of} is above max_batch_size={self.max_batch_size}: "
                "no batch could be a multiple of it, so it would be ignored"
            )
        if int_option("interleave", self.interleave, 1) > MAX_INTERLEAVE:
            raise OptionError(
                f"interleave={self.interleave} would keep that many shards open per worker; at most {MAX_INTERLEAVE}"
            )
        number_option("min_length", self.min_length, 0)
        _optional(number_option, "max_length", self.max_length, None, True)
        if self.max_length is not None and self.min_length > self.max_length:
            raise OptionError(
                f"min_length={self.min_length:g} is above max_length={self.max_length:g}: every sample would be skipped"
            )
        for name in ("drop_last", "strict", "shuffle"):
            bool_option(name, getattr(self, name))
        check_seed(self.seed)
        _optional(int_option, "pad_to_multiple_of", self.pad_to_multiple_of, 1)
        _check_pad_fits(self)
        choice_option("batch_order", self.batch_order, BATCH_ORDERS)
        _check_level_width(self)
        balance = resolve_step_time(self.step_balance)  # held as plain numbers: a checkpoint records every field
        object.__setattr__(self, "step_balance", None if balance is None else balance.to_dict())
        choice_option("batch_by", self.batch_by, (None, *BATCH_BY))
        if self.output_budget is not None:
            check_budget(self.output_budget, "output_budget")
            if self.cost.packed:
                raise OptionError(
                    "output_budget bounds padded batches (n × max output length); packed batches have none"
                )
        if self.bucket_boundaries is not None:
            edges = np.asarray(sorted(_boundaries(self.bucket_boundaries)), dtype=np.float64)
            object.__setattr__(self, "bucket_boundaries", edges)

    @property
    def streams(self) -> int:
        """Shards a worker's planned stream merges at once: ``interleave``, or 1 under an older rule or without
        shuffling."""
        return self.interleave if self.shuffle and self.plan_version >= 3 else 1

    @property
    def balance(self) -> StepBalance | None:
        """The time model a planned epoch's batches are ordered by (`balance`), or None where they keep their
        random order: no ``step_balance``, an older rule, no shuffle, or a sorted ``batch_order``."""
        on = self.plan_version >= 6 and self.shuffle and self.batch_order == "random"
        balance = resolve_step_time(self.step_balance) if on and self.step_balance is not None else None
        return dataclasses.replace(balance, band=True) if balance is not None and self.plan_version >= 7 else balance

    @property
    def epoch_seed(self) -> int:
        """The seed of an epoch's plan, a whole number (a sequence seeds one stream only, in ``plan_batches``)."""
        if isinstance(self.seed, Sequence):
            raise OptionError(f"seed: an epoch is planned from one whole number, not {self.seed!r}")
        return int(self.seed)

    @classmethod
    def make(
        cls,
        budget: float | str | None,
        lengths: np.ndarray | None = None,
        *,
        num_buckets: int | None = None,
        bucket_spacing: str = "quantile",
        cost: Any = "padded",
        quadratic_factor: float | None = None,
        packed: bool = False,
        mean_length: float | None = None,
        sample_bytes: float | None = None,
        **options: Any,
    ) -> BatchingConfig:
        """A config from user-facing options: ``cost`` by name (``quadratic_factor`` only with ``"quadratic"``),
        callable ``cost(n, max_len)`` returning a finite number ≥ 0 (called once on ``(1, 1.0)`` here) or
        calibration file (whose budget is used when ``budget`` is None), ``packed`` batches (with no other
        ``cost`` and no buckets), and ``num_buckets`` boundaries (1 to `MAX_BUCKETS`)
        estimated from ``lengths``, spaced by ``bucket_spacing``
        (`BUCKET_SPACINGS`). Without ``buffer_size`` the window is sized from the mean length
        (``mean_length``, else that of ``lengths``) and the mean stored bytes of a sample (``sample_bytes``,
        where known): `default_buffer_size()`. ``options`` are the other fields;
        an unknown name is a clear ``TypeError``."""
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown batching option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
        model, calibrated = (
            (PackedCost(), None) if bool_option("packed", packed) else resolve_cost(cost, quadratic_factor)
        )
        if budget is None:
            budget = calibrated
        budget = parse_budget(budget)  # a number; a string without the dataset's unit only as a plain number
        choice_option("bucket_spacing", bucket_spacing, BUCKET_SPACINGS)
        _optional(int_option, "num_buckets", num_buckets, 1, MAX_BUCKETS)
        if bucket_spacing != "quantile" and not num_buckets:
            raise OptionError(
                f"bucket_spacing={bucket_spacing!r} spaces the boundaries num_buckets asks for; give num_buckets"
            )
        _check_together(options, num_buckets, cost, quadratic_factor, packed)
        if lengths is not None and not isinstance(lengths, (np.ndarray, LengthStats)):
            lengths = np.asarray(lengths, dtype=np.float64)  # a list of lengths, as plan_batches takes them
        if options.get("bucket_boundaries") is None and num_buckets:
            if lengths is None:
                raise OptionError("num_buckets estimates boundaries from the index; without one pass bucket_boundaries")
            options["bucket_boundaries"] = estimate_boundaries(lengths, budget, num_buckets, spacing=bucket_spacing)
        if options.get("buffer_size") is None:  # sized by these: checked first
            _optional(int_option, "max_batch_size", options.get("max_batch_size"), 1, MAX_BATCH_SIZE)
            _optional(number_option, "mean_length", mean_length, 0)
            _check_sample_bytes(sample_bytes)
            options["buffer_size"] = _auto_buffer(
                model,
                budget,
                options.get("max_batch_size"),
                _mean(lengths) if mean_length is None else mean_length,
                sample_bytes,
            )
        balance = resolve_step_time(options.get("step_balance", "attention"))
        given = options.get("step_balance", "attention")
        if (
            balance is not None
            and not isinstance(given, StepBalance)
            and not (isinstance(given, dict) and "rounds" in given)
        ):  # rounds: from the samples' bytes
            refill = options.get("refill") or int(options["buffer_size"]) // 4
            rounds = balance_rounds(int(refill), sample_bytes)
            options["step_balance"] = dataclasses.replace(balance, rounds=rounds)
        return cls(budget=budget, cost=model, **options)

    def replace(self, **changes: Any) -> BatchingConfig:
        """A copy with some fields changed."""
        return with_plan_version(dataclasses.replace(self, **changes), self.plan_version)


def _check_together(options: dict[str, Any], num_buckets: Any, cost: Any, quadratic_factor: Any, packed: bool) -> None:
    """Options `make()` would otherwise ignore beside another: ``num_buckets`` beside ``bucket_boundaries``,
    ``quadratic_factor`` without ``cost="quadratic"``, a ``cost`` or buckets beside ``packed`` (packed batches are
    cut by the sum of their lengths, in no bucket)."""
    if packed and (cost is not None and not (isinstance(cost, str) and cost == "padded")):
        raise OptionError(
            f"packed=True costs a batch by the sum of its lengths, so cost={shown(cost)} would be ignored: pass one"
        )
    if packed and (num_buckets is not None or len(options.get("bucket_boundaries") or ()) > 0):
        raise OptionError(
            "packed=True packs each window by the sum of lengths, in no bucket, so num_buckets and "
            "bucket_boundaries would be ignored: leave them None"
        )
    if num_buckets is not None and options.get("bucket_boundaries") is not None:
        raise OptionError(
            f"num_buckets={num_buckets!r} estimates bucket boundaries and bucket_boundaries gives them: "
            "pass one of the two"
        )
    if quadratic_factor is not None and not (isinstance(cost, str) and cost == "quadratic"):
        raise OptionError(
            f"quadratic_factor={quadratic_factor!r} is used only with cost='quadratic', got cost={shown(cost)}: "
            "give cost='quadratic' or leave quadratic_factor=None"
        )


def _check_pad_fits(config: BatchingConfig) -> None:
    """With ``pad_to_multiple_of`` every batch is padded to at least that length: one sample so padded must fit the
    budget, else an `OptionError` naming ``pad_to_multiple_of`` (not the shortest sample it pads)."""
    m = config.pad_to_multiple_of
    if not m or m <= 1:
        return
    padded = np.array([float(m)])
    fits = m <= config.budget if config.cost.packed else config.cost.capacity(padded, config.budget, 1)[0] >= 1
    if not fits:
        raise OptionError(
            f"pad_to_multiple_of={m!r} pads every batch to a length of at least {m:,}, and one sample of that "
            f"length costs more than the budget {config.budget:,g} ({config.cost.name} cost): use a smaller "
            "pad_to_multiple_of or a larger budget"
        )


def _check_level_width(config: BatchingConfig) -> None:
    """``level_width``: None, or a length above 0 where the batches are cut from a shuffled, sorted window (else it
    would be ignored: an `OptionError` saying which option stands in its way)."""
    if config.level_width is None:
        return
    number_option("level_width", config.level_width, None, True)
    other = (
        "packed=True"
        if config.cost.packed
        else "bucket_boundaries"
        if config.bucket_boundaries is not None and len(config.bucket_boundaries)
        else "output_budget"
        if config.output_budget is not None
        else "shuffle=False"
        if not config.shuffle
        else None
    )
    if other:
        raise OptionError(
            f"level_width={config.level_width!r} cuts a shuffled, length-sorted window at levels; with {other} it "
            "would be ignored: leave level_width None"
        )


def _check_sample_bytes(value: Any) -> None:
    """``sample_bytes``: None, or a number of at least 0 (``inf``: not known, as an index without bytes gives)."""
    if value is not None and not (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) >= 0
    ):
        raise OptionError(f"sample_bytes must be a number of at least 0 (inf: not known), got {shown(value)}")


def _optional(check: Any, name: str, value: Any, *limits: Any) -> None:
    """``check`` a value that may also be None."""
    if value is not None:
        check(name, value, *limits)


def _boundaries(edges: Any) -> list[float]:
    """``bucket_boundaries`` as finite lengths of at least 0 (a list or array of numbers), else an OptionError."""
    if isinstance(edges, (str, bytes)) or not hasattr(edges, "__iter__"):
        raise OptionError(f"bucket_boundaries must be a list of lengths, got {edges!r}")
    return [number_option("bucket_boundaries", b, 0) for b in edges]


def check_seed(seed: Any) -> None:
    """A seed is a whole number from 0, or a sequence of them (``plan_batches``: a slot's seed); else an
    `OptionError` naming ``seed``."""
    if isinstance(seed, Sequence) and not isinstance(seed, str):
        for s in seed:
            int_option("seed", s, 0, MAX_SEED)
    else:
        int_option("seed", seed, 0, MAX_SEED)


def _mean(lengths: Any) -> float | None:
    """The mean of an array of lengths or of `LengthStats` (None without any)."""
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


#: the largest window a config takes (``buffer_size``), and what the batcher allocates per sample of it
MAX_BUFFER = 1 << 26
WINDOW_SLOT_BYTES = 32

#: emission orders of a slot's batches: ``random`` (seeded), or sorted by each batch's longest sample
BATCH_ORDERS = ("random", "ascending", "descending")
#: what ``batch_by`` may group batches by: each batch from one dataset of a mixture (None: any samples)
BATCH_BY = ("dataset",)
#: how ``num_buckets`` boundaries are spaced: equal counts of samples, or equal ratios of length
BUCKET_SPACINGS = ("quantile", "exponential")

#: the option names BatchingConfig takes as fields (``make`` takes these plus num_buckets/cost/packed)
FIELDS = tuple(f.name for f in dataclasses.fields(BatchingConfig) if f.name not in ("budget", "cost"))
#: every keyword `BatchingConfig.make()` understands besides ``budget`` and ``lengths``
OPTIONS = FIELDS + ("num_buckets", "bucket_spacing", "cost", "quadratic_factor", "packed")


def with_plan_version(config: BatchingConfig, version: int) -> BatchingConfig:
    """``config`` planning by the batching rule of ``version`` (1 to `PLAN_VERSION`: an earlier checkpoint's
    epochs)."""
    if isinstance(version, bool) or version not in range(1, PLAN_VERSION + 1):
        raise OptionError(f"plan_version {version!r}: this version plans by rules 1 to {PLAN_VERSION} only")
    object.__setattr__(config, "plan_version", version)  # not a field: the options stay as they were
    return config


def slot_seed(seed: Any, epoch: int, slot: int) -> list[int]:
    """The batcher seed of one (rank, worker) slot in one epoch: the same on every rank."""
    return [int(seed) & 0xFFFFFFFF, int(epoch), int(slot)]
