"""Writing index version 2: shards streamed into the Parquet shard table and sample files, in bounded memory,
published atomically with ``index.json`` last (see `streambatch.format.columnar` for the format)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import string
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import IndexFormatError, OptionError
from ..io.storage import AtomicWriter, is_local, local_path, parent_url, remove, write_bytes_atomic
from ..stats import json_number
from . import columnar
from .columnar import FORMAT, ID_KEY, INDEX_NAME, LENGTH_TYPES, sample_schema, shard_schema, table_names, table_url
from .columns import arrow_column
from .index_swap import clear_names, drop_tables, free_names, named_tables, swapped_in

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa


def source_date_epoch() -> int | None:
    """``SOURCE_DATE_EPOCH`` (the reproducible-builds convention: seconds since 1970), or None when unset. When
    set, an index records it as its ``created`` time and derives its id from it (`write_id()`), so the same
    input gives byte-identical output from any engine or number of tasks."""
    text = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not text:
        return None
    if not text.isdigit():
        from ..errors import OptionError

        raise OptionError(f"SOURCE_DATE_EPOCH={text!r}: expected whole seconds since 1970")
    return int(text)


def write_id(index_name: str) -> str:
    """The id that ties an index's tables to its header: random, or with ``SOURCE_DATE_EPOCH`` set derived from
    it and the index's name (a new input should come with a new ``SOURCE_DATE_EPOCH``, as its convention says)."""
    epoch = source_date_epoch()
    if epoch is None:
        return uuid.uuid4().hex
    return hashlib.sha256(f"streambatch index {epoch} {index_name}".encode()).hexdigest()[:32]


def _arrow() -> tuple[Any, Any]:
    """pyarrow and pyarrow.parquet, imported when a version 2 index is first written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def _digest(value: str | None, size: int, what: str) -> bytes | None:
    """A hex digest as its raw bytes (None stays None); anything else is an error, never a silent change."""
    if value is None:
        return None
    if len(value) != 2 * size or not all(c in string.hexdigits for c in value):
        raise IndexFormatError(f"{what}: {value!r} is not a hex digest of {size} bytes")
    return bytes.fromhex(value)


def typed_lengths(lengths: Any, length_type: str, what: str) -> np.ndarray:
    """``lengths`` in the column's type; whole numbers only in an int64 column (never silently rounded)."""
    arr = np.asarray(lengths)
    if length_type == "float64":
        return arr.astype(np.float64)
    if arr.dtype.kind == "f":
        if arr.size and not np.all(arr == np.round(arr)):
            raise IndexFormatError(f"{what}: lengths are not whole numbers; write the index with float64 lengths")
    return arr.astype(np.int64)


class _TableFile:
    """One Parquet table streamed to a temporary name, one row group per `write()`, page checksums on."""

    def __init__(
        self, url: str, schema: pa.Schema, index_id: str, storage_options: dict | None, dictionary: list[str]
    ) -> None:
        _, pq = _arrow()
        self.out = AtomicWriter(url, storage_options)
        self.rows = self.groups = 0
        self.writer = pq.ParquetWriter(
            self.out.file,
            schema.with_metadata({ID_KEY: index_id.encode()}),
            compression="zstd",
            write_page_checksum=True,
            use_dictionary=dictionary,
        )

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.rows, self.groups = self.rows + table.num_rows, self.groups + 1

    def finish(self) -> int:
        self.writer.close()
        return self.out.finish()

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # already closed, or broken by the error being handled
            self.writer.close()  # (a footer into the file thrown away next)
        self.out.abort()


def _column(group: list[tuple[Any, np.ndarray]], attr: str, typ: pa.DataType, n: int) -> pa.Array:
    """An optional per-sample attribute of the group's shards as one column; nulls where a shard has none."""
    pa, _ = _arrow()
    values = [(getattr(s, attr, None), len(x)) for s, x in group]
    if all(v is None for v, _ in values):
        return pa.nulls(n, typ)
    return pa.concat_arrays([pa.nulls(c, typ) if v is None else pa.array(v, typ) for v, c in values])


def _meta_column(group: list[tuple[Any, np.ndarray]], name: str, typ: str) -> pa.Array:
    """A metadata column of the group's shards (a shard without it: nulls)."""
    pa, _ = _arrow()
    arrays = [arrow_column((getattr(s, "columns", None) or {}).get(name), typ, len(x)) for s, x in group]
    for (s, x), a in zip(group, arrays):
        if len(a) != len(x):
            raise IndexFormatError(f"shard {s.url}: {len(a)} values of column {name!r} for {len(x)} samples")
    return pa.concat_arrays(arrays) if arrays else pa.array([], pa.type_for_alias(typ))


class V2Writer:
    """Streams shards into the version 2 tables: bounded memory (one row group of samples and one of shards).

    Groups of whole shards of about ``rows_per_group`` samples become row groups; about ``rows_per_file``
    samples (whole groups) make a sample file. `close()` publishes the tables and returns the header's
    ``tables`` entry; nothing is visible under the final names before then (local storage). ``index_name``: the
    header's file name, which names the tables (`table_names()`; ``names``: other names for them, as
    (shard table, sample folder)). ``output_length``: the sample
    table has an ``output_length`` column (each shard's ``output_lengths``). ``columns``: the metadata columns,
    ``{name: arrow type}``, whose values each shard brings in its ``columns`` dict (null where absent).
    """

    def __init__(
        self,
        root: str,
        length_type: str,
        storage_options: dict | None = None,
        rows_per_file: int | None = None,
        rows_per_group: int | None = None,
        index_name: str = INDEX_NAME,
        columns: dict[str, str] | None = None,
        output_length: bool = False,
        names: tuple[str, str] | None = None,
    ) -> None:
        if length_type not in LENGTH_TYPES:
            raise OptionError(f"length_type must be one of {LENGTH_TYPES}, got {length_type!r}")
        self.root, self.length_type, self.so = root, length_type, storage_options
        self.output_length = output_length
        self.extra = dict(columns or {})
        self.schema = sample_schema(length_type, self.extra, output_length)
        self.rows_per_file = rows_per_file or columnar.ROWS_PER_FILE
        self.rows_per_group = rows_per_group or columnar.ROWS_PER_GROUP
        self.id = write_id(index_name)
        self.shards_name, self.samples_dir = names or table_names(index_name)
        self.num_shards = self.num_samples = 0
        self.total: float | int = 0
        self.bytes = 0
        self.group: list[tuple[Any, np.ndarray]] = []
        self.group_rows = 0
        self.shard_rows: dict[str, list[Any]] = {n: [] for n in shard_schema(length_type).names}
        self.parts: list[dict[str, Any]] = []
        self.files: list[_TableFile] = []
        self.part: _TableFile | None = None
        self.shards = _TableFile(
            table_url(root, self.shards_name), shard_schema(length_type), self.id, storage_options, []
        )
        self.files.append(self.shards)

    def add(self, shard: Any) -> None:
        """Append one shard (``url, count, bytes, lengths, sha256, keys_sha1``; optional ``keys, offsets, sizes``)."""
        what = f"shard {self.num_shards} ({shard.url})"
        lengths = typed_lengths(shard.lengths, self.length_type, what)
        if len(lengths) != int(shard.count):
            raise IndexFormatError(f"{what}: count {shard.count} but {len(lengths)} lengths")
        if self.group_rows and self.group_rows + len(lengths) > self.rows_per_group:
            self._flush_group()
        self.group.append((shard, lengths))
        self.group_rows += len(lengths)
        self.num_shards += 1

    def _flush_group(self) -> None:
        pa, _ = _arrow()
        if self.part is None or (self.part.rows and self.part.rows + self.group_rows > self.rows_per_file):
            self._next_part()
        assert self.part is not None
        schema, n = self.schema, self.group_rows
        ids = [self.num_shards - len(self.group) + i for i in range(len(self.group))]
        counts = [len(x) for _, x in self.group]
        table = pa.table(
            [
                pa.array(np.repeat(np.asarray(ids, np.int32), counts), pa.int32()),
                _column(self.group, "keys", pa.string(), n),
                pa.array(np.concatenate([x for _, x in self.group]), schema.field("length").type),
                _column(self.group, "offsets", pa.int64(), n),
                _column(self.group, "sizes", pa.int64(), n),
            ]
            + ([_column(self.group, "output_lengths", pa.int64(), n)] if self.output_length else [])
            + [_meta_column(self.group, k, t) for k, t in self.extra.items()],
            schema=schema,
        )
        self.part.write(table)
        self._shard_rows(len(self.parts) - 1, self.part.groups - 1)

    def _shard_rows(self, part: int, row_group: int) -> None:
        """The shard-table rows of the pending group, flushed as a row group every ``rows_per_group`` shards."""
        r = self.shard_rows
        for shard, x in self.group:
            total, mx, mn = (x.sum().item(), x.max().item(), x.min().item()) if len(x) else (0, 0, 0)
            for name, value in (
                ("url", shard.url),
                ("count", len(x)),
                ("bytes", int(shard.bytes)),
                ("first", self.num_samples),
                ("sha256", _digest(shard.sha256, 32, f"shard {shard.url}: sha256")),
                ("keys_sha1", _digest(shard.keys_sha1, 20, f"shard {shard.url}: keys_sha1")),
                ("total_length", total),
                ("max_length", mx),
                ("min_length", mn),
                ("part", part),
                ("row_group", row_group),
            ):
                r[name].append(value)
            self.num_samples += len(x)
            self.total += total
            self.bytes += int(shard.bytes)
        self.group, self.group_rows = [], 0
        if len(r["url"]) >= self.rows_per_group:
            self._flush_shards()

    def _flush_shards(self) -> None:
        pa, _ = _arrow()
        if self.shard_rows["url"]:
            self.shards.write(pa.table(self.shard_rows, schema=shard_schema(self.length_type)))
            self.shard_rows = {n: [] for n in self.shard_rows}

    def _next_part(self) -> None:
        if self.part is not None:
            self._end_part()
        rel = f"{self.samples_dir}/part-{len(self.parts):05d}.parquet"
        self.parts.append({"path": rel, "shards": [self.num_shards - len(self.group), None]})
        self.part = _TableFile(table_url(self.root, rel), self.schema, self.id, self.so, ["shard"])
        self.files.append(self.part)

    def _end_part(self) -> None:
        assert self.part is not None
        entry = self.parts[-1]
        entry.update(bytes=self.part.finish(), rows=self.part.rows, row_groups=self.part.groups)
        entry["shards"][1] = self.num_shards - len(self.group)

    def close(self) -> dict[str, Any]:
        """Write what is pending, publish every table; returns the header's ``tables`` entry."""
        if self.group_rows:
            self._flush_group()
        elif self.group:  # trailing shards without samples: part of the last row group, if there is one
            self._shard_rows(len(self.parts) - 1, self.part.groups - 1 if self.part else -1)
        if self.part is not None:
            self._end_part()
        self._flush_shards()
        tables = {
            "shards": {"path": self.shards_name, "bytes": self.shards.finish(), "rows": self.shards.rows},
            "samples": self.parts,
        }
        for f in self.files:
            f.out.publish()
        return tables

    def abort(self) -> None:
        """Throw away every table file of this write (after an error), and the sample-table folder it made."""
        for f in self.files:
            f.abort()
        self._drop_empty_folder()

    def unpublish(self) -> None:
        """Remove the tables `close()` published (their header could not be written after them)."""
        for f in self.files:
            with contextlib.suppress(Exception):  # cleaning up after another error: that one is the one to see
                remove(f.out.url, self.so)
        self._drop_empty_folder()

    def _drop_empty_folder(self) -> None:
        if is_local(self.root):
            with contextlib.suppress(OSError):  # not empty (tables from before), or never made
                os.rmdir(local_path(table_url(self.root, self.samples_dir)))


def write_v2(
    index_url: str,
    shards: Any,
    header: dict[str, Any],
    length_type: str,
    storage_options: dict | None = None,
    progress: Any = None,
    columns: dict[str, str] | None = None,
    output_length: bool = False,
    **sizes: int,
) -> dict[str, Any]:
    """Stream ``shards`` into the tables beside ``index_url``, then write the header there last, atomically
    (``header``: unit, sample_rate, meta; counts, columns and tables are added). ``progress``: a tqdm-like bar
    updated per shard; ``columns``: the metadata columns; ``output_length``: write the shards' output lengths.
    Returns the header written. An index in place stays whole until the header is replaced (`index_swap`):
    the tables go under names it does not use, and its own are removed after."""
    root, index_name = parent_url(index_url), index_url.rstrip("/").rsplit("/", 1)[-1]
    taken = named_tables(index_url, storage_options)
    names = free_names(index_name, taken)
    clear_names(root, names, storage_options)
    w = V2Writer(
        root,
        length_type,
        storage_options,
        **sizes,
        index_name=index_name,
        columns=columns,
        output_length=output_length,
        names=names,
    )
    try:
        for shard in shards:
            w.add(shard)
            if progress is not None:
                progress.update(1)
        tables = w.close()
    except BaseException:  # the tables' names are ones no header names: nothing of this write is left
        w.abort()
        w.unpublish()
        raise
    out = {
        "format": FORMAT,
        "version": 2,
        **header,
        "num_shards": w.num_shards,
        "num_samples": w.num_samples,
        "total_length": json_number(w.total),
        "total_bytes": w.bytes,
        "id": w.id,
        "columns": {f.name: str(f.type) for f in w.schema},
        "tables": tables,
    }
    try:
        write_bytes_atomic(index_url, json.dumps(out, separators=(",", ":")).encode(), storage_options)
    except BaseException:  # before the swap: nothing of this write is left; after it, the new index is whole
        if not swapped_in(index_url, w.id, w.shards_name, storage_options):
            w.unpublish()
        raise
    drop_tables(root, taken - {tables["shards"]["path"], *(p["path"] for p in tables["samples"])}, storage_options)
    return out
