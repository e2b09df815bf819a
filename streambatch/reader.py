"""Stream tar shards (local or any fsspec URL) into samples: one dict per key, members as raw bytes.

A sample is ``{"__key__", "__url__", "__shard__", "__index__" (position in its shard), "json": dict,
EXT: bytes, ...}`` with extensions split at the first dot of the member name, as webdataset does. Nothing is
decoded here but the small ``.json``, which carries the length.
"""

from __future__ import annotations

import json
import tarfile
from typing import IO, Any, Iterable, Iterator

from .shards import Piece
from .storage import open_url


class ShardReadError(IOError):
    """A shard that cannot be opened or is not a valid tar stream; the message names its URL."""


def iter_members(stream: IO[bytes], url: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file in a tar stream, in tar order."""
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                f = tar.extractfile(info)
                yield info.name, f.read() if f is not None else b""
    except tarfile.TarError as e:
        raise ShardReadError(f"{url}: not a readable tar shard ({e})") from e


def split_name(name: str) -> tuple[str, str]:
    """``dir/KEY.ext.more`` → (``dir/KEY``, ``ext.more``)."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


def group_samples(members: Iterable[tuple[str, bytes]], url: str, shard: int = -1) -> Iterator[dict[str, Any]]:
    """Group consecutive members with the same key into samples; parse the ``json`` member."""
    cur: dict[str, Any] | None = None
    index = 0
    for name, data in members:
        key, ext = split_name(name)
        if cur is None or key != cur["__key__"]:
            if cur is not None:
                yield _finish(cur, url)
                index += 1
            cur = {"__key__": key, "__url__": url, "__shard__": shard, "__index__": index}
        cur[ext] = data
    if cur is not None:
        yield _finish(cur, url)


def _finish(sample: dict[str, Any], url: str) -> dict[str, Any]:
    raw = sample.get("json")
    if raw is not None:
        try:
            sample["json"] = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ShardReadError(f"{url}: sample {sample['__key__']!r} has an invalid .json ({e})") from e
    return sample


def read_shard(
    url: str, shard: int = -1, start: int = 0, stop: int | None = None, storage_options: dict | None = None
) -> Iterator[dict[str, Any]]:
    """The samples ``[start, stop)`` of one shard, streamed; stops reading once ``stop`` is reached."""
    try:
        stream = open_url(url, "rb", storage_options)
    except FileNotFoundError as e:
        raise ShardReadError(f"{url}: shard not found") from e
    except OSError as e:
        raise ShardReadError(f"{url}: cannot open shard ({e})") from e
    with stream:
        for sample in group_samples(iter_members(stream, url), url, shard):
            i = sample["__index__"]
            if stop is not None and i >= stop:
                return
            if i >= start:
                yield sample


def read_pieces(
    urls: list[str], pieces: Iterable[Piece], storage_options: dict | None = None
) -> Iterator[dict[str, Any]]:
    """Stage: the samples of each piece in turn (a slot's whole stream)."""
    for p in pieces:
        yield from read_shard(urls[p.shard], p.shard, p.start, p.stop, storage_options)
