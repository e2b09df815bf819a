"""The batch budget: the one parser of what a user writes for it (``960000``, ``"960000 samples"``, ``"60s"``), for
``StreamBatchLoader(budget=...)``, `BatchingConfig.make()` and ``shardify inspect --budget``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from ..errors import BudgetError, shown

BUDGET_ERROR = (
    "budget must be a positive finite number in the dataset's unit, a duration like '60s' for audio, or come "
    "from a calibration file given as cost=...; got {budget}"
)

#: duration suffixes a budget string may carry (audio only), in seconds
DURATIONS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "min": 60.0}
#: length units a budget string may name (it must be the dataset's own)
UNITS = ("samples", "seconds", "tokens", "frames")
_BUDGET_TEXT = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|[-+]?nan|[-+]?inf(?:inity)?)\s*([a-z]*)$")


def check_budget(budget: Any, name: str = "budget") -> float:
    """``budget`` as a float once it is a positive finite number (not text, not True), else a `BudgetError`
    naming the option (``name``: ``output_budget`` for the second budget)."""
    bad = BudgetError(BUDGET_ERROR.format(budget=shown(budget)).replace("budget must", f"{name} must", 1))
    if isinstance(budget, (bool, str, bytes)):
        raise bad
    try:
        value = float(budget)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float (10**400)
        raise bad from None
    if not math.isfinite(value) or value <= 0:
        raise bad
    return value


def parse_budget(
    value: Any, unit: str | None = None, sample_rate: int | None = None, to_frames: Callable[[int], Any] | None = None
) -> float:
    """A budget in the plan's unit from a number or a string: ``"960000"``, ``"960000 samples"``, or a duration of
    audio (``"60s"``, ``"1.5min"``, ``"500ms"``), converted with ``sample_rate`` when lengths count samples. The
    dataset's ``unit`` is None without an index: a number then, as it is. ``to_frames`` (samples → feature frames)
    when the plan counts feature frames: a number counts frames, a duration is the frames of that much audio."""
    if to_frames is None:
        return _parse(value, unit, sample_rate)
    try:
        return _parse(value, "frames", None)
    except BudgetError:  # a duration: its samples, then their frames
        return check_budget(float(to_frames(int(_parse(value, unit, sample_rate)))))


def _parse(value: Any, unit: str | None, sample_rate: int | None) -> float:
    """A budget in the dataset's ``unit`` (see `parse_budget()`)."""
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
        raise BudgetError(BUDGET_ERROR.format(budget=shown(value)))
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
