"""``shardify verify``: re-read every shard and check it against ``index.json``.

Shards are read with the training reader's own tar parser (``dataset/tar.py``), so a shard that verifies is
one the loader reads. Per shard: it exists, its size and sha256, its sample count and keys (``keys_sha1``);
per sample: a ``.json`` member and a payload, and the ``.json`` length equal to the index's.
"""

from __future__ import annotations

import itertools
import json
import sys
from operator import itemgetter
from typing import Any, Iterable

from tqdm import tqdm

from ..dataset import storage
from ..dataset.format import HashingReader, keys_sha1, sha256_problem, size_problem
from ..dataset.index import ShardIndex, ShardInfo
from ..dataset.tar import iter_members, split_name
from ..errors import ShardReadError


class _SampleChecks:
    """The per-sample checks of one shard, fed its members in tar order; ``keys`` are the samples read."""

    def __init__(self, info: ShardInfo):
        self.info = info
        self.keys: list[str] = []
        self.seen: set[str] = set()
        self.bad: list[str] = []

    def read(self, members: Iterable[tuple[str, bytes]]) -> None:
        """Group consecutive members with the same key into samples and check each."""
        named = ((*split_name(name), data) for name, data in members)
        for key, group in itertools.groupby(named, key=itemgetter(0)):
            sample: dict[str, Any] = {"key": key, "exts": []}
            for _, ext, data in group:
                sample["exts"].append(ext)
                if ext == "json":
                    try:
                        sample["length"] = json.loads(data).get("length")
                    except (ValueError, AttributeError) as e:
                        sample["bad_json"] = True
                        self.bad.append(f"{key}.json: not a JSON object ({e})")
            self._finish(sample)

    def _finish(self, s: dict[str, Any]) -> None:
        i = len(self.keys)
        self.keys.append(s["key"])
        where = f"sample {i} ({s['key']})"
        if s["key"] in self.seen:
            self.bad.append(f"{where}: key appears twice")
        self.seen.add(s["key"])
        if "json" not in s["exts"]:
            self.bad.append(f"{where}: no .json member")
        if not [e for e in s["exts"] if e != "json"]:
            self.bad.append(f"{where}: no payload member")
        length = s.get("length")
        if "json" in s["exts"] and not s.get("bad_json") and i < self.info.count:
            want = self.info.lengths[i]
            if length is None or not _same_length(length, want):
                self.bad.append(f"{where}: .json length {length!r}, the index says {_num(want)}")


def verify_shard(url: str, info: ShardInfo, storage_options: dict | None = None, max_listed: int = 5) -> list[str]:
    """Problems of one shard against its index entry (empty when it matches)."""
    if not storage.exists(url, storage_options):
        return ["missing"]
    problems = [p for p in [size_problem(storage.size(url, storage_options), info.bytes)] if p]
    checks = _SampleChecks(info)
    try:
        with storage.open_url(url, "rb", storage_options) as f:
            reader = HashingReader(f.read)
            checks.read(iter_members(reader, url))
            sha = reader.drain().hexdigest()
    except (ShardReadError, OSError, ValueError) as e:
        msg = str(e).removeprefix(f"{url}: ")
        problems.append(f"unreadable tar after {len(checks.keys)} samples ({type(e).__name__}: {msg})")
        sha = None
    if sha is not None:
        problems += [p for p in [sha256_problem(sha, info.sha256)] if p]
        if len(checks.keys) != info.count:
            problems.append(f"{len(checks.keys)} samples, the index says {info.count}")
        if info.keys_sha1 and keys_sha1(checks.keys) != info.keys_sha1:
            problems.append("keys differ from the index (keys_sha1 mismatch: a sample added, removed, renamed or "
                            "reordered)")
    problems += checks.bad[:max_listed]
    if len(checks.bad) > max_listed:
        problems.append(f"... and {len(checks.bad) - max_listed} more sample problems")
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
