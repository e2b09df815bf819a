"""Shards as the index lists them: `ShardInfo` (one shard, lengths in memory or in a version 2 sample
table), `ShardList` (the shards of a version 2 index over its shard table) and the version 1 length
encoding."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .columnar import ColumnarIndex, IndexFormatError


def _packed_dtype(arr: np.ndarray) -> str:
    """The smallest exact little-endian dtype for a length array (version 1's rule)."""
    if arr.dtype.kind == "f":
        if arr.size and np.all(arr == np.round(arr)) and arr.min() >= 0 and arr.max() < 2**32:
            return "<u4"
        return "<f8"
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        return "<i8"
    return "<u4"


def encode_lengths(lengths: np.ndarray) -> dict[str, str]:
    """Pack a length array compactly: the smallest exact dtype, little-endian, base64."""
    arr = np.asarray(lengths)
    arr = arr.astype(_packed_dtype(arr))
    return {"dtype": arr.dtype.str, "b64": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode_lengths(packed: dict[str, str]) -> np.ndarray:
    """Inverse of `encode_lengths()`; integer lengths come back as int64, float lengths as float64."""
    arr = np.frombuffer(base64.b64decode(packed["b64"]), dtype=np.dtype(packed["dtype"]))
    return arr.astype(np.float64 if arr.dtype.kind == "f" else np.int64)


class ShardInfo:
    """One shard as the index lists it. ``url`` is relative to the index's folder unless absolute.

    ``lengths``: per-sample lengths in tar order; from a version 2 index they load on first use (the shard's
    row group, cached by the index). ``keys``/``offsets``/``sizes``/``columns`` (metadata column values by name):
    optional per-sample extras a writer may attach for the version 2 sample table (not stored in version 1, not
    loaded back). ``output_lengths``: each sample's second length (``--output-length``), or None; stored in both
    versions, loaded on use.
    """

    __slots__ = (
        "url",
        "count",
        "bytes",
        "sha256",
        "keys_sha1",
        "keys",
        "offsets",
        "sizes",
        "columns",
        "_lengths",
        "_table",
        "_row",
        "_output_lengths",
    )

    def __init__(
        self,
        url: str,
        count: int,
        bytes: int,
        lengths: np.ndarray | None = None,
        sha256: str | None = None,
        keys_sha1: str | None = None,
        *,
        keys: Sequence[str] | None = None,
        offsets: Any = None,
        sizes: Any = None,
        columns: dict[str, Any] | None = None,
        table: ShardList | None = None,
        row: int = -1,
        output_lengths: np.ndarray | None = None,
    ) -> None:
        if lengths is None and table is None:
            raise TypeError("ShardInfo needs lengths")
        self.url, self.count, self.bytes, self.sha256, self.keys_sha1 = url, count, bytes, sha256, keys_sha1
        self.keys, self.offsets, self.sizes, self.columns = keys, offsets, sizes, columns
        self._lengths, self._table, self._row = lengths, table, row
        self._output_lengths = output_lengths

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            assert self._table is not None
            return self._table.lengths_of(self._row)
        return self._lengths

    @lengths.setter
    def lengths(self, value: np.ndarray) -> None:
        self._lengths = value
        if self._table is not None:
            self._table.changed.add(self._row)

    @property
    def has_output_lengths(self) -> bool:
        """Whether the shard knows its samples' output lengths (without reading them)."""
        return self._output_lengths is not None or (self._table is not None and self._table.reader.has_output_lengths)

    @property
    def output_lengths(self) -> np.ndarray | None:
        """Each sample's output length (int64), or None; from a version 2 index: its row group, read now."""
        if self._output_lengths is None and self.has_output_lengths:
            assert self._table is not None
            return self._table.reader.shard_output_lengths([self._row])[0]
        return self._output_lengths

    def _from_table(self, column: str) -> float | None:
        """A number of the version 2 shard table, while the lengths are the stored ones."""
        if self._lengths is None and self._table is not None:
            return float(getattr(self._table.columns, column)[self._row])
        return None

    @property
    def total_length(self) -> float:
        stored = self._from_table("total_length")
        if stored is not None:
            return stored
        return float(self.lengths.sum()) if self.count else 0.0

    @property
    def max_length(self) -> float:
        stored = self._from_table("max_length")
        if stored is not None:
            return stored
        return float(self.lengths.max()) if self.count else 0.0

    def __repr__(self) -> str:
        return f"ShardInfo(url={self.url!r}, count={self.count}, bytes={self.bytes}, sha256={self.sha256!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardInfo):
            return NotImplemented
        same = all(getattr(self, k) == getattr(other, k) for k in ("url", "count", "bytes", "sha256", "keys_sha1"))
        return same and np.array_equal(self.lengths, other.lengths)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def to_json(self) -> dict[str, Any]:
        lengths = self.lengths
        total = lengths.sum() if self.count else 0
        mx = lengths.max() if self.count else 0
        outputs = self.output_lengths
        return {
            "url": self.url,
            "count": int(self.count),
            "bytes": int(self.bytes),
            "total_length": total.item() if hasattr(total, "item") else total,
            "max_length": mx.item() if hasattr(mx, "item") else mx,
            "sha256": self.sha256,
            "keys_sha1": self.keys_sha1,
            "lengths": encode_lengths(lengths),
            **({"output_lengths": encode_lengths(outputs)} if outputs is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardInfo:
        lengths = decode_lengths(d["lengths"])
        outs = decode_lengths(d["output_lengths"]) if "output_lengths" in d else None
        if len(lengths) != int(d["count"]) or (outs is not None and len(outs) != len(lengths)):
            raise IndexFormatError(
                f"shard {d.get('url')!r}: count {d['count']} but {len(lengths)} lengths"
                + ("" if outs is None else f" and {len(outs)} output lengths")
            )
        return cls(
            url=d["url"],
            count=int(d["count"]),
            bytes=int(d["bytes"]),
            lengths=lengths,
            sha256=d.get("sha256"),
            keys_sha1=d.get("keys_sha1"),
            output_lengths=outs,
        )


def _hex_rows(column: Any, a: int, b: int) -> list[str | None]:
    """Rows ``[a, b)`` of a fixed-size binary column as hex strings (None where null), in one conversion."""
    arr = column.slice(a, b - a).combine_chunks()
    width = arr.type.byte_width
    raw = arr.buffers()[1].to_pybytes()[arr.offset * width : (arr.offset + len(arr)) * width].hex()
    out: list[str | None] = [raw[2 * width * k : 2 * width * (k + 1)] for k in range(len(arr))]
    if arr.null_count:
        for k in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)).tolist():
            out[k] = None
    return out


SHARD_NUMBERS = ("count", "total_length", "max_length", "min_length")


class ShardList(Sequence[ShardInfo]):
    """The shards of a version 2 index, over its shard table: a `ShardInfo` is made on first access
    and kept (changes to it stay, as in a list). Whole-index numbers come from the table's columns, except
    for shards whose lengths were set in memory (``changed``)."""

    _BLOCK = 4096

    def __init__(self, reader: ColumnarIndex) -> None:
        self.reader, self.columns = reader, reader.columns
        self._made: dict[int, ShardInfo] = {}
        self.changed: set[int] = set()

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i) + len(self) if int(i) < 0 else int(i)
        if not 0 <= i < len(self):
            raise IndexError("shard index out of range")
        if i not in self._made:
            self._make(i, i + 1)
        return self._made[i]

    def __iter__(self) -> Iterator[ShardInfo]:
        for a in range(0, len(self), self._BLOCK):
            b = min(a + self._BLOCK, len(self))
            self._make(a, b)
            yield from (self._made[i] for i in range(a, b))

    def _make(self, a: int, b: int) -> None:
        """ShardInfo objects for rows ``[a, b)`` not made yet (columns converted a block at a time)."""
        c, made = self.columns, self._made
        url, sha, ksha = c.url.slice(a, b - a).to_pylist(), _hex_rows(c.sha256, a, b), _hex_rows(c.keys_sha1, a, b)
        count, size = c.count[a:b].tolist(), c.bytes[a:b].tolist()
        for k, i in enumerate(range(a, b)):
            if i not in made:
                made[i] = ShardInfo(url[k], count[k], size[k], None, sha[k], ksha[k], table=self, row=i)

    def lengths_of(self, i: int) -> np.ndarray:
        return self.reader.lengths_of(i)

    def shard_lengths(self, ids: Sequence[int]) -> list[np.ndarray]:
        ids = [int(i) for i in ids]
        stored = iter(self.reader.shard_lengths([i for i in ids if i not in self.changed]))
        return [self._made[i].lengths if i in self.changed else next(stored) for i in ids]

    def all_lengths(self) -> np.ndarray:
        if self.changed:
            return np.concatenate(self.shard_lengths(range(len(self))))
        return self.reader.all_lengths()

    def iter_lengths(self) -> Iterator[np.ndarray]:
        for i, arr in enumerate(self.reader.iter_shard_lengths()):
            yield self._made[i].lengths if i in self.changed else arr

    def column(self, name: str) -> np.ndarray:
        """``count``, ``total_length``, ``max_length`` or ``min_length`` of every shard."""
        arr = getattr(self.columns, name)
        if not self.changed:
            return arr
        arr = arr.copy() if name == "count" else arr.astype(np.float64)
        reduces: dict[str, Callable[[np.ndarray], Any]] = {
            "total_length": np.sum,
            "max_length": np.max,
            "min_length": np.min,
        }
        reduce = reduces.get(name)
        for i in self.changed:
            x, n = self._made[i].lengths, self._made[i].count
            arr[i] = n if reduce is None else (reduce(x) if n else 0)
        return arr

    def urls(self) -> list[str]:
        urls = self.columns.url.to_pylist()
        for i, s in self._made.items():
            urls[i] = s.url
        return urls


class _Streamed:
    """A shard as saved: its info, with lengths (and keys, offsets, sizes, metadata columns) from its index's
    sample table when it came from a version 2 index, read a row group at a time and not kept."""

    __slots__ = ("info", "lengths", "keys", "offsets", "sizes", "output_lengths", "columns")

    def __init__(self, info: ShardInfo, stored: dict[str, Any]) -> None:
        self.info = info
        self.lengths, self.keys, self.offsets, self.sizes = (stored[k] for k in ("lengths", "keys", "offsets", "sizes"))
        self.output_lengths = stored.get("output_lengths")
        self.columns = stored.get("columns")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.info, name)


def _saving(info: ShardInfo) -> Any:
    """``info`` ready for the version 2 writer: a shard of a version 2 index brings its stored sample columns
    (lengths set in memory win); a shard built in memory is written as it is."""
    table = info._table
    if table is None:
        return info
    stored = table.reader.shard_samples(info._row)
    if info._lengths is not None:
        stored["lengths"] = info._lengths
    return _Streamed(info, stored)
