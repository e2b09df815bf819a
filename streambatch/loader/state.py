"""A loader's checkpoint, typed: :class:`LoaderState`, with its plain-dict form (what ``state_dict()`` returns and a
training script saves with the model), the checks that a state belongs to a loader, and the layout an interrupted
epoch ran on. States saved by earlier versions load: a key they lack is simply not checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import OptionError, StateError, int_option, shown
from ..plan.config import PLAN_VERSION, BatchingConfig, with_plan_version
from ..plan.cost import CostModel
from ..plan.layout import Layout
from ..plan.resume import EarlierRun, Resumed, equalised_of


@dataclass
class LoaderState:
    """Where a loader is: the epoch, the batches of it already yielded, and what decides which batches they were.
    Small: no per-sample data, whatever the dataset's size."""

    epoch: int = 0
    """The epoch the next pass yields (after a finished pass, the next one)."""
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
    """A mixture's datasets and weights (:meth:`~streambatch.dataset.mixture.MixedIndex.state`), else None; under a
    weight schedule the weights in force for ``epoch`` and where it begins in each dataset."""
    where: str | None = None
    """The filter expression, else None."""
    batching: dict[str, Any] | None = None
    """The batching options as plain values (:func:`batching_record`): a mid-epoch resume with others is refused."""
    earlier_layouts: list[dict[str, Any]] = field(default_factory=list)
    """The layouts ``epoch`` ran on before a resume on this one (:meth:`EarlierRun.state_dict`), oldest first."""
    excluded: str | None = None
    """A packed mask of consumed samples, from the oldest state format (:func:`pack_mask`)."""
    skip_steps: list[list[int]] = field(default_factory=list)
    """Steps of ``epoch`` a resume skips, as ``[[a, b], ...]`` ranges of step numbers from the epoch's start
    (``load_state_dict(state, skip_steps=...)``): a later resume from this state skips them too."""
    equalised: list[list[int]] | None = None
    """Every rank's equalisation of ``epoch`` on this layout (:meth:`RankEqualised.to_ints`, once planned): a resume on
    another layout then batches each old rank only as far as it consumed. A state without it (an older version)
    still resumes, re-planning the old ranks in full."""
    plan_version: int = PLAN_VERSION
    """The batching rule the epoch was planned by (:attr:`~streambatch.plan.config.BatchingConfig.plan_version`); a
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
        """A state from its dict form, as this or an earlier version saved it; anything else (not a mapping, no
        epoch, a position that is not a whole number from 0) is a :class:`StateError`."""
        if not isinstance(state, Mapping) or "epoch" not in state:
            raise StateError(f"not a loader state_dict (a mapping with an 'epoch'): {shown(state)}")
        known = [k for k in cls.names() if k in state]
        out = cls(**{k: state[k] for k in known}, recorded=frozenset(known))
        try:
            out.epoch = int_option("epoch", out.epoch, 0)
            out.batches_consumed = int_option("batches_consumed", out.batches_consumed or 0, 0)
        except OptionError as e:
            raise StateError(f"loader state: {e}") from None
        out.earlier_layouts = list(out.earlier_layouts or [])
        return out

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
        if mine.num_samples is not None and self.num_samples not in (None, mine.num_samples):
            raise StateError(
                f"state was saved for a dataset of {self.num_samples} samples, this one has {mine.num_samples}"
            )
        if self.knows("mixture") and self.mixture != mine.mixture:
            raise StateError(f"state was saved for the mixture {self.mixture}, this loader reads {mine.mixture}")
        if self.knows("where") and self.where != mine.where:
            raise StateError(f"state was saved with where={self.where!r}, this loader has where={mine.where!r}")
        if mine.num_samples is None and self.batches_consumed:
            raise StateError("mid-epoch resumption needs an index (the epoch's batches must be planned)")
        # between epochs the options may change; within one they decide what was seen
        if self.batches_consumed and self.batching is not None and mine.batching is not None:
            _check_batching(self.batching, mine.batching)

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


def batching_record(config: BatchingConfig) -> dict[str, Any]:
    """Every field of the batching config as plain values (a checkpoint holds them so that a mid-epoch resume with
    other options is refused rather than silently losing or repeating samples; a new field is recorded as well)."""
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


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
    differ = [k for k in saved if k in mine and saved[k] != mine[k]]
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


def unpack_mask(packed: str, n: int) -> np.ndarray:
    """Inverse of :func:`pack_mask` for ``n`` samples."""
    import base64
    import zlib

    bits = np.frombuffer(zlib.decompress(base64.b64decode(packed)), dtype=np.uint8)
    return np.unpackbits(bits)[:n].astype(bool)
