"""``shardify write``: a source → length-annotated WebDataset shards plus ``index.json``.

The pipeline, each stage a plain function: read the source (``sources.py``), measure every record
(``probe.py``), plan which samples go in which shard before writing (``tarwrite.py``: the output is the same
for any ``workers``), write the shards in worker processes (each appears whole or not at all), and the index
last. Until its shard is written, each record and sample waits in an unnamed temporary file (``spill.py``): memory
holds a few numbers per line and the index being built. Parts, ``--resume`` and what OUT may hold are in
``parts.py``; ``verify.py`` checks the result.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import (
    InputErrors,
    InputProblem,
    OptionError,
    OutputError,
    ShardifyError,
    bool_option,
    int_option,
    path_option,
    shown,
)
from ..format.columns import ColumnError, arrow_column, bounded, choose_columns, column_values, parse_columns
from ..format.index import ShardIndex, ShardInfo
from ..io import storage
from ..io.lock import holds_lock
from ..units import Unit, parse_bytes
from .aside import recover_replaced, replacing
from .engines import Engine
from .parts import Scope, check_out, parse_part, part_range, prepare_resume, utc_now, write_errors
from .probe import MAX_SAMPLE_RATE, MAX_WORKERS, check_storage_options, check_unit, measured, probe_slice, process_pool
from .rerun import complete_before
from .sources import KINDS, Record, detect_kind, read_source, source_medium
from .spill import SpillList
from .tarwrite import Sample, ShardTask, existing_shard, plan_shards, write_shard
from .tokenize import TextOptions

DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_SIZE = "1G"


def parse_size(size: int | str) -> int:
    """Bytes from ``123456``, ``"500M"``, ``"2G"``, ``"1.5GiB"`` (K, M, G, T are powers of 1024); positive."""
    try:
        n = parse_bytes(int(size) if isinstance(size, np.integer) else size, "size")
    except ValueError as e:
        raise ShardifyError(str(e)) from None
    if not n or n <= 0:
        raise ShardifyError(f"size must be positive, got {size!r}")
    return n


# ---- the whole pipeline ------------------------------------------------------------------------
#: what ``src`` and ``out`` must be, as their errors say
SRC_IS = "a source file, folder or URL (text or a path)"
OUT_IS = "the dataset's folder or URL (text or a path)"


def _output(a: Any) -> Any:
    """The folder ``write_shards`` holds the lock of (`lock`): OUT, whole or for its part; SRC, OUT,
    ``storage_options`` and ``progress`` are checked first, so that a bad one names itself before OUT is touched."""
    _, out, storage_options = _checked_places(*(a.arguments[k] for k in ("src", "out", "storage_options", "progress")))
    return out, parse_part(a.arguments["part"]), storage_options


def _checked_places(src: Any, out: Any, storage_options: Any, progress: Any) -> tuple[str, str, dict | None]:
    """SRC and OUT as text (paths or URLs; OUT without a trailing slash) and the ``storage_options`` (None or a
    mapping), with ``progress`` checked too: each bad one an `OptionError` naming it."""
    bool_option("progress", progress)
    src, out = path_option("src", src, SRC_IS), path_option("out", out, OUT_IS).rstrip("/") or "/"
    return src, out, check_storage_options(storage_options)


@holds_lock(_output)
def write_shards(
    src: str,
    out: str,
    *,
    kind: str | None = None,
    unit: Unit | str | None = None,
    sample_rate: int | None = None,
    data_root: str | None = None,
    max_count: int = DEFAULT_MAX_COUNT,
    max_size: int | str = DEFAULT_MAX_SIZE,
    shuffle: bool = False,
    seed: int = 0,
    workers: int = 1,
    on_error: str = "fail",
    overwrite: bool = False,
    resume: bool = False,
    part: str | tuple[int, int] | None = None,
    storage_options: dict | None = None,
    progress: bool = True,
    stats: dict[str, int] | None = None,
    index_version: int = 2,
    tokenizer: str | None = None,
    output_length: str | None = None,
    columns: str | Sequence[str] | None = None,
    engine: Engine | None = None,
) -> ShardIndex:
    """Write ``src`` (any source `read_source()` reads: an audio folder, a NeMo,
    SpeechBrain or lhotse manifest, a Kaldi folder, text JSONL, a Hugging Face dataset) as length-annotated WebDataset
    shards plus ``index.json`` under ``out`` (a folder or fsspec URL).

    Bad input records raise `InputErrors` before anything is written (``on_error="fail"``), or are
    skipped and listed in ``out/errors.jsonl`` (``on_error="skip"``; ``index.meta["skipped"]`` counts them).

    ``part=(i, n)`` (or ``"i/n"``) writes only part i of n (see ``parts.py``) and its ``index.part-IIII.json``;
    `merge_parts()` then writes ``index.json``. ``resume=True`` keeps the complete
    shards a previous (interrupted) run of the same command wrote and writes the rest; this command's complete
    dataset is returned untouched, another's refused (`rerun`). ``overwrite=True`` keeps a local old dataset
    until the new one is complete (`aside`). ``stats`` (if given) receives ``kept`` and ``written`` shard
    counts (and ``complete``: 1 for a dataset found complete and left untouched). ``index_version``: 2 (Parquet
    tables with each sample's key and byte range) or 1 (one JSON file, for older readers). ``tokenizer``: a text
    source's lengths are its tokens (``input_ids`` stored); ``output_length``: ``chars`` or ``tokens:TOKENIZER``,
    each audio sample's transcript length (``tokenize.py``). ``columns``: the ``.json`` fields stored as metadata
    columns of the sample table, for filters (a list or ``"a,b"``; ``""``: none); default: every scalar field but
    the transcript (`columns`). ``engine``: where probing and writing run (`engines`).
    """
    src, out, storage_options = _checked_places(src, out, storage_options, progress)
    _check_options(kind, max_count, workers, on_error, resume, overwrite, index_version, shuffle, seed, sample_rate)
    columns = _checked_columns(columns, stats)
    scope = Scope(part := parse_part(part))
    max_bytes = parse_size(max_size)
    kind = kind or detect_kind(src)
    medium = source_medium(src, kind)
    unit = check_unit(medium, unit, sample_rate)
    text = TextOptions.load(tokenizer, output_length, medium)
    meta = {**_index_meta(src, kind, shuffle, seed, int(max_count), max_bytes, 0), **text.meta()}
    done = _what_out_holds(out, meta, unit, sample_rate, part, overwrite, resume, storage_options)
    if done is not None:  # this command's dataset, complete: nothing left to write
        return _kept_whole(done, stats)
    records: Sequence[Record]
    records, problems = read_source(src, kind, data_root)
    num_records = len(records)
    records, span = _in_write_order(records, shuffle, seed, part)
    records, unusable = text.apply(records)
    samples, more, index_rate = measured(
        (engine.probe if engine else probe_slice)(records, medium, workers, progress, storage_options),
        medium,
        unit,
        sample_rate,
        on_error,
    )  # the probe's list of results is not kept: the samples hold what the write needs of it
    del records  # each sample holds its record: the records' temporary file goes
    problems = _problems_to_report(src, problems, unusable + more, on_error, part, num_records, bool(samples))
    chosen, left_out = _columns(samples, columns, index_version)
    with _replacing(out, scope, overwrite, storage_options):
        tasks = _shard_tasks(samples, int(max_count), max_bytes, scope, out, resume, storage_options)
        del samples  # held by the tasks alone, let go once written: the index has what it needs of them
        infos = _write_tasks(tasks, chosen, int(workers), progress, stats, engine)
        del tasks
        errors_url = storage.join_url(out, scope.errors_name)
        write_errors(errors_url, [p.to_json() for p in problems], storage_options, remove_stale=resume)
        meta = {
            **_index_meta(src, kind, shuffle, seed, int(max_count), max_bytes, len(problems)),
            **text.meta(),
            **_part_meta(part, span, num_records, on_error),
            **({"columns_left_out": len(left_out)} if left_out else {}),
        }
        index = ShardIndex(shards=infos, unit=unit, sample_rate=index_rate, root=out, meta=meta, columns=chosen)
        index.save(storage.join_url(out, scope.index_name), storage_options, version=index_version)
    return index


def _what_out_holds(
    out: str,
    meta: dict[str, Any],
    unit: Unit,
    sample_rate: int | None,
    part: tuple[int, int] | None,
    overwrite: bool,
    resume: bool,
    storage_options: dict | None,
) -> ShardIndex | None:
    """Before the source is read (holding OUT's lock): what an ``--overwrite`` killed in OUT left is recovered
    (`aside`); a ``resume`` returns this command's dataset (or part) when it is there, complete (nothing to
    write), and refuses another command's (`rerun`); OUT is checked for this write (a part's first)."""
    recover_replaced(out, part, overwrite)
    if part is not None:
        check_out(out, overwrite, storage_options, part, resume)
    done = complete_before(out, meta, unit, sample_rate, storage_options, part) if resume else None
    if done is None and part is None:
        check_out(out, overwrite, storage_options, part, resume)
    return done


@contextlib.contextmanager
def _replacing(out: str, scope: Scope, overwrite: bool, storage_options: dict | None) -> Iterator[None]:
    """Run the block that writes the shards and the index. An ``overwrite`` of a local dataset keeps the old one
    aside until the block is done, and puts it back if the block fails (`aside`); otherwise the whole shards
    of a write that runs out of space stay, for ``--resume``."""
    with replacing(out, scope.part, overwrite, storage_options) as aside:
        if aside:
            yield
        else:
            with _shards_kept_when_out_of_space(out, scope, storage_options):
                yield


@contextlib.contextmanager
def _shards_kept_when_out_of_space(out: str, scope: Scope, storage_options: dict | None) -> Iterator[None]:
    """Run the block that writes the shards and the index; an output that does not fit (`OutputError`) also
    says what it leaves: the whole shards written so far stay for ``--resume`` (as after any interrupted write)."""
    try:
        yield
    except OutputError as e:
        kept = [m for m in storage.listdir(out, storage_options) if scope.is_shard(m)]
        if not kept:
            raise
        these = f"the {len(kept)} whole shards" if len(kept) > 1 else "the whole shard"
        raise OutputError(
            f"{e}; {these} written so far stay (no index lists them): make room, then run the same command with "
            "--resume to finish"
        ) from None


def _shard_tasks(
    samples: Sequence[Sample],
    max_count: int,
    max_bytes: int,
    scope: Scope,
    out: str,
    resume: bool,
    storage_options: dict | None,
) -> list[ShardTask]:
    """The shards to write: samples cut into shards by count and size, named for this write (or part), with
    ``out`` made ready for them (stale files of an earlier write removed, a resumed write's kept)."""
    plan = plan_shards(np.fromiter((s.tar_bytes for s in samples), np.int64, len(samples)), max_count, max_bytes)
    names = [scope.shard_name(j) for j in range(len(plan))]
    _prepare_out(out, resume, scope, set(names), storage_options)
    return [
        ShardTask(name, storage.join_url(out, name), samples[a:b], storage_options, resume=resume)
        for name, (a, b) in zip(names, plan)
    ]


def _kept_whole(done: ShardIndex, stats: dict[str, int] | None) -> ShardIndex:
    """A resumed write whose dataset is there, complete (written whole, or merged from parts): every shard kept,
    none written, not a file touched (``stats["complete"]`` says so)."""
    if stats is not None:
        stats.update(kept=done.num_shards, written=0, complete=1)
    return done


def _write_tasks(
    tasks: list[ShardTask],
    chosen: Any,
    workers: int,
    progress: bool,
    stats: dict[str, int] | None,
    engine: Engine | None = None,
) -> list[ShardInfo]:
    """Write the planned shards (here, or on ``engine``) and attach each one's metadata columns (for filters),
    taken from its samples' ``.json`` dicts one shard at a time, as Arrow arrays (a few bytes a value, where a
    list holds a Python object for each)."""
    columns = [_shard_columns(task.samples, chosen) for task in tasks]
    infos = (engine.write if engine else write_planned)(tasks, workers, progress, stats)
    for info, values in zip(infos, columns):
        info.columns = values
    return infos


def _shard_columns(samples: Sequence[Sample], chosen: dict[str, str]) -> dict[str, Any]:
    """One shard's values of each metadata column, ``{name: Arrow array}``."""
    if not chosen:
        return {}
    values = column_values([s.meta for s in samples], chosen)
    return {k: arrow_column(v, chosen[k], len(samples)) for k, v in values.items()}


def _part_meta(part: tuple[int, int] | None, span: Any, num_records: int, on_error: str) -> dict[str, Any]:
    """What a part index records of its part (nothing for a whole write)."""
    if part is None:
        return {}
    return {
        "part": {
            "index": part[0],
            "count": part[1],
            "records": list(span),
            "num_records": num_records,
            "on_error": on_error,
        }
    }


def _columns(
    samples: Sequence[Any], names: str | Sequence[str] | None, index_version: int
) -> tuple[dict[str, str], list[str]]:
    """The metadata columns to store (none in a version 1 index, which has no sample table), and the scalar
    fields the bounded default left out."""
    names = parse_columns(names)
    if index_version == 1:
        if names:
            raise ShardifyError("--columns needs the version 2 index (a version 1 index has no sample table)")
        return {}, []
    try:
        chosen = choose_columns(_Metas(samples), names)
    except ColumnError as e:
        raise ShardifyError(str(e)) from None
    return bounded(chosen) if names is None else (chosen, [])


class _Metas(Sequence[dict[str, Any]]):
    """The samples' ``.json`` dicts, each made when it is read (`Sample.meta`): the column choice reads every
    one once, and a list of them all would hold every sample's dict at once."""

    def __init__(self, samples: Sequence[Any]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: Any) -> Any:  # an index or a slice, as a list's
        if isinstance(i, slice):
            return [s.meta for s in self.samples[i]]
        return self.samples[i].meta

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (s.meta for s in self.samples)


def _check_options(
    kind: str | None,
    max_count: int,
    workers: int,
    on_error: str,
    resume: bool,
    overwrite: bool,
    index_version: int,
    shuffle: bool,
    seed: int,
    sample_rate: int | None,
) -> None:
    """The write's options, each checked before anything is read; a bad one names itself (an
    `OptionError` for a value of the wrong type or range)."""
    whole = isinstance(index_version, (int, np.integer)) and not isinstance(index_version, bool)  # True is no version
    if not whole or index_version not in (1, 2):
        raise OptionError(f"index_version must be 1 or 2, got {shown(index_version)}")
    if on_error not in ("fail", "skip"):
        raise ShardifyError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
    if kind is not None and kind not in KINDS:
        raise ShardifyError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    int_option("max_count", max_count, 1)
    int_option("workers", workers, 1, MAX_WORKERS)
    int_option("seed", seed, 0)
    bool_option("shuffle", shuffle)
    bool_option("resume", resume)
    bool_option("overwrite", overwrite)
    if sample_rate is not None:
        int_option("sample_rate", sample_rate, 1, MAX_SAMPLE_RATE)
    if resume and overwrite:
        raise ShardifyError("--resume keeps what is in OUT and --overwrite replaces it: pass one of them")


def _checked_columns(columns: str | Sequence[str] | None, stats: Any) -> list[str] | None:
    """``columns`` parsed and ``stats`` checked before anything is read, as `_check_options()` does the rest."""
    if stats is not None and not isinstance(stats, dict):
        raise OptionError(f"stats must be a dict the write fills in (or None), got {shown(stats)}")
    return parse_columns(columns)


def _in_write_order(
    records: SpillList[Record], shuffle: bool, seed: int, part: tuple[int, int] | None
) -> tuple[SpillList[Record], tuple[int, int] | None]:
    """The records in write order (shuffled with ``seed``) and, for a part, its slice and where it lies. The
    order is decided on all the records, so that every part of a ``--part`` run slices the same list."""
    if shuffle:
        records = records.take(np.random.default_rng(seed).permutation(len(records)))
    if part is None:
        return records, None
    a, b = part_range(len(records), *part)
    return records[a:b], (a, b)


def _problems_to_report(
    src: str,
    problems: list[InputProblem],
    more: list[InputProblem],
    on_error: str,
    part: tuple[int, int] | None,
    num_records: int,
    any_samples: bool,
) -> list[InputProblem]:
    """The skipped inputs to list in the errors file. Raises when ``on_error="fail"`` found any, or when
    nothing is left to write."""
    if (problems or more) and on_error == "fail":
        raise InputErrors(_sorted(problems + more))
    if part is not None and part[0] != 0:
        problems = []  # problems of the source as a whole are reported (and counted) by part 0 only
    problems = _sorted(problems + more)
    if not any_samples and (part is None or num_records == 0):
        if problems:
            raise InputErrors(problems, "no valid samples left; nothing was written")
        raise ShardifyError(f"{src}: no samples found")
    return problems


def _prepare_out(out: str, resume: bool, scope: Scope, planned: set[str], storage_options: dict | None) -> None:
    """Make OUT ready (what ``overwrite`` replaces is out of the way already: `aside`); with ``resume``,
    only planned shards left to check."""
    storage.makedirs(out, storage_options)
    if resume:
        prepare_resume(out, scope, planned, storage_options)


def _index_meta(
    src: str, kind: str, shuffle: bool, seed: int, max_count: int, max_bytes: int, skipped: int
) -> dict[str, Any]:
    return {
        "source": os.path.abspath(src) if storage.is_local(src) and not src.startswith("hf:") else src,
        "kind": kind,
        "created": utc_now(),
        "streambatch_version": _version(),
        "shuffle": bool(shuffle),
        "seed": int(seed),
        "max_count": max_count,
        "max_size": max_bytes,
        "skipped": skipped,
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("streambatch")
    except Exception:
        return "unknown"


def _sorted(problems: list[InputProblem]) -> list[InputProblem]:
    return sorted(problems, key=lambda p: (p.source, p.line if p.line is not None else 0))


# ---- writing the planned shards ----------------------------------------------------------------
def _write_task(task: ShardTask) -> tuple[ShardInfo, bool]:
    """(info, kept): with ``task.resume``, a complete shard already there is kept, else written."""
    task = dataclasses.replace(task, samples=list(task.samples))  # read back once (`SpillList`), used a few times
    if task.resume:
        info = existing_shard(task)
        if info is not None:
            return info, True
    return write_shard(task), False


def write_planned(
    tasks: Sequence[ShardTask], workers: int = 1, progress: bool = True, stats: dict[str, int] | None = None
) -> list[ShardInfo]:
    """Write the shards (in ``workers`` processes, at most ``2 * workers`` in flight); infos in shard order.

    Tasks with ``resume`` keep a complete shard already written; ``stats`` (if given) gets ``kept`` and
    ``written`` counts."""
    bar = tqdm(
        total=sum(len(t.samples) for t in tasks),
        desc="writing",
        unit="sample",
        file=sys.stderr,
        disable=None if progress else True,
    )
    if stats is not None:
        stats.setdefault("kept", 0)
        stats.setdefault("written", 0)
    infos: dict[int, ShardInfo] = {}

    def finished(i: int, info: ShardInfo, kept: bool) -> None:
        infos[i] = info
        if stats is not None:
            stats["kept" if kept else "written"] += 1
        bar.update(len(tasks[i].samples))

    try:
        if workers <= 1 or len(tasks) < 2:
            for i, t in enumerate(tasks):
                finished(i, *_write_task(t))
        else:
            _write_in_pool(tasks, workers, finished)
    finally:
        bar.close()
    return [infos[i] for i in range(len(tasks))]


def _write_in_pool(tasks: Sequence[ShardTask], workers: int, finished: Callable[[int, ShardInfo, bool], None]) -> None:
    """Run the tasks in ``workers`` processes with at most ``2 * workers`` in flight (their samples' bytes
    stay bounded); a failure cancels the tasks not started."""
    remote = any(not storage.is_local(t.url) for t in tasks) or any(s.remote_path for t in tasks for s in t.samples)
    with process_pool(workers, remote) as ex:
        pending: dict[cf.Future, int] = {}
        try:
            for i, t in enumerate(tasks):
                pending[ex.submit(_write_task, t)] = i
                if len(pending) >= 2 * workers:
                    _collect(pending, finished)
            while pending:
                _collect(pending, finished)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


def _collect(pending: dict[cf.Future, int], finished: Callable[[int, ShardInfo, bool], None]) -> None:
    done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
    for fut in done:
        i = pending.pop(fut)
        finished(i, *fut.result())
