"""An adopted sample's length, from its members' headers (and a manifest's entry or segment), or why the loader
could not use it."""

from __future__ import annotations

from ...format.audio import AUDIO_EXTENSIONS
from ...units import Unit, same_length
from ..segments import Segment
from .nemo import Entry, duration_problem
from .scan import SampleScan


def sample_length(
    s: SampleScan, layout: str, unit: str, rate: int | None, entry: Entry | None, segment: Segment | str | None = None
) -> tuple[float, tuple[int, int] | None] | str:
    """A sample's length in ``unit`` and, for a segment, its ``(first frame, frames)`` of the member; or (a str)
    why the loader could not use it. A ``.json`` ``length`` is the length the loader checks the index against, so
    it must agree with the audio header."""
    if s.problem is not None:
        return s.problem
    if entry is not None and entry.problem is not None:
        return f"{entry.where}: {entry.member!r}: {entry.problem}"
    if layout == "text":
        if s.length is not None:
            whole = s.length > 0 and s.length == int(s.length)
            return (s.length, None) if whole else f"{s.key}.json: length {s.length:g} is not a positive whole number"
        if s.tokens < 0:
            return f"{s.key}: no text member (.txt, .input_ids.npy or a .json text), has {_exts(s)}"
        return (s.tokens, None) if s.tokens > 0 else f"{s.key}: empty text (0 tokens)"
    if s.audio is None:
        return f"{s.key}: no audio member ({AUDIO_MEMBERS}), has {_exts(s)}"
    header = Unit.parse(unit).audio_length(s.frames, s.rate, rate)
    if unit == "samples" and header <= 0:
        return f"{s.key}.{s.audio}: {s.frames} frames at {s.rate} Hz is 0 samples at {rate} Hz"
    if s.length is not None and not same_length(s.length, header):
        return (
            f"{s.key}.json: length {s.length:g} but the audio header gives {header:g} {unit} ({s.frames} frames "
            f"at {s.rate} Hz); the loader checks the .json length (is --unit right?)"
        )
    if segment is not None and entry is not None:
        return _segment_length(s, unit, rate, entry, segment)
    if entry is not None:
        problem = duration_problem(entry.duration, f"{s.key}.{s.audio}: the manifest ({entry.where})", s.rate, s.frames)
    else:
        problem = duration_problem(s.duration, f"{s.key}.json", s.rate, s.frames)
    return problem or (header, None)


def _segment_length(
    s: SampleScan, unit: str, rate: int | None, entry: Entry, segment: Segment | str
) -> tuple[float, tuple[int, int]] | str:
    """A segment's length and stretch of its member, or what is wrong with it (naming the manifest line)."""
    got = segment.frames(s.rate, s.frames) if isinstance(segment, Segment) else segment
    if isinstance(got, str):
        return f"{entry.where}: {entry.member!r} (member {s.key}.{s.audio}): {got}"
    length = Unit.parse(unit).audio_length(got[1], s.rate, rate)
    if unit == "samples" and length <= 0:
        return f"{entry.where}: {entry.member!r}: {got[1]} frames at {s.rate} Hz is 0 samples at {rate} Hz"
    return length, got


#: the audio members an adopted tar may hold, as messages list them
AUDIO_MEMBERS = ", ".join(AUDIO_EXTENSIONS)


def _exts(s: SampleScan) -> str:
    return ", ".join("." + e for e in s.exts) or "no members"
