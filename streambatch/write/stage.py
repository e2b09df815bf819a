"""``shardify stage SRC DEST``: copy a dataset (its shards, then its index) to node-local disk.

For jobs that prefer to read from a local copy: SRC is any dataset folder or fsspec URL (``s3://``, ...), DEST
usually ``$TMPDIR`` or a node-local scratch path. Each shard is copied to a temporary name beside its target,
checked against the index (byte size, and sha256 computed while copying) and renamed, so a killed stage
never leaves a partial shard under a shard's name. A shard already in DEST with the index's size is kept
(``verify=True`` also re-hashes it), so running stage again finishes an interrupted copy and otherwise
touches nothing. The index is written last: DEST only has an ``index.json`` once every shard it lists is
complete. Nothing else in DEST is changed.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import posixpath
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

from tqdm import tqdm

from ..dataset import storage
from ..errors import ShardifyError
from ..dataset.index import INDEX_NAME, ShardIndex, ShardInfo

CHUNK = 4 << 20
ATTEMPTS = 3


@dataclass
class StageResult:
    dest: str
    index: ShardIndex
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_copied: int = 0


def _index_url(src: str) -> str:
    return src if src.endswith(".json") else storage.join_url(src, INDEX_NAME)


def _is_absolute(url: str) -> bool:
    return "://" in url or url.startswith("/")


def _sha256_of(url: str, storage_options: dict | None) -> str:
    h = hashlib.sha256()
    with storage.open_url(url, "rb", storage_options) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _complete(dst: str, info: ShardInfo, verify: bool, storage_options: dict | None) -> bool:
    """Is the shard at ``dst`` already the one the index lists (size; sha256 too with ``verify``)?"""
    try:
        if storage.size(dst, storage_options) != info.bytes:
            return False
    except (FileNotFoundError, OSError):
        return False
    return not (verify and info.sha256) or _sha256_of(dst, storage_options) == info.sha256


def _copy_one(src: str, dst: str, info: ShardInfo, src_options: dict | None, dest_options: dict | None,
              bar: tqdm, lock: threading.Lock) -> int:
    """Copy one shard to a temporary name, check its size and sha256 against the index, then rename."""
    local = storage.is_local(dst)
    if local:
        target = storage.local_path(dst)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    else:
        fd, tmp = tempfile.mkstemp(prefix="shardify-stage-", suffix=".tar")
        os.close(fd)
    done = 0
    try:
        for attempt in range(ATTEMPTS):
            h, n = hashlib.sha256(), 0
            try:
                with storage.open_url(src, "rb", src_options) as fi, open(tmp, "wb") as fo:
                    while chunk := fi.read(CHUNK):
                        fo.write(chunk)
                        h.update(chunk)
                        n += len(chunk)
                        with lock:
                            bar.update(len(chunk))
                        done += len(chunk)
                    fo.flush()
                    os.fsync(fo.fileno())
                break
            except FileNotFoundError:
                raise ShardifyError(f"{src}: listed in the index but missing") from None
            except OSError:
                with lock:
                    bar.update(-done)
                done = 0
                if attempt + 1 == ATTEMPTS or storage.is_local(src):
                    raise
                time.sleep(0.5 * 2 ** attempt)
        if n != info.bytes:
            raise ShardifyError(f"{src}: {n} bytes, the index says {info.bytes} (check with `shardify verify`)")
        if info.sha256 and h.hexdigest() != info.sha256:
            raise ShardifyError(f"{src}: sha256 {h.hexdigest()[:12]}..., the index says {info.sha256[:12]}... "
                                "(check with `shardify verify`)")
        if local:
            os.replace(tmp, target)
        else:
            storage.put_file_atomic(tmp, dst, dest_options)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n


def stage_dataset(
    src: str, dest: str, *, verify: bool = False, workers: int = 4, storage_options: dict | None = None,
    dest_storage_options: dict | None = None, progress: bool = True,
) -> StageResult:
    """Copy the dataset at ``src`` (folder, URL or index file) to ``dest``; see the module docstring.

    ``workers`` shards are copied at a time (threads). Returns what was copied and kept."""
    src, dest = str(src), str(dest).rstrip("/") or "/"
    if int(workers) <= 0:
        raise ShardifyError("workers must be positive")
    index_url = _index_url(src)
    try:
        with storage.open_url(index_url, "rb", storage_options) as f:
            raw = f.read()
    except FileNotFoundError:
        raise ShardifyError(f"no dataset index at {index_url}") from None
    index = ShardIndex.load(index_url, storage_options)
    if storage.is_local(dest) and os.path.exists(storage.local_path(dest)) and not os.path.isdir(storage.local_path(dest)):
        raise ShardifyError(f"{dest} exists and is not a folder")
    if _same_place(index.root or "", dest):
        raise ShardifyError(f"{dest} is the dataset itself")

    # where each shard goes: its relative url under dest (an absolute url: its file name)
    rewrite = False
    names: list[str] = []
    for info in index.shards:
        if _is_absolute(info.url):
            rewrite = True
            names.append(posixpath.basename(info.url.rstrip("/")))
        else:
            if info.url.startswith("..") or "/../" in info.url:
                raise ShardifyError(f"shard url {info.url!r} leaves the dataset folder; cannot stage it")
            names.append(info.url)
    if len(set(names)) != len(names):
        raise ShardifyError("two shards of the index have the same file name; cannot stage them into one folder")
    srcs = index.shard_urls()
    dsts = [storage.join_url(dest, *n.split("/")) for n in names]

    storage.makedirs(dest, dest_storage_options)
    dest_index = storage.join_url(dest, INDEX_NAME)
    if storage.exists(dest_index, dest_storage_options):
        with storage.open_url(dest_index, "rb", dest_storage_options) as f:
            same = f.read() == raw and not rewrite
        if not same:  # another dataset (version) was staged here: its index goes first
            storage.remove(dest_index, dest_storage_options)

    result = StageResult(dest=dest, index=index)
    total = sum(info.bytes for info in index.shards)
    bar = tqdm(total=total, desc="staging", unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=None if progress else True)
    lock = threading.Lock()

    def one(i: int) -> tuple[int, int | None]:
        info = index.shards[i]
        if _complete(dsts[i], info, verify, dest_storage_options):
            with lock:
                bar.update(info.bytes)
            return i, None
        return i, _copy_one(srcs[i], dsts[i], info, storage_options, dest_storage_options, bar, lock)

    try:
        with cf.ThreadPoolExecutor(max_workers=int(workers)) as ex:
            futures = [ex.submit(one, i) for i in range(len(index.shards))]
            try:
                for fut in cf.as_completed(futures):
                    i, n = fut.result()
                    if n is None:
                        result.kept.append(names[i])
                    else:
                        result.copied.append(names[i])
                        result.bytes_copied += n
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        bar.close()
    result.copied.sort()
    result.kept.sort()
    if rewrite:
        for info, name in zip(index.shards, names):
            info.url = name
        staged = ShardIndex(shards=index.shards, unit=index.unit, sample_rate=index.sample_rate, root=dest,
                            meta=dict(index.meta, staged_from=src))
        staged.save(dest_index, dest_storage_options)
    else:
        storage.write_bytes_atomic(dest_index, raw, dest_storage_options)
    result.index = ShardIndex.load(dest_index, dest_storage_options)
    return result


def _same_place(a: str, b: str) -> bool:
    def key(u: str) -> str:
        u = u.rstrip("/")
        return os.path.realpath(storage.local_path(u)) if storage.is_local(u) else u

    return bool(a) and key(a) == key(b)
