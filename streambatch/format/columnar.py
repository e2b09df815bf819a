"""Index version 2: a small ``index.json`` header beside columnar Parquet tables, for datasets of 10⁹ samples.

``index.shards.parquet`` has one row per shard; the per-sample table (shard, key, length, offset, size) is
split into ``index.samples/part-NNNNN.parquet`` files of whole shards, one row group per group of whole
shards, so a DDP rank reads the header, the shard table and only the row groups of the shards it streams.
Page checksums, byte sizes, row counts and a per-write id are checked on every read, and the values read
(`index_values`): a damaged or lying table is an `IndexFormatError` naming the file. pyarrow is
imported on first use (version 1 indexes never need it).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import IndexError_, IndexFormatError  # noqa: F401  (IndexError_: the old name, still importable here)
from ..io.prefetch import PartPrefetch, asked
from ..io.storage import is_local, join_url, open_sized
from .index_values import Rows, check_group, check_shard_totals
from .parquet_table import ParquetTable, column_numpy

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

FORMAT = "streambatch-index"
INDEX_NAME = "index.json"
SHARDS_NAME = "index.shards.parquet"  # beside index.json; an index ``NAME.json`` has ``NAME.shards.parquet``
SAMPLES_DIR = "index.samples"  # and ``NAME.samples/`` (part indexes of a ``--part`` write sit in one folder)
ROWS_PER_FILE = 1 << 20
ROWS_PER_GROUP = 1 << 16
WHOLE_READ_MAX = 16 << 20  # a shard table up to this size is fetched in one request
SMALL_PART_MAX = 1 << 20  # a sample file up to this size: fetched whole once per process, not per column chunk
ID_KEY = b"streambatch.index_id"
LENGTH_TYPES = ("int64", "float64")
_NUMPY_NAME = {"double": "float64"}  # the header names Arrow types
log = logging.getLogger("streambatch")
_LOCK = threading.Lock()  # guards the indexes' caches and open files (held for dict updates only)


def sample_schema(length_type: str, extra: dict[str, str] | None = None, output_length: bool = False) -> pa.Schema:
    """The per-sample table: offset/size locate a sample's members in its tar (null when unknown);
    ``output_length`` (a dataset written with ``--output-length``): each sample's second length; ``extra``:
    the metadata columns (`columns`), ``{name: arrow type}``, after them."""
    import pyarrow as pa

    fields = [
        ("shard", pa.int32()),
        ("key", pa.string()),
        ("length", pa.type_for_alias(length_type)),
        ("offset", pa.int64()),
        ("size", pa.int64()),
    ]
    if output_length:
        fields.append(("output_length", pa.int64()))
    return pa.schema(fields + [(k, pa.type_for_alias(t)) for k, t in (extra or {}).items()])


#: the sample table's own columns (the rest are metadata columns)
BASE_COLUMNS = ("shard", "key", "length", "offset", "size", "output_length")


@functools.lru_cache(maxsize=8)
def own_types(length_type: str, output_length: bool) -> dict[str, Any]:
    """The Arrow type of each of the sample table's own columns (what a row group read is checked against)."""
    return {f.name: f.type for f in sample_schema(length_type, None, output_length)}


def shard_schema(length_type: str) -> pa.Schema:
    """The shard table; checksums are raw digests (fixed-size binary: half the memory of hex strings)."""
    import pyarrow as pa

    lt = pa.type_for_alias(length_type)
    return pa.schema(
        [
            ("url", pa.string()),
            ("count", pa.int64()),
            ("bytes", pa.int64()),
            ("sha256", pa.binary(32)),
            ("keys_sha1", pa.binary(20)),
            ("total_length", lt),
            ("max_length", lt),
            ("min_length", lt),
            ("first", pa.int64()),
            ("part", pa.int32()),
            ("row_group", pa.int32()),
        ]
    )


def table_url(root: str, rel: str) -> str:
    return join_url(root, *rel.split("/"))


def table_names(index_name: str, alternate: bool = False) -> tuple[str, str]:
    """(shard table file, sample folder) of the index file ``index_name``: ``index.json`` has
    ``index.shards.parquet`` and ``index.samples/``; ``index.part-0003.json`` has ``index.part-0003.shards.parquet``
    and ``index.part-0003.samples/``. ``alternate``: the names a rewrite uses while the index in place holds the
    usual ones (``index.1.shards.parquet``, ``index.1.samples/``); the header names its tables, so either loads."""
    stem = index_name[: -len(".json")] if index_name.endswith(".json") else index_name
    if alternate:
        stem += ".1"
    elif stem == INDEX_NAME[: -len(".json")]:
        return SHARDS_NAME, SAMPLES_DIR
    return f"{stem}.shards.parquet", f"{stem}.samples"


def beside_index(rel: Any) -> bool:
    """Whether a table path a header names is a file under the index's folder (no absolute path, ``..`` or URL)."""
    return isinstance(rel, str) and not (rel.startswith("/") or ".." in rel.split("/") or "://" in rel)


# ---- reading ---------------------------------------------------------------------------------------
def _numbered(part: np.ndarray, row_group: np.ndarray, num_parts: int) -> bool:
    """Groups in order: parts 0..num_parts-1, and in each part row groups 0, 1, 2, …"""
    if not len(part):
        return num_parts == 0
    new_part = np.concatenate([[True], part[1:] != part[:-1]])
    steps_ok = np.all(row_group[new_part] == 0) and np.all(np.diff(row_group)[~new_part[1:]] == 1)
    return bool(steps_ok and np.array_equal(part, np.cumsum(new_part) - 1) and part[-1] + 1 == num_parts)


@dataclass
class ShardColumns:
    """The shard table in memory: numbers as numpy arrays, strings and digests as Arrow chunked arrays.

    The columns planning needs are read when the index opens; the others (url, checksums, sizes, max/min
    length) on first access, so a rank that only plans never holds them."""

    PLAN = ("count", "total_length", "first", "part", "row_group")

    def __init__(self, values: dict[str, Any], load_rest: Any) -> None:
        self._values, self._load_rest = values, load_rest

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if values is None or name.startswith("_"):
            raise AttributeError(name)
        if name not in values:
            values.update(self._load_rest())
        if name not in values:
            raise AttributeError(name)
        return values[name]

    def __len__(self) -> int:
        return len(self._values["count"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the planning columns only: a worker loads the rest again if it needs them, so a
        DataLoader worker is not sent every shard's URL and checksums."""
        return {"_values": {k: v for k, v in self._values.items() if k in self.PLAN}, "_load_rest": self._load_rest}


class ColumnarIndex:
    """Reads a version 2 index's tables: the shard table whole, sample row groups on demand.

    Row groups read for lengths are cached here (a shard's lengths are a view of its group's array);
    `iter_shard_lengths()` streams without filling the cache. Open files are not pickled.
    """

    def __init__(
        self,
        root: str,
        header: dict[str, Any],
        storage_options: dict | None = None,
        source: str = INDEX_NAME,
        tables: dict[str, str] | None = None,
    ) -> None:
        self.root, self.header, self.storage_options, self.source = root, header, storage_options, source
        self.tables = dict(tables or {})  # local copies of table files (`shared_index`), checked as the originals;
        # a copy deleted once the index is open (its cache folder cleared) is read from the original instead
        try:
            self.length_type = _NUMPY_NAME.get(str(header["columns"]["length"]), str(header["columns"]["length"]))
            self.parts = list(header["tables"]["samples"])
            self.shard_entry = dict(header["tables"]["shards"])
            self.id = str(header["id"])
            self.extra = {str(k): str(v) for k, v in header["columns"].items() if k not in BASE_COLUMNS}
        except (KeyError, TypeError) as e:
            raise IndexFormatError(f"{source}: malformed version 2 header ({e!r})") from e
        if self.length_type not in LENGTH_TYPES:
            raise IndexFormatError(f"{source}: length column type {self.length_type!r} is not one of {LENGTH_TYPES}")
        for rel in [self.shard_entry.get("path")] + [
            p.get("path") if isinstance(p, dict) else None for p in self.parts
        ]:
            if not beside_index(rel):
                raise IndexFormatError(f"{source}: table path {rel!r} is not a file beside the index")
        self.has_output_lengths = "output_length" in header["columns"]
        self._cache: dict[int, np.ndarray] = {}
        self._last: tuple[int, Any] | None = None  # the row group shard_samples read last
        self._spans: tuple[int, Any] | None = None  # the row group sample_offsets read last
        self._values: tuple[int, dict[str, Any]] | None = None  # the row group's columns shard_values read last
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()
        self._prefetch: PartPrefetch | None = None
        self._shard_file: tuple[int, Any] | None = None  # (pid, the shard table read whole): read once, not twice
        if asked():  # a loader is being built: its first plan's lengths, fetched beside the shard table
            self.prefetch()
        self.columns = ShardColumns(self._read_shard_table(ShardColumns.PLAN), self._read_rest)
        self._index_groups()

    def __getstate__(self) -> dict[str, Any]:  # open files and cached row groups stay here
        none = dict.fromkeys(("_last", "_spans", "_values", "_shard_file"))
        return {**self.__dict__, "_files": {}, "_cache": {}, **none}

    def prefetch(self) -> None:
        """Open the sample files ahead, in the background, where `prefetch.PartPrefetch` finds it worth it."""
        sizes, remote = [int(e["bytes"]) for e in self.parts], not is_local(self.root)
        if self._prefetch is None and (wanted := PartPrefetch.wanted(sizes, SMALL_PART_MAX, remote)):
            self._prefetch = PartPrefetch(wanted, self._part_file)

    def table_files(self) -> list[tuple[str, int]]:
        """(path relative to the index's folder, bytes) of every table file the header names."""
        return [(str(e["path"]), int(e["bytes"])) for e in [self.shard_entry, *self.parts]]

    # ---- opening tables ------------------------------------------------------------------------
    def _open(self, rel: str, entry: dict[str, Any], whole: bool = False) -> Any:
        """A verified `ParquetTable`: size as the header says, footer readable, the same write id, the row
        count. ``whole``: fetch the file in one read first (the shard table: one request, not one per column chunk)."""

        url, copy = table_url(self.root, rel), self.tables.get(rel)
        want = int(entry["bytes"])
        whole = whole and want <= WHOLE_READ_MAX  # a small table: one read of at most one byte more than it should be
        try:
            if copy is not None:
                try:
                    f, size = open_sized(copy, want, None, whole)
                    url = copy
                except (FileNotFoundError, NotADirectoryError):
                    # the node copy was deleted (the cache folder cleared mid-run) after the index was opened from
                    # it, e.g. before a worker started: the original it copied, checked the same way below
                    log.info("streambatch: the node copy %s is gone; reading %s from the store", copy, url)
                    f, size = open_sized(url, want, self.storage_options, whole)
            else:
                f, size = open_sized(url, want, self.storage_options, whole)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise IndexFormatError(f"{url}: missing ({e})") from e
        if size != want:
            f.close()
            found = f"more than {want} bytes" if size > want else f"{size} bytes"
            raise IndexFormatError(f"{url}: {found}, the index says {want} (truncated or replaced)")
        try:
            pf = ParquetTable(f)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged footer
            f.close()
            raise IndexFormatError(f"{url}: not a readable Parquet table ({e})") from e
        md = pf.metadata
        found = (md.metadata or {}).get(ID_KEY, b"").decode("utf-8", "replace")
        if found != self.id:
            raise IndexFormatError(
                f"{url}: written by another index write ({found or 'no id'}, {self.source} has "
                f"{self.id}): tables and header do not belong together"
            )
        if md.num_rows != int(entry["rows"]):
            raise IndexFormatError(f"{url}: {md.num_rows} rows, the index says {entry['rows']}")
        return pf

    def _read_shard_table(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Columns of the shard table (all others than the planning ones when ``names`` is None), a row group
        at a time: numbers into numpy arrays, strings kept as Arrow chunks (no second copy while converting)."""
        import pyarrow as pa

        rel, held = str(self.shard_entry["path"]), self._shard_file
        self._shard_file, url = None, table_url(self.root, rel)
        pf = held[1] if held is not None and held[0] == os.getpid() else self._open(rel, self.shard_entry, whole=True)
        if held is None and names is not None and int(self.shard_entry["bytes"]) <= WHOLE_READ_MAX:
            self._shard_file = (os.getpid(), pf)  # in memory: kept for the other columns' read
        schema, n = shard_schema(self.length_type), pf.metadata.num_rows
        names = list(names) if names is not None else [f for f in schema.names if f not in ShardColumns.PLAN]
        texts = [k for k in ("url", "sha256", "keys_sha1") if k in names]
        nums = {k: np.empty(n, schema.field(k).type.to_pandas_dtype()) for k in names if k not in texts}
        chunks: dict[str, list[Any]] = {k: [] for k in texts}
        at = 0
        for rg in range(pf.metadata.num_row_groups):
            try:
                t = pf.read_row_group(rg, names)
            except Exception as e:  # noqa: BLE001 - checksum, decoding, a missing column: a damaged table
                raise IndexFormatError(f"{url}: row group {rg} cannot be read ({e})") from e
            if t.schema.names != names or any(t.schema.field(k).type != schema.field(k).type for k in names):
                raise IndexFormatError(f"{url}: columns {t.schema.names} are not the shard table's {names}")
            for k, arr in nums.items():
                arr[at : at + t.num_rows] = column_numpy(t.column(k))
            for k in texts:
                chunks[k].extend(t.column(k).chunks)
            at += t.num_rows
        pa.system_memory_pool().release_unused()  # the read buffers back to the system (malloc_trim)
        return {**{k: pa.chunked_array(c, schema.field(k).type) for k, c in chunks.items()}, **nums}

    def _read_rest(self) -> dict[str, Any]:
        return self._read_shard_table(None)

    def _index_groups(self) -> None:
        """Where each shard's samples are: runs of shards with the same (part, row group), checked."""
        c, where = self.columns, table_url(self.root, str(self.shard_entry["path"]))
        n, samples = len(c), int(c.count.sum())
        if n != int(self.header.get("num_shards", -1)) or samples != int(self.header.get("num_samples", -1)):
            raise IndexFormatError(
                f"{where}: {n} shards of {samples} samples, the index says "
                f"{self.header.get('num_shards')} of {self.header.get('num_samples')}"
            )
        check_shard_totals(c.count, c.total_length, self.header, where)
        if not np.array_equal(c.first, np.cumsum(c.count) - c.count):
            raise IndexFormatError(f"{where}: column 'first' is not the running count of samples")
        change = np.flatnonzero((np.diff(c.part) != 0) | (np.diff(c.row_group) != 0)) + 1
        self.group_start = np.concatenate([[0], change]).astype(np.int64) if n else np.zeros(0, np.int64)
        self.group_stop = np.append(self.group_start[1:], n).astype(np.int64) if n else np.zeros(0, np.int64)
        self.group_rows = np.add.reduceat(c.count, self.group_start) if n else np.zeros(0, np.int64)
        sizes = self.group_stop - self.group_start
        self.shard_group = np.repeat(np.arange(len(self.group_start), dtype=np.int32), sizes)
        self.shard_row = c.first - np.repeat(c.first[self.group_start], sizes)  # first row in its row group
        self.group_part, self.group_rg = c.part[self.group_start], c.row_group[self.group_start]
        gp, gr = self.group_part, self.group_rg
        if not _numbered(gp[gp >= 0], gr[gp >= 0], len(self.parts)) or np.any(self.group_rows[gp < 0]):
            raise IndexFormatError(f"{where}: part/row_group columns do not match the {len(self.parts)} sample files")

    def _file(self, part: int) -> Any:
        """The open sample file ``part``, once the files opened ahead (`prefetch()`) are open."""
        if self._prefetch is not None:
            self._prefetch.wait()
        return self._part_file(part)

    def _part_file(self, part: int) -> Any:
        """The open sample file ``part`` (footer read once per process: a forked worker opens its own, as
        processes sharing one file offset would read each other's bytes)."""
        with _LOCK:
            if self._pid != os.getpid():
                self._files, self._pid = {}, os.getpid()
            pf = self._files.get(part)
        if pf is None:
            entry = self.parts[part]
            pf = self._open(entry["path"], entry, whole=int(entry["bytes"]) <= SMALL_PART_MAX)
            if pf.metadata.num_row_groups != int(entry["row_groups"]):
                raise IndexFormatError(
                    f"{table_url(self.root, entry['path'])}: {pf.metadata.num_row_groups} row "
                    f"groups, the index says {entry['row_groups']}"
                )
            with _LOCK:
                self._files[part] = pf
        return pf

    # ---- reading samples -------------------------------------------------------------------------
    def _read_group(self, g: int, columns: Sequence[str]) -> pa.Table:
        """One read of one row group (``columns`` plus the shard column, which is checked)."""
        part, rg = int(self.group_part[g]), int(self.group_rg[g])
        pf, url = self._file(part), table_url(self.root, self.parts[part]["path"])
        if rg >= pf.metadata.num_row_groups:
            raise IndexFormatError(f"{url}: no row group {rg} (the file has {pf.metadata.num_row_groups})")
        rows, want = pf.metadata.row_group(rg).num_rows, int(self.group_rows[g])
        if rows != want:
            raise IndexFormatError(f"{url}: row group {rg} has {rows} rows, the shard table says {want}")
        # a key is checked only where its sample is planned (length above 0): shardify index keeps the key of a
        # sample it left out (length 0) as the tar has it, unsafe or not
        extra = ["length"] if "key" in columns and "length" not in columns else []
        try:
            t = pf.read_row_group(rg, ["shard", *columns, *extra])
        except Exception as e:  # noqa: BLE001 - checksum, decompression, decoding: all mean a damaged file
            raise IndexFormatError(f"{url}: row group {rg} cannot be read ({e})") from e
        a, b = int(self.group_start[g]), int(self.group_stop[g])
        expected = np.repeat(np.arange(a, b, dtype=np.int32), self.columns.count[a:b])
        if not np.array_equal(column_numpy(t.column("shard")), expected):
            raise IndexFormatError(f"{url}: row group {rg} does not hold shards {a}..{b - 1} as the shard table says")
        c, types = self.columns, own_types(self.length_type, self.has_output_lengths)
        check_group(t, Rows(url, rg, a, c.count[a:b], c.total_length[a:b], types, lambda: c.bytes[a:b]))
        return t.drop_columns(extra) if extra else t

    def _group_lengths(self, g: int, keep: bool = True) -> np.ndarray:
        with _LOCK:
            got = self._cache.get(g)
        if got is not None:
            return got
        if self.group_part[g] < 0:
            arr = np.zeros(0, dtype=self.length_type)
        else:
            arr = column_numpy(self._read_group(g, ["length"]).column("length")).astype(self.length_type)
        if keep:
            with _LOCK:
                self._cache[g] = arr
        return arr

    def lengths_of(self, shard: int) -> np.ndarray:
        """One shard's lengths: a view of its row group's cached array."""
        arr = self._cache.get(int(self.shard_group[shard]))  # a dict read needs no lock
        if arr is None:
            arr = self._group_lengths(int(self.shard_group[shard]))
        start = int(self.shard_row[shard])
        return arr[start : start + int(self.columns.count[shard])]

    def shard_lengths(self, shards: Sequence[int]) -> list[np.ndarray]:
        """Lengths of the given shards, each needed row group read once (from the cache when there): copies in
        the narrowest integer type that holds them, so a caller keeps only its own shards' lengths, at 4 bytes
        a sample where they fit in int32, and not the rest of their row groups."""
        ids = np.asarray(shards, dtype=np.int64)
        groups, starts = self.shard_group[ids].tolist(), self.shard_row[ids].tolist()
        counts = self.columns.count[ids].tolist()
        out: list[np.ndarray] = [np.zeros(0)] * len(groups)
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_group.setdefault(g, []).append(i)
        for g, members in sorted(by_group.items()):
            arr = self._group_lengths(g, keep=False)
            narrow = np.int32 if arr.dtype == np.int64 and (not arr.size or arr.max() < 2**31) else arr.dtype
            for i in members:
                out[i] = arr[starts[i] : starts[i] + counts[i]].astype(narrow)
        return out

    def shard_output_lengths(self, shards: Sequence[int]) -> list[np.ndarray]:
        """The output lengths (int64) of the given shards, reading only their row groups, each once; the index
        must have them (`has_output_lengths`)."""
        ids = [int(i) for i in shards]
        read: dict[int, np.ndarray] = {}
        out = []
        for i in ids:
            g, start, n = int(self.shard_group[i]), int(self.shard_row[i]), int(self.columns.count[i])
            if g not in read:
                empty = self.group_part[g] < 0
                col = None if empty else self._read_group(g, ["output_length"]).column("output_length")
                read[g] = np.zeros(0, np.int64) if col is None else column_numpy(col).astype(np.int64)
            out.append(read[g][start : start + n].copy())
        return out

    def all_lengths(self) -> np.ndarray:
        """Every sample's length, shards in order (every row group read and cached)."""
        if not len(self.group_start):
            return np.zeros(0, dtype=self.length_type)
        return np.concatenate([self._group_lengths(g) for g in range(len(self.group_start))])

    def iter_shard_lengths(self) -> Iterator[np.ndarray]:
        """Every shard's lengths in order, one row group in memory at a time (the cache is used, not filled)."""
        for g, arr in enumerate(self.iter_group_lengths()):
            a, b = int(self.group_start[g]), int(self.group_stop[g])
            for start, n in zip(self.shard_row[a:b].tolist(), self.columns.count[a:b].tolist()):
                yield arr[start : start + n]

    def iter_group_lengths(self) -> Iterator[np.ndarray]:
        """Every row group's lengths in order (shards in index order), one group in memory at a time."""
        for g in range(len(self.group_start)):
            yield self._group_lengths(g, keep=False)

    def sample_offsets(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(offsets, sizes) of a shard's samples in its tar, or None where the index does not know them."""
        g = int(self.shard_group[shard])
        if self.group_part[g] < 0:
            return None
        last = self._spans  # a reader asks shard after shard of one row group: read it once (no lock: one tuple)
        if last is None or last[0] != g:
            last = self._spans = (g, self._read_group(g, ["offset", "size"]))
        t = last[1].slice(int(self.shard_row[shard]), int(self.columns.count[shard]))
        if t.column("offset").null_count or t.column("size").null_count:
            return None
        return column_numpy(t.column("offset")), column_numpy(t.column("size"))

    def shard_values(self, shard: int, name: str) -> list[Any]:
        """The values of metadata column ``name`` for one shard's samples, in tar order (the row group's column
        is read once for the shards of the group asked in a row)."""
        g = int(self.shard_group[shard])
        last = self._values  # no lock: one tuple
        if last is None or last[0] != g:
            last = self._values = (g, {})
        if name not in last[1]:  # the group's columns asked for so far are kept together
            last[1][name] = self.read_columns(g, [name]).column(name)
        return last[1][name].slice(int(self.shard_row[shard]), int(self.columns.count[shard])).to_pylist()

    # ---- writing ---------------------------------------------------------------------------------------

    def shard_samples(self, shard: int) -> dict[str, Any]:
        """Everything the sample table holds for one shard: ``lengths``, and ``keys``, ``offsets``, ``sizes``,
        ``output_lengths`` (None where the index does not know them). Reading shards in order reads each row
        group once (the last one is kept), so re-saving an index streams it."""
        g, n = int(self.shard_group[shard]), int(self.columns.count[shard])
        if self.group_part[g] < 0:
            empty = {"lengths": np.zeros(0, dtype=self.length_type), "keys": None, "offsets": None, "sizes": None}
            return {
                **empty,
                "output_lengths": np.zeros(0, np.int64) if self.has_output_lengths else None,
                "columns": {},
            }
        if self._last is None or self._last[0] != g:
            second = ["output_length"] if self.has_output_lengths else []
            self._last = (g, self._read_group(g, ["key", "length", "offset", "size", *second, *self.extra]))
        start = int(self.shard_row[shard])
        t, cached = self._last[1].slice(start, n), self._cache.get(g)  # a cached group may hold changes made in place
        lengths = cached[start : start + n] if cached is not None else column_numpy(t.column("length"))
        out: dict[str, Any] = {"lengths": lengths.astype(self.length_type), "output_lengths": None}
        if self.has_output_lengths:
            out["output_lengths"] = column_numpy(t.column("output_length")).astype(np.int64)
        for name, column in (("keys", "key"), ("offsets", "offset"), ("sizes", "size")):
            col = t.column(column)
            out[name] = None if col.null_count else (col.to_pylist() if name == "keys" else column_numpy(col))
        out["columns"] = {k: t.column(k) for k in self.extra}
        return out

    def read_columns(self, g: int, columns: Sequence[str]) -> pa.Table:
        """Columns of row group ``g`` (shards ``group_start[g]..group_stop[g]-1``, samples in index order); an
        empty table of the shards that have no sample row group."""
        if self.group_part[g] < 0:
            return (
                sample_schema(self.length_type, self.extra, self.has_output_lengths).empty_table().select(list(columns))
            )
        return self._read_group(g, list(columns)).select(list(columns))
