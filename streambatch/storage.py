"""Paths and fsspec URLs, one way: open, join, list, and write whole objects atomically.

Every module that touches storage goes through here, so local folders, ``file://``, ``s3://``, ``gs://`` and
``http(s)://`` behave the same, and ``storage_options`` (credentials, ``endpoint_url``) reach fsspec.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import IO, Any

import fsspec


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def join_url(base: str, *parts: str) -> str:
    """Join path parts onto a local path or URL."""
    if is_local(base) and not base.startswith("file://"):
        return os.path.join(base, *parts)
    return posixpath.join(base, *parts)


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path


def open_url(url: str, mode: str = "rb", storage_options: dict | None = None) -> IO[Any]:
    """Open a local path or fsspec URL."""
    if is_local(url):
        return open(local_path(url), mode)
    fs, path = filesystem(url, storage_options)
    return fs.open(path, mode)


def exists(url: str, storage_options: dict | None = None) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def makedirs(url: str, storage_options: dict | None = None) -> None:
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
        return
    fs, path = filesystem(url, storage_options)
    fs.makedirs(path, exist_ok=True)


def listdir(url: str, storage_options: dict | None = None) -> list[str]:
    """Names (not paths) of the entries in a folder; empty if it does not exist."""
    if is_local(url):
        p = local_path(url)
        return sorted(os.listdir(p)) if os.path.isdir(p) else []
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        return []
    return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))


def remove(url: str, storage_options: dict | None = None) -> None:
    if is_local(url):
        p = local_path(url)
        if os.path.exists(p):
            os.remove(p)
        return
    fs, path = filesystem(url, storage_options)
    if fs.exists(path):
        fs.rm(path)


def size(url: str, storage_options: dict | None = None) -> int:
    if is_local(url):
        return os.path.getsize(local_path(url))
    fs, path = filesystem(url, storage_options)
    return int(fs.size(path))


def put_file_atomic(local_src: str, url: str, storage_options: dict | None = None) -> None:
    """Move/upload a finished local file to ``url`` so it appears only complete.

    Local targets: ``os.replace`` of a temporary name in the same folder (atomic on POSIX).
    Object stores: a single whole-object upload, which becomes visible only when complete.
    """
    if is_local(url):
        dst = local_path(url)
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(local_src, "rb") as fi, open(tmp, "wb") as fo:
                while chunk := fi.read(1 << 22):
                    fo.write(chunk)
                fo.flush()
                os.fsync(fo.fileno())
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    fs, path = filesystem(url, storage_options)
    fs.put_file(local_src, path)


def write_bytes_atomic(url: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write ``data`` to ``url`` so that readers see either nothing or the whole object."""
    if is_local(url):
        dst = local_path(url)
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    fs, path = filesystem(url, storage_options)
    fs.pipe_file(path, data)
