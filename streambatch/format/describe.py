"""Lengths and totals as a person reads them, in a dataset's unit (with seconds or hours for audio): the one
wording for the loader's messages and the ``shardify`` reports."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .index import ShardIndex


def length_text(x: float, index: ShardIndex | None) -> str:
    """A length in the dataset's unit, with seconds for audio: ``"12,000 samples (1.5 s)"``."""
    if index is None:
        return number_text(x)
    spu = index.seconds_per_unit()
    seconds = f" ({float(x) * spu:.3g} s)" if spu and index.unit != "seconds" else ""
    return f"{number_text(x)} {index.unit}{seconds}"


def total_text(index: ShardIndex) -> str:
    """The dataset's total length: hours (or minutes) for audio, else the total in its unit."""
    spu = index.seconds_per_unit()
    if spu:
        return hours_text(index.total_length * spu / 3600)
    return f"{number_text(index.total_length)} {index.unit}"


def unit_text(index: ShardIndex) -> str:
    """The dataset's unit as the ``shardify`` reports name it, with the sample rate where it has one:
    ``"samples @ 16000 Hz"``."""
    return f"{index.unit}" + (f" @ {index.sample_rate} Hz" if index.sample_rate else "")


def hours_text(h: float) -> str:
    """``"1.50 h"``, or minutes under an hour: ``"12.00 min"``."""
    return f"{h:,.2f} h" if h >= 1 else f"{h * 60:,.2f} min"


def number_text(x: float) -> str:
    """1,234 for whole or large numbers, else up to 3 decimals."""
    x = float(x)
    if x.is_integer() or abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:,.3f}".rstrip("0").rstrip(".")
