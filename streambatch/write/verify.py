"""``shardify verify``: re-read every shard and check it against ``index.json``.

Shards are read with the training reader's own tar parser (``format/tar.py``), so a shard that verifies is
one the loader reads. Per shard: it exists, its size and sha256, its sample count and keys (``keys_sha1``);
per sample: a ``.json`` member and a payload, and the ``.json`` length equal to the index's. With
``decode=True`` every audio member is also decoded as the loader decodes it, and its decoded length compared
with the index's: a member damaged after writing, and re-hashed or written so, fails here, not in training.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
from tqdm import tqdm

from .. import limits
from ..errors import IndexFormatError, ShardReadError
from ..format.audio import AUDIO_EXTENSIONS, AudioError
from ..format.audio import decode as decode_audio
from ..format.index import ShardIndex, ShardInfo
from ..format.index_check import table_problems
from ..format.members import PLAIN, SEGMENT_FIELD, ShardMembers
from ..format.rules import keys_sha1
from ..format.tar import iter_members, split_name
from ..io import storage
from ..io.digest import HashingReader, sha256_problem, size_problem
from ..units import Unit, same_length


@dataclass(frozen=True)
class DecodeCheck:
    """What ``verify --decode`` needs of the index: its length unit and sample rate (``samples``: the decoded
    frames at the member's rate, resampled to ``sample_rate``, are the length; ``seconds``: frames / rate)."""

    unit: Unit
    sample_rate: int | None


class _SampleChecks:
    """The per-sample checks of one shard, fed its members in tar order; ``keys`` are the samples read;
    ``undecodable`` the audio members that do not decode (or decode to another length), all of them."""

    def __init__(
        self, info: ShardInfo, decode: DecodeCheck | None = None, adopted: bool = False, members: ShardMembers = PLAIN
    ):
        self.info = info
        self.decode = decode
        self.adopted = adopted  # tars indexed in place (`shardify index`): a .json is optional, length 0 = left out
        self.members = members  # the key rule, and the rows of member groups that hold several samples (segments)
        self.keys: list[str] = []
        self.seen: set[str] = set()
        self.bad: list[str] = []
        self.undecodable: list[str] = []
        self.groups = 0

    def read(self, members: Iterable[tuple[str, bytes]]) -> None:
        """Group consecutive members with the same key into samples and check each (each row of a member group
        that holds several segments)."""
        named = ((*split_name(name, self.members.suffixes), data) for name, data in members)
        for key, group in itertools.groupby(named, key=itemgetter(0)):
            sample: dict[str, Any] = {"key": key, "exts": []}
            for _, ext, data in group:
                sample["exts"].append(ext)
                if self.decode and ext in AUDIO_EXTENSIONS:
                    sample.setdefault("audio", []).append((ext, data))
                if ext == "json":
                    try:
                        sample["length"] = limits.loads(data).get("length")
                    except (ValueError, AttributeError) as e:
                        sample["bad_json"] = True
                        self.bad.append(f"{key}.json: not a JSON object ({e})")
            rows = self.members.rows
            if rows is None:
                self._finish(sample)
            else:
                for row in rows.expand(sample, self.groups, 0, self.info.count):
                    segment = row.get(SEGMENT_FIELD)
                    if segment is not None:  # a member's .json length is the recording's, not the segment's
                        row["length"] = None
                    self._finish({**row, "key": row["__key__"], "segment": segment})
            self.groups += 1

    def _finish(self, s: dict[str, Any]) -> None:
        i = len(self.keys)
        self.keys.append(s["key"])
        where = f"sample {i} ({s['key']})"
        if self.adopted and i < self.info.count and self.info.lengths[i] == 0:
            self.bad = [b for b in self.bad if not b.startswith(f"{s['key']}.json:")]
            return  # left out when the tars were indexed (listed in errors.jsonl): never streamed to training
        if s["key"] in self.seen:
            self.bad.append(f"{where}: key appears twice")
        self.seen.add(s["key"])
        written = not self.adopted  # an adopted sample's .json is optional (its length: the audio header or text)
        if written and "json" not in s["exts"]:
            self.bad.append(f"{where}: no .json member")
        if written and not [e for e in s["exts"] if e != "json"]:
            self.bad.append(f"{where}: no payload member")
        length = s.get("length")
        if "json" in s["exts"] and not s.get("bad_json") and i < self.info.count and (written or length is not None):
            want = self.info.lengths[i]
            if length is None or not same_length(length, want):
                self.bad.append(f"{where}: .json length {length!r}, the index says {_num(want)}")
        for ext, data in s.get("audio", []):
            want = self.info.lengths[i] if i < self.info.count else None
            problem = _decode_problem(data, ext, want, self.decode, s.get("segment")) if self.decode else None
            if problem:
                self.undecodable.append(f"{s['key']}.{ext}: {problem}")


def _decode_problem(
    data: bytes, ext: str, want: float | None, check: DecodeCheck, segment: tuple[int, int] | None = None
) -> str | None:
    """Why an audio member (or its ``segment``) does not decode as the loader decodes it, or not to the index's
    length ``want``."""
    try:
        wav, sr = decode_audio(data, mono=False, segment=segment)
    except AudioError as e:
        return str(e)
    frames = len(wav)
    if frames == 0:
        return "decodes to 0 frames"
    if segment is not None and frames != segment[1]:
        return f"its segment (frames {segment[0]} + {segment[1]}) decodes to {frames} frames"
    if want is None:
        return None
    got = check.unit.audio_length(frames, sr, check.sample_rate)
    if same_length(got, want):
        return None
    return f"decodes to {frames} frames at {sr} Hz (length {_num(got)}), the index says {_num(want)}"


def verify_shard(
    url: str,
    info: ShardInfo,
    storage_options: dict | None = None,
    max_listed: int = 5,
    decode: DecodeCheck | None = None,
    adopted: bool = False,
    members: ShardMembers = PLAIN,
) -> list[str]:
    """Problems of one shard against its index entry (empty when it matches); with ``decode``, also every
    audio member that does not decode (all listed, as ``KEY.EXT: problem``). ``adopted``: the shard was indexed
    in place (``shardify index``): samples need no ``.json``, and those left out (length 0) are not checked.
    ``members``: how its members map to samples (`shard_members()`)."""
    if not storage.exists(url, storage_options):
        return ["missing"]
    problems = [p for p in [size_problem(storage.size(url, storage_options), info.bytes)] if p]
    try:
        info.lengths  # noqa: B018 - its lengths read first: a damaged sample table is the index's problem, not the tar's
    except IndexFormatError as e:
        return problems + [f"the index's lengths of this shard cannot be read: {e}"]
    checks = _SampleChecks(info, decode, adopted, members)
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
        rows = members.rows
        if rows is not None and len(rows.group) and checks.groups != int(rows.group[-1]) + 1:
            problems.append(f"{checks.groups} member groups, the index's segments name {int(rows.group[-1]) + 1}")
        if info.keys_sha1 and keys_sha1(checks.keys) != info.keys_sha1:
            problems.append(
                "keys differ from the index (keys_sha1 mismatch: a sample added, removed, renamed or reordered)"
            )
    problems += checks.bad[:max_listed]
    if len(checks.bad) > max_listed:
        problems.append(f"... and {len(checks.bad) - max_listed} more sample problems")
    return problems + checks.undecodable


def _num(x: Any) -> Any:
    x = float(x)
    return int(x) if x.is_integer() else x


_Job = tuple[str, ShardInfo, "dict | None", "DecodeCheck | None", bool, ShardMembers]


def _verify_job(job: _Job) -> list[str]:
    url, info, storage_options, check, adopted, members = job
    return verify_shard(url, info, storage_options, decode=check, adopted=adopted, members=members)


def verify_dataset(
    index: ShardIndex,
    storage_options: dict | None = None,
    progress: bool = True,
    decode: bool = False,
    workers: int | None = None,
    tables: bool = True,
) -> list[str]:
    """Re-read every shard and compare it with the index; returns ``"URL: problem"`` lines.

    The index's own tables are read in full first, as the loader reads them (`index_check`):
    when one is damaged its problems (``"TABLE: problem"``) are returned and no shard is read (``tables=False``:
    the caller checked them). ``decode=True`` also decodes every audio member (``"URL: KEY.EXT: problem"`` for
    each bad one). Shards are checked in ``workers`` processes (default: 1, or every CPU with ``decode``); the
    lines keep shard order.
    """
    damaged = table_problems(index) if tables else []
    if damaged:
        return damaged
    check = DecodeCheck(index.unit, index.sample_rate) if decode else None
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if decode and hasattr(os, "sched_getaffinity") else 1
    urls = index.shard_urls()
    adopted = index.meta.get("kind") == "adopted"
    jobs = (
        (url, info, storage_options, check, adopted, index.shard_members(i))
        for i, (url, info) in enumerate(zip(urls, index.shards))
    )
    bar = tqdm(
        total=len(urls),
        desc="decoding" if decode else "verifying",
        unit="shard",
        file=sys.stderr,
        disable=None if progress else True,
    )
    with bar:
        if workers > 1 and len(urls) > 1:
            remote = any(not storage.is_local(u) for u in urls)
            found = _verify_in_pool(_portable(jobs), len(urls), min(workers, len(urls)), remote, bar)
        else:
            found = []
            for job in jobs:
                found.append(_verify_job(job))
                bar.update()
    return [f"{url}: {p}" for url, problems in zip(urls, found) for p in problems]


def _portable(jobs: Iterable[_Job]) -> Iterator[_Job]:
    """The jobs with a plain copy of each shard entry (a version 2 entry reads its lengths from a table that
    stays in this process)."""
    for url, info, so, check, adopted, members in jobs:
        plain = ShardInfo(
            info.url,
            info.count,
            info.bytes,
            lengths=np.asarray(info.lengths),
            sha256=info.sha256,
            keys_sha1=info.keys_sha1,
        )
        yield url, plain, so, check, adopted, members


def _verify_in_pool(jobs: Iterator[_Job], n: int, workers: int, remote: bool, bar: tqdm) -> list[list[str]]:
    """Each shard's problems, checked in ``workers`` processes with at most two shards per worker queued (the
    lengths of a large index are not all loaded at once); results in shard order."""
    from .probe import process_pool

    found: list[list[str]] = [[] for _ in range(n)]
    with process_pool(workers, remote) as ex:
        pending: dict[cf.Future, int] = {}
        for i, job in enumerate(jobs):
            if len(pending) >= 2 * workers:
                _collect(pending, found, bar, cf.FIRST_COMPLETED)
            pending[ex.submit(_verify_job, job)] = i
        _collect(pending, found, bar, cf.ALL_COMPLETED)
    return found


def _collect(pending: dict[cf.Future, int], found: list[list[str]], bar: tqdm, when: str) -> None:
    done, _ = cf.wait(pending, return_when=when)
    for fut in done:
        found[pending.pop(fut)] = fut.result()
        bar.update()
