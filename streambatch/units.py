"""The unit a dataset's lengths count: `Unit`, parsed once where a unit enters (an index header, ``--unit``,
an option) and compared as a value everywhere after.

Sizes in bytes are read here too (`parse_bytes()`: ``"64M"``, ``"8MiB"``), one way for every option that takes one.

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

__all__ = ["Unit", "parse_bytes", "resampled_count", "same_length"]


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
