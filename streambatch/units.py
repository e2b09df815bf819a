"""The unit a dataset's lengths count: `Unit`, parsed once where a unit enters (an index header, ``--unit``,
an option) and compared as a value everywhere after.

The one grammar of amounts a user writes is here too (docs/guide/amounts.md): a length in the dataset's unit or
a duration (`parse_length()`: ``"960000"``, ``"3.2M"``, ``"3.2M samples"``, ``"60s"``, ``"1.5min"``, ``"1h"``), a
count (`parse_count()`: ``"10k"``), a duration (`parse_duration()`) and a size in bytes (`parse_bytes()`:
``"64M"``, ``"8MiB"``), one way for every option that takes one.

A leaf module beside `errors`: the index (``dataset/``), the planner (``plan/``), the writer and the
calibration all name units, and none of them should import another to do it.
"""

from __future__ import annotations

import enum
import math
import numbers
import re
from collections.abc import Iterable

from .errors import OptionError, shown

__all__ = ["Unit", "parse_bytes", "parse_count", "parse_duration", "parse_length", "resampled_count", "same_length"]


class Unit(str, enum.Enum):
    """What one unit of a length is. A ``str`` too: ``Unit.SAMPLES == "samples"``, it is written to an index
    and to JSON as that string, and every function taking a unit takes the string as well."""

    #: audio samples at the index's sample rate
    SAMPLES = "samples"
    #: seconds of audio (fractional lengths)
    SECONDS = "seconds"
    #: text tokens (or characters where the tokenizer counts them)
    TOKENS = "tokens"
    #: feature frames (a length plan's lengths after a transform)
    FRAMES = "frames"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: object, choices: Iterable[Unit] | None = None) -> Unit:
        """``value`` (a `Unit` or its name) as a `Unit`, one of ``choices`` (default: any); an
        `OptionError` naming the units there are for anything else."""
        allowed = tuple(cls) if choices is None else tuple(choices)
        unit = cls._value2member_map_.get(value) if isinstance(value, str) else None
        if not isinstance(unit, cls) or unit not in allowed:
            raise OptionError(f"unknown unit {value!r}; choose one of {', '.join(u.value for u in allowed)}")
        return unit

    @property
    def is_audio(self) -> bool:
        """Whether lengths measure audio (samples or seconds), so durations convert to them."""
        return self in (Unit.SAMPLES, Unit.SECONDS)

    @property
    def whole(self) -> bool:
        """Whether lengths are whole numbers (every unit but seconds)."""
        return self is not Unit.SECONDS

    def names(self, word: str) -> bool:
        """Whether ``word`` names this unit, in the plural or the singular (``"samples"``, ``"sample"``)."""
        return word in (self.value, self.value[:-1])

    def seconds_per_unit(self, sample_rate: int | None) -> float | None:
        """How many seconds one unit is: ``1/sample_rate`` for samples, 1 for seconds, None where lengths are not
        audio or the sample rate is unknown."""
        if self is Unit.SAMPLES and sample_rate:
            return 1.0 / float(sample_rate)
        return 1.0 if self is Unit.SECONDS else None

    def from_seconds(self, seconds: float, sample_rate: int | None) -> float | None:
        """``seconds`` of audio in this unit, or None where it does not convert (not audio, no sample rate)."""
        if self is Unit.SECONDS:
            return seconds
        return seconds * float(sample_rate) if self is Unit.SAMPLES and sample_rate else None

    def audio_length(self, frames: int, rate: int, index_rate: int | None) -> int | float:
        """The length of ``frames`` frames of audio at ``rate`` Hz: samples at ``index_rate`` (the audio's own
        rate when None; counted as the writer counts them, `resampled_count()`) or seconds."""
        if self is Unit.SAMPLES:
            return resampled_count(frames, rate, index_rate or rate)
        if self is Unit.SECONDS:
            return frames / rate
        raise OptionError(f"audio is measured in samples or seconds, not {self.value}")


#: how far a sample's ``.json`` length may stray from its index's (relative, at least 1 unit × this): the rounding
#: of a tool that wrote seconds to six places, not a different sample
LENGTH_TOLERANCE = 1e-6


def same_length(found: object, said: float) -> bool:
    """Whether a ``.json`` length (any JSON value) is the index's ``said``, within `LENGTH_TOLERANCE`: the
    one rule ``shardify index`` adopts a ``.json`` length by and the loader checks a streamed sample by."""
    if isinstance(found, bool) or not isinstance(found, numbers.Real):
        return False
    return abs(float(found) - float(said)) <= LENGTH_TOLERANCE * max(1.0, abs(float(said)))


def resampled_count(frames: int, rate: int, target: int) -> int:
    """``round(frames * target / rate)`` in exact integer arithmetic (halves round up): the samples ``frames``
    frames at ``rate`` Hz are at ``target`` Hz."""
    return frames if rate == target else (2 * frames * target + rate) // (2 * rate)


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


#: the largest size in bytes an option takes: what a signed 64-bit offset holds
MAX_BYTES = 2**63 - 1


def parse_bytes(size: int | str | None, what: str = "size") -> int | None:
    """Bytes from ``123456``, ``"64M"``, ``"8MiB"``, ``"1.5G"`` (K, M, G, T are powers of 1024); 0 allowed. A number
    must be whole (``64e6`` is, ``1.5`` is not); anything else is an `OptionError` naming ``what``."""
    if size is None:
        return None
    whole = f"{what} must be a whole number of bytes or a size like 64M, got {shown(size)}"
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        if isinstance(size, float) and not (math.isfinite(size) and float(size).is_integer()):
            raise OptionError(whole)
        n = int(size)
    else:
        m = _SIZE.fullmatch(str(size))
        if not m:
            raise OptionError(f"{what}: cannot read {size!r} as a size; write e.g. 64M, 8MiB, 2G or a number of bytes")
        unit = _UNITS[m.group(2).lower()]
        exact = float(m.group(1)) * unit
        if not math.isfinite(exact) or (unit == 1 and not exact.is_integer()):  # "1.5" bytes; "1.5K" is 1536
            raise OptionError(whole)
        n = round(exact)
    if n < 0:
        raise OptionError(f"{what} must not be negative, got {size!r}")
    if n > MAX_BYTES:
        raise OptionError(f"{what} must be at most {MAX_BYTES:,} bytes (8 EiB), got {shown(size)}")
    return n


# ---- the grammar of amounts: NUMBER [MULTIPLIER] [WORD] -----------------------------------------------------------
#: duration words, in seconds (any case; ``m`` alone is a million, not a minute: write ``min``)
DURATIONS: dict[str, float] = {
    **dict.fromkeys(("ms", "msec", "millisecond", "milliseconds"), 1e-3),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
}
#: multipliers of a count or length (powers of 1000; sizes in bytes count K, M, G, T in powers of 1024)
MULTIPLIERS: dict[str, float] = {"k": 1e3, "m": 1e6, "g": 1e9}
#: where the grammar is written down (named by every message about an amount it cannot read)
GRAMMAR_DOC = "docs/guide/amounts.md"

_NUMBER = re.compile(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|[-+]?nan|[-+]?inf(?:inity)?)", re.I)


def read_amount(text: str) -> tuple[float, str]:
    """``text`` as ``NUMBER [MULTIPLIER] [WORD]``: the number (times its multiplier, k/M/G = 10³/10⁶/10⁹) and
    the word after it, lower case ("" for none): a duration word, a unit's name or anything else (the caller
    decides). A ``ValueError`` where no number starts it or something follows the word."""
    m = _NUMBER.match(text)
    if m is None:
        raise ValueError(f"no number in {text!r}")
    number, rest = float(m.group(1)), text[m.end() :].strip().lower()
    if rest in DURATIONS or rest[:1] not in MULTIPLIERS:
        word, times = rest, 1.0
    else:
        word, times = rest[1:].strip(), MULTIPLIERS[rest[0]]
    if word and not word.isalpha():
        raise ValueError(f"cannot read {rest!r} after the number in {text!r}")
    return number * times, word


def _amount_error(what: str, value: object, expected: str) -> OptionError:
    return OptionError(f"{what}: cannot read {shown(value)}; expected {expected} (the grammar: {GRAMMAR_DOC})")


def parse_duration(value: object, what: str = "duration") -> float:
    """Seconds from a number of seconds or text: ``"90"``, ``"500ms"``, ``"1.5min"``, ``"2h"`` (`DURATIONS`);
    finite and not negative, else an `OptionError` naming ``what`` and the grammar."""
    expected = "a duration like 90, 500ms, 60s, 1.5min or 2h"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            number, word = read_amount(value)
        except ValueError:
            raise _amount_error(what, value, expected) from None
        if word and word not in DURATIONS:
            raise _amount_error(what, value, expected)
        seconds = number * DURATIONS.get(word, 1.0)
    else:
        raise _amount_error(what, value, expected)
    if not math.isfinite(seconds) or seconds < 0:
        raise OptionError(f"{what} must be a finite duration of 0 or more, got {shown(value)}")
    return seconds


def parse_count(value: object, what: str = "count", minimum: int = 0) -> int:
    """A whole number from a number or text: ``"1000"``, ``"10k"``, ``"2.5M"`` (`MULTIPLIERS`), at least
    ``minimum``, else an `OptionError` naming ``what`` and the grammar."""
    expected = "a whole number like 1000, 10k or 2.5M"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number, word = float(value), ""
    elif isinstance(value, str):
        try:
            number, word = read_amount(value)
        except ValueError:
            raise _amount_error(what, value, expected) from None
    else:
        raise _amount_error(what, value, expected)
    if word or not math.isfinite(number) or not float(number).is_integer():
        raise _amount_error(what, value, expected)
    if number < minimum:
        raise OptionError(f"{what} must be at least {minimum}, got {shown(value)}")
    return int(number)


def parse_length(value: str, unit: str | None, sample_rate: int | None, what: str = "length") -> float:
    """A length in the dataset's ``unit`` from text: a number in that unit (``"960000"``, ``"3.2M"``,
    ``"3.2M samples"``) or a duration of audio (``"60s"``, ``"1h"``) converted at ``sample_rate`` when lengths
    count samples. ``unit`` None (no index): a number as it is, a unit word any of them. Not checked for sign
    (the caller's range); an `OptionError` naming ``what`` for text it cannot read, a word that is neither a
    duration nor the dataset's unit, or a duration where lengths are not audio."""
    expected = "a number in the dataset's unit (960000, 3.2M) or a duration (60s, 1.5min, 1h)"
    try:
        number, word = read_amount(value)
    except ValueError:
        raise _amount_error(what, value, expected) from None
    if not word or (unit is not None and Unit(unit).names(word)):
        return number
    if unit is None and word not in DURATIONS and any(u.names(word) for u in Unit):
        return number
    if word not in DURATIONS:
        known = f"not this dataset's unit, {unit}" if unit else f"not one of {', '.join(u.value for u in Unit)}"
        raise OptionError(
            f"{what} {value!r}: {word!r} is {known}, nor a duration (60s, 500ms, 1.5min, 1h; the grammar: "
            f"{GRAMMAR_DOC})"
        )
    seconds = number * DURATIONS[word]
    if unit == Unit.SECONDS:
        return seconds
    if unit == Unit.SAMPLES and sample_rate:
        return seconds * float(sample_rate)
    if unit is None:
        raise OptionError(
            f"{what} {value!r}: a duration needs the dataset's unit and sample rate from its index; without one "
            "give it in the dataset's unit"
        )
    raise OptionError(
        f"{what} {value!r}: seconds only make sense for audio, this dataset's lengths are in {unit}"
        + (" without a sample rate" if unit == Unit.SAMPLES else "")
    )
