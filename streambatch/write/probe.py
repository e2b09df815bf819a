"""Measuring records: every sample's length, before anything is written.

Audio lengths come from the file's header (never by decoding the whole file), probed in worker processes; text
lengths are token counts. Lengths that lie are caught here: a file cut short (its last block is decoded after a
seek) and a manifest duration that disagrees with the header. Bad files become `InputProblem` s, so
one run reports every bad input at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import wait as wait_for
from typing import IO, Any, Literal, TypeVar

from tqdm import tqdm

from ..errors import InputProblem, OptionError, ShardifyError, int_option, os_problem, shown
from ..format.audio import AUDIO_EXTENSIONS, AudioError, TruncatedAudio, probe
from ..interrupts import Interrupter
from ..io import storage
from ..procs import die_with_parent
from ..units import Unit
from .records import LENGTH_FIELDS, Record
from .segments import as_segment
from .sources import token_length
from .spill import SpillList
from .tarwrite import Sample, audio_sample, text_sample

T = TypeVar("T")
#: the units a written dataset's lengths may count
UNITS = (Unit.SAMPLES, Unit.SECONDS, Unit.TOKENS)


def check_unit(kind: str, unit: Unit | str | None, sample_rate: int | None) -> Unit:
    """The dataset's length unit: ``samples`` (audio default), ``seconds``, or ``tokens`` (text)."""
    text = kind == "text"
    if sample_rate is not None:
        int_option("sample_rate", sample_rate, 1, MAX_SAMPLE_RATE)
    unit = Unit.parse((Unit.TOKENS if text else Unit.SAMPLES) if unit is None else unit, UNITS)
    if text and unit is not Unit.TOKENS:
        raise ShardifyError(f"a text source is measured in tokens, not {unit}")
    if not text and unit is Unit.TOKENS:
        raise ShardifyError("an audio source is measured in samples or seconds, not tokens")
    if sample_rate is not None and text:
        raise ShardifyError("--sample-rate needs an audio source and a positive rate")
    return unit


#: the highest ``sample_rate`` (Hz) a write or an index of existing tars takes
MAX_SAMPLE_RATE = 2**31 - 1


def check_storage_options(storage_options: Any) -> dict | None:
    """``storage_options`` once it is None or a mapping (fsspec's options for a remote URL), else an
    `OptionError`: checked for every OUT, local ones too, before anything is read."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise OptionError(f"storage_options must be None or a dict of fsspec options, got {shown(storage_options)}")
    return None if storage_options is None else dict(storage_options)


@contextlib.contextmanager
def _opened(path: Any, storage_options: dict | None) -> Iterator[tuple[IO[bytes], int]]:
    """The audio open for reading, and its size: a file (path or URL), or a source's blob (``read()``)."""
    if not isinstance(path, str):
        data = path.read()
        yield io.BytesIO(data), len(data)
        return
    with storage.open_url(path, "rb", storage_options) as f:
        yield f, os.fstat(f.fileno()).st_size if storage.is_local(path) else storage.size(path, storage_options)


def probe_file(path: Any, storage_options: dict | None = None) -> tuple[int, int, int] | str:
    """``(sample_rate, frames, bytes)`` of an audio file (or a source's audio blob) from its header, or what is
    wrong with it (the end of the audio is decoded too, so a file cut short is a problem here, not a bad shard
    in training)."""
    try:
        with _opened(path, storage_options) as (f, nbytes):
            if nbytes == 0:
                return "empty audio file (0 bytes)"
            info = probe(f, check_end=True)
    except FileNotFoundError:
        return "audio file not found"
    except IsADirectoryError:
        return "audio path is a folder"
    except OSError as e:
        return f"cannot read audio file ({os_problem(e)})"
    except TruncatedAudio as e:
        return str(e)
    except AudioError as e:
        msg = (str(e.__cause__ or e).strip().splitlines() or ["?"])[-1]
        msg = re.sub(r"^Error opening <.*?>: ", "", msg)
        if "header reports" in msg:
            return "audio file has no frames"
        return f"not readable audio ({msg.rstrip('.')})"
    if info.frames <= 0:
        return "audio file has no frames"
    return info.sample_rate, info.frames, nbytes


def _probe_one(args: tuple[Any, dict | None]) -> tuple[int, int, int] | str:
    return probe_file(*args)


#: the most worker processes a write or an index of existing tars starts (each holds a pool slot and its pipes)
MAX_WORKERS = 1024


#: seconds the workers of an interrupted pool get to unwind the task they run (its ``finally`` blocks remove what it
#: half wrote) before they are killed
STOP_GRACE = 2.0
#: the signals a worker leaves to the process that started it (blocked while it starts: see `Pool.submit()`)
_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
#: a worker's state: running a task, and told to stop
_WORKER = {"busy": False, "stopped": False}
#: a worker's SIGTERM, raised where its task can unwind it (never inside a callback from C: soundfile's I/O)
_INTERRUPT = Interrupter()


def process_pool(workers: int, remote: bool) -> Pool:
    """Worker processes for probing and writing; fresh (spawned) ones when they do remote I/O. They end when
    this process dies, even by SIGKILL (no stranded worker holding a caller's pipes), and leave interrupts to it:
    see `Pool`."""
    # fsspec object-store filesystems are not fork-safe: start fresh processes for remote I/O
    ctx = multiprocessing.get_context("spawn") if remote else None
    return Pool(max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),))


class Pool(cf.ProcessPoolExecutor):
    """A process pool whose workers ignore SIGINT (a terminal sends Ctrl-C to the whole process group: the parent
    decides) and stop on SIGTERM. Leaving its ``with`` block on an interrupt (KeyboardInterrupt, SystemExit: any
    exception that is not an ``Exception``) cancels the tasks not started and stops the workers without waiting
    for their tasks (`stop()`); on an error it cancels the tasks not started and waits for the running ones."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future[T]:
        # a worker is forked here: it starts with the stop signals blocked (so that none kills it with a traceback
        # before its initializer has set its own handlers); a signal meanwhile waits here for the unblock
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            return super().submit(_in_worker, fn, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None or issubclass(exc_type, Exception):
            self.shutdown(wait=True, cancel_futures=exc_type is not None)
        else:
            self.stop()
        return False

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Cancel the tasks not started and end the workers: SIGTERM (a worker unwinds its task, removing what it
        half wrote, and exits), SIGKILL for those still running after ``grace`` seconds; never waits longer."""
        procs = list((self._processes or {}).values())
        self.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        left, deadline = procs, time.monotonic() + grace
        while left and (timeout := deadline - time.monotonic()) > 0:
            ended = wait_for([p.sentinel for p in left], timeout)
            left = [p for p in left if p.sentinel not in ended]
        for p in left:
            p.kill()
        wait_for([p.sentinel for p in left], grace)


def _worker_init(parent: int) -> None:
    """A pool worker's initializer: end with ``parent`` (`die_with_parent()`), ignore
    SIGINT, and stop on SIGTERM (`_stop_worker()`)."""
    die_with_parent(parent)
    _INTERRUPT.arm()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _stop_worker(signum: int, frame: Any) -> None:
    """A worker's SIGTERM: interrupt the task it runs (its cleanup runs, then `_in_worker()` exits) as soon
    as the code it is in can unwind (not inside soundfile's callbacks from C, where the exception would be printed
    and lost), or exit at once when idle; quietly either way."""
    if _WORKER["stopped"] and not _INTERRUPT.pending:
        return  # told again (the pool terminates the others once one has exited): the task is unwinding already
    _WORKER["stopped"] = True
    if not _WORKER["busy"]:
        os._exit(128 + signum)
    _INTERRUPT.interrupt(signum, frame)  # KeyboardInterrupt, as Ctrl-C in a single process


def _in_worker(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run one task in a worker; exit once it has unwound if the worker was told to stop meanwhile."""
    _WORKER["busy"] = True
    try:
        return fn(*args, **kwargs)
    finally:
        _WORKER["busy"] = False
        if _WORKER["stopped"]:
            os._exit(128 + signal.SIGTERM)


def probe_records(
    records: Sequence[Record], workers: int = 1, progress: bool = True, storage_options: dict | None = None
) -> Iterator[tuple[int, int, int] | str]:
    """Probe every record's audio header (in ``workers`` processes); results in record order, each as soon as it
    is in (one process holds no list of them all)."""
    args = ((r.path if r.audio is None else r.audio, storage_options) for r in records)
    bar = tqdm(total=len(records), desc="probing", unit="file", file=sys.stderr, disable=None if progress else True)
    try:
        if workers <= 1 or len(records) < 2:
            for a in args:
                yield _probe_one(a)
                bar.update()
            return
        remote = any(r.path and not storage.is_local(r.path) for r in records)
        with process_pool(workers, remote) as ex:
            for res in ex.map(_probe_one, args, chunksize=max(1, min(256, len(records) // (workers * 8)))):
                yield res
                bar.update()
    finally:
        bar.close()


def measure(
    records: Sequence[Record],
    kind: str,
    unit: Unit | str,
    sample_rate: int | None = None,
    workers: int = 1,
    progress: bool = True,
    storage_options: dict | None = None,
    on_error: str = "fail",
) -> tuple[Sequence[Sample], list[InputProblem], int | None]:
    """Lengths and tar members of every record: ``(samples, problems, index sample rate)``.

    Audio lengths come from the header (frames at the file's rate, resampled to ``sample_rate`` when
    given, the rate the loader then emits and each ``.json`` reports); mixed rates in ``samples`` without
    ``sample_rate`` raise ``ShardifyError`` naming two files.
    """
    return measured(probe_slice(records, kind, workers, progress, storage_options), kind, unit, sample_rate, on_error)


#: what `probe_slice()` found: text samples, or audio records with their header's rate, frames and size; and
#: a problem for each record it could not use. Slices of a record list probed apart concatenate in order.
Probed = tuple[Sequence[Any], list[InputProblem]]


def probe_slice(
    records: Sequence[Record], kind: str, workers: int = 1, progress: bool = True, storage_options: dict | None = None
) -> Probed:
    """The per-record half of `measure()` (headers read, tokens counted): it depends on no other record, so
    an engine may probe slices of the record list apart (`ray_engine`) and join them before `measured()`."""
    if kind == "text":
        return _measure_text(records)
    return _probe_audio(records, workers, progress, storage_options)


def measured(
    probed: Probed, kind: str, unit: Unit | str, sample_rate: int | None, on_error: str
) -> tuple[Sequence[Sample], list[InputProblem], int | None]:
    """The whole-list half of `measure()`: the index's sample rate (one rate for all records) and the
    samples' lengths at it."""
    items, problems = probed
    if kind == "text":
        return items, problems, None
    if problems and on_error == "fail":
        return [], problems, None
    audio_unit = Unit.parse(unit, (Unit.SAMPLES, Unit.SECONDS))
    index_rate = _index_rate(items, audio_unit, sample_rate)
    samples = _audio_samples(items, audio_unit, index_rate, problems)
    return samples, problems, index_rate


def _measure_text(records: Sequence[Record]) -> tuple[SpillList[Sample], list[InputProblem]]:
    samples: SpillList[Sample] = SpillList()
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
) -> tuple[SpillList[_Probed], list[InputProblem]]:
    """Each readable record with its header's rate, frames and size (in a temporary file: `SpillList`); a problem
    for each other one."""
    probed: SpillList[_Probed] = SpillList()
    problems: list[InputProblem] = []
    for rec, res in zip(records, probe_records(records, workers, progress, storage_options)):
        if not isinstance(res, str) and rec.segment is not None:
            res = as_segment(rec, res, storage_options)  # segments.py: its own frames and WAV member
        elif not isinstance(res, str):
            res = extension_problem(rec) or duration_problem(rec, res[0], res[1]) or res
        if isinstance(res, str):  # name the audio file unless the problem is reported at it already
            problems.append(rec.problem(res if rec.where == rec.path or rec.path is None else f"{res}: {rec.path}"))
        else:
            probed.append((rec, *res))
    return probed, problems


def extension_problem(rec: Record) -> str | None:
    """Why the record's audio cannot be stored under its file's extension: the loader finds a sample's audio by
    its member's extension (`AUDIO_EXTENSIONS`), so audio under any other name
    would be written and then stream without its audio."""
    if rec.ext in AUDIO_EXTENSIONS:
        return None
    named = f"extension .{rec.ext}" if rec.ext else "no extension"
    return f"audio file has {named}; name it with its format's extension (.wav, .flac, .mp3, .sph, ...)"


#: a manifest's duration may differ from the audio header's by max(DURATION_TOLERANCE_S, DURATION_TOLERANCE *
#: the header's duration) (rounding, a tool's own idea of a duration); more is an input error
DURATION_TOLERANCE_S = 0.1
DURATION_TOLERANCE = 0.01


def duration_problem(rec: Record, sample_rate: int, frames: int) -> str | None:
    """What is wrong with the record's manifest duration (``duration``, else ``length``, in seconds) against
    the header's ``frames / sample_rate``; None when it agrees, is absent, or (``length``) is the frame count."""
    field = next((f for f in LENGTH_FIELDS if f in rec.fields), None)
    value = rec.fields.get(field) if field else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # no declared duration (a folder) or one sources.py has reported already
    header = frames / sample_rate
    if abs(value - header) <= max(DURATION_TOLERANCE_S, DURATION_TOLERANCE * header):
        return None
    if field == "length" and abs(value - frames) <= DURATION_TOLERANCE * frames:
        return None  # a length counted in samples, not seconds
    unit = " s" if field == "duration" else ""  # a length may be seconds or samples: it matches neither
    return (
        f"the manifest's {field} is {value:g}{unit} but the audio header says {header:.6g} s ({frames} frames "
        f"at {sample_rate} Hz)"
    )


def _index_rate(probed: Sequence[_Probed], unit: Unit, sample_rate: int | None) -> int | None:
    """The index's sample rate: ``sample_rate`` if given, else the one rate found (mixed rates are an error
    when lengths are counted in samples)."""
    first_at: dict[int, str] = {}
    for rec, sr, _, _ in probed:
        first_at.setdefault(sr, rec.where if rec.path is None or rec.where == rec.path else f"{rec.path} ({rec.where})")
    rates = sorted(first_at)
    if sample_rate is None and len(rates) > 1 and unit is Unit.SAMPLES:
        (a, b) = rates[:2]
        raise ShardifyError(
            f"mixed sample rates: {first_at[a]} is {a} Hz but {first_at[b]} is {b} Hz "
            f"(rates found: {', '.join(map(str, rates))}); pass --sample-rate R to count lengths in samples at R"
        )
    return int(sample_rate) if sample_rate else (rates[0] if len(rates) == 1 else None)


def _audio_samples(
    probed: Sequence[_Probed], unit: Unit, index_rate: int | None, problems: list[InputProblem]
) -> SpillList[Sample]:
    """The probed records as samples (in a temporary file: `SpillList`); one that is 0 samples long at
    ``index_rate`` goes to ``problems``."""
    samples: SpillList[Sample] = SpillList()
    for rec, sr, frames, nbytes in probed:
        length = unit.audio_length(frames, sr, index_rate)
        if unit is Unit.SAMPLES and length <= 0:
            problems.append(rec.problem(f"{frames} frames at {sr} Hz is 0 samples at {index_rate} Hz"))
            continue
        rate = index_rate if unit is Unit.SAMPLES and index_rate else sr  # the rate the loader emits it at
        samples.append(audio_sample(rec, length, sr, frames, nbytes, rate))
    return samples
