"""The dataset index beside the shards: every shard with its sample count, byte size, checksums and the
per-sample lengths in shard order, so a loader can plan a whole epoch (batches, DDP split, ``len()``) before
reading a byte of audio.

Version 1 is one ``index.json`` (lengths as base64 per shard); version 2 is a header plus columnar tables
(`columnar`) whose lengths load per row group, on first use. `ShardIndex` reads both.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import limits
from ..errors import DatasetNotFound, OptionError, output_fits, path_option
from ..io.storage import is_local, join_url, local_path, parent_url, read_whole, write_bytes_atomic
from ..stats import LengthStats, json_number, stream_stats
from ..units import Unit
from .columnar import FORMAT, INDEX_NAME, ColumnarIndex, IndexFormatError
from .columnar_write import write_v2
from .columns import merged_columns
from .index_header import check_header
from .index_values import check_v1
from .members import ShardMembers, shard_members
from .shards import SHARD_NUMBERS, ShardInfo, ShardList, _packed_dtype, _saving
from .trust import Roots

__all__ = ["FORMAT", "INDEX_NAME", "IndexFormatError", "ShardIndex", "ShardInfo", "ShardList", "upgrade"]

VERSION = 2  # what save writes by default (to_json is always version 1)
NEWEST = 2  # the newest version this streambatch reads
log = logging.getLogger(__name__)


@dataclass
class ShardIndex:
    """The index of a length-annotated dataset: shards, their lengths, and the unit lengths are in.

    ``unit``: a `Unit` (or its name): ``"samples"`` (audio samples at ``sample_rate``),
    ``"seconds"``, ``"tokens"`` or ``"frames"``. ``root`` is the folder or URL the relative shard urls resolve
    against. ``shards`` is a list, or a `ShardList` for an index loaded from version 2. ``columns``: the
    sample table's metadata columns, ``{name: arrow type}`` (`columns`; a version 2 index's own when not
    given). ``roots``: where its shard URLs may point (`trust`), set by `load()` from the index's folder
    and the user's ``shard_roots``; None for an index built in code, whose URLs are the code's own.
    """

    shards: Sequence[ShardInfo]
    unit: Unit
    sample_rate: int | None = None
    root: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)
    roots: Roots | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.unit = Unit.parse(self.unit)
        if not self.columns and isinstance(self.shards, ShardList):
            self.columns = dict(self.shards.reader.extra)

    # ---- reading and writing -------------------------------------------------------------------
    @classmethod
    def load(cls, url: str, storage_options: dict | None = None, shard_roots: Sequence[str] = ()) -> ShardIndex:
        """Read an index (version 1 or 2) from a path or fsspec URL: the dataset folder or the index file.
        Version 2 reads the header and the shard table; lengths load when asked for. Its shard URLs resolve only
        inside the index's folder, or under one of ``shard_roots`` (the user's; `trust`): another is refused
        with `UntrustedURL` before anything opens it. Nothing at ``url`` (no folder, or a
        folder without ``index.json``) is `DatasetNotFound` (a ``FileNotFoundError``), as
        for the loader; a path that is there but is no index (a file, ``index.json`` a folder) an
        `IndexFormatError`; ``url`` empty or not a path an `OptionError`."""
        url = _index_url(path_option("url", url, f"a dataset folder, index file or URL ({EXPECTED})"))
        try:
            raw = read_whole(url, storage_options)  # one GET: no size request before it
        except FileNotFoundError as e:
            raise DatasetNotFound(f"no dataset index at {url}: {EXPECTED}") from e
        except (NotADirectoryError, IsADirectoryError) as e:
            raise IndexFormatError(_not_an_index(url, e)) from None
        return cls.from_raw(raw, url, storage_options, shard_roots)

    @classmethod
    def from_raw(
        cls,
        raw: bytes,
        url: str,
        storage_options: dict | None = None,
        shard_roots: Sequence[str] = (),
        tables: dict[str, str] | None = None,
    ) -> ShardIndex:
        """An index from the bytes of its index file at ``url``, checked as `load()` checks it. ``tables``: local
        copies of table files to read instead of those beside ``url`` (`shared_index`)."""
        try:
            d = limits.loads(raw)
        except ValueError as e:  # not JSON (or not UTF-8), or nested deeper than the limit
            raise IndexFormatError(f"{url}: not valid JSON ({e})") from e
        return cls.from_json(d, parent_url(url), url, storage_options, shard_roots, tables)

    @classmethod
    def from_json(
        cls,
        d: dict[str, Any],
        root: str | None = None,
        source: str = "<index>",
        storage_options: dict | None = None,
        shard_roots: Sequence[str] = (),
        tables: dict[str, str] | None = None,
    ) -> ShardIndex:
        """An index from its parsed ``index.json``; version 2 reads its tables under ``root`` (or the local copies
        ``tables`` names). With a ``root``, its shard URLs must resolve inside it or under one of ``shard_roots``
        (`load()`)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise IndexFormatError(
                f"{source}: not a {FORMAT} file (format={d.get('format') if isinstance(d, dict) else None!r})"
            )
        version = d.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise IndexFormatError(f"{source}: index version {version!r} is not a whole number")
        if version > NEWEST:
            raise IndexFormatError(
                f"{source}: index version {d['version']} is newer than this streambatch reads ({NEWEST})"
            )
        check_header(d, version, source)
        try:
            unit = Unit.parse(d["unit"])
        except KeyError as e:
            raise IndexFormatError(f"{source}: no {e} in the index") from e
        except OptionError as e:
            raise IndexFormatError(f"{source}: {e}") from None
        if version == 2:
            if root is None:
                raise IndexFormatError(f"{source}: a version 2 index needs its folder to read its tables")
            shards: Sequence[ShardInfo] = ShardList(ColumnarIndex(root, d, storage_options, source, tables))
        else:
            try:
                shards = [ShardInfo.from_json(s) for s in d["shards"]]
            except (KeyError, TypeError, ValueError) as e:
                raise IndexFormatError(f"{source}: malformed shard entry ({e!r})") from e
            check_v1(shards, source)
        roots = Roots(root, shard_roots, source) if root else None
        meta = dict(d.get("meta") or {})
        return cls(shards=shards, unit=unit, sample_rate=d.get("sample_rate"), root=root, meta=meta, roots=roots)

    def to_json(self) -> dict[str, Any]:
        """The version 1 ``index.json`` (all lengths inline)."""
        return {
            "format": FORMAT,
            "version": 1,
            "unit": self.unit.value,
            "sample_rate": self.sample_rate,
            "num_shards": self.num_shards,
            "num_samples": self.num_samples,
            "total_length": json_number(self.total_length),
            "meta": self.meta,
            "shards": [s.to_json() for s in self.shards],
        }

    def save(
        self, url: str, storage_options: dict | None = None, version: int = VERSION, progress: bool = False
    ) -> str:
        """Write the index atomically (temporary names, then renames or whole uploads; version 2 writes its
        tables first and ``index.json`` last). Returns the index file's URL."""
        url = _index_url(url)
        if version not in (1, 2):
            raise OptionError(f"index version must be 1 or 2, got {version!r}")
        with output_fits(url, "the index (its tables, then this file; an index already there is kept)"):
            if version == 2:
                self._save_v2(url, storage_options, progress)
            else:
                data = json.dumps(self.to_json(), separators=(",", ":")).encode()
                write_bytes_atomic(url, data, storage_options)
        return url

    def _save_v2(self, url: str, storage_options: dict | None, progress: bool) -> None:
        from tqdm import tqdm

        header = {"unit": self.unit.value, "sample_rate": self.sample_rate, "meta": self.meta}
        with tqdm(
            total=len(self.shards), desc="writing index", unit="shard", file=sys.stderr, disable=not progress
        ) as bar:
            write_v2(
                url,
                (_saving(s) for s in self.shards),
                header,
                self._length_type(),
                storage_options,
                progress=bar,
                columns=self.columns,
                output_length=self.has_output_lengths,
            )

    def _length_type(self) -> str:
        """The length column's type: float64 if any shard's lengths are fractional, else int64."""
        if isinstance(self.shards, ShardList) and not self.shards.changed:
            return self.shards.reader.length_type
        for s in self.shards:
            stored = s._table.reader.length_type if s._table is not None and s._lengths is None else None
            if (stored or _packed_dtype(np.asarray(s.lengths))) in ("float64", "<f8"):
                return "float64"
        return "int64"

    # ---- contents ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The index format this index was read from (1 for one built in memory)."""
        return 2 if isinstance(self.shards, ShardList) else 1

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def num_samples(self) -> int:
        if isinstance(self.shards, ShardList):
            return int(self.shards.column("count").sum())
        return int(sum(s.count for s in self.shards))

    @property
    def total_length(self) -> float:
        if isinstance(self.shards, ShardList):
            return float(sum(self.shards.column("total_length").tolist()))  # in order, as version 1 adds
        return float(sum(s.total_length for s in self.shards))

    @property
    def total_bytes(self) -> int | None:
        """Bytes of all shards (None for a version 2 index written before its header carried the figure)."""
        if isinstance(self.shards, ShardList):
            value = self.shards.reader.header.get("total_bytes")
            return int(value) if value is not None else None
        return int(sum(s.bytes for s in self.shards))

    @property
    def lengths(self) -> np.ndarray:
        """All per-sample lengths, shards in index order, samples in tar order."""
        if isinstance(self.shards, ShardList):
            return self.shards.all_lengths()
        if not self.shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([s.lengths for s in self.shards])

    def shard_lengths(self, shards: Sequence[int]) -> list[np.ndarray]:
        """The lengths of the given shards; on version 2 only their row groups are read (one read each)."""
        if isinstance(self.shards, ShardList):
            return self.shards.shard_lengths(shards)
        return [self.shards[int(i)].lengths for i in shards]

    @property
    def has_output_lengths(self) -> bool:
        """Whether every sample has an output length (a second length: ``shardify write --output-length``)."""
        if isinstance(self.shards, ShardList):
            return self.shards.reader.has_output_lengths
        return bool(self.shards) and all(s.has_output_lengths for s in self.shards)

    def shard_output_lengths(self, shards: Sequence[int]) -> list[np.ndarray]:
        """The output lengths (int64) of the given shards, like `shard_lengths()`: on version 2 only their
        row groups are read (one read each). The index must have them (`has_output_lengths`)."""
        if not self.has_output_lengths:
            raise IndexFormatError("this index has no output lengths (write it with `shardify write --output-length`)")
        if isinstance(self.shards, ShardList):
            return self.shards.reader.shard_output_lengths(shards)
        return [np.asarray(self.shards[int(i)].output_lengths, dtype=np.int64) for i in shards]

    def iter_lengths(self) -> Iterator[np.ndarray]:
        """Every shard's lengths in order, streamed (version 2: one row group in memory at a time)."""
        if isinstance(self.shards, ShardList):
            return self.shards.iter_lengths()
        return (s.lengths for s in self.shards)

    def shard_table(self, columns: Sequence[str] = SHARD_NUMBERS) -> dict[str, np.ndarray]:
        """Per-shard numbers without per-sample data (of ``count``, ``total_length``, ``max_length``,
        ``min_length``), plus ``first``: the global id of each shard's first sample."""
        if isinstance(self.shards, ShardList):
            out = {k: self.shards.column(k) for k in columns}
            count = out["count"] if "count" in out else self.shards.column("count")
        else:
            ls = [np.asarray(s.lengths) for s in self.shards]
            count = np.array([s.count for s in self.shards], dtype=np.int64)
            every = {
                "count": lambda: count,
                "total_length": lambda: np.array([s.total_length for s in self.shards], dtype=np.float64),
                "max_length": lambda: np.array([s.max_length for s in self.shards], dtype=np.float64),
                "min_length": lambda: np.array([x.min() if len(x) else 0 for x in ls], dtype=np.float64),
            }
            out = {k: every[k]() for k in columns}
        out["first"] = (np.cumsum(count) - count).astype(np.int64)
        return out

    def sample_offsets(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(byte offset of each sample's first member header in the tar, bytes its members span), or None
        where the index does not know them."""
        if isinstance(self.shards, ShardList):
            return self.shards.reader.sample_offsets(int(shard))
        info = self.shards[int(shard)]
        if info.offsets is None or info.sizes is None:
            return None
        return np.asarray(info.offsets), np.asarray(info.sizes)

    def shard_members(self, shard: int) -> ShardMembers:
        """How shard ``shard``'s tar members map to its samples: the key rule, and its segments' rows (several
        samples in one member group; see `members`)."""
        return shard_members(self, int(shard))

    def has_column(self, name: str) -> bool:
        """Whether the sample table has the metadata column ``name``."""
        return name in self.columns

    def shard_values(self, shard: int, name: str) -> list[Any] | None:
        """The values of the sample table's metadata column ``name`` for one shard's samples (tar order), or
        None where the index has no such column (the reader reads the shard's row group on first use)."""
        if name not in self.columns:
            return None
        if isinstance(self.shards, ShardList):
            return self.shards.reader.shard_values(int(shard), name)
        values = (self.shards[int(shard)].columns or {}).get(name)
        if values is None:
            return None
        return values.to_pylist() if hasattr(values, "to_pylist") else list(values)  # an Arrow array, as a write makes

    def shard_url(self, i: int) -> str:
        """The absolute URL (or path) of shard ``i``, once it is inside the roots the index may reach."""
        return self._resolved(self.shards[int(i)].url)

    def shard_urls(self) -> list[str]:
        """Absolute URLs (or paths) of every shard (a list: O(shards); readers use `ShardURLs`), each
        checked as `shard_url()` checks it."""
        return [self._resolved(u) for u in self._entries()]

    def check_urls(self) -> None:
        """Refuse the index (`UntrustedURL`) if any shard URL points outside its roots:
        done where a dataset is opened, so a bad URL stops the run before any shard is read (string work only)."""
        if self.roots is not None:
            for entry in self._entries():
                self._resolved(entry)

    def allow(self, shard_roots: Sequence[str]) -> ShardIndex:
        """Let this loaded index's shard URLs also point under ``shard_roots`` (the user's); returns the index."""
        if self.roots is not None and shard_roots:
            self.roots = Roots(self.root, [*self.roots.allowed, *shard_roots], self.roots.source)
        return self

    def _entries(self) -> list[str]:
        """The shard urls as the index lists them (relative to its folder, or absolute)."""
        return self.shards.urls() if isinstance(self.shards, ShardList) else [s.url for s in self.shards]

    def _resolved(self, entry: str) -> str:
        url = _absolute(entry, self.root)
        return url if self.roots is None else self.roots.check_entry(entry, url)

    def seconds_per_unit(self) -> float | None:
        """How many seconds one length unit is, for audio units; None for tokens/frames."""
        return self.unit.seconds_per_unit(self.sample_rate)

    def length_stats(self, progress: bool = False) -> LengthStats:
        """Statistics of every length, streamed shard by shard in bounded memory (exact percentiles up to a
        few million samples, within 0.1 % beyond)."""
        whole = self.shards.reader if isinstance(self.shards, ShardList) and not self.shards.changed else None
        chunks = whole.iter_group_lengths() if whole is not None else self.iter_lengths()
        if progress:
            from tqdm.auto import tqdm

            total = len(whole.group_start) if whole is not None else self.num_shards
            chunks = tqdm(chunks, total=total, unit="part", desc="reading lengths", leave=False)
        stats = stream_stats(chunks)
        stats.total = float(self.total_length)  # the shard table's sum: the same whichever way it was streamed
        return stats

    def stats(self) -> dict[str, Any]:
        """Counts, totals and length percentiles (and hours for audio units)."""
        return self.length_stats().summary(self.unit, self.seconds_per_unit(), num_shards=self.num_shards)

    @classmethod
    def merge(cls, indexes: Sequence[ShardIndex]) -> ShardIndex:
        """Concatenate the shards of several indexes (parts of one dataset, same unit and rate)."""
        if not indexes:
            raise OptionError("nothing to merge")
        first = indexes[0]
        for ix in indexes[1:]:
            if ix.unit != first.unit or ix.sample_rate != first.sample_rate:
                raise OptionError(
                    f"cannot merge indexes with different units: {first.unit}@{first.sample_rate} "
                    f"and {ix.unit}@{ix.sample_rate}"
                )
        shards: list[ShardInfo] = []
        for ix in indexes:
            shards.extend(ix.shards)
        columns = merged_columns([ix.columns for ix in indexes], [str(ix.root) for ix in indexes])
        return cls(
            shards=shards,
            unit=first.unit,
            sample_rate=first.sample_rate,
            root=first.root,
            meta=dict(first.meta),
            columns=columns,
        )


def _absolute(url: str, root: str | None) -> str:
    if not root or "://" in url or url.startswith("/"):
        return url
    return join_url(root, url)


def _index_url(url: str) -> str:
    url = str(url)
    return url if is_index_file(url) else join_url(url, INDEX_NAME)


def is_index_file(url: str) -> bool:
    """Whether ``url`` names an index file rather than a dataset folder: it ends in ``.json`` and is not a local
    folder (a dataset folder may be named ``*.json``)."""
    url = str(url)
    return url.endswith(".json") and not (is_local(url) and os.path.isdir(local_path(url)))


#: what `ShardIndex.load()` reads, for its messages
EXPECTED = (
    f"expected a dataset folder written by `shardify write` or `shardify index` (holding {INDEX_NAME}), "
    f"or its {INDEX_NAME}"
)


def _not_an_index(url: str, e: OSError) -> str:
    """Why the local ``url`` is no index: it is a folder, or a path along it is a file (``/dev/null``, a shard)."""
    if isinstance(e, IsADirectoryError):
        return f"{url} is a folder, not an index file: {EXPECTED}"
    path = os.path.dirname(local_path(url))
    while path and not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return f"{url}: not a dataset index, {path or url} is a file, not a folder: {EXPECTED}"


def upgrade(url: str, storage_options: dict | None = None, progress: bool = True) -> str:
    """Rewrite a version 1 dataset index as version 2 in place: the tables first, ``index.json`` last (the
    version 1 file is replaced only by that final rename). Sample offsets are unknown (null). A version 2
    index is left as it is (logged). Returns the index file's URL. It holds no writer lock: ``shardify upgrade``
    (`streambatch.write.upgrade.upgrade_dataset()`) does, so no write of the folder runs meanwhile."""
    index_url = _index_url(url)
    index = ShardIndex.load(index_url, storage_options)
    if index.version >= 2:
        log.info("%s is already a version %d index: nothing to upgrade", index_url, index.version)
        return index_url
    return index.save(index_url, storage_options, version=2, progress=progress)
