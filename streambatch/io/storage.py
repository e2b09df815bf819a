"""Paths and URLs, one way: open, join, list, and write whole objects atomically.

Every module that touches storage goes through here, so local folders, ``file://``, ``s3://``, ``gs://``, ``az://``
and ``http(s)://`` behave the same. Object stores go through obstore (`objstore`: ``s3://``, ``gs://``, ``az://``;
``http(s)://`` read only), with `objstore`'s timeouts and number of tries unless ``storage_options`` set them:
every write (one upload that becomes visible whole; a create-only put where a publish must be exclusive, `lock`),
and every read once the process runs obstore's runtime (`store_of()`: a read never starts it, so that a training
process can still fork its workers). fsspec serves local paths, every other scheme, options obstore is not given
(`objstore.store_for()` answers None: s3fs, gcsfs or adlfs then) and those first reads, so ``storage_options``
reach the one that serves the URL.

Around every back-end: its exception about a URL (missing credentials, no answer, a bucket that does not exist)
becomes the package's error naming the URL (`names_errors()`); cleanup after an interrupt or an error (a lock file
removed, an upload aborted) waits for the storage at most `CLEANUP_TIMEOUT` seconds (`within()`); a shard, an index
or its table is read only from a regular file (`open_local()`: opening a FIFO waits for a writer forever).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import io
import os
import posixpath
import shutil
import stat
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

import fsspec

from ..errors import MissingCredentials, StorageError, UnknownStorage
from . import objstore
from .node_files import object_version
from .tempname import temporary_name

#: the largest body one upload request sends, in bytes: a bigger object goes up in parts of this size (a multipart
#: upload, visible only once complete), so each request's deadline (`objstore.store_for()`) stays short
PART = 8 * 1024 * 1024
#: bytes a file opened to read (`open_url()`) asks for at a time: a small object in one request
READ_BLOCK = 8 * 1024 * 1024


#: seconds a cleanup call to object storage may take (removing a lock file, aborting an upload) before it is given up
CLEANUP_TIMEOUT = 5.0

T = TypeVar("T")
_F = TypeVar("_F", bound=Callable[..., Any])


# ---- errors named with their URL ---------------------------------------------------------------------------------
#: botocore's (and google-auth's) exceptions for credentials that are missing or incomplete
CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError")
#: the exceptions of a storage endpoint that did not answer or could not be reached (botocore, aiohttp, fsspec)
NO_ANSWER_ERRORS = frozenset(
    {
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ServerTimeoutError",
        "FSTimeoutError",
        "TimeoutError",
    }
)


def names_errors(writes: bool = False) -> Callable[[_F], _F]:
    """Decorate a storage call whose first argument is a URL: a back-end's exception about it becomes the package's
    error naming it (`named_error()`; ``writes``: a bucket that does not exist is one too, where the call
    writes: reading one is a plain not-found)."""

    def decorate(func: _F) -> _F:
        @functools.wraps(func)
        def wrapper(url: str, *args: Any, **kwargs: Any) -> Any:
            try:
                return func(url, *args, **kwargs)
            except Exception as e:
                named = named_error(url, e, writes)
                if named is None:
                    raise
                raise named from e

        return wrapper  # type: ignore[return-value]

    return decorate


def named_error(url: str, e: BaseException, writes: bool = False) -> Exception | None:
    """The package's error for the back-end's exception ``e`` about ``url``: missing credentials, no answer from
    the endpoint in time (after its retries), a bucket that does not exist (``writes``); None for any other."""
    if isinstance(e, (StorageError, MissingCredentials)) or "://" not in url or url.startswith("file://"):
        return None
    if type(e).__name__ in CREDENTIAL_ERRORS:
        what = f"{url}: no credentials for {url.partition('://')[0]} storage ({type(e).__name__})"
        return MissingCredentials(f"{what}: {objstore.credentials_hint(url)}")
    if any(c.__name__ in NO_ANSWER_ERRORS for c in type(e).__mro__[:-2]):
        said = (str(e).strip().splitlines() or [""])[0]
        return StorageError(
            f"{url}: the storage did not answer ({type(e).__name__}{': ' + said if said else ''}); check the "
            "endpoint and the network (config_kwargs.read_timeout and connect_timeout set how long it is waited for)"
        )
    if writes and isinstance(e, FileNotFoundError) and _error_code(e.__cause__) == "NoSuchBucket":
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        return StorageError(f"{url}: the bucket {bucket!r} does not exist; create it, or check the URL")
    return None


def _error_code(e: BaseException | None) -> str | None:
    """The error code of a botocore ``ClientError`` (``NoSuchBucket``, ...); None for anything else."""
    response = getattr(e, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def write_error(url: str, e: Exception) -> Exception:
    """``e``, raised while ``url`` was written, saying which file it is about: an object store's error as the
    package's (`named_error()`), a disk's input/output error as a `StorageError`, and an OS error about
    no file (``fsync``, ``close``) with ``url`` as its ``filename``."""
    named = named_error(url, e, writes=True)
    if named is not None:
        return named
    if isinstance(e, OSError) and e.errno == errno.EIO:
        return StorageError(
            f"{url}: input/output error while writing it (the disk or the filesystem failed); nothing was left "
            "under its name"
        )
    if isinstance(e, OSError) and e.filename is None:
        e.filename = url
    return e


# ---- bounded cleanup ---------------------------------------------------------------------------------------------
def within(seconds: float, fn: Callable[[], T]) -> tuple[bool, T | None]:
    """``fn()`` on a daemon thread, waited for at most ``seconds``: ``(True, its result)``, or ``(False, None)``
    when it has not returned by then (it is left to end on its own, unheard); its exception is raised here."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box.append((False, e))

    thread = threading.Thread(target=run, name="streambatch-cleanup", daemon=True)
    thread.start()
    thread.join(seconds)
    if not box:
        return False, None
    ok, value = box[0]
    if not ok:
        raise value
    return True, value


def abort_upload(file: Any, url: str) -> None:
    """Abort an object store's unfinished upload to ``url`` (s3fs: its multipart upload), waiting for the storage
    at most `CLEANUP_TIMEOUT` seconds (then a warning says what may be left); closing ``file`` later uploads
    nothing."""
    discard = getattr(file, "discard", None)
    try:
        if callable(discard) and not within(CLEANUP_TIMEOUT, discard)[0]:
            print(
                f"shardify: warning: gave up aborting the upload of {url} after {CLEANUP_TIMEOUT:g} s (the storage "
                "did not answer); the parts it received may stay until a lifecycle rule removes them",
                file=sys.stderr,
            )
    finally:
        file.closed = True


# ---- local files -------------------------------------------------------------------------------------------------
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


#: what only a regular file may be, to be read: a tar (every shard is one; its reader needs its size and seeks)
REGULAR_ONLY = (".tar",)


def open_local(path: str, mode: str, regular: bool | None = None) -> IO[Any]:
    """``open(path, mode)``; to read with ``regular`` (None: for a tar, `REGULAR_ONLY`), only a regular file
    (or a folder, which ``open`` refuses itself): a FIFO, socket or device named like a shard or an index is a
    `StorageError` naming it, before it is opened — opening a FIFO to read waits for a writer forever. A
    source read as a stream (a manifest) may be a FIFO."""
    if regular is None:
        regular = path.endswith(REGULAR_ONLY)
    if regular and "r" in mode and "+" not in mode:
        check_regular(path)
    return open(path, mode)


def check_regular(path: str) -> None:
    """Raise `StorageError` if ``path`` is there and is neither a regular file nor a folder."""
    try:
        st = os.stat(path)
    except OSError:
        return  # open() says what is wrong with it
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise StorageError(f"{path}: {kind}, not a regular file; streambatch reads data from regular files only")


# ---- URLs ------------------------------------------------------------------------------------------------------
def store_of(url: str, storage_options: dict | None, writes: bool = False) -> tuple[Any, str] | None:
    """(this process's obstore store for ``url``, the object's path in it) for the calls here, or None where fsspec
    serves ``url``: a local path, another scheme, options obstore is not given, a write to ``http(s)://``, or a
    read (not ``writes``) in a process where obstore's runtime does not run yet, of a scheme whose fsspec package
    is installed.

    Such reads start no runtime: a process that has made no obstore request can still fork workers that make them
    (`objstore.fork_unsafe()`), so a training process that plans from a remote index keeps forked DataLoader
    workers (which share its lengths and may run callables that do not pickle). A write starts it (a writer's
    first request is its lock's create-only put), and from then on the process reads through obstore too; so does
    a read of ``gs://`` or ``az://`` without gcsfs or adlfs (its workers then start by forkserver)."""
    if is_local(url) or not objstore.usable(url, storage_options):
        return None
    if writes and url.startswith("http"):
        return None
    if not writes and not objstore.runtime_running() and _fsspec_serves(url):
        return None
    return objstore.store_for(
        url,
        storage_options,
        objstore.READ_TIMEOUT,
        connect=objstore.CONNECT_TIMEOUT,
        retries=objstore.ATTEMPTS - 1,
        part=PART if writes else None,
    )


def _fsspec_serves(url: str) -> bool:
    """Whether an installed fsspec back-end serves ``url``'s scheme."""
    try:
        filesystem_class(url)
    except UnknownStorage:
        return False
    return True


def _dir(path: str) -> str:
    """An object path as a folder's prefix (``a/b/``; the bucket's root: empty)."""
    path = path.strip("/")
    return f"{path}/" if path else ""


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def join_url(base: str, *parts: str) -> str:
    """Join path parts onto a local path or URL."""
    if is_local(base) and not base.startswith("file://"):
        return os.path.join(base, *parts)
    return posixpath.join(base, *parts)


def parent_url(url: str) -> str:
    """The folder holding a local path or URL."""
    return posixpath.dirname(url) if "://" in url else os.path.dirname(url)


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it; an object store's with timeouts and a bounded
    number of tries unless ``storage_options`` set them (`_with_timeouts()`)."""
    filesystem_class(url)
    opts, tries = _with_timeouts(url, storage_options)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    if tries:
        fs.retries = tries
    return fs, path


def filesystem_class(url: str) -> type[fsspec.AbstractFileSystem]:
    """fsspec's filesystem class for ``url``'s scheme (the outermost, in a chained ``a::b://...`` URL, each of whose
    schemes is checked); a scheme fsspec does not know, or whose back-end is not installed, is an
    `UnknownStorage` naming the URL."""
    *outer, last = url.split("::")
    classes = [_scheme_class(url, p) for p in [*outer, fsspec.core.split_protocol(last)[0] or "file"]]
    return classes[0]


def _scheme_class(url: str, protocol: str) -> type[fsspec.AbstractFileSystem]:
    try:
        return fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise UnknownStorage(f"{url}: unknown storage scheme {protocol!r} (no fsspec back-end has it)") from None
    except ImportError as e:  # a known scheme whose package is missing: fsspec says which to install
        raise UnknownStorage(f"{url}: {protocol}:// storage needs a package that is not installed ({e})") from None


# ---- the fsspec path for ``s3://`` (s3fs): reads before obstore's runtime runs, options obstore is not given ------
# Unless ``storage_options`` set them (``config_kwargs.connect_timeout``, ``read_timeout``, ``retries``), a request
# waits at most `objstore.CONNECT_TIMEOUT` seconds to connect and `objstore.READ_TIMEOUT` for data, and is tried
# `objstore.ATTEMPTS` times (botocore's ``standard`` retry mode; s3fs's own retry loop is off unless
# ``storage_options["retries"]`` turns it on). aiohttp times an upload only once its body is sent (the wait for
# ``100 Continue`` and a body the storage stops taking have no timeout), so an upload also has a deadline,
# `_upload_deadline()`, as obstore's uploads have: a stalled endpoint fails a write in one line naming the URL.
def _with_timeouts(url: str, storage_options: dict | None) -> tuple[dict, int]:
    """``storage_options`` for ``url``'s filesystem with this section's defaults where it is an ``s3://`` URL, and how
    many times s3fs itself tries a call there (0: not an ``s3://`` URL)."""
    opts = dict(storage_options or {})
    if "::" in url or fsspec.core.split_protocol(url)[0] not in ("s3", "s3a"):
        return opts, 0
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", objstore.CONNECT_TIMEOUT)
    cfg.setdefault("read_timeout", objstore.READ_TIMEOUT)
    cfg.setdefault("retries", {"mode": "standard", "total_max_attempts": objstore.ATTEMPTS})
    session = _deadline_session(float(cfg["connect_timeout"]), float(cfg["read_timeout"]))
    if session is not None:
        cfg.setdefault("http_session_cls", session)
    opts["config_kwargs"] = cfg
    return opts, int(opts.get("retries", 1))


def _upload_deadline(method: str, headers: Any, connect: float, read: float) -> float | None:
    """Seconds an HTTP request may take in all, or None for no deadline: an upload (``PUT``: PutObject, UploadPart)
    gets ``connect + read`` plus a second per `objstore.UPLOAD_RATE` bytes of its body; any other request is
    timed by aiohttp alone (its small body is sent at once, then the read timeout runs)."""
    if method.upper() != "PUT":
        return None
    size = 0
    for name in ("Content-Length", "X-Amz-Decoded-Content-Length"):
        value = headers.get(name) if hasattr(headers, "get") else None
        if value is not None:
            size = max(size, int(value.decode() if isinstance(value, bytes) else value))
    return connect + read + size / objstore.UPLOAD_RATE


@functools.cache
def _deadline_session(connect: float, read: float) -> type | None:
    """aiobotocore's HTTP session class with `_upload_deadline()` (one class per pair of timeouts: fsspec tells
    cached filesystems apart by their options' text); None where this aiobotocore has no ``http_session_cls``."""
    try:
        from aiobotocore.config import AioConfig
        from aiobotocore.httpsession import AIOHTTPSession
        from botocore.exceptions import ReadTimeoutError
    except ImportError:  # pragma: no cover - s3fs needs both
        return None
    if "http_session_cls" not in inspect.signature(AioConfig.__init__).parameters:
        return None

    class DeadlineSession(AIOHTTPSession):
        """aiobotocore's session; an upload past its deadline is a read timeout (retried like one)."""

        async def send(self, request: Any) -> Any:
            deadline = _upload_deadline(request.method, request.headers, connect, read)
            if deadline is None:
                return await super().send(request)
            try:
                return await asyncio.wait_for(super().send(request), deadline)
            except asyncio.TimeoutError as e:
                raise ReadTimeoutError(endpoint_url=request.url, error=e) from e

    DeadlineSession.__qualname__ = DeadlineSession.__name__ = f"DeadlineSession_{connect:g}s_{read:g}s"
    return DeadlineSession


# ---- filesystems for reading shards ----------------------------------------------------------------
# One filesystem per (process, URL protocol, options): s3fs and other async back-ends are not fork-safe, so a
# DataLoader worker must never use an object its parent created. Each process builds its own on first use.
_READ_FS: dict[tuple, fsspec.AbstractFileSystem] = {}
_READ_FS_LOCK = threading.Lock()


def _aws_env() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))


def reading_filesystem(
    url: str, storage_options: dict | None = None, timeout: float | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for reading shards that obstore does not read (`objstore`) in this process: created here
    (never inherited over a fork), cached per process, with botocore's own retries off for ``s3://`` (streambatch
    retries each range itself) and ``timeout`` as the connect/read timeout, unless ``storage_options`` set them."""
    opts = dict(storage_options or {})
    if "::" in url:  # chained URLs (simplecache::s3://...): let fsspec build the chain
        return filesystem(url, opts)
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    cls = filesystem_class(url)
    path = cls._strip_protocol(url)
    key = (os.getpid(), protocol, repr(sorted(opts.items(), key=lambda kv: kv[0])), timeout, _aws_env())
    with _READ_FS_LOCK:
        fs = _READ_FS.get(key)
        if fs is None:
            fs = _make_reading_fs(protocol, opts, timeout)
            _READ_FS[key] = fs
    return fs, path


def _make_reading_fs(protocol: str, opts: dict, timeout: float | None) -> fsspec.AbstractFileSystem:
    if protocol in ("s3", "s3a"):  # unmapped options (objstore): s3fs, tried once, with the reader's timeouts
        cfg = dict(opts.get("config_kwargs") or {})
        if timeout:
            cfg.setdefault("connect_timeout", timeout)
            cfg.setdefault("read_timeout", timeout)
        cfg.setdefault("retries", {"total_max_attempts": 1})
        opts["config_kwargs"] = cfg
        opts.pop("retries", None)  # s3fs's own retry loop stays its default: the one rule is the caller's
    elif protocol in ("http", "https") and timeout:
        import aiohttp

        ck = dict(opts.get("client_kwargs") or {})
        ck.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout))
        opts["client_kwargs"] = ck
    return fsspec.filesystem(protocol, skip_instance_cache=True, **opts)


def read_range_fsspec(
    fs: fsspec.AbstractFileSystem, path: str, start: int, end: int, sink: list[bytes], heard: list
) -> int | None:
    """Append the bytes ``[start, end)`` of an object fsspec reads (every scheme obstore does not: `objstore`) to
    ``sink``, in one read, and None (the version the answer names: unknown) to ``heard``; the object's size is not
    told (None). A read that breaks is asked again whole by the caller's retry."""
    heard.append(None)
    sink.append(fs.cat_file(path, start=start, end=end))
    return None


def _protocol(fs: Any) -> str:
    """The filesystem's protocol (the first of its names)."""
    return fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol


def object_size(fs: fsspec.AbstractFileSystem, path: str) -> int:
    info = fs.info(path)
    size = info.get("size")
    if size is None:
        raise OSError(f"{path}: the storage reports no size")
    return int(size)


@names_errors()
def open_url(url: str, mode: str = "rb", storage_options: dict | None = None) -> IO[Any]:
    """Open a local path or fsspec URL (a local shard only if it is a regular file: `open_local()`)."""
    if is_local(url):
        return open_local(local_path(url), mode)
    target = store_of(url, storage_options, writes="r" not in mode)
    if target is not None and mode in ("rb", "r"):
        raw = ObjectFile(*target, url)
        buffered = io.BufferedReader(raw, READ_BLOCK)
        return buffered if mode == "rb" else io.TextIOWrapper(buffered, encoding="utf-8")
    if target is not None and mode == "wb":
        return AtomicWriter(url, storage_options).file
    fs, path = filesystem(url, storage_options)
    return fs.open(path, mode)


@names_errors()
def exists(url: str, storage_options: dict | None = None) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    target = store_of(url, storage_options)
    if target is not None:
        import obstore

        store, path = target
        try:
            objstore.call(url, lambda: obstore.head(store, path))
            return True
        except FileNotFoundError:  # a folder (a prefix some objects start with) is there too; HTTP has none
            if url.startswith("http"):
                return False

            def first() -> Any:
                return next(iter(obstore.list(store, _dir(path), chunk_size=1)), [])

            return bool(objstore.call(url, first))
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


@names_errors(writes=True)
def makedirs(url: str, storage_options: dict | None = None) -> None:
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
        return
    if store_of(url, storage_options, writes=True) is not None:
        return  # an object store has no folders: an object's name makes its own
    fs, path = filesystem(url, storage_options)
    fs.makedirs(path, exist_ok=True)


@names_errors()
def listdir(url: str, storage_options: dict | None = None) -> list[str]:
    """Names (not paths) of the entries in a folder; empty if it does not exist."""
    if is_local(url):
        p = local_path(url)
        return sorted(os.listdir(p)) if os.path.isdir(p) else []
    target = store_of(url, storage_options)
    if target is not None and not url.startswith("http"):
        import obstore

        store, path = target
        prefix = _dir(path)
        listed = objstore.call(url, lambda: obstore.list_with_delimiter(store, prefix or None))
        names = [posixpath.basename(p.rstrip("/")) for p in listed["common_prefixes"]]
        names += [posixpath.basename(o["path"]) for o in listed["objects"] if o["path"] != prefix]
        return sorted(set(names))
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        return []
    return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))


@names_errors()
def remove(url: str, storage_options: dict | None = None, recursive: bool = False) -> None:
    """Remove a file (a folder and what it holds with ``recursive``); nothing there is not an error."""
    if is_local(url):
        p = local_path(url)
        if recursive and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.remove(p)
        return
    target = store_of(url, storage_options, writes=True)
    if target is not None:
        import obstore

        store, path = target
        objstore.call(url, lambda: obstore.delete(store, path), writes=True)  # nothing there: no error
        if recursive:
            below = objstore.call(url, lambda: [o["path"] for part in obstore.list(store, _dir(path)) for o in part])
            if below:
                objstore.call(url, lambda: obstore.delete(store, below), writes=True)
        return
    fs, path = filesystem(url, storage_options)
    if fs.exists(path):
        fs.rm(path, recursive=recursive)


@names_errors()
def size(url: str, storage_options: dict | None = None) -> int:
    if is_local(url):
        return os.path.getsize(local_path(url))
    target = store_of(url, storage_options)
    if target is not None:
        return objstore.call(url, lambda: objstore.head(*target, url))[0]
    fs, path = filesystem(url, storage_options)
    return int(fs.size(path))


@names_errors()
def read_whole(url: str, storage_options: dict | None = None) -> bytes:
    """The whole of ``url`` in one read: for an object store one GET, with no size request before it."""
    if is_local(url):
        with open_local(local_path(url), "rb", regular=True) as f:
            return f.read()
    target = store_of(url, storage_options)
    if target is not None:
        import obstore

        return objstore.call(url, lambda: bytes(obstore.get(*target).bytes()))
    fs, path = filesystem(url, storage_options)
    s3 = _protocol(fs) in ("s3", "s3a")
    return bytes(fs.cat_file(path, **({"max_concurrency": 1} if s3 else {})))  # s3fs: no size request to split it


@names_errors()
def read_prefix(url: str, limit: int, storage_options: dict | None = None) -> bytes:
    """At most ``limit`` bytes from the start of ``url``, in one read: for an object store a single ranged GET, with
    no size request before it (a small table the index knows the size of costs one round trip, not two)."""
    return _read_range(url, 0, limit, storage_options)


@names_errors()
def read_range(url: str, start: int, end: int, storage_options: dict | None = None) -> bytes:
    """The bytes ``[start, end)`` of ``url`` (fewer where it ends first), in one read with no size request before
    it: for an object store one ranged GET. ``start`` must lie inside the object (a store refuses a range that
    starts at or past its end)."""
    return _read_range(url, start, end, storage_options)


def _read_range(url: str, start: int, end: int, storage_options: dict | None) -> bytes:
    if end <= start:
        return b""
    if is_local(url):
        with open_local(local_path(url), "rb", regular=True) as f:
            f.seek(start)
            return f.read(end - start)
    target = store_of(url, storage_options)
    if target is not None:
        return objstore.call(url, lambda: _range(*target, start, end))
    fs, path = filesystem(url, storage_options)
    got = bytes(fs.cat_file(path, start=start, end=end))
    return got[start:end] if len(got) > end - start else got  # an HTTP server may answer the whole object


def _range(store: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object through obstore: one ranged GET; where the server does not serve
    ranges (HTTP lets it answer the whole object), one plain GET read only as far as ``end``."""
    import obstore
    from obstore.exceptions import GenericError, NotSupportedError

    try:
        return bytes(obstore.get(store, path, options={"range": (start, end)}).bytes())[: end - start]
    except (NotSupportedError, GenericError) as e:
        if isinstance(e, GenericError) and "non-partial" not in str(e):
            raise
    got = bytearray()
    for piece in obstore.get(store, path).stream():
        got += piece
        if len(got) >= end:
            break
    return bytes(got[start:end])


@names_errors()
def version(url: str, storage_options: dict | None = None) -> str:
    """One version of the object's bytes as its store reports it, in one request (an object store's ``HEAD``): its
    size and its ETag, version id, generation or mtime. Compared only with another answer about the same URL (a
    cache key): a rewrite in place answers another. No object there: `FileNotFoundError`."""
    if is_local(url):
        st = os.stat(local_path(url))
        return object_version({"size": st.st_size, "mtime": st.st_mtime_ns})
    target = store_of(url, storage_options)
    if target is not None:
        size, named = objstore.call(url, lambda: objstore.head(*target, url))
        return object_version({"size": size, "ETag": named})
    fs, path = filesystem(url, storage_options)
    return object_version(fs.info(path))


#: the largest object an object store copies in one request (S3's CopyObject: 5 GiB); a larger one is copied
#: through this process in parts of `COPY_PIECE` bytes
COPY_IN_STORE = 5 << 30
COPY_PIECE = 64 << 20


@names_errors(writes=True)
def copy(src: str, dst: str, storage_options: dict | None = None) -> None:
    """Copy the file or object ``src`` to ``dst``, two URLs of one storage (two local paths, two objects of one
    bucket), replacing what is there; an object store copies it itself (no byte passes through this process) up to
    `COPY_IN_STORE` bytes."""
    if is_local(src) and is_local(dst):
        shutil.copyfile(local_path(src), local_path(dst))
        return
    a, b = store_of(src, storage_options, writes=True), store_of(dst, storage_options, writes=True)
    if a is not None and b is not None and a[0] is b[0]:
        import obstore

        store = a[0]
        if objstore.call(src, lambda: objstore.head(store, a[1], src))[0] <= COPY_IN_STORE:
            objstore.call(dst, lambda: obstore.copy(store, a[1], b[1]), writes=True)
        else:  # larger than one copy request may be (S3's CopyObject): through this process, in parts
            import asyncio

            async def in_parts() -> None:  # the download's stream fed to a multipart upload, a piece at a time
                got = await obstore.get_async(store, a[1])
                await obstore.put_async(store, b[1], got.stream(min_chunk_size=COPY_PIECE), chunk_size=COPY_PIECE)

            objstore.call(dst, lambda: asyncio.run(in_parts()), writes=True)
        return
    fs, path = filesystem(src, storage_options)
    fs.copy(path, filesystem(dst, storage_options)[1])


@names_errors(writes=True)  # a bucket that does not exist: one line naming it
def create_only(url: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write ``data`` to ``url`` only if nothing is there, in one step the store decides: a local file opened with
    ``O_EXCL``, an object put with ``mode="create"`` (S3's and Azure's ``If-None-Match: *``, GCS's
    ``ifGenerationMatch=0``; fsspec's ``pipe_file(..., mode="create")`` where obstore does not serve the URL). Of
    writers racing, exactly one succeeds; the others get `FileExistsError`."""
    if is_local(url):
        fd = os.open(local_path(url), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    target = store_of(url, storage_options, writes=True)
    if target is not None:
        import obstore

        objstore.call(url, lambda: obstore.put(*target, data, mode="create"), writes=True)
        return
    fs, path = filesystem(url, storage_options)
    fs.pipe_file(path, data, mode="create")


@names_errors()
def modified(url: str, storage_options: dict | None = None) -> float:
    """When ``url`` was last written, in seconds since the epoch (a local file's mtime, an object's Last-Modified)."""
    if is_local(url):
        return os.stat(local_path(url)).st_mtime
    target = store_of(url, storage_options)
    if target is not None:
        import obstore

        return objstore.call(url, lambda: obstore.head(*target))["last_modified"].timestamp()
    fs, path = filesystem(url, storage_options)
    return fs.modified(path).timestamp()


def open_sized(url: str, want: int, storage_options: dict | None, whole: bool) -> tuple[IO[bytes], int]:
    """A random-access file over ``url`` and its size, to check against the ``want`` bytes an index says. ``whole``:
    its first ``want + 1`` bytes read at once (`read_prefix()`) and served from memory, so a larger object is
    seen as larger without reading the rest."""
    if whole:
        data = read_prefix(url, want + 1, storage_options)
        return io.BytesIO(data), len(data)
    f = open_random(url, storage_options)
    size = f.seek(0, 2)
    f.seek(0)
    return f, size


def open_random(url: str, storage_options: dict | None = None) -> IO[bytes]:
    """Open for random-access reads (Parquet footers and row groups): object stores fetch exactly the ranges
    asked for, with no read-ahead block around them."""
    if is_local(url):
        return open_local(local_path(url), "rb", regular=True)
    target = store_of(url, storage_options)
    if target is not None:
        return ObjectFile(*target, url)  # type: ignore[return-value]
    fs, path = filesystem(url, storage_options)
    return fs.open(path, "rb", cache_type="none")


class ObjectFile(io.RawIOBase):
    """An object read through obstore as a seekable binary file: its size asked once when opened (one ``HEAD``),
    then each read one ranged ``GET`` of exactly the bytes asked for (wrap it in ``io.BufferedReader`` to read
    ahead). A failed request raises as `objstore.call()` classifies it."""

    def __init__(self, store: Any, path: str, url: str) -> None:
        super().__init__()
        self._store, self._path, self.name = store, path, url
        self._size = objstore.call(url, lambda: objstore.head(store, path, url))[0]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.name}: seek to a negative position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        import obstore

        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        if n == 0:
            return 0
        start = self._pos
        data = objstore.call(self.name, lambda: obstore.get_range(self._store, self._path, start=start, length=n))
        got = len(data)
        view[:got] = memoryview(data)
        self._pos += got
        return got


class AtomicWriter:
    """A file written under a temporary name and published whole, for streaming writes of big objects.

    Local targets: a temporary file in the target's folder, fsync'ed by `finish()` and renamed into place
    by `publish()` (atomic on POSIX), so several files can be finished first and published together.
    Object stores: an upload that becomes visible only when `finish()` completes it (obstore's: in parts of
    `PART` bytes once it outgrows one). `abort()` throws an unfinished file away. As a context manager: publish on
    success, abort on an exception.
    """

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url
        self.nbytes: int | None = None
        self.tmp: str | None = None
        if is_local(url):
            self.dst = local_path(url)
            os.makedirs(os.path.dirname(self.dst) or ".", exist_ok=True)
            self.tmp = temporary_name(self.dst)
            self.file: IO[bytes] = open(self.tmp, "wb")
        elif (target := store_of(url, storage_options, writes=True)) is not None:
            self.file = _ObjectWriter(*target, url)  # type: ignore[assignment]
        else:
            fs, path = filesystem(url, storage_options)
            self.file = fs.open(path, "wb")

    def finish(self) -> int:
        """Flush, sync and close the file; returns its size in bytes. An error names the file
        (`write_error()`)."""
        if self.nbytes is None:
            try:
                self.file.flush()
                size = self.file.tell()
                if self.tmp is not None:
                    os.fsync(self.file.fileno())
                self.file.close()
            except Exception as e:
                raise write_error(self.url, e) from e.__cause__
            self.nbytes = int(size)
        return self.nbytes

    def publish(self) -> None:
        """Make the finished file visible under its name."""
        self.finish()
        if self.tmp is not None:
            try:
                os.replace(self.tmp, self.dst)
            except OSError as e:
                raise write_error(self.url, e) from e.__cause__
            self.tmp = None

    def abort(self) -> None:
        """Throw the file away (best effort): nothing appears under its name."""
        try:
            if self.tmp is not None:
                try:
                    self.file.close()
                except OSError:  # its buffer could not be written (the disk is full): the file goes all the same
                    pass
                if os.path.exists(self.tmp):
                    os.remove(self.tmp)
                self.tmp = None
            elif self.nbytes is None and isinstance(self.file, _ObjectWriter):
                self.file.discard()
            elif self.nbytes is None:
                abort_upload(self.file, self.url)
        except Exception:  # noqa: BLE001 - cleaning up after another error: that error is the one to see
            pass

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.publish()
        except BaseException:  # no room to finish, a folder in the way: nothing is left under either name
            self.abort()
            raise


class _ObjectWriter(io.RawIOBase):
    """An upload through obstore, as a binary file to write: obstore's buffered writer (a multipart upload in
    `PART`-byte parts once it outgrows one), whose object appears whole when `close()` completes it and never if
    `discard()` comes first; ``tell()`` is the bytes written. What is written is gathered here and handed to obstore
    a part at a time (one request's worth per `objstore.call()`). Errors name the URL as `objstore.call()` says."""

    def __init__(self, store: Any, path: str, url: str) -> None:
        import obstore

        super().__init__()
        self.name, self._written, self._held = url, 0, bytearray()
        self._file = objstore.call(url, lambda: obstore.open_writer(store, path, buffer_size=PART), writes=True)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        self._held += data
        self._written += n
        if len(self._held) >= PART:
            self._hand_over()
        return n

    def _hand_over(self) -> None:
        held, self._held = bytes(self._held), bytearray()
        objstore.call(self.name, lambda: self._file.write(held), writes=True)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        """Nothing to do: a part goes once it is full, the rest when the upload is completed (`close()`)."""

    def close(self) -> None:
        if not self.closed:
            try:
                if self._held:
                    self._hand_over()
                objstore.call(self.name, self._file.close, writes=True)
            finally:
                super().close()

    def discard(self) -> None:
        """Abort the upload (what was sent is thrown away; nothing appears under the name), waiting for the storage
        at most `CLEANUP_TIMEOUT` seconds."""
        if self.closed:
            return
        self._held = bytearray()
        error = RuntimeError("the upload is discarded")
        try:  # the context manager's exit on an exception is obstore's one way to abort its upload
            within(CLEANUP_TIMEOUT, lambda: self._file.__exit__(RuntimeError, error, None))
        finally:
            super().close()


def put_file_atomic(local_src: str, url: str, storage_options: dict | None = None) -> None:
    """Move/upload a finished local file to ``url`` so it appears only complete.

    Local targets: ``os.replace`` of a temporary name in the same folder (atomic on POSIX).
    Object stores: a single whole-object upload, which becomes visible only when complete.
    """
    if is_local(url):
        with AtomicWriter(url) as w, open(local_src, "rb") as fi:
            while chunk := fi.read(1 << 22):
                w.file.write(chunk)
        return
    _upload(url, local_src, storage_options)


@names_errors(writes=True)
def _upload(url: str, local_src: str, storage_options: dict | None) -> None:
    """Upload a local file to an object store's ``url`` (one whole-object upload)."""
    target = store_of(url, storage_options, writes=True)
    if target is not None:
        import pathlib

        import obstore

        put = lambda: obstore.put(*target, pathlib.Path(local_src), chunk_size=PART)  # noqa: E731
        objstore.call(url, put, writes=True)
        return
    fs, path = filesystem(url, storage_options)
    fs.put_file(local_src, path)


@names_errors(writes=True)
def write_bytes_atomic(url: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write ``data`` to ``url`` so that readers see either nothing or the whole object."""
    if is_local(url):
        with AtomicWriter(url) as w:
            w.file.write(data)
        return
    target = store_of(url, storage_options, writes=True)
    if target is not None:
        import obstore

        objstore.call(url, lambda: obstore.put(*target, data, chunk_size=PART), writes=True)
        return
    fs, path = filesystem(url, storage_options)
    fs.pipe_file(path, data)
