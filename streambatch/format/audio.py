"""Audio: probe lengths from headers (decoding only an MP3, whose header estimates its length) and decode bytes to
float32 waveforms.

soundfile (libsndfile) is the default: it reads every format in `AUDIO_EXTENSIONS` (WAV, FLAC, Ogg
Vorbis/Opus, MP3, SPHERE, AIFF, AU, W64, ...) from paths and from bytes, telling the format from the bytes, not the
name. torchaudio is used only as a fallback for audio soundfile cannot decode, and only when it imports (its releases
pin torch exactly, so it stays optional).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import soundfile as sf

from ..errors import AudioError, TruncatedAudio

#: file extensions of the formats libsndfile reads, by its format name (``soundfile.available_formats()``). Left
#: out: RAW (no header: nothing tells its rate or length), and MAT4/MAT5, HTK, XI, SDS and MPC2K, whose extensions
#: (``.mat``, ``.htk``, ...) far more often hold other data (features, matrices) than audio.
FORMAT_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "FLAC": ("flac",),
    "WAV": ("wav", "wave"),
    "OGG": ("ogg", "opus", "oga"),
    "MP3": ("mp3",),
    "NIST": ("sph", "nist"),
    "AIFF": ("aiff", "aif", "aifc"),
    "AU": ("au", "snd"),
    "W64": ("w64",),
    "RF64": ("rf64",),
    "CAF": ("caf",),
    "IRCAM": ("ircam",),
    "VOC": ("voc",),
    "AVR": ("avr",),
    "PAF": ("paf",),
    "PVF": ("pvf",),
    "SD2": ("sd2",),
    "SVX": ("8svx", "svx"),
    "WVE": ("wve",),
}
_ALWAYS = ("FLAC", "WAV", "OGG", "MP3")  # read by torchaudio when this libsndfile lacks them


def _audio_extensions() -> tuple[str, ...]:
    readable = set(sf.available_formats())
    return tuple(e for fmt, exts in FORMAT_EXTENSIONS.items() if fmt in readable or fmt in _ALWAYS for e in exts)


#: extensions of the audio members and files streambatch reads (writes as they are, decodes when streaming)
AUDIO_EXTENSIONS = _audio_extensions()
#: formats whose header states an estimate of the frame count: they are decoded to count the frames
ESTIMATED_LENGTH_FORMATS = ("MP3", "MPEG")
#: lossy codecs (soundfile subtypes) whose frame count a container states from its own bookkeeping (a WAV's
#: ``fact`` chunk or data size), not from the decoded stream: MP3 data in a WAV (``WAVE_FORMAT_MPEGLAYER3``),
#: GSM 6.10, ADPCM and G.72x. Files of these subtypes are decoded to count the frames, whatever the container. Ogg
#: Vorbis and Opus are not listed: their frame count is the last page's granule position, exact.
ESTIMATED_LENGTH_SUBTYPES = (
    "MPEG_LAYER_I",
    "MPEG_LAYER_II",
    "MPEG_LAYER_III",
    "GSM610",
    "IMA_ADPCM",
    "MS_ADPCM",
    "VOX_ADPCM",
    "G721_32",
    "G723_24",
    "G723_40",
    "NMS_ADPCM_16",
    "NMS_ADPCM_24",
    "NMS_ADPCM_32",
)
#: how many fewer frames than its header's estimate an MP3 may decode to (encoder delay and padding, a fraction of
#: an MPEG frame, under two frames of 1152) before it counts as cut short
MP3_SLACK_FRAMES = 2 * 1152


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    frames: int
    channels: int
    format: str

    @property
    def duration(self) -> float:
        return self.frames / float(self.sample_rate)


def probe(src: str | IO[bytes], check_end: bool = False) -> AudioInfo:
    """Read sample rate, frame count and channels from the header; the frame count is the number of frames that
    decode (what the loader emits). For a format whose header only estimates it (MP3:
    `ESTIMATED_LENGTH_FORMATS`) or a lossy codec in any container (`ESTIMATED_LENGTH_SUBTYPES`: MP3 data
    in a WAV, GSM 6.10, ADPCM) the file is decoded to count them (a decode of the whole file).

    ``check_end=True`` also checks that the audio the header declares is there (a cheap look at the file's
    end, not a decode of the whole file), so a truncated file raises `TruncatedAudio` here rather than
    failing later, in training.
    """
    name = src if isinstance(src, str) else getattr(src, "name", "<bytes>")
    try:
        with sf.SoundFile(src) as f:
            info = AudioInfo(
                sample_rate=int(f.samplerate), frames=int(f.frames), channels=int(f.channels), format=str(f.format)
            )
            if estimated_length(f):
                info = _decoded_length(f, info, check_end)
            elif check_end:
                _check_end(f, info)
    except AudioError:
        raise
    except Exception as e:  # soundfile raises RuntimeError/LibsndfileError/TypeError for bad input
        raise AudioError(f"{name}: cannot read audio header ({_short(e)})") from e
    if info.frames <= 0 and info.format != "OGG":
        raise AudioError(f"{name}: audio header reports {info.frames} frames")
    return info


def estimated_length(f: sf.SoundFile) -> bool:
    """Whether an open file's frame count is its container's estimate, not the frames that decode (its format or
    its codec: `ESTIMATED_LENGTH_FORMATS`, `ESTIMATED_LENGTH_SUBTYPES`)."""
    return f.format in ESTIMATED_LENGTH_FORMATS or f.subtype in ESTIMATED_LENGTH_SUBTYPES


def read_stretch(f: sf.SoundFile, first: int, frames: int, **kw: Any) -> np.ndarray:
    """``frames`` frames (-1: to the end) of an open file from frame ``first``: after a seek where the codec can
    seek, else read forward and dropped, a block at a time (GSM 6.10, G.72x: libsndfile cannot seek in them)."""
    if first and f.seekable():
        f.seek(first)
    elif first:
        skip = np.empty((min(first, 65536), f.channels), dtype=np.float32)
        left = first
        while left > 0:
            got = len(f.read(min(left, len(skip)), dtype="float32", always_2d=True, out=skip[: min(left, len(skip))]))
            if not got:
                break
            left -= got
    if frames < 0 and not f.seekable():  # soundfile needs a count where it cannot tell what is left
        blocks = []
        while len(got := f.read(65536, **kw)):
            blocks.append(got)
        return np.concatenate(blocks) if blocks else f.read(0, **kw)
    return f.read(frames, **kw)


#: how much audio at the end of a file ``probe(check_end=True)`` decodes, in seconds
END_CHECK_SECONDS = 0.02
_DATA_SIZE = re.compile(r"^(?:data|SSND)\s*:\s*(\d+)(?:\s*\(should be (\d+)\))?", re.M)
_BLOCK_ALIGN = re.compile(r"Block Align\s*:\s*(\d+)")
_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # a header written before the size was known (streamed WAV): not a cut


def _check_end(f: sf.SoundFile, info: AudioInfo) -> None:
    """Raise `TruncatedAudio` unless the audio the header declares is there. Cheap: a WAV/AIFF's data size
    against the file's (libsndfile's log); any other format's last ``END_CHECK_SECONDS`` decoded after a seek."""
    if _data_size_checked(f.extra_info, info) or info.frames <= 0 or not f.seekable():
        return
    n = min(info.frames, max(1, int(info.sample_rate * END_CHECK_SECONDS)))
    try:
        f.seek(info.frames - n)
        got = len(f.read(n, dtype="float32"))
    except Exception as e:
        raise TruncatedAudio(
            f"audio data ends early or is corrupt: cannot decode its last {n} frames of the "
            f"{info.frames}{_secs(info.frames, info)} the header declares ({_short(e)})"
        ) from e
    if got < n:
        raise TruncatedAudio(
            f"audio data ends early: {got} of its last {n} frames decode, of the "
            f"{info.frames}{_secs(info.frames, info)} the header declares"
        )


def _decoded_length(f: sf.SoundFile, header: AudioInfo, check_end: bool) -> AudioInfo:
    """``header`` with the frames that decode (read block by block into one buffer: bounded memory). With
    ``check_end``, fewer than the header's estimate less `MP3_SLACK_FRAMES` is a file cut short."""
    block = np.empty((min(65536, max(header.frames, 1)), header.channels), dtype=np.float32)
    frames = 0
    try:
        while got := len(f.read(len(block), dtype="float32", always_2d=True, out=block)):
            frames += got
    except Exception as e:  # noqa: BLE001 - libsndfile's decoder gave up (corrupt data)
        raise TruncatedAudio(
            f"audio data ends early or is corrupt: decoding stops after {frames}{_secs(frames, header)} of the "
            f"{header.frames}{_secs(header.frames, header)} frames the header declares ({_short(e)})"
        ) from e
    if check_end and frames < header.frames - MP3_SLACK_FRAMES:
        raise TruncatedAudio(
            f"audio data ends early: {frames}{_secs(frames, header)} of the {header.frames}"
            f"{_secs(header.frames, header)} frames the header declares decode"
        )
    return AudioInfo(header.sample_rate, frames, header.channels, header.format)


def _data_size_checked(log: str, info: AudioInfo) -> bool:
    """False for a format without a data size (FLAC, OGG, MP3); True for a WAV/AIFF whose data is all there.
    Raises for one whose data is shorter than its header says: libsndfile then reads what is there (a 2 ms
    sample from a 10 s header) and notes ``data : N (should be M)`` in its log."""
    size = _DATA_SIZE.search(log)
    if not size:
        return False
    declared, held = int(size.group(1)), int(size.group(2) or size.group(1))
    if declared in _UNKNOWN_SIZES or declared <= held:
        return True
    align = _BLOCK_ALIGN.search(log)
    step = int(align.group(1)) if align else 0
    if step <= 0:
        raise TruncatedAudio(
            f"audio data cut short: the header declares {declared} bytes of audio data, the file holds {held}"
        )
    if declared // step > held // step:
        raise TruncatedAudio(
            f"audio data cut short: the header declares {declared // step} frames"
            f"{_secs(declared // step, info)}, the file holds {held // step}"
            f"{_secs(held // step, info)}"
        )
    return True


def _secs(frames: int, info: AudioInfo) -> str:
    return f" ({frames / info.sample_rate:.6g} s)"


def decode(data: bytes, mono: bool = True, segment: tuple[int, int] | None = None) -> tuple[np.ndarray, int]:
    """Decode encoded audio bytes to float32 ``[T]`` (mono, channels averaged) or ``[T, C]``; ``segment``
    ``(first frame, frames)``: only that stretch (a segment of a recording), as soundfile decodes it after a seek."""
    first, frames = segment if segment is not None else (0, -1)
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            wav, sr = read_stretch(f, first, frames, dtype="float32", always_2d=True), f.samplerate
    except Exception as e:
        wav, sr = _decode_torchaudio(data, e)
        wav = wav[first:] if frames < 0 else wav[first : first + frames]
    if mono:
        wav = wav[:, 0] if wav.shape[1] == 1 else wav.mean(axis=1)
    return np.ascontiguousarray(wav, dtype=np.float32), int(sr)


class Clips:
    """Encoded mono clips opened for decoding straight into the rows of one array (the padded batch): no array
    per clip, no copy. `open_clips()` gives None where that cannot be done; `decode()` then decodes
    them one by one (and says what is wrong with a bad one)."""

    def __init__(self, files: list[sf.SoundFile], frames: list[int] | None = None):
        self.files = files
        self.frames = frames or [int(f.frames) for f in files]  # as the headers (or the segments) state them
        self.rates = [int(f.samplerate) for f in files]

    def decode_into(self, out: np.ndarray) -> list[int]:
        """Decode clip ``i`` into ``out[i, :frames]``, zero the rest of the row; the frames each one gave."""
        lengths = []
        for row, f, n in zip(out, self.files, self.frames):
            got = len(f.read(n, dtype="float32", out=row[:n]))
            row[got:] = 0
            lengths.append(got)
        return lengths

    def close(self) -> None:
        for f in self.files:
            f.close()


def open_clips(
    payloads: list[bytes], sample_rate: int | None = None, segments: list[tuple[int, int] | None] | None = None
) -> Clips | None:
    """`Clips` over encoded clips (``segments``: the ``(first frame, frames)`` stretch of each, None: all
    of it), or None when one is not mono, has another rate than ``sample_rate``, does not state its exact length
    (MP3) or cannot be opened."""
    files: list[sf.SoundFile] = []
    frames: list[int] = []
    try:
        for data, segment in zip(payloads, segments or [None] * len(payloads)):
            f = sf.SoundFile(io.BytesIO(data), "r")
            files.append(f)
            if f.channels != 1 or f.frames <= 0 or (sample_rate and f.samplerate != sample_rate):
                break
            if estimated_length(f) or not f.seekable():  # its header's frame count is not what decodes
                break
            if segment is not None:
                f.seek(segment[0])
            frames.append(int(f.frames) if segment is None else segment[1])
        else:
            return Clips(files, frames)
    except Exception:  # noqa: BLE001 - decoded one by one, which raises the clear error
        pass
    for f in files:
        f.close()
    return None


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
