"""Measuring records: every sample's length, before anything is written.

Audio lengths come from the file's header (never by decoding), probed in worker processes; text lengths are
token counts. Bad files become :class:`InputProblem` s, so one run reports every bad input at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import re
import sys
from typing import Sequence

from tqdm import tqdm

from ..dataset import storage
from ..dataset.audio import AudioError, probe
from ..errors import InputProblem, ShardifyError
from .sources import Record, token_length
from .tarwrite import Sample, audio_sample, text_sample

UNITS = ("samples", "seconds", "tokens")


def check_unit(kind: str, unit: str | None, sample_rate: int | None) -> str:
    """The dataset's length unit: ``samples`` (audio default), ``seconds``, or ``tokens`` (text)."""
    text = kind == "text"
    unit = unit or ("tokens" if text else "samples")
    if unit not in UNITS:
        raise ShardifyError(f"unknown unit {unit!r}; choose one of {', '.join(UNITS)}")
    if text and unit != "tokens":
        raise ShardifyError(f"a text source is measured in tokens, not {unit}")
    if not text and unit == "tokens":
        raise ShardifyError("an audio source is measured in samples or seconds, not tokens")
    if sample_rate is not None and (text or int(sample_rate) <= 0):
        raise ShardifyError("--sample-rate needs an audio source and a positive rate")
    return unit


def probe_file(path: str, storage_options: dict | None = None) -> tuple[int, int, int] | str:
    """``(sample_rate, frames, bytes)`` of an audio file from its header only, or what is wrong with it."""
    try:
        with storage.open_url(path, "rb", storage_options) as f:
            nbytes = os.fstat(f.fileno()).st_size if storage.is_local(path) else storage.size(path, storage_options)
            if nbytes == 0:
                return "empty audio file (0 bytes)"
            info = probe(f)
    except FileNotFoundError:
        return "audio file not found"
    except IsADirectoryError:
        return "audio path is a folder"
    except OSError as e:
        return f"cannot read audio file ({e.strerror or e})"
    except AudioError as e:
        msg = (str(e.__cause__ or e).strip().splitlines() or ["?"])[-1]
        msg = re.sub(r"^Error opening <.*?>: ", "", msg)
        if "header reports" in msg:
            return "audio file has no frames"
        return f"not readable audio ({msg.rstrip('.')})"
    if info.frames <= 0:
        return "audio file has no frames"
    return info.sample_rate, info.frames, nbytes


def _probe_one(args: tuple[str, dict | None]) -> tuple[int, int, int] | str:
    return probe_file(*args)


def process_pool(workers: int, remote: bool) -> cf.ProcessPoolExecutor:
    """Worker processes for probing and writing; fresh (spawned) ones when they do remote I/O."""
    # fsspec object-store filesystems are not fork-safe: start fresh processes for remote I/O
    ctx = multiprocessing.get_context("spawn") if remote else None
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def probe_records(
    records: Sequence[Record], workers: int = 1, progress: bool = True, storage_options: dict | None = None
) -> list[tuple[int, int, int] | str]:
    """Probe every record's audio header (in ``workers`` processes); results in record order."""
    args = [(r.path, storage_options) for r in records]
    bar = tqdm(total=len(args), desc="probing", unit="file", file=sys.stderr, disable=None if progress else True)
    try:
        if workers <= 1 or len(args) < 2:
            results = []
            for a in args:
                results.append(_probe_one(a))
                bar.update()
            return results
        remote = any(not storage.is_local(r.path) for r in records)
        with process_pool(workers, remote) as ex:
            results = []
            for res in ex.map(_probe_one, args, chunksize=max(1, min(256, len(args) // (workers * 8)))):
                results.append(res)
                bar.update()
            return results
    finally:
        bar.close()


def _resampled(frames: int, sr: int, target: int) -> int:
    """``round(frames * target / sr)`` in exact integer arithmetic (halves round up)."""
    return frames if sr == target else (2 * frames * target + sr) // (2 * sr)


def measure(
    records: Sequence[Record], kind: str, unit: str, sample_rate: int | None = None, workers: int = 1,
    progress: bool = True, storage_options: dict | None = None, on_error: str = "fail",
) -> tuple[list[Sample], list[InputProblem], int | None]:
    """Lengths and tar members of every record: ``(samples, problems, index sample rate)``.

    Audio lengths come from the header (frames at the file's rate, resampled to ``sample_rate`` when
    given); mixed rates in ``samples`` without ``sample_rate`` raise ``ShardifyError`` naming two files.
    """
    if kind == "text":
        return (*_measure_text(records), None)
    probed, problems = _probe_audio(records, workers, progress, storage_options)
    if problems and on_error == "fail":
        return [], problems, None
    index_rate = _index_rate(probed, unit, sample_rate)
    samples = _audio_samples(probed, unit, index_rate, problems)
    return samples, problems, index_rate


def _measure_text(records: Sequence[Record]) -> tuple[list[Sample], list[InputProblem]]:
    samples: list[Sample] = []
    problems: list[InputProblem] = []
    for rec in records:
        n = token_length(rec)
        if n <= 0:
            problems.append(rec.problem("empty text (0 tokens)"))
        else:
            samples.append(text_sample(rec, n))
    return samples, problems


_Probed = tuple[Record, int, int, int]  # record, sample rate, frames, bytes


def _probe_audio(
    records: Sequence[Record], workers: int, progress: bool, storage_options: dict | None
) -> tuple[list[_Probed], list[InputProblem]]:
    """Each readable record with its header's rate, frames and size; a problem for each other one."""
    probed: list[_Probed] = []
    problems: list[InputProblem] = []
    for rec, res in zip(records, probe_records(records, workers, progress, storage_options)):
        if isinstance(res, str):  # name the audio file unless the problem is reported at it already
            problems.append(rec.problem(res if rec.where == rec.path else f"{res}: {rec.path}"))
        else:
            probed.append((rec, *res))
    return probed, problems


def _index_rate(probed: Sequence[_Probed], unit: str, sample_rate: int | None) -> int | None:
    """The index's sample rate: ``sample_rate`` if given, else the one rate found (mixed rates are an error
    when lengths are counted in samples)."""
    first_at: dict[int, str] = {}
    for rec, sr, _, _ in probed:
        first_at.setdefault(sr, rec.path if rec.where == rec.path else f"{rec.path} ({rec.where})")
    rates = sorted(first_at)
    if sample_rate is None and len(rates) > 1 and unit == "samples":
        (a, b) = rates[:2]
        raise ShardifyError(
            f"mixed sample rates: {first_at[a]} is {a} Hz but {first_at[b]} is {b} Hz "
            f"(rates found: {', '.join(map(str, rates))}); pass --sample-rate R to count lengths in samples at R"
        )
    return int(sample_rate) if sample_rate else (rates[0] if len(rates) == 1 else None)


def _audio_samples(
    probed: Sequence[_Probed], unit: str, index_rate: int | None, problems: list[InputProblem]
) -> list[Sample]:
    """The probed records as samples; one that is 0 samples long at ``index_rate`` goes to ``problems``."""
    samples: list[Sample] = []
    for rec, sr, frames, nbytes in probed:
        if unit == "samples":
            length: int | float = _resampled(frames, sr, index_rate)
            if length <= 0:
                problems.append(rec.problem(f"{frames} frames at {sr} Hz is 0 samples at {index_rate} Hz"))
                continue
        else:
            length = frames / sr
        samples.append(audio_sample(rec, length, sr, frames, nbytes))
    return samples
