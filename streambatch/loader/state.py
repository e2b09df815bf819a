"""A loader's checkpoint, typed: `LoaderState`, with its plain-dict form (what ``state_dict()`` returns and a
training script saves with the model), the checks that a state belongs to a loader, and the layout an interrupted
epoch ran on. States saved by earlier versions load: a key they lack is simply not checked; fields that disagree
(a plan rule edited down, a digest removed) are refused."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StateError, shown
from ..plan.config import PLAN_VERSION, BatchingConfig, with_plan_version
from ..plan.cost import CostModel
from ..plan.layout import EVEN_BATCHES, Layout
from ..plan.perturb import LengthTransform
from ..plan.resume import MAX_COUNT, EarlierRun, Resumed, equalised_of, state_count
from .mixing import mixture_problem

if TYPE_CHECKING:
    from ..select.mixture import AnyIndex


#: the first plan rule whose states saved with an index always hold a dataset digest (``dataset``)
DIGEST_ALWAYS = 4

#: the largest epoch number (``set_epoch``, a checkpoint's ``epoch``): 2³¹ - 1, as 32-bit epoch counters hold;
#: a loader's shared state holds it in 64 bits, and no run reaches it
MAX_EPOCH = 2**31 - 1


@dataclass
class LoaderState:
    """Where a loader is: the epoch, the batches of it already yielded, and what decides which batches they were.
    Small: no per-sample data, whatever the dataset's size."""

    epoch: int = 0
    """The epoch the next pass yields (after a finished pass, the next one); at most `MAX_EPOCH`."""
    batches_consumed: int = 0
    """Batches of ``epoch`` this rank already yielded."""
    steps: int | None = None
    """The batches per rank ``epoch`` has on this layout, once planned (spares a re-plan on another layout)."""
    seed: Any = 0
    """The batching seed."""
    world_size: int | None = None
    """The layout it ran on: ranks (the data-parallel ones with ``dp_size``), …"""
    num_workers: int | None = None
    """… slots per rank, …"""
    even_batches: str | None = None
    """… how the ranks were made to step together, …"""
    hardest_first: bool | None = None
    """… and whether each rank's hardest batch came first."""
    num_samples: int | None = None
    """Samples in the dataset (None without an index)."""
    mixture: Any = None
    """A mixture's datasets and weights (`state()`), else None; under a
    weight schedule the weights in force for ``epoch`` and where it begins in each dataset."""
    where: str | None = None
    """The filter expression, else None."""
    dataset: str | None = None
    """A digest of what the plan reads of the index (`dataset_digest()`): a state of another dataset of the
    same size, or of this one re-sharded since, is refused."""
    batching: dict[str, Any] | None = None
    """The batching options as plain values (`batching_record()`): a mid-epoch resume with others is refused."""
    earlier_layouts: list[dict[str, Any]] = field(default_factory=list)
    """The layouts ``epoch`` ran on before a resume on this one (`EarlierRun.state_dict()`), oldest first."""
    excluded: str | None = None
    """A packed mask of consumed samples, from the oldest state format (`pack_mask()`)."""
    skip_steps: list[list[int]] = field(default_factory=list)
    """Steps of ``epoch`` a resume skips, as ``[[a, b], ...]`` ranges of step numbers from the epoch's start
    (``load_state_dict(state, skip_steps=...)``): a later resume from this state skips them too. Step numbers are
    at most `MAX_COUNT`."""
    equalised: list[list[int]] | None = None
    """Every rank's equalisation of ``epoch`` on this layout (`RankEqualised.to_ints()`, once planned): a resume on
    another layout then batches each old rank only as far as it consumed. A state without it (an older version)
    still resumes, re-planning the old ranks in full."""
    plan_version: int = PLAN_VERSION
    """The batching rule the epoch was planned by (`plan_version`); a
    state saved before it was recorded was planned by rule 1, and a loader resuming it keeps that rule."""
    recorded: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    """The keys the saved dict held (all for a state this version made): an absent one is not checked."""

    @classmethod
    def names(cls) -> list[str]:
        """The keys of the dict form."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "recorded"]

    def to_dict(self) -> dict[str, Any]:
        """The plain dict ``state_dict()`` returns (ints, strings, lists: ``torch.save`` and JSON both keep it)."""
        return {name: getattr(self, name) for name in self.names()}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoaderState:
        """A state from its dict form, as this or an earlier version saved it. Every field it holds is checked here,
        once, before the loader changes: anything else (not a mapping, no epoch, a field of the wrong type or out
        of range, lists of the wrong shape) is a `StateError` naming the field and its value."""
        if not isinstance(state, Mapping) or "epoch" not in state:
            raise StateError(f"not a loader state_dict (a mapping with an 'epoch'): {shown(state)}")
        known = [k for k in cls.names() if k in state]
        out = cls(**{k: state[k] for k in known}, recorded=frozenset(known))
        out._check_position()
        out._check_layout()
        out._check_resume()
        out._check_consistent()
        return out

    def _check_position(self) -> None:
        """The epoch, the batches of it consumed and its steps: whole numbers in range (consumed at most steps)."""
        self.epoch = state_count("epoch", self.epoch, 0, MAX_EPOCH)
        self.steps = None if self.steps is None else state_count("steps", self.steps)
        most = MAX_COUNT if self.steps is None else self.steps
        consumed = 0 if self.batches_consumed is None else self.batches_consumed
        self.batches_consumed = state_count("batches_consumed", consumed, 0, most)
        if self.knows("plan_version"):  # which versions this one plans by: keep_plan_version
            self.plan_version = state_count("plan_version", self.plan_version, 1)
        seeds = self.seed if isinstance(self.seed, (list, tuple)) else [self.seed]
        if not seeds or not all(_is_count(s) for s in seeds):
            raise StateError(f"loader state: seed must be a whole number from 0 or a list of them: {shown(self.seed)}")

    def _check_layout(self) -> None:
        """The layout's fields (each None in a state that did not record it) and what the state was saved for."""
        if self.world_size is not None:
            self.world_size = state_count("world_size", self.world_size, 1)
        if self.num_workers is not None:
            self.num_workers = state_count("num_workers", self.num_workers, 1)
        if self.even_batches is not None and self.even_batches not in EVEN_BATCHES:
            said = shown(self.even_batches)
            raise StateError(f"loader state: even_batches must be one of {', '.join(EVEN_BATCHES)}, got {said}")
        if self.hardest_first is not None and not isinstance(self.hardest_first, (bool, np.bool_)):
            raise StateError(f"loader state: hardest_first must be True or False, got {shown(self.hardest_first)}")
        if self.num_samples is not None:
            self.num_samples = state_count("num_samples", self.num_samples)
        if self.mixture is not None and not _is_mixture(self.mixture):
            raise StateError(
                "loader state: mixture must be None or a list of [name, weight, samples] rows (a weight schedule adds "
                f"where the epoch begins), got {shown(self.mixture)}"
            )
        if self.dataset is not None and not isinstance(self.dataset, str):
            raise StateError(f"loader state: dataset must be None or a digest (text), got {shown(self.dataset)}")
        if self.where is not None and not isinstance(self.where, str):
            raise StateError(f"loader state: where must be None or the filter expression, got {shown(self.where)}")
        if self.batching is not None and (
            not isinstance(self.batching, Mapping) or not all(isinstance(k, str) for k in self.batching)
        ):
            raise StateError(f"loader state: batching must be a mapping of option names, got {shown(self.batching)}")

    def _check_resume(self) -> None:
        """What a resume plans around: the earlier layouts, the packed mask of the oldest format, the skipped
        steps and the ranks' equalisation, each checked whole (a resume trusts them)."""
        layouts = self.earlier_layouts if self.earlier_layouts is not None else []
        if not isinstance(layouts, (list, tuple)):
            raise StateError(f"loader state: earlier_layouts must be a list of layouts, got {shown(layouts)}")
        runs = [EarlierRun.from_state(d, f"earlier_layouts[{i}]") for i, d in enumerate(layouts)]
        self.earlier_layouts = [run.state_dict() for run in runs]
        if self.excluded is not None:
            unpack_mask(self.excluded, self.num_samples)
        self.skip_steps = _skip_ranges(self.skip_steps)
        if self.equalised is not None and self.world_size is not None and self.num_workers is not None:
            equalised_of(self.equalised, Layout(self.world_size, self.num_workers), self.steps)
        elif self.equalised is not None and not isinstance(self.equalised, (list, tuple)):
            raise StateError(f"loader state: equalised must be None or a list per rank, got {shown(self.equalised)}")

    def _check_consistent(self) -> None:
        """Fields that must agree with each other, so that a hand edit that keeps each in range is refused: the
        plan rule against the one the batching record repeats (a lower rule would plan other batches: samples
        repeated and missed), and a state saved with an index holding its
        dataset's digest (without it the dataset would go unchecked)."""
        version = int(self.plan_version) if self.knows("plan_version") else 1
        said = self.batching.get("plan_version") if isinstance(self.batching, Mapping) else None
        if said is not None and said != version:
            raise StateError(
                f"loader state: plan_version {version if self.knows('plan_version') else '(absent: 1)'} differs "
                f"from the {shown(said)} its batching record was saved with; the state was edited: resume from "
                "the state as saved (another rule would repeat and miss samples)"
            )
        saved_digest = version >= DIGEST_ALWAYS or said is not None
        if saved_digest and self.num_samples is not None and self.dataset is None:
            raise StateError(
                f"loader state: no dataset digest, which a state of plan rule {version} saved with an index always "
                "holds; the state was edited: resume from it as saved (without it the dataset goes unchecked)"
            )

    @classmethod
    def current(cls, **values: Any) -> LoaderState:
        """A state a loader makes of itself (every key recorded)."""
        return cls(**values, recorded=frozenset(cls.names()))

    def knows(self, name: str) -> bool:
        return name in self.recorded

    def check(self, mine: LoaderState) -> None:
        """Refuse a state that does not belong to the loader whose own state is ``mine``: another seed, dataset
        size, mixture or filter; mid-epoch, other batching options or no index to plan the epoch's batches."""
        if self.knows("seed") and self.seed != mine.seed:
            raise StateError(f"state was saved with seed {self.seed}, this loader has seed {mine.seed}")
        mixture = mixture_problem(self.mixture, mine.mixture, self.epoch, self.mid_epoch)
        if self.knows("mixture") and mixture:  # before the sample count: a mixture's is not a dataset's
            raise StateError(mixture)
        counted = not (self.mixture and mine.mixture)  # a mixture's count is of its layout: its rows say more
        if counted and mine.num_samples is not None and self.num_samples not in (None, mine.num_samples):
            raise StateError(
                f"state was saved for a dataset of {self.num_samples} samples, this one has {mine.num_samples}"
            )
        if self.knows("where") and self.where != mine.where:
            raise StateError(f"state was saved with where={self.where!r}, this loader has where={mine.where!r}")
        if None not in (self.dataset, mine.dataset) and self.dataset != mine.dataset:
            raise StateError(
                "state was saved for another dataset of as many samples, or for this one before it was sharded "
                "again (its shards' sample counts or lengths differ); to go on with this dataset from that "
                f"state's epoch, call set_epoch({self.epoch}) instead of load_state_dict()"
            )
        if mine.num_samples is None and self.batches_consumed:
            raise StateError("mid-epoch resumption needs an index (the epoch's batches must be planned)")
        # between epochs the options may change; within one (or after a resume on another layout, even before
        # this layout's first batch) they decide what was seen
        if self.mid_epoch and self.batching is not None and mine.batching is not None:
            _check_batching(self.batching, mine.batching)

    @property
    def mid_epoch(self) -> bool:
        """Whether some of the epoch's batches were consumed: on this layout, or on earlier ones."""
        return bool(self.batches_consumed or self.earlier_layouts or self.excluded)

    def keep_plan_version(self, config: BatchingConfig) -> BatchingConfig:
        """``config`` planning by the rule this state's epochs were planned by (1 for a state that does not say)."""
        return with_plan_version(config, int(self.plan_version) if self.knows("plan_version") else 1)

    def layout(self, current: Layout) -> Layout | None:
        """The layout the state was saved on (what an older state did not record taken from ``current``), or None
        when it names none."""
        if self.world_size is None or self.num_workers is None:
            return None
        even = current.even_batches if self.even_batches is None else self.even_batches
        hardest = current.hardest_first if self.hardest_first is None else bool(self.hardest_first)
        return Layout(int(self.world_size), int(self.num_workers), even, hardest)

    def resume_on(
        self, layout: Layout, num_samples: int, plan_steps: Callable[[Layout, Resumed], int]
    ) -> tuple[Resumed | None, int, int | None]:
        """Where a loader on ``layout`` resumes this state: the layouts the epoch ran on before (with a packed
        mask of the oldest format), the batches of it this layout already yielded, and the steps the state saved
        for this layout. Saved mid-epoch on another layout, the saved one joins the earlier layouts and this one
        starts the rest afresh; a state from before ``steps`` was saved gets its old step count from
        ``plan_steps`` (the old layout's whole plan, O(N), once)."""
        runs = [EarlierRun.from_state(d) for d in self.earlier_layouts]
        base = unpack_mask(self.excluded, num_samples) if self.excluded else None
        old = self.layout(layout)
        consumed = self.batches_consumed
        if consumed and old != layout:
            if old is None:
                raise StateError("loader state: saved mid-epoch without its layout (world_size, num_workers)")
            before = Resumed(self.epoch, tuple(runs), base)
            steps = self.steps if self.steps is not None else plan_steps(old, before)
            known = equalised_of(self.equalised, old) if self.steps is not None else ()
            runs.append(EarlierRun(old, int(steps), consumed, known))
            consumed = 0
        resumed = Resumed(self.epoch, tuple(runs), base) if runs or base is not None else None
        return resumed, consumed, self.steps if old == layout else None

    def equalised_on(self, layout: Layout) -> list[list[int]] | None:
        """The saved equalisation where the state was saved on ``layout`` (a later checkpoint of the same epoch
        carries it on until the epoch is planned again), else None."""
        return self.equalised if self.layout(layout) == layout else None


def batching_record(config: BatchingConfig, length_transform: LengthTransform | None = None) -> dict[str, Any]:
    """Every field of the batching config as plain values, and how the planned lengths follow from the index's
    (the speed factors and weights; the frame counts ``features`` gives a few lengths): a checkpoint holds them so
    that a mid-epoch resume with other options is refused rather than silently losing or repeating samples (a
    new field is recorded as well)."""
    out = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    out["plan_version"] = config.plan_version  # the state's plan_version again: an edit of one is refused
    speed = length_transform.speed if length_transform is not None else None
    out["speed_perturb"] = None if speed is None else [_plain(speed.factors), _plain(speed.weights)]
    frames = length_transform.frames if length_transform is not None and length_transform.in_frames else None
    out["features_frames"] = _plain(list(frames(_FRAME_PROBES))) if frames is not None else None
    return out


#: lengths (in samples) whose frame counts stand for a ``features`` extractor's framing in a checkpoint
_FRAME_PROBES = [400, 16_000, 160_000, 1_600_000]


def dataset_digest(index: AnyIndex | None) -> str | None:
    """A short digest of what an epoch's plan reads of the index: each shard's sample count and the total,
    longest and shortest of its lengths, in order (a mixture: each dataset's). Another dataset, or this one
    sharded again, differs; the same shards indexed again (``shardify upgrade``, ``index --overwrite``) or
    copied elsewhere do not. None without an index."""
    if index is None:
        return None
    import hashlib

    digest = hashlib.blake2b(digest_size=12)
    for ix in getattr(index, "indexes", [index]):
        table = ix.shard_table(("count", "total_length", "max_length", "min_length"))
        digest.update(np.asarray(table["count"], dtype=np.int64).tobytes())
        for name in ("total_length", "max_length", "min_length"):  # float32: the same whichever way summed
            digest.update(np.asarray(table[name], dtype=np.float64).astype(np.float32).tobytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """A config value as JSON holds it."""
    if isinstance(value, CostModel):
        return value.to_json()
    if isinstance(value, np.ndarray):
        return [float(x) for x in value]
    if isinstance(value, (list, tuple)):
        return [_plain(x) for x in value]
    return value.item() if isinstance(value, np.generic) else value


def _check_batching(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    differ = [k for k in saved if k in mine and saved[k] != mine[k] and k != "plan_version"]  # the state keeps its rule
    if differ:
        said = ", ".join(f"{k}={saved[k]!r} (now {mine[k]!r})" for k in differ)
        raise StateError(
            f"state was saved mid-epoch with other batching options: {said}; resume with the same "
            "options, or from the end of an epoch"
        )


def pack_mask(mask: np.ndarray) -> str:
    """A consumed-sample mask as text (the oldest state format held one)."""
    import base64
    import zlib

    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode("ascii")


def unpack_mask(packed: Any, n: int | None) -> np.ndarray:
    """Inverse of `pack_mask()` for ``n`` samples (None: as many as it holds); text that is not a packed
    mask, or one of fewer than ``n`` samples, is a `StateError` naming ``excluded`` (its key)."""
    import base64
    import binascii
    import zlib

    most = None if n is None else (n + 7) // 8
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(packed, validate=True), most or 0)
        short = most is not None and (len(raw) < most or inflate.unconsumed_tail or not inflate.eof)
    except (TypeError, binascii.Error, zlib.error):
        short = True
    if short:
        said = "a packed mask of consumed samples" + ("" if n is None else f" ({n} samples)")
        raise StateError(f"loader state: excluded must be {said}, got {shown(packed)}")
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:n].astype(bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _is_mixture(rows: Any) -> bool:
    """Whether ``rows`` is a mixture's state: ``[name, weight, samples]`` rows, or with a fourth (its start)."""
    if not isinstance(rows, (list, tuple)):
        return False
    for row in rows:
        if not isinstance(row, (list, tuple)) or len(row) not in (3, 4) or not isinstance(row[0], str):
            return False
        weight = row[1]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight < 0:
            return False
        if not all(_is_count(v) for v in row[2:]):
            return False
    return True


def _skip_ranges(value: Any) -> list[list[int]]:
    """The checkpoint's skipped steps (None or none: no skip), ``[[a, b], ...]`` with ``0 <= a < b``."""
    if value is None:
        return []
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(map(_is_count, r)) and r[0] < r[1] <= MAX_COUNT
        for r in value
    )
    if not ok:
        raise StateError(
            f"loader state: skip_steps must be a list of [first, end] step ranges of whole numbers, 0 <= first < end "
            f"<= {MAX_COUNT:,}, got {shown(value)}"
        )
    return [[int(a), int(b)] for a, b in value]
