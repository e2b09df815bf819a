"""Segments: a sample that is a stretch of a longer recording (a NeMo ``offset`` + ``duration`` entry, a SpeechBrain
``{"file", "start", "stop"}`` entry, a Kaldi ``segments`` line, a lhotse cut or supervision).

Each segment is a sample of its own. ``shardify write`` stores only its slice, as a WAV member whose samples are
exactly what soundfile decodes from the original for that stretch: the original's PCM width where WAV holds it
(16, 24 or 32 bits; 8-bit as 16), 64-bit float for a ``DOUBLE`` file, else (lossy and other codecs) the 32-bit
float decode itself. The member's size is known from the segment's frame count before any audio is decoded, so
shards are planned as for whole files; the slice is decoded and encoded when its shard is written.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf

from ..format.audio import read_stretch
from ..io import storage

#: a segment may run past the end of its recording by this much (a tool's rounding) and is then cut at the end;
#: more is an input error
OVERRUN_TOLERANCE_S = 0.1
_KEEP_PCM = {"PCM_16": ("PCM_16", "int16"), "PCM_24": ("PCM_24", "int32"), "PCM_32": ("PCM_32", "int32")}
_WIDEN = {"PCM_S8": ("PCM_16", "int16"), "PCM_U8": ("PCM_16", "int16"), "DOUBLE": ("DOUBLE", "float64")}


@dataclass(frozen=True)
class Segment:
    """Where a segment lies in its recording: ``start`` and ``length`` in seconds, or in frames when ``in_frames``
    (SpeechBrain's ``start``/``stop``); ``length`` None: to the end. ``clamp``: a segment running past the end is
    cut there whatever the overrun (SpeechBrain reads what is there)."""

    start: float = 0.0
    length: float | None = None
    in_frames: bool = False
    clamp: bool = False

    def frames(self, sample_rate: int, total: int) -> tuple[int, int] | str:
        """``(first frame, frame count)`` in a recording of ``total`` frames at ``sample_rate``, or what is wrong."""
        scale = 1 if self.in_frames else sample_rate
        first = int(round(self.start * scale))
        count = total - first if self.length is None else int(round(self.length * scale))
        if first < 0 or count < 0:
            return f"the segment starts at {self.start:g} with length {self.length!r}: negative"
        over = first + count - total
        if over > 0 and (self.clamp or over <= OVERRUN_TOLERANCE_S * sample_rate):
            count -= over
        elif over > 0:
            unit = "frames" if self.in_frames else "s"
            return (
                f"the segment ({self.start:g} {unit} + {self.length:g} {unit}) ends {over / sample_rate:.6g} s after "
                f"the end of its recording ({total} frames at {sample_rate} Hz)"
            )
        if count <= 0:
            return f"the segment at {self.start:g} is empty (its recording has {total} frames at {sample_rate} Hz)"
        return first, count

    def key_suffix(self) -> str:
        """What tells this segment's key from its recording's: its start (ms, or frames), e.g. ``_0012340``."""
        return f"_{int(self.start):09d}" if self.in_frames else f"_{int(round(self.start * 1000)):09d}"


@dataclass(frozen=True)
class SegmentAudio:
    """A segment's slice of the recording at ``path``, read when its shard is written (``read()``: a WAV file's
    bytes, ``size`` of them); picklable, so writer processes can read it."""

    path: str
    first: int
    frames: int
    subtype: str
    dtype: str
    sample_rate: int
    channels: int
    size: int
    storage_options: dict | None = None
    ext: str = "wav"

    def read(self) -> bytes:
        with storage.open_url(self.path, "rb", self.storage_options) as f, sf.SoundFile(f) as snd:
            data = read_stretch(snd, self.first, self.frames, dtype=self.dtype, always_2d=True)
        buf = io.BytesIO()
        sf.write(buf, data, self.sample_rate, subtype=self.subtype, format="WAV")
        return buf.getvalue()


def segment_audio(path: str, first: int, frames: int, storage_options: dict | None = None) -> SegmentAudio:
    """The slice ``[first, first + frames)`` of the recording at ``path`` as a WAV member to be (its exact size
    from the recording's header alone)."""
    sample_rate, channels, source_subtype = _layout(path, storage_options)
    subtype, dtype = _KEEP_PCM.get(source_subtype) or _WIDEN.get(source_subtype) or ("FLOAT", "float32")
    size = wav_size(frames, channels, subtype, sample_rate)
    return SegmentAudio(path, first, frames, subtype, dtype, sample_rate, channels, size, storage_options)


def _layout(path: str, storage_options: dict | None) -> tuple[int, int, str]:
    """Rate, channels and subtype of a recording (cached for plain paths: a long recording has many segments)."""
    return _read_layout(path, storage_options) if storage_options else _cached_layout(path)


@functools.lru_cache(maxsize=256)
def _cached_layout(path: str) -> tuple[int, int, str]:
    return _read_layout(path, None)


def _read_layout(path: str, storage_options: dict | None) -> tuple[int, int, str]:
    with storage.open_url(path, "rb", storage_options) as f, sf.SoundFile(f) as snd:
        return int(snd.samplerate), int(snd.channels), str(snd.subtype)


@functools.lru_cache(maxsize=64)
def _wav_header(channels: int, subtype: str, sample_rate: int) -> tuple[int, int]:
    """(header bytes, bytes per frame) of the WAV files libsndfile writes for this layout."""
    buf = io.BytesIO()
    sf.write(buf, np.zeros((2, channels), dtype="float32"), sample_rate, subtype=subtype, format="WAV")
    with sf.SoundFile(io.BytesIO(buf.getvalue())) as snd:
        per_frame = {"PCM_16": 2, "PCM_24": 3, "PCM_32": 4, "FLOAT": 4, "DOUBLE": 8}[subtype] * snd.channels
    data = 2 * per_frame
    return len(buf.getvalue()) - data - data % 2, per_frame


def wav_size(frames: int, channels: int, subtype: str, sample_rate: int) -> int:
    """Bytes of a WAV file of ``frames`` frames as libsndfile writes it (the data chunk padded to even)."""
    header, per_frame = _wav_header(channels, subtype, sample_rate)
    data = frames * per_frame
    return header + data + data % 2


def as_segment(
    rec: Any, probed: tuple[int, int, int], storage_options: dict | None = None
) -> tuple[int, int, int] | str:
    """A probed segment record (``probed``: its recording's rate, frames and bytes) as its own sample: its rate, its
    frames and its WAV member's bytes (``rec.audio`` set to the slice, read when the shard is written), or what is
    wrong with it."""
    sample_rate, total, _ = probed
    got = rec.segment.frames(sample_rate, total)
    if isinstance(got, str):
        return got
    first, frames = got
    rec.audio = segment_audio(rec.path, first, frames, storage_options)
    return sample_rate, frames, rec.audio.size
