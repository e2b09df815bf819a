"""Filters: ``where="language = 'de' AND snr > 10"``, an SQL expression over the sample table's columns.

`Where` is one SQL expression, checked once against the table's columns (one clear line naming the
bad column or the syntax error, with the columns there are) and then evaluated on Arrow tables of one row
group at a time; nothing is ever passed to Python's ``eval``. Plain comparisons joined by AND, OR and NOT (the
short path, `where_arrow`) are evaluated by Arrow's compute functions in the loader's process, as DuckDB would
answer them. Any other expression goes to DuckDB, with file access disabled: its check and the first pass over
every row group run in a child process whose memory and time are bounded (`where_engine`;
`limits.filter_memory()`, `limits.filter_seconds()`), and only deterministic functions are allowed, so every
rank and worker keeps the same samples.
`SampleFilter` applies it to an index: which samples of a shard it keeps, the kept share of each shard's
length (so shards are dealt by the length they keep), and the kept lengths. The loader's process evaluates the
filter once (by Arrow, or in the engine's child) and keeps the answers as a bit mask (one bit a sample,
`KeepBits`); the DataLoader workers read which samples they keep from that mask, so they never load DuckDB and
fork like the workers of an unfiltered loader.
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import EmptyEpochError, OptionError
from ..format.columnar import ColumnarIndex, column_numpy
from ..format.index import ShardIndex, ShardList
from ..limits import filter_memory, filter_seconds
from ..plan.filter import LeftOut
from ..plan.lengths import Mask
from ..plan.mixing import any_of
from ..stats import LengthStats, stream_stats
from .mixture import AnyIndex, MixedIndex, datasets_of, selection_of
from .where_arrow import ArrowWhere, compile_where
from .where_engine import EngineError, connect, evaluate
from .where_sandbox import Engine

_STRING = re.compile(r"'(?:[^']|'')*'")
_IDENT = re.compile(r'"((?:[^"]|"")+)"|([A-Za-z_][A-Za-z0-9_]*)')


def engine() -> Engine:
    """A filter engine (a child process; use it as a context manager) with today's limits."""
    return Engine(filter_memory(), filter_seconds())


class Where:
    """One filter expression over columns ``{name: arrow type}``; True keeps a sample (NULL does not).
    An expression the short path reads (`where_arrow`: plain comparisons joined by AND, OR and NOT) is evaluated
    by Arrow in this process and needs no engine; any other is checked by the engine ``checker`` (None: one
    started for the check) and evaluated by DuckDB."""

    def __init__(self, expr: str, columns: dict[str, str], what: str = "where", checker: Engine | None = None):
        self.expr, self.columns, self.what = str(expr), dict(columns), what
        self.memory = filter_memory()  # as it was when the filter was built, in every worker too
        self._con: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        self.arrow: ArrowWhere | None = compile_where(self.expr, self.columns)
        self.used = self.arrow.used if self.arrow is not None else self._check(checker)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_con": None, "_pid": -1, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _problem(self, why: str) -> OptionError:
        cols = ", ".join(f"{k} ({t})" for k, t in self.columns.items())
        shown = repr(self.expr) if len(self.expr) <= 400 else f"{self.expr[:400]!r}... ({len(self.expr):,} characters)"
        return OptionError(f"{self.what}={shown}: {why}; the sample table's columns: {cols}")

    def _check(self, checker: Engine | None) -> list[str]:
        """Refuse anything but one deterministic boolean expression over the columns (checked by the engine,
        within its limits); the columns it names (a superset)."""
        bare = _STRING.sub("''", self.expr)
        if ";" in bare or re.search(r"\bselect\b", bare, re.IGNORECASE):
            raise self._problem("only an expression is allowed (no ';', no SELECT)")
        if not bare.strip():
            raise self._problem("the expression is empty")
        try:
            if checker is not None:
                checker.check(self.expr, self.columns)
            else:
                with engine() as e:
                    e.check(self.expr, self.columns)
        except EngineError as e:
            raise self._problem(str(e)) from None
        named = {a or b for a, b in _IDENT.findall(bare)}
        lower = {n.lower() for n in named}
        return [k for k in self.columns if k in named or k.lower() in lower]

    def _connection(self) -> Any:
        """This process's DuckDB connection (file access off; a forked worker opens its own)."""
        if self._con is None or self._pid != os.getpid():
            self._con = connect(self.memory)
            self._pid = os.getpid()
        return self._con

    def close(self) -> None:
        """Close this process's DuckDB connection, if it opened one (a process that forks later then holds
        no DuckDB state a child could trip over)."""
        if self._con is not None and self._pid == os.getpid():
            self._con.close()
        self._con, self._pid = None, -1

    def evaluate(self, table: Any, within: Engine | None = None) -> np.ndarray:
        """Which rows of an Arrow table (holding at least `used`) the expression keeps, in row order;
        ``within``: evaluate in that engine (the first pass over a dataset), else in this process; the short
        path's expressions always in this process, by Arrow."""
        if table.num_rows == 0:
            return np.zeros(0, dtype=bool)
        table = table.select(self.used) if self.used else table
        if self.arrow is not None:
            return self.arrow.keep(table)
        try:
            if within is not None:
                return within.keep(self.expr, table)
            with self._lock:
                return evaluate(self._connection(), self.expr, table)
        except EngineError as e:
            raise self._problem(str(e)) from None


def filter_columns(index: ShardIndex) -> dict[str, str]:
    """The columns a filter on ``index`` (a version 2 `ShardIndex`) can name."""
    reader = _table_reader(index)
    return {"key": "string", "length": reader.length_type, **reader.extra}


def _table_reader(index: ShardIndex) -> ColumnarIndex:
    """The sample table of a version 2 index (a version 1 index has none to filter on)."""
    if not isinstance(index.shards, ShardList):
        raise OptionError(
            "where= needs a version 2 index with metadata columns (this one is version 1): write the "
            "dataset again with `shardify write` (`shardify upgrade` keeps no metadata columns)"
        )
    return index.shards.reader


class KeepBits:
    """Which samples of a dataset a filter keeps, one bit a sample (in sample-table row order, each row group's
    bits starting on a byte): 1/8 byte per sample in the loader's process, shared by its forked workers (sent
    whole to workers that do not fork). Filled once, a row group at a time, by the engine's first pass."""

    def __init__(self) -> None:
        self.groups: dict[int, np.ndarray] = {}  # row group -> its packed bits (numpy.packbits, big-endian bits)

    def add(self, group: int, keep: np.ndarray) -> None:
        self.groups[group] = np.packbits(keep)

    def take(self, group: int, start: int, count: int) -> np.ndarray | None:
        """Rows ``start`` to ``start + count`` of row group ``group`` (a bool array), None if not filled."""
        bits = self.groups.get(group)
        if bits is None:
            return None
        first, skip = divmod(start, 8)
        chunk = bits[first : first + (skip + count + 7) // 8]
        return np.unpackbits(chunk, count=skip + count)[skip:].astype(bool)

    @property
    def nbytes(self) -> int:
        """The mask's size in bytes (about one eighth of the samples filled)."""
        return sum(b.nbytes for b in self.groups.values())


class SampleFilter:
    """A `Where` applied to one dataset's index: kept samples per shard, evaluated a row group at a time by the
    engine's first pass (`scan()`) and then read from its bit mask (`KeepBits`), never evaluated again.
    ``checker``: the engine that checks the expression (None: one started for the check)."""

    def __init__(self, index: ShardIndex, expr: str, what: str = "where", checker: Engine | None = None):
        self.index, self.where = index, Where(expr, filter_columns(index), what, checker)
        self.reader = _table_reader(index)
        self.bits = KeepBits()

    def _group(
        self, g: int, lengths: bool = False, within: Engine | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(keep, lengths or None) of row group ``g``'s samples (evaluated ``within`` an engine, if given)."""
        names = list(dict.fromkeys([*self.where.used, *(["length"] if lengths else [])]))
        table = self.reader.read_columns(g, names or ["length"])
        keep = self.where.evaluate(table, within)
        return keep, (column_numpy(table.column("length")) if lengths else None)

    def keep(self, shard: int) -> np.ndarray:
        """Which samples of ``shard`` (tar order) the filter keeps, from the bit mask of the first pass (a row
        group that pass did not reach, only outside the loader, is evaluated here, in this process)."""
        r = self.reader
        g, start, count = int(r.shard_group[shard]), int(r.shard_row[shard]), int(r.columns.count[shard])
        got = self.bits.take(g, start, count)
        if got is None:
            keep = self._group(g)[0]
            self.bits.add(g, keep)
            return keep[start : start + count]
        return got

    def scan(self, within: Engine) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(first shard, keep, lengths) of every row group in order, one in memory at a time; the answers are kept
        as bits (`KeepBits`) for `keep()`. Evaluated ``within`` an engine: this first pass is what proves the
        filter keeps to the limits on this data, and the only pass the loader makes."""
        for g in range(len(self.reader.group_start)):
            keep, lengths = self._group(g, lengths=True, within=within)
            self.bits.add(g, keep)
            yield int(self.reader.group_start[g]), keep, lengths  # type: ignore[misc]

    def kept_totals(self, within: Engine) -> tuple[np.ndarray, np.ndarray]:
        """Per shard: samples kept and their total length (streamed over every row group, by `scan()`)."""
        r = self.reader
        n = len(r.columns.count)
        counts, totals = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float64)
        for g, (_, keep, lengths) in enumerate(self.scan(within)):
            a, b = int(r.group_start[g]), int(r.group_stop[g])
            rows = r.shard_row[a:b].astype(np.int64)
            nonempty = r.columns.count[a:b] > 0
            if not keep.size:
                continue
            starts = rows[nonempty]
            counts[a:b][nonempty] = np.add.reduceat(keep.astype(np.int64), starts)
            totals[a:b][nonempty] = np.add.reduceat(np.where(keep, lengths, 0).astype(np.float64), starts)
        return counts, totals

    def iter_kept_lengths(self, within: Engine) -> Iterator[np.ndarray]:
        """The kept samples' lengths, a row group at a time (``shardify inspect --where``)."""
        for _, keep, lengths in self.scan(within):
            yield lengths[keep]


class IndexFilter:
    """A filter over the plan's shards (one dataset's, or a mixture's virtual shards; each dataset filtered by
    the same expression): which samples a shard keeps, the kept share of each shard's length (``scale``, to deal
    shards by the length they keep; computed once, by streaming the filter's columns), and the lazy mask of the
    samples it leaves out (`LeftOut`)."""

    def __init__(self, index: AnyIndex, expr: str):
        self.index, self.expr = index, str(expr)
        datasets = datasets_of(index)
        ixs = [ix for _, ix in datasets]
        with engine() as checker:
            self.parts = [SampleFilter(ix, expr, _what(n), checker) for n, ix in datasets]
            kept = [p.kept_totals(checker) for p in self.parts]
        self.kept = int(sum(int(c.sum()) for c, _ in kept))
        self.total = int(sum(ix.num_samples for ix in ixs))
        self.shares = [_share(t, ix.shard_table(("total_length",))["total_length"]) for (_, t), ix in zip(kept, ixs)]
        self.scale = self._scale()
        if self.kept == 0:
            raise EmptyEpochError(f"where={self.expr!r} keeps none of the {self.total:,} samples")

    def _scale(self) -> np.ndarray:
        """Per plan shard, the share of its length the filter keeps (a mixture's: per virtual shard)."""
        blocks = self.index.blocks if isinstance(self.index, MixedIndex) else None
        if blocks is None:
            return self.shares[0]
        return np.concatenate([self.shares[d] for d, _ in blocks]) if blocks else np.zeros(0)

    def relaid(self, index: MixedIndex) -> IndexFilter:
        """The same filter over the same datasets laid out as another epoch's mixture (a weight schedule's), without
        evaluating it again."""
        out = copy.copy(self)
        out.index = index
        out.scale = out._scale()
        return out

    def keep(self, shard: int) -> np.ndarray:
        """Which samples of plan shard ``shard`` (tar order) the filter keeps."""
        if not isinstance(self.index, MixedIndex):
            return self.parts[0].keep(int(shard))
        d, s = self.index.real_shard(int(shard))
        return self.parts[d].keep(s)

    def mask(self, offsets: np.ndarray) -> LeftOut:
        """The samples left out, as a lazy mask over the plan's global ids (``offsets``: each shard's first)."""
        return LeftOut(self.keep, offsets)


def _share(kept: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Kept length over total length per shard (1 where a shard has no length: nothing to scale)."""
    total = np.asarray(total, dtype=np.float64)
    out = np.ones(len(total))
    np.divide(kept, total, out=out, where=total > 0)
    return out


def open_filter(index: AnyIndex | None, where: str | None) -> IndexFilter | None:
    """The loader's filter (None without ``where``); a filter needs an index to read the columns from."""
    if where is None:
        return None
    if index is None:
        raise OptionError(
            f"where={where!r} needs a dataset index (index.json with metadata columns): write the "
            "dataset with `shardify write`, or load it by its folder"
        )
    return IndexFilter(index, where)


def left_out(
    index: AnyIndex | None, flt: IndexFilter | None, epoch: int, seed: int, offsets: np.ndarray
) -> Mask | None:
    """What epoch ``epoch`` leaves out before any resume: a mixture's unselected samples and the filtered ones,
    one lazy mask over the plan's global ids (None: nothing) — the same in the planner and in every worker."""
    return any_of(selection_of(index, epoch, seed), flt.mask(offsets) if flt is not None else None)


def kept_stats(index: AnyIndex, expr: str) -> LengthStats:
    """Length statistics of the samples ``expr`` keeps (each dataset of a mixture once), streamed a row group
    at a time (``shardify inspect --where``)."""
    with engine() as checker:
        parts = [SampleFilter(ix, expr, _what(n), checker) for n, ix in datasets_of(index)]
        return stream_stats(chunk for p in parts for chunk in p.iter_kept_lengths(checker))


def _what(dataset: str | None) -> str:
    """How errors name the filter: ``where``, or with several datasets ``where (dataset 'NAME')``."""
    return "where" if dataset is None else f"where (dataset {dataset!r})"
