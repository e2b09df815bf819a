"""The dataset index: ``index.json`` beside the shards.

It lists every shard with its sample count, byte size, checksum and the per-sample lengths in shard order,
so a loader can plan a whole epoch (batches, DDP split, ``len()``) before reading a byte of audio.
Lengths are stored as base64 of a little-endian numpy array per shard: the index of 10 M samples loads in
a fraction of a second (``tools/bench_index.py``).
"""

from __future__ import annotations

import base64
import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .storage import join_url, open_url, write_bytes_atomic

FORMAT = "streambatch-index"
VERSION = 1
INDEX_NAME = "index.json"


class IndexError_(ValueError):
    """An index file that cannot be read or does not describe a streambatch dataset."""


def encode_lengths(lengths: np.ndarray) -> dict[str, str]:
    """Pack a length array compactly: the smallest exact dtype, little-endian, base64."""
    arr = np.asarray(lengths)
    if arr.dtype.kind == "f":
        if arr.size and np.all(arr == np.round(arr)) and arr.min() >= 0 and arr.max() < 2**32:
            arr = arr.astype("<u4")
        else:
            arr = arr.astype("<f8")
    else:
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            arr = arr.astype("<i8")
        else:
            arr = arr.astype("<u4")
    return {"dtype": arr.dtype.str, "b64": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode_lengths(packed: dict[str, str]) -> np.ndarray:
    """Inverse of :func:`encode_lengths`; integer lengths come back as int64, float lengths as float64."""
    arr = np.frombuffer(base64.b64decode(packed["b64"]), dtype=np.dtype(packed["dtype"]))
    return arr.astype(np.float64 if arr.dtype.kind == "f" else np.int64)


@dataclass
class ShardInfo:
    """One shard as the index lists it. ``url`` is relative to the index's folder unless absolute."""

    url: str
    count: int
    bytes: int
    lengths: np.ndarray
    sha256: str | None = None
    keys_sha1: str | None = None

    @property
    def total_length(self) -> float:
        return float(self.lengths.sum()) if self.count else 0.0

    @property
    def max_length(self) -> float:
        return float(self.lengths.max()) if self.count else 0.0

    def to_json(self) -> dict[str, Any]:
        total = self.lengths.sum() if self.count else 0
        mx = self.lengths.max() if self.count else 0
        return {
            "url": self.url,
            "count": int(self.count),
            "bytes": int(self.bytes),
            "total_length": total.item() if hasattr(total, "item") else total,
            "max_length": mx.item() if hasattr(mx, "item") else mx,
            "sha256": self.sha256,
            "keys_sha1": self.keys_sha1,
            "lengths": encode_lengths(self.lengths),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardInfo":
        lengths = decode_lengths(d["lengths"])
        if len(lengths) != int(d["count"]):
            raise IndexError_(f"shard {d.get('url')!r}: count {d['count']} but {len(lengths)} lengths")
        return cls(
            url=d["url"],
            count=int(d["count"]),
            bytes=int(d["bytes"]),
            lengths=lengths,
            sha256=d.get("sha256"),
            keys_sha1=d.get("keys_sha1"),
        )


def _is_absolute(url: str) -> bool:
    return "://" in url or url.startswith("/")


@dataclass
class ShardIndex:
    """The index of a length-annotated dataset: shards, their lengths, and the unit lengths are in.

    ``unit`` is ``"samples"`` (audio samples at ``sample_rate``), ``"seconds"``, ``"tokens"`` or
    ``"frames"``. ``root`` is the folder or URL the relative shard urls resolve against.
    """

    shards: list[ShardInfo]
    unit: str
    sample_rate: int | None = None
    root: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- reading and writing -------------------------------------------------------------------
    @classmethod
    def load(cls, url: str, storage_options: dict | None = None) -> "ShardIndex":
        """Read an index from a path or fsspec URL: the dataset folder or the ``index.json`` itself."""
        url = str(url)
        if not url.endswith(".json"):
            url = join_url(url, INDEX_NAME)
        try:
            with open_url(url, "rb", storage_options) as f:
                raw = f.read()
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no dataset index at {url}") from e
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise IndexError_(f"{url}: not valid JSON ({e})") from e
        return cls.from_json(d, root=posixpath.dirname(url) if "://" in url else os.path.dirname(url), source=url)

    @classmethod
    def from_json(cls, d: dict[str, Any], root: str | None = None, source: str = "<index>") -> "ShardIndex":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise IndexError_(f"{source}: not a {FORMAT} file (format={d.get('format') if isinstance(d, dict) else None!r})")
        if int(d.get("version", 0)) > VERSION:
            raise IndexError_(f"{source}: index version {d['version']} is newer than this streambatch reads ({VERSION})")
        try:
            shards = [ShardInfo.from_json(s) for s in d["shards"]]
        except (KeyError, TypeError, ValueError) as e:
            raise IndexError_(f"{source}: malformed shard entry ({e!r})") from e
        return cls(
            shards=shards,
            unit=d["unit"],
            sample_rate=d.get("sample_rate"),
            root=root,
            meta=dict(d.get("meta") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "unit": self.unit,
            "sample_rate": self.sample_rate,
            "num_shards": self.num_shards,
            "num_samples": self.num_samples,
            "total_length": _num(self.total_length),
            "meta": self.meta,
            "shards": [s.to_json() for s in self.shards],
        }

    def save(self, url: str, storage_options: dict | None = None) -> str:
        """Write the index atomically (temporary name, then rename or whole upload). Returns its URL."""
        url = str(url)
        if not url.endswith(".json"):
            url = join_url(url, INDEX_NAME)
        data = json.dumps(self.to_json(), separators=(",", ":")).encode()
        write_bytes_atomic(url, data, storage_options)
        return url

    # ---- contents ------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def num_samples(self) -> int:
        return int(sum(s.count for s in self.shards))

    @property
    def total_length(self) -> float:
        return float(sum(s.total_length for s in self.shards))

    @property
    def lengths(self) -> np.ndarray:
        """All per-sample lengths, shards in index order, samples in tar order."""
        if not self.shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([s.lengths for s in self.shards])

    def shard_urls(self) -> list[str]:
        """Absolute URLs (or paths) of the shards."""
        return [s.url if _is_absolute(s.url) or not self.root else join_url(self.root, s.url) for s in self.shards]

    def seconds_per_unit(self) -> float | None:
        """How many seconds one length unit is, for audio units; None for tokens/frames."""
        if self.unit == "samples" and self.sample_rate:
            return 1.0 / float(self.sample_rate)
        if self.unit == "seconds":
            return 1.0
        return None

    def stats(self) -> dict[str, Any]:
        """Counts, totals and length percentiles (and hours for audio units)."""
        return length_stats(self.lengths, self.unit, self.seconds_per_unit(), num_shards=self.num_shards)

    @classmethod
    def merge(cls, indexes: Sequence["ShardIndex"]) -> "ShardIndex":
        """Concatenate the shards of several indexes (parts of one dataset, same unit and rate)."""
        if not indexes:
            raise ValueError("nothing to merge")
        first = indexes[0]
        for ix in indexes[1:]:
            if ix.unit != first.unit or ix.sample_rate != first.sample_rate:
                raise ValueError(
                    f"cannot merge indexes with different units: {first.unit}@{first.sample_rate} "
                    f"and {ix.unit}@{ix.sample_rate}"
                )
        shards: list[ShardInfo] = []
        for ix in indexes:
            shards.extend(ix.shards)
        return cls(shards=shards, unit=first.unit, sample_rate=first.sample_rate, root=first.root, meta=dict(first.meta))


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


def length_stats(
    lengths: np.ndarray, unit: str, seconds_per_unit: float | None = None, num_shards: int | None = None
) -> dict[str, Any]:
    """Summary statistics of a length array, shared by ``shardify inspect`` and the benchmarks."""
    lengths = np.asarray(lengths)
    out: dict[str, Any] = {"num_samples": int(lengths.size), "unit": unit}
    if num_shards is not None:
        out["num_shards"] = num_shards
    if lengths.size == 0:
        return out
    out["total_length"] = _num(lengths.sum())
    out["mean"] = float(lengths.mean())
    out["min"] = _num(lengths.min())
    out["max"] = _num(lengths.max())
    out["percentiles"] = {p: float(np.percentile(lengths, p)) for p in (1, 5, 25, 50, 75, 95, 99)}
    if seconds_per_unit:
        out["total_hours"] = float(lengths.sum()) * seconds_per_unit / 3600.0
    return out
