"""The batch budget: the one parser of what a user writes for it (``960000``, ``"3.2M samples"``, ``"60s"``,
``"1h"``: the grammar of lengths, `streambatch.units.parse_length()`), for ``StreamBatchLoader(budget=...)``,
`BatchingConfig.make()` and ``shardify inspect --budget``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import BudgetError, OptionError, shown
from ..units import parse_length

BUDGET_ERROR = (
    "budget must be a positive finite number in the dataset's unit, a duration like '60s' for audio, or come "
    "from a calibration file given as cost=...; got {budget}"
)


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
    """A budget in the dataset's ``unit`` (see `parse_budget()`): the grammar of lengths, `parse_length()`."""
    if not isinstance(value, str):
        return check_budget(value)
    try:
        number = parse_length(value, unit, sample_rate, "budget")
    except OptionError as e:
        raise BudgetError(str(e)) from None
    if not math.isfinite(number) or number <= 0:
        raise BudgetError(BUDGET_ERROR.format(budget=shown(value)))
    return number
