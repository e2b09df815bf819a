"""Cost models: what a batch of ``n`` samples whose longest has length ``L`` costs against the budget.

* ``"padded"`` (default): ``n × L``, the elements of the padded tensor (right for convolutional and
  recurrent encoders, whose memory grows with the padded size).
* ``"quadratic"``: ``n × (L + L² / q)``, for attention, whose memory grows with ``L²`` (``q`` is the length
  at which the quadratic term equals the linear one; ``calibrate`` measures it).
* any callable ``cost(n, L)`` that is non-decreasing in both arguments.
* ``packed=True`` on the loader: padding-free batches whose cost is the real total length ``Σ lengths``.

Every model answers one question for the batcher: for each length, how many samples fit under the budget
(:meth:`CostModel.capacity`). The budget invariant is then checked exactly with :meth:`CostModel.cost`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from ..errors import OptionError, number_option
from .stats import LengthStats

CALIBRATION_FORMAT = "streambatch-calibration"


class CostModel:
    """Base: ``cost(n, max_len)`` and the largest ``n`` per length under a budget."""

    name = "custom"
    packed = False

    def cost(self, n: Any, max_len: Any) -> Any:
        raise NotImplementedError

    def capacity(self, lengths: np.ndarray, budget: float, max_batch_size: int) -> np.ndarray:
        """For each length, the most samples of at most that length a batch can hold (0: not even one)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        lo = np.zeros(lengths.shape, dtype=np.int64)  # fits (0 always does)
        hi = np.full(lengths.shape, int(max_batch_size) + 1, dtype=np.int64)  # does not fit (or beyond the cap)
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                return lo
            mid = (lo + hi) // 2
            fits = np.asarray(self._cost_vec(mid, lengths)) <= budget
            lo = np.where(open_ & fits, mid, lo)
            hi = np.where(open_ & ~fits, mid, hi)

    def _cost_vec(self, n: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return self.cost(n, lengths)

    def to_json(self) -> dict[str, Any]:
        return {"cost": self.name}


class PaddedCost(CostModel):
    """``n × max_len``."""

    name = "padded"

    def cost(self, n, max_len):
        return n * max_len

    def capacity(self, lengths: np.ndarray, budget: float, max_batch_size: int) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        cap = _whole(budget / lengths, max_batch_size)
        cap -= cap * lengths > budget  # guard against rounding in the division
        return np.minimum(cap, max_batch_size)


@dataclass
class QuadraticCost(CostModel):
    """``n × (max_len + max_len² / factor)``."""

    factor: float = 1.0
    name = "quadratic"

    def __post_init__(self) -> None:
        if not self.factor or self.factor <= 0:
            raise ValueError(f"quadratic cost needs a positive quadratic_factor, got {self.factor!r}")

    def cost(self, n, max_len):
        return n * (max_len + max_len * max_len / self.factor)

    def capacity(self, lengths: np.ndarray, budget: float, max_batch_size: int) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        per = lengths + lengths * lengths / self.factor
        cap = _whole(budget / per, max_batch_size)
        cap -= cap * per > budget
        return np.minimum(cap, max_batch_size)

    def to_json(self) -> dict[str, Any]:
        return {"cost": self.name, "quadratic_factor": self.factor}


def _whole(ratio: np.ndarray, most: int) -> np.ndarray:
    """``floor(ratio)`` as whole numbers, at most ``most + 1`` first: a budget far above every length (``1e30``)
    does not overflow int64 into a negative capacity."""
    return np.floor(np.minimum(ratio, float(most) + 1.0)).astype(np.int64)


class CallableCost(CostModel):
    """A user function ``cost(n, max_len)``; called with numpy arrays when it accepts them."""

    name = "callable"

    def __init__(self, fn: Callable[[Any, Any], float]):
        self.fn = fn
        self._vectorised: bool | None = None

    def cost(self, n, max_len):
        return self.fn(n, max_len)

    def _cost_vec(self, n: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self._vectorised is None:
            try:
                out = np.asarray(self.fn(n, lengths), dtype=np.float64)
                self._vectorised = out.shape == np.broadcast(n, lengths).shape
            except Exception:
                self._vectorised = False
        if self._vectorised:
            return np.asarray(self.fn(n, lengths), dtype=np.float64)
        return np.array([float(self.fn(int(a), float(b))) for a, b in zip(n.ravel(), lengths.ravel())]).reshape(n.shape)

    def check_monotone(self, lengths: Any, max_n: int = 64) -> None:
        """Raise if the function decreases in ``n`` or in length on a grid over the data's lengths (an array
        or a :class:`~streambatch.plan.stats.LengthStats`)."""
        ls = np.unique(LengthStats.of(lengths).quantile(np.linspace(0, 1, 9)))
        ns = np.unique(np.geomspace(1, max_n, 8).astype(int))
        grid = np.array([[float(self.fn(int(n), float(x))) for x in ls] for n in ns])
        if (np.diff(grid, axis=0) < 0).any() or (np.diff(grid, axis=1) < 0).any():
            raise ValueError("cost(n, max_len) must be non-decreasing in both n and max_len")


class PackedCost(CostModel):
    """Padding-free batches: the cost is the real total length (the batcher packs by sum)."""

    name = "packed"
    packed = True

    def cost(self, n, max_len):  # an upper bound; the packed batcher checks the real sum
        return n * max_len


def resolve_cost(cost: Any = "padded", quadratic_factor: float | None = None) -> tuple[CostModel, float | None]:
    """A :class:`CostModel` from a name, a callable, a model, or a calibration file/dict.

    Returns (model, budget from a calibration file or None).
    """
    if quadratic_factor is not None:
        number_option("quadratic_factor", quadratic_factor, positive=True)
    if isinstance(cost, CostModel):
        return cost, None
    if callable(cost):
        return CallableCost(cost), None
    if isinstance(cost, dict):
        return calibration_cost(cost, "<dict>")
    if cost in (None, "padded"):
        return PaddedCost(), None
    if cost == "quadratic":
        if quadratic_factor is None:
            raise OptionError(
                "cost='quadratic' needs quadratic_factor (or a calibration file from streambatch.calibrate)"
            )
        return QuadraticCost(number_option("quadratic_factor", quadratic_factor, positive=True)), None
    if is_calibration_path(cost):
        return calibration_cost(read_calibration(cost), cost)
    raise OptionError(f"unknown cost {cost!r}: use 'padded', 'quadratic', a callable, or a calibration .json")


def is_calibration_path(cost: Any) -> bool:
    """Whether ``cost`` names a calibration file (``*.json``)."""
    return isinstance(cost, str) and cost.endswith(".json")


def read_calibration(path: str, opener: Callable[[str], IO[bytes]] | None = None) -> dict[str, Any]:
    """A calibration file's contents. ``opener``: how to open ``path`` (the loader passes its storage layer, so
    the file may live in object storage); a local file by default."""
    try:
        with opener(path) if opener is not None else open(path, "rb") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no calibration file at {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a calibration file ({e})") from None


def calibration_cost(d: dict[str, Any], source: str) -> tuple[CostModel, float | None]:
    """The cost model and budget a calibration (``source``: where it came from, for messages) describes."""
    if d.get("format", CALIBRATION_FORMAT) != CALIBRATION_FORMAT:
        raise ValueError(f"{source}: not a {CALIBRATION_FORMAT} file")
    kind = d.get("cost", "padded")
    budget = d.get("budget")
    if kind == "padded":
        return PaddedCost(), budget
    if kind == "quadratic":
        return QuadraticCost(float(d["quadratic_factor"])), budget
    raise ValueError(f"{source}: unknown cost {kind!r}")


def max_length_alone(model: CostModel, budget: float) -> float:
    """The longest sample that fits in a batch by itself (for the padded and quadratic models)."""
    if isinstance(model, QuadraticCost):
        q = model.factor
        return (-q + math.sqrt(q * q + 4 * q * budget)) / 2
    return budget
