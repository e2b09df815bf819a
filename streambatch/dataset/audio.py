"""Audio: probe lengths from headers (never decoding) and decode bytes to float32 waveforms.

soundfile (libsndfile) is the default: it reads WAV, FLAC and OGG from paths and from bytes. torchaudio is
used only as a fallback for formats soundfile cannot read, and only when it imports (its releases pin torch
exactly, so it stays optional).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import soundfile as sf

AUDIO_EXTENSIONS = ("flac", "wav", "ogg", "opus", "mp3")


class AudioError(ValueError):
    """A file or byte string that cannot be read as audio."""


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    frames: int
    channels: int
    format: str

    @property
    def duration(self) -> float:
        return self.frames / float(self.sample_rate)


def probe(src: str | BinaryIO) -> AudioInfo:
    """Read sample rate, frame count and channels from the header only."""
    try:
        info = sf.info(src)
    except Exception as e:  # soundfile raises RuntimeError/LibsndfileError/TypeError for bad input
        name = src if isinstance(src, str) else getattr(src, "name", "<bytes>")
        raise AudioError(f"{name}: cannot read audio header ({_short(e)})") from e
    if info.frames <= 0 and info.format not in ("OGG", "MPEG"):
        name = src if isinstance(src, str) else getattr(src, "name", "<bytes>")
        raise AudioError(f"{name}: audio header reports {info.frames} frames")
    return AudioInfo(sample_rate=int(info.samplerate), frames=int(info.frames), channels=int(info.channels),
                     format=str(info.format))


def decode(data: bytes, mono: bool = True) -> tuple[np.ndarray, int]:
    """Decode encoded audio bytes to float32 ``[T]`` (mono, channels averaged) or ``[T, C]``."""
    try:
        wav, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:
        wav, sr = _decode_torchaudio(data, e)
    if mono:
        wav = wav[:, 0] if wav.shape[1] == 1 else wav.mean(axis=1)
    return np.ascontiguousarray(wav, dtype=np.float32), int(sr)


def _decode_torchaudio(data: bytes, first_error: Exception) -> tuple[np.ndarray, int]:
    try:
        import torchaudio  # optional

        t, sr = torchaudio.load(io.BytesIO(data))
        return t.numpy().T.astype(np.float32), int(sr)
    except Exception:
        raise AudioError(f"cannot decode audio ({_short(first_error)})") from first_error


def _short(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return msg[-1] if msg else type(e).__name__
