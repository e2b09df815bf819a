"""``shardify verify``: re-read every shard and check it against ``index.json``.

Per shard: it exists, its byte size and sha256, its sample count and keys (``keys_sha1`` and the order of
samples), and per sample: a ``.json`` member and a payload, and the ``.json`` length equal to the index's.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tarfile
from typing import Any

from tqdm import tqdm

from ..dataset import storage
from ..dataset.index import ShardIndex, ShardInfo
from .writer import keys_sha1


class _HashingReader:
    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.h.update(b)
        return b

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def split_member_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` as webdataset groups members: the key ends at the first dot of the basename."""
    d, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext


def verify_shard(url: str, info: ShardInfo, storage_options: dict | None = None, max_listed: int = 5) -> list[str]:
    """Problems of one shard against its index entry (empty when it matches)."""
    if not storage.exists(url, storage_options):
        return ["missing"]
    problems: list[str] = []
    nbytes = storage.size(url, storage_options)
    if nbytes != info.bytes:
        problems.append(f"size is {nbytes} bytes, the index says {info.bytes}")
    keys: list[str] = []
    bad_samples: list[str] = []
    current: dict[str, Any] | None = None

    def finish(s: dict[str, Any] | None) -> None:
        if s is None:
            return
        i = len(keys)
        keys.append(s["key"])
        where = f"sample {i} ({s['key']})"
        if s["key"] in seen:
            bad_samples.append(f"{where}: key appears twice")
        seen.add(s["key"])
        if "json" not in s["exts"]:
            bad_samples.append(f"{where}: no .json member")
        if not [e for e in s["exts"] if e != "json"]:
            bad_samples.append(f"{where}: no payload member")
        length = s.get("length")
        if "json" in s["exts"] and not s.get("bad_json") and i < info.count:
            want = info.lengths[i]
            if length is None or not _same_length(length, want):
                bad_samples.append(f"{where}: .json length {length!r}, the index says {_num(want)}")

    seen: set[str] = set()
    try:
        with storage.open_url(url, "rb", storage_options) as f:
            reader = _HashingReader(f)
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    key, ext = split_member_name(m.name)
                    if current is None or current["key"] != key:
                        finish(current)
                        current = {"key": key, "exts": []}
                    current["exts"].append(ext)
                    if ext == "json":
                        try:
                            current["length"] = json.loads(tar.extractfile(m).read()).get("length")
                        except (ValueError, AttributeError) as e:
                            current["bad_json"] = True
                            bad_samples.append(f"{key}.json: not a JSON object ({e})")
                finish(current)
            reader.drain()
            sha = reader.h.hexdigest()
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        problems.append(f"unreadable tar after {len(keys)} samples ({type(e).__name__}: {e})")
        sha = None
    if sha is not None and info.sha256 and sha != info.sha256:
        problems.append(f"sha256 is {sha[:12]}..., the index says {info.sha256[:12]}...")
    if len(keys) != info.count and sha is not None:
        problems.append(f"{len(keys)} samples, the index says {info.count}")
    if sha is not None and info.keys_sha1 and keys_sha1(keys) != info.keys_sha1:
        problems.append("keys differ from the index (keys_sha1 mismatch: a sample added, removed, renamed or reordered)")
    problems += bad_samples[:max_listed]
    if len(bad_samples) > max_listed:
        problems.append(f"... and {len(bad_samples) - max_listed} more sample problems")
    return problems


def _same_length(a: Any, b: float) -> bool:
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return False


def _num(x: Any) -> Any:
    x = float(x)
    return int(x) if x.is_integer() else x


def verify_dataset(
    index: ShardIndex, storage_options: dict | None = None, progress: bool = True
) -> list[str]:
    """Re-read every shard and compare it with the index; returns ``"URL: problem"`` lines."""
    problems = []
    urls = index.shard_urls()
    for url, info in tqdm(list(zip(urls, index.shards)), desc="verifying", unit="shard", file=sys.stderr,
                          disable=None if progress else True):
        problems += [f"{url}: {p}" for p in verify_shard(url, info, storage_options)]
    return problems
