"""Storage calls that end, and errors that say where: what `storage` puts around the back-ends (the
timeouts of object-store calls are `s3_timeouts`').

* A back-end's exception about a URL (missing credentials, no answer, a bucket that does not exist) becomes the
  package's error naming the URL (`names_errors()`).
* Cleanup after an interrupt or an error (a lock file removed, an upload aborted) waits for the storage at most
  `CLEANUP_TIMEOUT` seconds (`within()`); the caller says what it left.
* A shard, an index or its table is read only from a regular file (`open_local()`): opening a FIFO waits for a
  writer forever.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

from ..errors import MissingCredentials, StorageError

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
        what = f"{url}: no credentials for {_protocol(url)} storage ({type(e).__name__})"
        return MissingCredentials(f"{what}: {credentials_hint(url)}")
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


def _protocol(url: str) -> str:
    return url.split("://")[0]


def credentials_hint(url: str) -> str:
    """Where credentials for ``url``'s storage come from."""
    if _protocol(url) in ("s3", "s3a"):
        return (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass --storage-option key=... "
            "--storage-option secret=... (Python: storage_options={'key': ..., 'secret': ...}); anon=true for a "
            "public bucket"
        )
    return "pass them with --storage-option KEY=VALUE (Python: storage_options={...})"


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
