"""Cost models: what a batch of ``n`` samples whose longest has length ``L`` costs against the budget.

* ``"padded"`` (default): ``n × L``, the elements of the padded tensor (right for convolutional and
  recurrent encoders, whose memory grows with the padded size).
* ``"quadratic"``: ``n × (L + L² / q)``, for attention, whose memory grows with ``L²`` (``q`` is the length
  at which the quadratic term equals the linear one; ``calibrate`` measures it).
* any callable ``cost(n, L)`` that is non-decreasing in both arguments.
* ``packed=True`` on the loader: padding-free batches whose cost is the real total length ``Σ lengths``.

Every model answers one question for the batcher: for each length, how many samples fit under the budget
(`CostModel.capacity()`). The budget invariant is then checked exactly with `CostModel.cost()`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from ..errors import IndexFormatError, OptionError, callable_option, int_option, number_option, shown
from ..stats import LengthStats

CALIBRATION_FORMAT = "streambatch-calibration"
#: the cost models a calibration file may name
CALIBRATED_COSTS = ("padded", "quadratic")
#: where a calibration given as a dict (``cost={...}``) came from, in messages
GIVEN_DICT = "<dict>"


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
        self.factor = number_option("quadratic_factor", self.factor, positive=True)

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
    """A user function ``cost(n, max_len)`` returning a finite number of at least 0; called with numpy arrays
    when it accepts them. Its signature is checked, and it is called once on ``(1, 1.0)``, where it is built, so a
    function of the wrong shape fails there (an `OptionError`), not in a worker."""

    name = "callable"

    def __init__(self, fn: Callable[[Any, Any], float]):
        _check_signature(fn)
        self.fn = fn
        self._vectorised: bool | None = None
        self.value(1, 1.0)

    def cost(self, n, max_len):
        return self.fn(n, max_len)

    def value(self, n: int, max_len: float) -> float:
        """``cost(n, max_len)`` as a float, checked: an `OptionError` naming what the function returned
        when that is not a finite number of at least 0 (the function's own errors pass through as they are)."""
        return _cost_value(self.fn(n, max_len), n, max_len)

    def _cost_vec(self, n: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self._vectorised is None:
            try:
                out = np.asarray(self.fn(n, lengths), dtype=np.float64)
                self._vectorised = out.shape == np.broadcast(n, lengths).shape
            except Exception:
                self._vectorised = False
        if not self._vectorised:
            return np.array([self.value(int(a), float(b)) for a, b in zip(n.ravel(), lengths.ravel())]).reshape(n.shape)
        out = np.asarray(self.fn(n, lengths), dtype=np.float64)
        bad = ~(np.isfinite(out) & (out >= 0))
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), bad.shape)
            a, b = np.broadcast_arrays(n, lengths)
            _cost_value(out[i], int(a[i]), float(b[i]))  # raises, naming that value
        return out

    def check_monotone(self, lengths: Any, max_n: int = 64) -> None:
        """Raise an `OptionError` if the function decreases in ``n`` or in length on a grid over the data's
        lengths (an array or a `LengthStats`), or returns anything but a finite
        number of at least 0 there."""
        ls = np.unique(LengthStats.of(lengths).quantile(np.linspace(0, 1, 9)))
        ns = np.unique(np.geomspace(1, max_n, 8).astype(int))
        grid = np.array([[self.value(int(n), float(x)) for x in ls] for n in ns])
        if (np.diff(grid, axis=0) < 0).any() or (np.diff(grid, axis=1) < 0).any():
            raise OptionError("cost: cost(n, max_len) must be non-decreasing in both n and max_len")


def _check_signature(fn: Callable[..., Any]) -> None:
    """Refuse a cost function that cannot be called as ``fn(n, max_len)`` (where its signature can be read)."""
    if isinstance(fn, type) and issubclass(fn, CostModel):
        raise OptionError(f"cost={fn.__name__} is a class: pass an instance, {fn.__name__}()")
    callable_option("cost", fn, "cost(n, max_len) -> number", 2)


def _cost_value(value: Any, n: int, max_len: float) -> float:
    """What a cost function returned, as a float once it is a finite number of at least 0, else an OptionError."""
    try:
        x = math.nan if isinstance(value, (str, bytes, bool, np.bool_)) else float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise OptionError(
            f"cost must return a finite number of at least 0; cost({n}, {max_len:g}) returned "
            + shown(value.item() if isinstance(value, np.generic) else value)
        )
    return x


class PackedCost(CostModel):
    """Padding-free batches: the cost is the real total length (the batcher packs by sum)."""

    name = "packed"
    packed = True

    def cost(self, n, max_len):  # an upper bound; the packed batcher checks the real sum
        return n * max_len


def resolve_cost(cost: Any = "padded", quadratic_factor: float | None = None) -> tuple[CostModel, float | None]:
    """A `CostModel` from a name, a callable, a model, or a calibration file/dict.

    Returns (model, budget from a calibration file or None).
    """
    if quadratic_factor is not None:
        number_option("quadratic_factor", quadratic_factor, positive=True)
    if isinstance(cost, CostModel):
        return cost, None
    if callable(cost):
        return CallableCost(cost), None
    if isinstance(cost, dict):
        return calibration_cost(cost, GIVEN_DICT)
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


#: the most bytes a calibration file may hold (``shardify calibrate`` writes well under 1 KB): it is data
MAX_CALIBRATION_BYTES = 1 << 20


def read_calibration(path: str, opener: Callable[[str], IO[bytes]] | None = None) -> dict[str, Any]:
    """A calibration file's contents, checked (`check_calibration()`). ``opener``: how to open ``path`` (the
    loader passes its storage layer, so the file may live in object storage); a local file by default. No file
    there is an `OptionError` (``cost`` names a file that is not there); a file that is not a calibration
    is an `IndexFormatError` naming it."""
    try:
        with opener(path) if opener is not None else open(path, "rb") as f:
            raw = f.read(MAX_CALIBRATION_BYTES + 1)
    except FileNotFoundError:
        raise OptionError(
            f"cost: no calibration file at {path} (write one with `shardify calibrate ... --out {path}`)"
        ) from None
    except IsADirectoryError:
        raise OptionError(f"cost: {path} is a folder, not a calibration file written by `shardify calibrate`") from None
    if len(raw) > MAX_CALIBRATION_BYTES:
        raise IndexFormatError(f"{path}: more than {MAX_CALIBRATION_BYTES:,} bytes, not a calibration file")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser's stack
        said = " ".join(str(e).split()) if isinstance(e, ValueError) else "nested too deep"
        raise IndexFormatError(f"{path}: not a calibration file written by `shardify calibrate` ({said})") from None
    return check_calibration(d, path)


def check_calibration(d: Any, source: str) -> dict[str, Any]:
    """``d`` once it is a calibration as ``shardify calibrate`` writes it: a JSON object whose ``format`` (a file's
    must have one; a dict given as ``cost`` may have ``cost`` instead) is `CALIBRATION_FORMAT`, ``cost`` one
    of `CALIBRATED_COSTS`, ``quadratic_factor`` (for ``"quadratic"``) and ``budget`` (when not null) finite
    numbers above 0, ``unit`` (when not null) a `Unit` name and ``max_batch_size``
    (when not null) a whole number of at least 1. What is wrong is one line naming ``source``: an
    `IndexFormatError` for a file (the file is what is wrong, as for an index), an `OptionError`
    for a dict given as ``cost`` (``source`` `GIVEN_DICT`)."""
    from ..units import Unit

    given = source == GIVEN_DICT
    where, error = ("cost", OptionError) if given else (source, IndexFormatError)
    if not isinstance(d, dict):
        raise error(f"{where}: not a calibration (a JSON object written by `shardify calibrate`), got {shown(d)}")
    if "format" not in d and (not given or "cost" not in d):  # a file says what it is; a dict at least its cost
        what = "no 'format'" if not given else "no 'format' or 'cost'"
        raise error(f"{where}: not a calibration written by `shardify calibrate` ({what}: {shown(d)})")
    if d.get("format", CALIBRATION_FORMAT) != CALIBRATION_FORMAT:
        raise error(f"{where}: not a {CALIBRATION_FORMAT} file (format={shown(d.get('format'))})")
    try:
        kind = d.get("cost", "padded")
        if kind not in CALIBRATED_COSTS:
            raise OptionError(f"cost must be one of {', '.join(map(repr, CALIBRATED_COSTS))}, got {shown(kind)}")
        if kind == "quadratic":
            number_option("quadratic_factor", d.get("quadratic_factor"), positive=True)
        if d.get("budget") is not None:
            number_option("budget", d["budget"], positive=True)
        if d.get("unit") is not None:
            Unit.parse(d["unit"])
        if d.get("max_batch_size") is not None:
            int_option("max_batch_size", d["max_batch_size"], 1)
    except OptionError as e:
        raise error(f"{where}: not a valid calibration: {e}") from None
    return d


def calibration_cost(d: dict[str, Any], source: str) -> tuple[CostModel, float | None]:
    """The cost model and budget a calibration (``source``: where it came from, for messages; `GIVEN_DICT`
    for a dict given as ``cost``) describes, checked by `check_calibration()`."""
    d = check_calibration(d, source)
    budget = None if d.get("budget") is None else float(d["budget"])
    if d.get("cost", "padded") == "quadratic":
        return QuadraticCost(float(d["quadratic_factor"])), budget
    return PaddedCost(), budget


def max_length_alone(model: CostModel, budget: float) -> float:
    """The longest sample that fits in a batch by itself (for the padded and quadratic models)."""
    if isinstance(model, QuadraticCost):
        q = model.factor
        return (-q + math.sqrt(q * q + 4 * q * budget)) / 2
    return budget
