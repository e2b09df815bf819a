"""The loader's options in typed groups, each default written once (in its field, with its docstring) and each
value checked once, where its group is built.

``StreamBatchLoader`` takes a dozen everyday keywords by name and the rest in four groups, passed as objects or
flat by field name (`sort_options()` maps them):

* ``batching=`` `BatchingOptions`: which batches form; with what the index says it becomes the planner's
  `BatchingConfig` (`batching_config()`);
* ``reading=`` `ReadOptions`: how shards are read;
* ``per_sample=`` `SampleOptions`: decoding, transforms, speed perturbation, features;
* ``run=`` `RunOptions`: rank, world size, workers, how the ranks step together, the DataLoader's knobs; its
  `RunOptions.layout()` is the plan's `Layout`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from ..errors import OptionError, bool_option, callable_option, choice_option, int_option
from ..io import storage
from ..plan.config import MAX_SEED, BatchingConfig
from ..plan.cost import calibration_cost, is_calibration_path, read_calibration
from ..plan.layout import EVEN_BATCHES, MAX_WORKERS, Layout, check_slots
from ..plan.perturb import LengthTransform, SpeedPerturb
from ..read.reader import ReadOptions
from ..read.worker import CollateOptions
from ..select.mixture import AnyIndex, dataset_names, datasets_of
from ..stats import stream_stats
from ..units import Unit, parse_bytes
from .mesh import check_data_parallel

#: how an epoch is planned: "auto" (rank-local with a process group, else whole), "local", "global"
PLANNING = ("auto", "local", "global")
#: how a micro-batch's share of the loss is weighed
LOSS_WEIGHT_BY = ("samples", "frames")
#: what ``decode`` may name (else a callable ``sample -> array``)
DECODE = ("auto", "audio", "text", "none")
#: the most batches a worker prepares ahead (``prefetch_factor``): each held in memory until the loop takes it
MAX_PREFETCH_FACTOR = 64


def whole(low: int | None = None, high: int | None = None) -> dict[str, Any]:
    """A field's bounds: a whole number from ``low`` to ``high`` (None: unbounded; checked by `check_fields()`)."""
    return {"whole": (low, high)}


def one_of(*choices: Any) -> dict[str, Any]:
    """A field's values: one of ``choices`` (checked by `check_fields()`)."""
    return {"one_of": choices}


#: a field that is True or False (checked by `check_fields()`)
FLAG: dict[str, Any] = {"flag": True}


def check_fields(options: Any) -> None:
    """Check every field of a group whose metadata bounds it (`whole()`, `one_of()`, `FLAG`): the bounds are
    written once, in the field; a field whose default is None may be None. A bad value is an `OptionError` naming
    the field."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value is None and f.default is None:
            continue
        if "whole" in f.metadata:
            int_option(f.name, value, *f.metadata["whole"])
        elif "one_of" in f.metadata:
            choice_option(f.name, value, f.metadata["one_of"])
        elif "flag" in f.metadata:
            bool_option(f.name, value)


@dataclass(frozen=True)
class BatchingOptions:
    """Which batches form: the loader's batching options. With what the index says (its lengths, unit and bytes per
    sample) they become the planner's `BatchingConfig` (`batching_config()`), where each value is checked; the
    fields it shares with `BatchingConfig` take their defaults from there, so `plan_batches` and the loader form
    the same batches from the same options (see the guide's "How a batch forms")."""

    buffer_size: int | None = BatchingConfig.buffer_size
    """The window of samples each worker's batches are formed from (it bounds memory); None: 64 batches of samples
    of the dataset's mean length, at most 256 MiB of stored samples, never fewer than 2,000 samples
    (`default_buffer_size()`; ``loader.config.buffer_size`` says what it chose)."""
    refill: int | None = BatchingConfig.refill
    """Samples that must leave the window before it waits for new ones; None (or 0): ``buffer_size // 4``."""
    bucket_boundaries: Sequence[float] | None = None
    """Lengths no batch straddles; None: each batch is cut from the length-sorted window directly (pads least)."""
    num_buckets: int | None = None
    """Estimate this many bucket boundaries from the index (1 to 4,096) instead of giving ``bucket_boundaries``."""
    bucket_spacing: str = "quantile"
    """How ``num_buckets`` boundaries are spaced: ``"quantile"`` (equal sample counts) or ``"exponential"``
    (equal length ratios); needs ``num_buckets``."""
    max_batch_size: int | None = BatchingConfig.max_batch_size
    """At most this many samples per batch; None: only the budget limits it."""
    batch_size_multiple_of: int = BatchingConfig.batch_size_multiple_of
    """Batch sizes are multiples of this (8, 16 for tensor cores) where the budget leaves room for that many."""
    min_length: float = BatchingConfig.min_length
    """Shorter samples are never emitted (counted as skipped)."""
    max_length: float | None = BatchingConfig.max_length
    """Longer samples are never emitted (counted as skipped); None: only the budget limits them."""
    drop_last: bool = BatchingConfig.drop_last
    """Drop each worker's last incomplete batch (counted)."""
    strict: bool = BatchingConfig.strict
    """Raise `SampleTooLongError` instead of skipping a sample that can never fit."""
    shuffle: bool = BatchingConfig.shuffle
    """Shard order and batch order follow ``(seed, epoch)``; False keeps the index's order."""
    seed: int = field(default=0, metadata=whole(0, MAX_SEED))
    """The seed of every random choice (with the epoch), the same on every rank: a whole number from 0 to
    2³² − 1 (plans are keyed by its low 32 bits)."""
    pad_to_multiple_of: int | None = BatchingConfig.pad_to_multiple_of
    """Pad ``T`` up to a multiple of this; the budget holds for the padded tensor."""
    batch_order: str = BatchingConfig.batch_order
    """The order a worker's batches leave in: ``"random"`` (seeded), or sorted by longest sample
    (``"ascending"``, ``"descending"``); sorting needs an index."""
    output_budget: float | None = BatchingConfig.output_budget
    """A second budget: every batch also holds ``n × max output length ≤ output_budget`` (needs output lengths
    in the index)."""
    batch_by: str | None = BatchingConfig.batch_by
    """``"dataset"``: every batch holds samples of one dataset of a mixture; None: any."""
    cost: Any = "padded"
    """What the budget bounds: ``"padded"`` (``n × max_len``), ``"quadratic"``, a callable ``cost(n, max_len)``
    returning a finite number ≥ 0, or a calibration file (`streambatch.calibrate`; its budget serves when
    ``budget`` is None)."""
    quadratic_factor: float | None = None
    """The weight of the quadratic term, only with ``cost="quadratic"``."""
    packed: bool = False
    """Pack samples end to end (cut by the sum of their lengths) instead of padding them; no ``cost``, no buckets."""
    interleave: int = BatchingConfig.interleave
    """Shards each worker streams at once, their samples merged in a seeded order that changes with the epoch
    (1 to 64); 1 streams one shard after another."""
    level_width: float | None = BatchingConfig.level_width
    """Fresher batch-mates for more batches: cut each window at length levels this far apart (the dataset's unit),
    a level's samples in a random order per epoch (see `BatchingConfig.level_width`); None: off."""
    step_balance: Any = BatchingConfig.step_balance
    """Order each worker's batches so that step k takes about the same time on every rank: a step-time model's
    name (``"attention"``, ``"conv"``, ``"tokens"``), a `StepTime` fitted by ``calibrate``, a `StepBalance`, or
    None for the plain seeded-random order (see `BatchingConfig.step_balance` and the balance guide)."""

    def __post_init__(self) -> None:
        # the seed one whole number: an epoch's plan needs one (only `plan_batches` seeds a stream with a sequence);
        # the other values are checked where `BatchingConfig` is built, with the index
        check_fields(self)

    def as_make_options(self) -> dict[str, Any]:
        """The options as `BatchingConfig.make()` takes them, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class SampleOptions:
    """What happens to each sample of a formed batch in the workers, before it is padded into the batch."""

    decode: Any = "auto"
    """``"auto"``, ``"audio"``, ``"text"``, ``"none"`` (raw samples in ``batch["samples"]``), or a callable
    ``sample -> array [T, ...]``. ``"audio"`` on a dataset counted in tokens, or ``"text"`` (token ids) on one
    counted in audio, is refused: its shards hold no such member."""
    transform: Callable[..., Any] | None = None
    """``fn(sample, rng) -> sample`` on each sample, ``rng`` seeded from ``(seed, epoch, sample id)``."""
    speed_perturb: Any = None
    """Speed factors ``(0.9, 1.0, 1.1)``, ``(factors, weights)`` or ``{factor: weight}``, drawn per sample and
    planned inside the budget; None: off."""
    features: Any = None
    """``"fbank"`` (80-dim Kaldi log-mel, planned in frames) or a callable ``(waveform, rate) -> [frames, dim]``."""
    speed: SpeedPerturb | None = field(init=False, default=None, repr=False)
    """``speed_perturb`` as the plan draws it."""
    feature_fn: Any = field(init=False, default=None, repr=False)
    """``features`` as the workers compute them."""

    def __post_init__(self) -> None:
        from ..read.features import resolve_features

        if not callable(self.decode):
            choice_option("decode", self.decode, DECODE)
        else:
            callable_option("decode", self.decode, "fn(sample) -> array", 1)
        if self.transform is not None:
            callable_option("transform", self.transform, "fn(sample, rng) -> sample", 2)
        object.__setattr__(self, "speed", SpeedPerturb.make(self.speed_perturb))
        object.__setattr__(self, "feature_fn", resolve_features(self.features))
        if callable(self.features):
            callable_option("features", self.features, "fn(waveform, sample_rate) -> [frames, dim]", 2)

    @property
    def active(self) -> list[str]:
        """The per-sample options in use, by name."""
        given = {"transform": self.transform, "speed_perturb": self.speed, "features": self.feature_fn}
        return [k for k, v in given.items() if v is not None]


@dataclass(frozen=True)
class RunOptions:
    """Where this process stands in the job and how its batches reach the training loop."""

    rank: int | None = field(default=None, metadata=whole(0))
    """This process's rank; None: detected (torch.distributed, torchrun or SLURM variables), else 0."""
    world_size: int | None = field(default=None, metadata=whole(1))
    """Ranks in the job; None: detected as ``rank`` is, else 1. At most
    `MAX_WORLD_SIZE` (65,536) ranks and, with ``num_workers``,
    `MAX_SLOTS` (262,144) (rank, worker) slots: every rank deals the epoch over
    every slot, and a whole-epoch plan plans each one, in time and memory that grow with the slots (the
    benchmarks page has the figures)."""
    dp_rank: int | None = None
    """With tensor, context or pipeline parallelism: this process's data-parallel rank (``0 <= dp_rank <
    dp_size``), given with ``dp_size``. The processes of one rank (its peers) get bit-identical batches, the
    ranks disjoint samples; the plan has ``dp_size`` ranks (a checkpoint's ``world_size``). None: one
    data-parallel rank per process (``rank``)."""
    dp_size: int | None = None
    """Data-parallel ranks, given with ``dp_rank``; it must divide the processes of the job as detected
    (torch.distributed, torchrun or SLURM). Planning is rank-local with an initialised process group: each
    process plans its data-parallel rank's slots, and one all_gather of a few integers over the whole world
    (peers contribute identical values) agrees the step count."""
    dp_mesh: Any = None
    """A torch ``DeviceMesh`` instead of ``dp_rank``/``dp_size``: its dimension named ``"dp"`` (or a 1-D
    mesh's only one) gives the data-parallel rank and size, and its process group agrees the step count."""
    num_workers: int = field(default=0, metadata=whole(0, MAX_WORKERS))
    """DataLoader worker processes per rank (0: read in the training process); at most
    `MAX_WORKERS` (1,024): each is a process, and each is a slot every rank's plan
    deals the epoch over."""
    even_batches: str = field(default="split", metadata=one_of(*EVEN_BATCHES))
    """How every rank gets the same step count: ``"split"``, ``"drop"`` or ``"pad"`` (checked by
    `Layout`)."""
    hardest_first: bool = field(default=False, metadata=FLAG)
    """The most expensive batch at step 1 (checked by `Layout`)."""
    planning: str = field(default="auto", metadata=one_of(*PLANNING))
    """Who plans the epoch (`PLANNING`): ``"auto"`` rank-local with a matching process group, else the
    whole epoch on every rank; ``"local"`` requires the process group; ``"global"`` always the whole epoch."""
    batches_per_epoch: int | None = field(default=None, metadata=whole(1))
    """Without an index: every rank yields exactly this many batches per epoch (a nominal epoch); with an index its
    plan gives the length (refused beside it)."""
    micro_batches: int = field(default=1, metadata=whole(1))
    """Yield each batch as this many micro-batches (a list of dicts with loss weights)."""
    loss_weight_by: str = field(default="samples", metadata=one_of(*LOSS_WEIGHT_BY))
    """What a micro-batch's loss weight counts (`LOSS_WEIGHT_BY`)."""
    prefetch_factor: int | None = field(default=None, metadata=whole(1, MAX_PREFETCH_FACTOR))
    """Batches each worker prepares ahead (as in ``torch.utils.data.DataLoader``; None: 2), with workers only
    (``num_workers`` ≥ 1; the DataLoader refuses it without). At most `MAX_PREFETCH_FACTOR` (64): each
    worker holds that many formed batches in memory (each up to the budget's padded tensor), and a pass starts
    by queueing ``num_workers × prefetch_factor`` requests."""
    persistent_workers: bool = field(default=False, metadata=FLAG)
    """Keep the workers between epochs (as in ``DataLoader``; only with ``num_workers``)."""
    pin_memory: bool = field(default=False, metadata=FLAG)
    """Batches in page-locked memory (as in ``DataLoader``)."""
    worker_init_fn: Callable[[int], Any] | None = None
    """Called in each worker with its id (after the loader's own set-up)."""
    progress: bool = field(default=False, metadata=FLAG)
    """A tqdm bar per pass (total ``len(loader)``, starting at the batches already consumed)."""
    max_plan_bytes: int | str = "16G"
    """The most memory a mixture's epoch plan may take (about 48 bytes per sample its weights put in an epoch,
    every copy counted); larger weights are refused before anything is allocated. A size like ``"64G"``."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.world_size is not None:
            check_slots(self.world_size, self.num_workers)
        check_data_parallel(self)
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise OptionError(
                f"prefetch_factor={self.prefetch_factor!r} is the batches each worker prepares ahead, and "
                "num_workers=0 starts none (the DataLoader refuses it too): give num_workers >= 1 or leave "
                "prefetch_factor=None"
            )
        if self.persistent_workers and self.num_workers == 0:  # as the DataLoader refuses it
            raise OptionError("persistent_workers=True keeps worker processes, and num_workers=0 starts none")
        if self.max_plan_bytes is None:
            raise OptionError("max_plan_bytes must be a size like 64G or a number of bytes, got None")
        object.__setattr__(self, "max_plan_bytes", parse_bytes(self.max_plan_bytes, "max_plan_bytes"))
        if self.worker_init_fn is not None:
            callable_option("worker_init_fn", self.worker_init_fn, "fn(worker_id)", 1)

    def layout(self, world_size: int) -> Layout:
        """The plan's layout on ``world_size`` ranks (the detected one when ``world_size`` was not given; the
        `Layout` bounds it as a given one is)."""
        return Layout(world_size, max(1, self.num_workers), self.even_batches, self.hardest_first)


def check_epoch_length(run: RunOptions, index: AnyIndex | None, world_size: int) -> None:
    """Who says how long an epoch is: the index (its plan), or without one ``batches_per_epoch``, which several
    ranks need (else they would step unevenly, a DDP hang); both at once would leave ``batches_per_epoch`` unused."""
    if index is not None and run.batches_per_epoch is not None:
        raise OptionError(
            f"batches_per_epoch={run.batches_per_epoch} gives an epoch's length without an index, and this dataset "
            "has one, whose plan gives it: leave batches_per_epoch=None"
        )
    if index is None and world_size > 1 and not run.batches_per_epoch:
        raise OptionError(
            f"without an index the ranks cannot know how many batches the data gives, so {world_size} "
            "ranks would step unevenly (a DDP hang): write an index (`shardify write`), or pass "
            "batches_per_epoch=N to give every rank exactly N batches per epoch"
        )


def worker_callables(sample: SampleOptions, run: RunOptions, config: BatchingConfig) -> dict[str, Any]:
    """The user's functions the DataLoader workers run, by the option that gave each."""
    given = {
        "decode": sample.decode if callable(sample.decode) else None,
        "transform": sample.transform,
        "features": sample.features if callable(sample.features) else None,
        "cost": getattr(config.cost, "fn", None),
        "worker_init_fn": run.worker_init_fn,
    }
    return {name: fn for name, fn in given.items() if fn is not None}


def collate_options(
    sample: SampleOptions, run: RunOptions, config: BatchingConfig, index: AnyIndex | None, ops: Any
) -> CollateOptions:
    """How the workers turn a formed batch into tensors (``ops``: the per-sample stages of `sample_plan()`)."""
    return CollateOptions(
        decode=sample.decode,
        pad_to_multiple_of=config.pad_to_multiple_of,
        sample_rate=index.sample_rate if index is not None and index.unit == "samples" else None,
        packed=config.cost.packed,
        micro_batches=run.micro_batches,
        loss_weight_by=run.loss_weight_by,
        datasets=dataset_names(index),
        per_sample=ops,
    )


def init_fields(group: type) -> list[str]:
    """The option names a group takes (its init fields)."""
    return [f.name for f in dataclasses.fields(group) if f.init]


#: the loader's option groups by the keyword that takes each
GROUPS: dict[str, type] = {
    "batching": BatchingOptions,
    "reading": ReadOptions,
    "per_sample": SampleOptions,
    "run": RunOptions,
}
#: which group each option belongs to, by its name
GROUP_OF: dict[str, str] = {name: keyword for keyword, group in GROUPS.items() for name in init_fields(group)}
#: the loader's keywords that belong to no group
PLAIN = ("weights", "index", "where", "storage_options")


def field_default(group: type, name: str) -> Any:
    """The default of field ``name`` of ``group``, as written in its declaration."""
    f = next(f for f in dataclasses.fields(group) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class FromGroup:
    """The default of an everyday keyword that belongs to a group: its field's, written there once. It stands for
    "not given" (so that a value given both here and in the group is caught) and shows as the field's default in
    ``help()``."""

    def __init__(self, group: type, name: str):
        self.group, self.name = group, name

    def __repr__(self) -> str:
        return repr(field_default(self.group, self.name))


#: the defaults of the everyday keywords `StreamBatchLoader` names that belong to a group (their fields' defaults)
EVERYDAY = ("num_workers", "shuffle", "seed", "buffer_size", "max_batch_size", "decode")
GROUP_DEFAULT: Any = SimpleNamespace(**{name: FromGroup(GROUPS[GROUP_OF[name]], name) for name in EVERYDAY})


@dataclass(frozen=True)
class LoaderOptions:
    """A loader's options, sorted: its four groups, each built (checked) once."""

    batching: BatchingOptions
    reading: ReadOptions
    per_sample: SampleOptions
    run: RunOptions


def sort_options(flat: Mapping[str, Any], groups: Mapping[str, Any] | None = None) -> LoaderOptions:
    """The loader's options in their groups: ``groups`` the group objects given (by keyword, None: not given) and
    ``flat`` the options given by name (an everyday keyword left at its `FromGroup` default is not given). A
    flat option updates its group's object; an unknown name, a group that is not its class, or an option given
    both flat and (other than its default) in its group is an `OptionError` naming it."""
    given = {k: v for k, v in flat.items() if not isinstance(v, FromGroup)}
    for name in given:
        if name not in GROUP_OF:
            raise OptionError(f"unknown loader option {name!r}{_closest(name)}")
    built: dict[str, Any] = {}
    for keyword, group in GROUPS.items():
        obj = (groups or {}).get(keyword)
        if obj is not None and not isinstance(obj, group):
            name = group.__name__
            raise OptionError(f"{keyword} must be a {name}, got a {type(obj).__name__}: pass {keyword}={name}(...)")
        mine = {k: v for k, v in given.items() if GROUP_OF[k] == keyword}
        if obj is None:
            built[keyword] = group(**mine)
            continue
        for name in mine:
            if not _is_default(getattr(obj, name), field_default(group, name)):
                raise OptionError(
                    f"{name} is given twice, as {name}={mine[name]!r} and in {keyword}={group.__name__}"
                    f"({name}={getattr(obj, name)!r}): give it once"
                )
        built[keyword] = dataclasses.replace(cast(Any, obj), **mine) if mine else obj
    return LoaderOptions(**built)


def _is_default(value: Any, default: Any) -> bool:
    """Whether a group's value is its field's default (an array compares as a whole)."""
    try:
        return bool(value is default or value == default)
    except ValueError:  # numpy: an array's truth is ambiguous, and an array is no field's default
        return False


def _closest(name: str) -> str:
    """``: did you mean X?`` with the closest option name, or the list of groups to look in."""
    known = [*GROUP_OF, *PLAIN, *GROUPS, "source", "budget"]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f": did you mean {close[0]!r}?"
    return f"; the options are the fields of {', '.join(g.__name__ for g in GROUPS.values())} and {', '.join(PLAIN)}"


def check_plain(where: Any, storage_options: Any) -> None:
    """The loader's options that belong to no group: ``where`` is SQL text, ``storage_options`` a mapping."""
    if where is not None and not isinstance(where, str):
        raise OptionError(f'where must be an SQL expression as text, like "snr > 10", got {where!r}')
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise OptionError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")


def check_options(options: Mapping[str, Any]) -> LoaderOptions:
    """Loader options by name (``source`` and ``budget`` aside), as a DataModule holds them to build its loaders:
    checked now, the batching values with the index later. Group objects go by their keywords."""
    flat = {k: v for k, v in options.items() if k not in GROUPS and k not in PLAIN}
    for name in ("source", "budget"):
        if name in flat:
            raise OptionError(f"{name} is an argument of its own, not one of the loader options")
    check_plain(options.get("where"), options.get("storage_options"))
    return sort_options(flat, {k: options[k] for k in GROUPS if k in options})


def batching_config(
    budget: float | None,
    index: AnyIndex | None,
    options: Mapping[str, Any],
    length_transform: LengthTransform | None = None,
    storage_options: dict | None = None,
) -> BatchingConfig:
    """The loader's `BatchingConfig`: a calibration file's budget, batch cap and unit check, and
    lengths rounded as the tensor will be when they count tensor elements (feature frames when planning in them)."""
    if options.get("batch_by") is not None and not hasattr(index, "dataset_of_shard"):
        raise OptionError(
            f"batch_by={options['batch_by']!r} keeps every batch within one dataset of a mixture; this "
            "loader reads one dataset (name several: a {name: folder} mapping, a list of folders with "
            "weights=, or a mixture file), or leave batch_by=None"
        )
    if options.get("output_budget") is not None and index is not None and not index.has_output_lengths:
        raise OptionError(
            f"output_budget={options['output_budget']!r} needs each sample's output length, and this dataset's "
            "index has none: write it with `shardify write --output-length chars|tokens:NAME`"
        )
    if index is None and options.get("batch_order", "random") != "random":
        raise OptionError(
            f"batch_order={options['batch_order']!r} sorts each worker's planned batches, which needs "
            "an index (write one with `shardify index`); without one batches leave as they form"
        )
    unit = (
        "frames"
        if length_transform is not None and length_transform.in_frames
        else index.unit
        if index is not None
        else None
    )
    options, budget = _calibrated(options, budget, index is not None, unit, storage_options)
    if index is not None and index.unit == "seconds":
        options = {**options, "pad_to_multiple_of": None}
    # every length, streamed in bounded memory, read once where an option needs them
    stats = _stats(index, length_transform) if index is not None and options.get("num_buckets") else None
    mean, sample_bytes = _window_figures(index, length_transform)
    config = BatchingConfig.make(budget, stats, mean_length=mean, sample_bytes=sample_bytes, **options)
    if hasattr(config.cost, "check_monotone") and index is not None:
        config.cost.check_monotone(stats if stats is not None else _stats(index, length_transform))
    return config


def _calibrated(
    options: Mapping[str, Any], budget: float | None, indexed: bool, unit: str | None, storage_options: dict | None
) -> tuple[Mapping[str, Any], float | None]:
    """With ``cost`` a calibration file (read here, from any storage) or dict: its cost model, its budget where
    none was given, its batch-size cap (larger batches would be extrapolated, not measured), its unit checked."""
    cost = options.get("cost")
    if options.get("packed") or not (isinstance(cost, dict) or is_calibration_path(cost)):
        return options, budget
    calib = cost if isinstance(cost, dict) else read_calibration(str(cost), lambda p: storage.open_url(p, "rb"))
    if indexed and calib.get("unit") not in (None, unit):
        raise OptionError(f"{cost}: calibrated for lengths in {calib['unit']!r}, but this dataset's unit is {unit!r}")
    model, calibrated_budget = calibration_cost(calib, str(cost) if isinstance(cost, str) else "<dict>")
    options = {**options, "cost": model}
    if options.get("max_batch_size") is None and calib.get("max_batch_size"):
        options["max_batch_size"] = int(calib["max_batch_size"])
    return options, calibrated_budget if budget is None else budget


def _window_figures(
    index: AnyIndex | None, length_transform: LengthTransform | None
) -> tuple[float | None, float | None]:
    """The mean length (in the plan's unit) and mean stored bytes of a sample that size the default window."""
    if index is None or not index.num_samples:
        return None, None
    indexes = [ix for _, ix in datasets_of(index)]  # a mixture: its datasets' own figures
    count = sum(ix.num_samples for ix in indexes)
    mean = sum(ix.total_length for ix in indexes) / count if count else None
    if mean is not None and length_transform is not None and length_transform.in_frames:
        mean = float(length_transform.frames(int(mean)))
    sizes = [ix.total_bytes for ix in indexes if ix.total_bytes is not None]
    # an index that does not say its bytes (written before its header carried them): the floor, not a guess
    return mean, sum(sizes) / count if len(sizes) == len(indexes) and count else math.inf


def _stats(index: AnyIndex, length_transform: LengthTransform | None) -> Any:
    """Statistics of every length in the plan's unit (frames when planning in them; speed factors aside)."""
    if length_transform is None or not length_transform.in_frames:
        return index.length_stats()
    return stream_stats(length_transform.frames(x) for _, ix in datasets_of(index) for x in ix.iter_lengths())


def check_decode_unit(decode: Any, unit: Unit) -> None:
    """Refuse a decode mode that reads members this dataset's shards do not hold: audio of a text dataset, token
    ids of an audio one (the batches would carry no payload)."""
    if decode == "audio" and unit is Unit.TOKENS:
        raise OptionError(
            f"decode='audio' reads audio members, and this dataset's lengths count {unit} (text): "
            "use decode='auto' or 'text'"
        )
    if decode == "text" and unit.is_audio:
        raise OptionError(
            f"decode='text' reads token ids (input_ids.npy), and this dataset's lengths count {unit} (audio): "
            "use decode='auto', 'audio', 'none' or a callable"
        )


def sample_plan(o: SampleOptions, index: AnyIndex | None, seed: Any) -> tuple[LengthTransform | None, Any]:
    """The `LengthTransform` the epochs are planned with and the per-sample stages of the workers
    (`SampleOps`; each worker sets the epoch), from the per-sample options."""
    from ..read.features import plans_in_frames
    from ..read.transforms import SampleOps

    speed, features = o.speed, o.feature_fn
    if index is not None:
        check_decode_unit(o.decode, Unit.parse(index.unit))
    if not o.active:
        return None, None
    which = ", ".join(o.active)
    if index is None:
        raise OptionError(f"{which} need an index: each sample's randomness and planned length follow its global id")
    if o.decode == "none":
        raise OptionError(f"{which} work on decoded samples; decode='none' keeps them raw")
    if speed is not None or features is not None:
        if index.unit != "samples" or not index.sample_rate:
            raise OptionError(
                f"speed_perturb and features need audio lengths in samples with a sample rate; this "
                f"index counts {index.unit}" + ("" if index.sample_rate else " without a sample rate")
            )
        if o.decode not in ("auto", "audio"):
            raise OptionError(f"speed_perturb and features work on decoded audio; decode={o.decode!r}")
    frames = features if plans_in_frames(features) else None
    plan = (
        LengthTransform(int(index.sample_rate or 0), speed, frames) if speed is not None or frames is not None else None
    )
    return plan, SampleOps(o.transform, speed, features, seed, 0, index.sample_rate)
