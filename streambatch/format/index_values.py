"""The values an index's tables hold, checked where they are read: an index is data, and a table whose checksums
and row counts agree can still lie (a negative or absurd length, a null key, a byte range outside its tar).

Every read of a version 2 sample row group goes through ``ColumnarIndex._read_group`` (`columnar`), which
calls `check_group()` on the columns it read (and only those: a rank that reads lengths never reads keys). The shard
table's planning numbers are checked once when the index opens (`check_shard_totals()`), version 1 lengths when
they are decoded (`check_v1()`). Every check is vectorised (numpy or Arrow kernels over a column of a row group,
no Python loop over rows); a bad value is an `IndexFormatError` naming the file, the row
group, the row, the column and what is wrong.

The rules: a length (and an output length) is a number from 0 to `max_length()` (0: a sample the loader
never plans, as ``shardify index`` records one it cannot use), finite, never null; the lengths of each shard add up
to the shard table's ``total_length``, and those to the header's; a string column is UTF-8; a planned sample's key
is one the loader could have read from a tar (`key_problem()`; a left-out one keeps its tar's key), or
null for a whole shard (its keys unknown); an offset and a size are not negative and end inside the shard's bytes
(or are null: unknown); a segment starts at frame 0 or later.

Cost: opening an index checks the shard totals (one pass over the shard table); streaming every length, a
min, a max and a per-shard sum of each row group (vectorised, no Python per sample); reading keys, offsets and
sizes, UTF-8 validation and a byte scan of the keys (the exact key rule, a regular expression, runs only where
the scan finds a suspect byte).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import limits
from ..errors import IndexFormatError
from .parquet_table import column_numpy

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

#: a key `key_problem()` refuses: absolute, a ``..`` part, a control character (RE2 syntax)
_BAD_KEY = r"^[/\\]|(^|[/\\])\.\.([/\\]|$)|[\x00-\x1f\x{7f}-\x{9f}]"
#: columns holding byte positions in the shard's tar, and the segment columns (frames of a member)
_SPANS, _SEGMENTS = ("offset", "size"), ("segment_start", "segment_frames")


@dataclass(frozen=True)
class Rows:
    """What the checks of one row group need from the index: its file and number, its shards (``first`` is the shard
    of its first row), their sample counts and shard table totals, the Arrow type of each of the sample table's own
    columns, and the shards' byte sizes (a function: the shard table's sizes are read only where spans are)."""

    url: str
    rg: int
    first: int
    counts: np.ndarray
    totals: np.ndarray
    types: Mapping[str, Any]
    shard_bytes: Callable[[], np.ndarray]

    def at(self, row: int) -> str:
        """``FILE: row group G, row R (shard S)``."""
        shard = self.first + int(np.searchsorted(np.cumsum(self.counts), row, side="right"))
        return f"{self.url}: row group {self.rg}, row {row} (shard {shard})"

    def shard_of_rows(self, values: np.ndarray) -> np.ndarray:
        """A per-shard array spread over the rows: each row gets its shard's value."""
        return np.repeat(values, self.counts)


def check_group(t: pa.Table, rows: Rows) -> None:
    """Raise `IndexFormatError` for the first value of the row group ``t`` (the columns a caller asked for,
    of the row group ``rows`` describes) that the rules of this module refuse."""
    _check_types(t, rows)
    planned = _planned(t)
    for name in t.column_names:
        col = t.column(name)
        if pa_types().is_string(col.type):
            _check_text(col, name, rows, planned)
    if "length" in t.column_names:
        values = _not_null(t.column("length"), "length", rows)
        check_lengths(values, "length", rows)
        _check_totals(values, rows)
    if "output_length" in t.column_names:
        check_lengths(_not_null(t.column("output_length"), "output_length", rows), "output_length", rows)
    if any(k in t.column_names for k in _SPANS):
        _check_spans(t, rows)
    for name, least in zip(_SEGMENTS, (0, -1)):
        if name in t.column_names:
            _at_least(t.column(name), name, least, rows)


def pa_types() -> Any:
    """``pyarrow.types`` (imported on first use, as everywhere in the index reader)."""
    import pyarrow.types

    return pyarrow.types


def _check_types(t: pa.Table, rows: Rows) -> None:
    """Each of the sample table's own columns (and the segment columns) of the type the index's schema gives it."""
    import pyarrow as pa

    for name in t.column_names:
        found, want = t.schema.field(name).type, rows.types.get(name)
        if want is not None and not found.equals(want):
            raise IndexFormatError(f"{rows.url}: row group {rows.rg}: column {name!r} is {found}, not {want}")
        if name in _SEGMENTS and not pa.types.is_integer(found):
            raise IndexFormatError(f"{rows.url}: row group {rows.rg}: column {name!r} is {found}, not whole numbers")


def _not_null(col: Any, name: str, rows: Rows) -> np.ndarray:
    """A numeric column as numpy, once it has no null."""
    if col.null_count:
        import pyarrow.compute as pc

        row = int(pc.index(col.is_null(), True).as_py())
        raise IndexFormatError(f"{rows.at(row)}: column {name!r} is null")
    return column_numpy(col)


def check_lengths(values: np.ndarray, name: str, rows: Rows | str) -> None:
    """Raise `IndexFormatError` unless every value is a length: finite, from 0 to `max_length()`
    (whole, in an integer array). ``rows``: where the values are (a `Rows`, or a prefix such as
    ``"FILE: shards[3].lengths"``). One min and one max over the array; the bad row is looked for only on failure."""
    if not values.size:
        return
    if values.dtype.kind not in "iuf":
        raise IndexFormatError(f"{_where(rows, None)}: column {name!r} holds {values.dtype}, not numbers")
    bound = limits.max_length()
    lo, hi = values.min(), values.max()  # a NaN anywhere makes both NaN: caught by the comparisons
    if lo >= 0 and hi <= bound:
        return
    row = int(np.flatnonzero(~((values >= 0) & (values <= bound)))[0])
    value = values[row].item()
    why = "negative" if value < 0 else "not a finite number" if not np.isfinite(value) else f"over {bound}"
    raise IndexFormatError(
        f"{_where(rows, row)}: {name} {value!r} is {why} (a length is from 0 to {bound}; {limits.LENGTH_ENV}=N "
        "raises the bound)"
    )


def _where(rows: Rows | str, row: int | None) -> str:
    if isinstance(rows, str):
        return rows if row is None else f"{rows}[{row}]"
    return f"{rows.url}: row group {rows.rg}" if row is None else rows.at(row)


def _check_totals(values: np.ndarray, rows: Rows) -> None:
    """Each shard's lengths add up to the shard table's ``total_length`` (what planning balances ranks by); run after
    `check_lengths()` (no value over the bound, so an int64 sum of a row group does not overflow)."""
    full = rows.counts > 0
    if np.any(rows.totals[~full] != 0):
        shard = rows.first + int(np.flatnonzero(~full & (rows.totals != 0))[0])
        raise IndexFormatError(f"{rows.url}: shard {shard} has no sample but a total length in the shard table")
    if not values.size:
        return
    starts = (np.cumsum(rows.counts) - rows.counts)[full]
    exact = values.dtype.kind in "iu" and limits.max_length() * len(values) < 2**62  # checked: none is over it
    sums = np.add.reduceat(values if exact else values.astype(np.float64), starts)
    want = rows.totals[full]
    off = sums != want if exact else ~np.isclose(sums, want, rtol=1e-7, atol=1e-9)
    if np.any(off):
        k = int(np.flatnonzero(off)[0])
        shard = rows.first + int(np.flatnonzero(full)[k])
        raise IndexFormatError(
            f"{rows.url}: row group {rows.rg}: the lengths of shard {shard} add up to {sums[k].item()!r}, the shard "
            f"table says {want[k].item()!r}"
        )


def _planned(t: pa.Table) -> Any:
    """Where ``t`` holds keys and lengths, which rows the loader plans (length above 0; a null length counts, its
    own check refuses it); None otherwise."""
    if "length" not in t.column_names or "key" not in t.column_names:
        return None
    import pyarrow.compute as pc

    return pc.fill_null(pc.greater(t.column("length"), 0), True)


def _check_text(col: Any, name: str, rows: Rows, planned: Any = None) -> None:
    """A string column is valid UTF-8 (Parquet does not check it); the key column has no null, and no key the
    loader would refuse from a tar among the rows it plans (``planned``: a mask, None for all)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for chunk in col.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid as e:
            where = f"{rows.url}: row group {rows.rg}"
            raise IndexFormatError(f"{where}: column {name!r} is not UTF-8 text ({e})") from None
    if name != "key":
        return
    if col.null_count:
        _unknown_shards_only(col, name, rows)
    if not any(_may_be_bad_keys(chunk) for chunk in col.chunks):
        return
    bad = pc.match_substring_regex(col, _BAD_KEY)
    if planned is not None:  # a left-out sample (length 0) keeps its key as its tar has it: only planned ones count
        bad = pc.and_(bad, planned)
    if pc.any(bad).as_py():
        row = int(pc.index(bad, True).as_py())
        key = col[row].as_py()
        raise IndexFormatError(f"{rows.at(row)}: {limits.key_problem(key) or f'key {key!r} is refused'}")


def _may_be_bad_keys(chunk: Any) -> bool:
    """Whether the keys of one string array might be refused, from its bytes (a few numpy passes, ~6 ns a key;
    the exact check, a regular expression at ~50 ns a key, runs only where this says yes): a control character
    (a byte below 0x20, 0x7f, or 0xc2 then 0x80–0x9f), a backslash, two dots in a row, a key starting with ``/``."""
    if not len(chunk):
        return False
    offsets = np.frombuffer(chunk.buffers()[1], np.int32, len(chunk) + 1, chunk.offset * 4)
    data = np.frombuffer(chunk.buffers()[2] or b"", np.uint8)[offsets[0] : offsets[-1]]
    if (data < 0x20).any() or (data == 0x7F).any() or (data == 0x5C).any():
        return True
    c2 = np.flatnonzero(data[:-1] == 0xC2)
    dots = np.flatnonzero(data == 0x2E)
    if ((data[c2 + 1] >= 0x80) & (data[c2 + 1] <= 0x9F)).any() or (np.diff(dots) == 1).any():
        return True
    starts = offsets[:-1][offsets[1:] > offsets[:-1]] - offsets[0]
    return bool((data[starts] == 0x2F).any())


def _unknown_shards_only(col: Any, name: str, rows: Rows) -> None:
    """Nulls in ``col`` only as whole shards (a shard whose keys are unknown: written without them, or upgraded from
    version 1), never a null among a shard's known values."""
    null = col.is_null().to_numpy(zero_copy_only=False)
    starts = np.cumsum(rows.counts) - rows.counts
    full = rows.counts > 0
    nulls = np.add.reduceat(null.astype(np.int64), starts[full]) if null.size else np.zeros(0, np.int64)
    part = (nulls > 0) & (nulls < rows.counts[full])
    if np.any(part):
        shard = int(np.flatnonzero(full)[np.flatnonzero(part)[0]])
        row = int(starts[shard] + np.flatnonzero(null[starts[shard] : starts[shard] + rows.counts[shard]])[0])
        raise IndexFormatError(f"{rows.at(row)}: column {name!r} is null among the shard's known values")


def _check_spans(t: pa.Table, rows: Rows) -> None:
    """Offsets and sizes (null where unknown) are not negative, and a sample's range ends inside its shard."""
    got = {k: _filled(t.column(k)) for k in _SPANS if k in t.column_names}
    for name, values in got.items():
        if values.size and values.min() < 0:
            row = int(np.flatnonzero(values < 0)[0])
            raise IndexFormatError(f"{rows.at(row)}: {name} {values[row].item()} is negative")
    if len(got) < 2 or not got["offset"].size:
        return
    shard_bytes = rows.shard_of_rows(np.asarray(rows.shard_bytes(), np.int64))
    over = got["size"] > shard_bytes - got["offset"]  # no overflow: both are not negative
    if np.any(over):
        row = int(np.flatnonzero(over)[0])
        offset, size = got["offset"][row].item(), got["size"][row].item()
        raise IndexFormatError(
            f"{rows.at(row)}: offset {offset} and size {size} reach past the end of the shard "
            f"({shard_bytes[row].item()} bytes)"
        )


def _filled(col: Any) -> np.ndarray:
    """An integer column as int64 numpy, nulls (unknown) as 0."""
    return column_numpy(col.fill_null(0) if col.null_count else col).astype(np.int64, copy=False)


def _at_least(col: Any, name: str, least: int, rows: Rows) -> None:
    """A segment column's values (null: the whole member) are at least ``least``."""
    values = _filled(col)
    if values.size and values.min() < least:
        row = int(np.flatnonzero(values < least)[0])
        raise IndexFormatError(f"{rows.at(row)}: {name} {values[row].item()} is below {least}")


def check_shard_totals(count: np.ndarray, totals: np.ndarray, header: dict[str, Any], where: str) -> None:
    """The shard table's planning numbers, when the index opens: counts not negative, each total a sum of at most
    ``count`` lengths (finite, from 0 to ``count`` × the bound), and the header's ``total_length`` their sum."""
    if count.size and count.min() < 0:
        raise IndexFormatError(f"{where}: shard {int(np.flatnonzero(count < 0)[0])} has a negative count")
    bound = np.asarray(count, np.float64) * limits.max_length()
    bad = ~((totals >= 0) & (totals <= bound))  # NaN fails both
    if np.any(bad):
        shard = int(np.flatnonzero(bad)[0])
        raise IndexFormatError(
            f"{where}: shard {shard} has total length {totals[shard].item()!r}, not the sum of {count[shard]} lengths "
            f"from 0 to {limits.max_length()}"
        )
    said = header.get("total_length")
    if isinstance(said, (int, float)) and not isinstance(said, bool):
        found = float(totals.sum())
        if not np.isclose(found, float(said), rtol=1e-9, atol=1e-6):
            raise IndexFormatError(f"{where}: the shards' lengths add up to {found:g}, the index header says {said!r}")


def check_v1(shards: Sequence[Any], source: str) -> None:
    """The lengths (and output lengths) of a version 1 index's shards (`ShardInfo`), decoded: each
    shard's checked as one array."""
    for i, s in enumerate(shards):
        check_lengths(np.asarray(s.lengths), "length", f"{source}: shards[{i}].lengths")
        outputs = s.output_lengths
        if outputs is not None:
            check_lengths(np.asarray(outputs), "output_length", f"{source}: shards[{i}].output_lengths")
