"""Range reads and heads of shards on object storage through obstore (Rust ``object_store``): ``s3://`` and
``http(s)://``; every other scheme (and local paths) through fsspec.

A store is made per process and kept per (process, scheme, bucket or host, options, ``AWS_*`` environment, timeout),
from the same s3fs-style ``storage_options`` users pass for every other storage call (`s3_config()`; the mapping is
in the storage guide). Requests run in Rust with the interpreter lock released.

**Fork.** obstore runs its requests on one tokio runtime per process, started by the first request, and a tokio
runtime does not survive ``fork()``: the child inherits the runtime's state but not its threads, and its first
request waits forever. So a loader's workers are forked only from a process where no such runtime runs
(`fork_unsafe()`, asked where the workers are started): the runtime's threads are looked for in
``/proc/self/task`` (they are there whoever started them: this package, the user's own obstore calls, another
library built on tokio), and where one runs the workers start by ``forkserver`` instead, from a clean process.
Looking is what makes this robust: keeping the parent away from obstore holds only until a pass without workers,
a ``shardify verify`` or the user's own code makes one request, and starting every object-store dataset's
workers by forkserver would cost each worker its own imports and length reads, and would refuse callables that do
not pickle, where forking is safe. The training process plans from the index through fsspec (not obstore), so
in the usual case the workers are forked.

Every answer is checked against what was asked (`read_range()`): obstore itself checks the status and refuses a
``206`` of another range than asked (an error: retried); an answer with the whole object (``200``: HTTP allows a
server to ignore ``Range``) is read and sliced; a body shorter than asked keeps what arrived, so the caller's retry
resumes at the first missing byte (`RangeReader`: the one retry rule, so obstore's own retries are off); a body
longer than asked is a broken answer. A store's failure is a `StoreError` (transient: counted as the store's, never
as bad data); a missing object a `FileNotFoundError`; a refused request a `PermissionError`.

``s3://`` options this module does not map (requester pays, server-side encryption keys, version-aware paths) read
through fsspec's generic range read instead (`store_for()` answers None).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

from ..errors import StorageError, UsageError

#: the fewest bytes obstore hands over at a time: 1, each piece as it arrives, so that what arrived before a break
#: is kept (obstore drops a piece it had not handed over) and the retry asks only for the rest
PIECE = 1
#: s3fs options that only tune s3fs itself (caches, its own retries): nothing for a range read to honour
_S3FS_ONLY = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "cache_regions",
    "retries",
    "max_concurrency",
    "fixed_upload_size",
    "asynchronous",
    "loop",
    "session",
}
_CREDENTIALS = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
_CLIENT_KWARGS = {
    "endpoint_url": "endpoint",
    "region_name": "region",
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
}
_CONFIG_KWARGS = {
    "connect_timeout",
    "read_timeout",
    "retries",
    "max_pool_connections",
    "s3",
    "signature_version",
    "proxies",
}


class StoreError(StorageError, ConnectionError):
    """A request the store did not answer as asked (a 5xx, throttling, a broken or stalled answer, another range
    than asked): transient, retried from the first byte not yet received; the message names the URL."""


def handles(url: str) -> bool:
    """Whether ``url``'s scheme is one this module reads (``s3``, ``s3a``, ``http``, ``https``)."""
    return url.partition("://")[0] in ("s3", "s3a", "http", "https") and "::" not in url


def _proxy(endpoint: str | None, proxies: dict | None) -> dict:
    """obstore's proxy options for requests to ``endpoint`` (None: AWS's, over HTTPS): botocore's ``proxies``
    (``{"http": URL, "https": URL}``) where given, else the ``HTTPS_PROXY``/``HTTP_PROXY``/``ALL_PROXY``
    environment as botocore reads it, with ``NO_PROXY`` the hosts that bypass it."""
    scheme = "http" if str(endpoint or "").startswith("http://") else "https"
    env = lambda name: os.environ.get(name) or os.environ.get(name.upper())  # noqa: E731
    url = (proxies or {}).get(scheme) if proxies else env(f"{scheme}_proxy") or env("all_proxy")
    if not url:
        return {}
    out = {"proxy_url": str(url)}
    if not proxies and env("no_proxy"):
        out["proxy_excludes"] = str(env("no_proxy"))
    return out


def s3_config(storage_options: dict | None) -> tuple[dict, dict] | None:
    """``(S3Store keyword arguments, client options)`` for s3fs-style ``storage_options``; None where they ask for
    something not mapped here (fsspec's generic range read then serves). ``key``/``secret``/``token`` and their
    ``client_kwargs`` spellings are the credentials; ``endpoint_url`` (top level or in ``client_kwargs``) the
    endpoint, path-style unless ``config_kwargs["s3"]["addressing_style"]`` is ``"virtual"``, plain HTTP allowed for
    an ``http://`` one; ``region_name`` the region; ``anon`` unsigned requests; ``profile`` a boto3 session's
    credentials; ``client_kwargs["verify"]=False`` accepts any certificate, a path as ``verify`` is the CA bundle;
    ``config_kwargs`` timeouts in seconds and ``proxies``. What is not given comes from the ``AWS_*`` environment,
    as s3fs does."""
    opts = dict(storage_options or {})
    kw: dict[str, Any] = {}
    client: dict[str, Any] = {}
    proxies: dict | None = None
    for name, value in opts.items():
        if name in _S3FS_ONLY:
            continue
        if name in _CREDENTIALS:
            if value is not None:
                kw[_CREDENTIALS[name]] = str(value)
        elif name == "endpoint_url":
            if value:
                kw["endpoint"] = str(value)
        elif name == "anon":
            if value:
                kw["skip_signature"] = True
        elif name == "profile":
            if value:
                kw["profile"] = str(value)
        elif name == "version_aware":
            if value:
                return None
        elif name == "client_kwargs":
            for k, v in (value or {}).items():
                if k in _CLIENT_KWARGS:
                    if v is not None:
                        kw[_CLIENT_KWARGS[k]] = str(v)
                elif k == "verify":
                    if v is False:
                        client["allow_invalid_certificates"] = True
                    elif isinstance(v, str):
                        client["root_certificate"] = v
                else:
                    return None
        elif name == "config_kwargs":
            cfg = dict(value or {})
            if set(cfg) - _CONFIG_KWARGS:
                return None
            for k in ("connect_timeout", "read_timeout"):
                if cfg.get(k):
                    client[k] = timedelta(seconds=float(cfg[k]))
            if (cfg.get("s3") or {}).get("addressing_style") == "virtual":
                kw["virtual_hosted_style_request"] = True
            proxies = cfg.get("proxies") or None
        else:
            return None
    endpoint = kw.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        kw.setdefault("virtual_hosted_style_request", False)
        if str(endpoint).startswith("http://"):
            client["allow_http"] = True
    client.update(_proxy(endpoint, proxies))
    if "region" not in kw and not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        kw["region"] = "us-east-1"
    return kw, client


# ---- the stores of this process ---------------------------------------------------------------------------------
_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()
#: the process that made an obstore request through this module (where ``/proc`` cannot be read: `fork_unsafe()`)
_REQUESTED_IN: int | None = None


def usable(url: str, storage_options: dict | None) -> bool:
    """Whether `store_for()` reads ``url`` through obstore, without making a store."""
    if not handles(url):
        return False
    if url.startswith("http"):
        return not storage_options
    return s3_config(storage_options) is not None


def runtime_running() -> bool:
    """Whether a tokio runtime runs in this process (its worker threads are named ``tokio-...``): then a process
    forked from this one cannot make obstore requests. Where ``/proc/self/task`` cannot be read, whether this
    module made a request here."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return _REQUESTED_IN == os.getpid()
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("tokio-"):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def fork_unsafe(urls: Any, storage_options: dict | None) -> bool:
    """Whether processes forked from this one now could not read ``urls`` (a dataset's shards): some of them read
    through obstore, and its runtime already runs here (`runtime_running()`). A loader then starts its workers by
    ``forkserver``."""
    if urls is None or not runtime_running():
        return False
    schemes: set[str] = set()
    for url in urls:  # a mixture may hold local shards and remote ones: one URL of each scheme is asked
        scheme = str(url).partition("://")[0]
        if scheme not in schemes:
            schemes.add(scheme)
            if usable(str(url), storage_options):
                return True
    return False


def store_for(url: str, storage_options: dict | None, timeout: float | None = None) -> tuple[Any, str] | None:
    """(this process's obstore store for ``url``'s bucket or host, the object's path in it), or None where this
    module does not read ``url`` (another scheme, unmapped options).
    ``timeout``: seconds to connect and to wait for data; a whole request may take four times as long."""
    global _REQUESTED_IN
    if not usable(url, storage_options):
        return None
    scheme, _, rest = url.partition("://")
    where, _, path = rest.partition("/")
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_") or k.lower().endswith("proxy")))
    key = (os.getpid(), scheme, where, repr(sorted((storage_options or {}).items())), timeout, env)
    with _LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _make(scheme, where, storage_options, timeout)
            if store is None:
                return None
            _STORES[key] = store
        _REQUESTED_IN = os.getpid()
    return store, path


def _timeouts(client: dict, timeout: float | None) -> Any:
    if timeout:
        client.setdefault("connect_timeout", timedelta(seconds=timeout))
        client.setdefault("read_timeout", timedelta(seconds=timeout))
        client.setdefault("timeout", timedelta(seconds=4 * timeout))
    return client


def _make(scheme: str, where: str, storage_options: dict | None, timeout: float | None) -> Any:
    """A new store for bucket (or host) ``where``; None where the options are not mapped."""
    from obstore.store import HTTPStore, S3Store

    no_retries: Any = {"max_retries": 0}  # the one retry rule is the caller's: resume at the byte
    if scheme in ("http", "https"):
        if storage_options:  # aiohttp's client options (auth, headers, ...): fsspec's HTTP reads them
            return None
        client = _timeouts({"allow_http": scheme == "http", **_proxy(f"{scheme}://", None)}, timeout)
        return HTTPStore.from_url(f"{scheme}://{where}", client_options=client, retry_config=no_retries)
    mapped = s3_config(storage_options)
    if mapped is None:
        return None
    kw, client = mapped
    provider = _credentials(kw.pop("profile", None), kw)
    if provider is not None:
        kw["credential_provider"] = provider
    return S3Store(where, client_options=_timeouts(client, timeout), retry_config=no_retries, **kw)


def _credentials(profile: str | None, kw: dict) -> Any:
    """Where a store's credentials come from where the options name no keys: botocore's chain (a boto3 session, of
    ``profile`` where given), the one s3fs uses, so the shared credentials and config files, ``AWS_PROFILE``, SSO and
    the instance's role serve as they do for the index; None where the options or ``AWS_ACCESS_KEY_ID`` give keys,
    requests go unsigned, or boto3 is not installed (then obstore reads the ``AWS_*`` environment itself)."""
    if kw.get("access_key_id") or kw.get("skip_signature"):
        return None
    if profile is None and os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        if profile is not None:
            raise UsageError(f"storage_options profile={profile!r} needs boto3: pip install boto3") from None
        return None
    return Boto3CredentialProvider(boto3.Session(profile_name=profile))


# ---- requests ---------------------------------------------------------------------------------------------------
def _error(e: BaseException, url: str) -> BaseException:
    """An obstore error as the caller classifies it: a missing object, a refusal, or the store's failure."""
    from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

    if isinstance(e, NotFoundError):
        return FileNotFoundError(f"{url}: no such object")
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)):
        return PermissionError(f"{url}: the store refused the request ({type(e).__name__})")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return StoreError(f"{url}: {first}")


def object_version(meta: Any) -> str | None:
    """One version of an object's bytes as its store names it, from an obstore ``ObjectMeta``:
    ``ETAG@SECONDS[#VERSIONID]`` (the ETag and the Last-Modified time change on every write); None without both."""
    etag, modified, version = meta.get("e_tag"), meta.get("last_modified"), meta.get("version")
    if not etag or modified is None:
        return None
    return f"{str(etag).strip()}@{int(modified.timestamp())}" + (f"#{version}" if version else "")


def same_bytes(a: str | None, b: str | None) -> bool:
    """Whether two answers' versions (`object_version()`) name the same bytes: their ETags."""
    return (a or "").partition("@")[0] == (b or "").partition("@")[0]


def head(store: Any, path: str, url: str) -> tuple[int, str | None]:
    """The object's size in bytes and its version (None where the store names none)."""
    import obstore

    try:
        meta = obstore.head(store, path)
    except Exception as e:  # noqa: BLE001 - obstore's errors, classified
        raise _error(e, url) from e
    return int(meta["size"]), object_version(meta)


def read_range(store: Any, path: str, url: str, start: int, end: int, sink: list[bytes], heard: list) -> int | None:
    """Append bytes ``[start, end)`` of the object to ``sink`` as they arrive, and to ``heard`` the version the answer
    names; the object's size (from the answer). An answer with the whole object is sliced; a body that ends early
    leaves what arrived in ``sink`` (the caller asks again for the rest); a longer one raises `StoreError`."""
    import obstore
    from obstore.exceptions import GenericError

    try:
        result = obstore.get(store, path, options={"range": (start, end)})
        skip, whole = 0, False
    except GenericError as e:
        if "non-partial" not in str(e):  # obstore's NotPartial: a 200 with the whole object, dropped
            raise _error(e, url) from e
        try:  # ask for the whole object and take the range out of it
            result = obstore.get(store, path)
        except Exception as e2:  # noqa: BLE001 - obstore's errors, classified
            raise _error(e2, url) from e2
        skip, whole = start, True
    except Exception as e:  # noqa: BLE001 - obstore's errors, classified
        raise _error(e, url) from e
    meta = result.meta
    heard.append(object_version(meta))
    into = bytearray(end - start)  # the range's bytes land here once, as they arrive
    view, got = memoryview(into), 0
    try:
        for piece in result.stream(min_chunk_size=PIECE):
            data = memoryview(piece)
            if skip:
                cut = min(skip, len(data))
                data, skip = data[cut:], skip - cut
            if len(data) > len(into) - got:
                if not whole:
                    raise StoreError(f"{url}: the answer to bytes {start}-{end - 1} is longer than asked")
                data = data[: len(into) - got]
            view[got : got + len(data)] = data
            got += len(data)
            if got >= len(into):
                break
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken body: what arrived goes to sink, the retry resumes after it
        raise _error(e, url) from e
    finally:
        view.release()
        if got == len(into):
            sink.append(into)  # type: ignore[arg-type] # bytes-like: every reader of a chunk takes a buffer
        elif got:
            sink.append(bytes(into[:got]))
    return int(meta["size"])


def store_of(url: str, storage_options: dict | None) -> tuple[Any, str] | None:
    """This process's store for ``url`` and the object's path in it (for other rooms: locks, create-only puts);
    None where fsspec handles ``url``."""
    return store_for(url, storage_options)
