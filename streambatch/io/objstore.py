"""Range reads of shards on object storage through obstore (Rust ``object_store``): ``s3://`` and ``http(s)://``.

A store is made per process (never inherited over a fork) and kept per (process, scheme, bucket or host, options,
``AWS_*`` environment, timeout), from the same s3fs-style ``storage_options`` users pass for every other storage call
(`s3_config()`; the mapping is in the storage guide). Requests run in Rust with the interpreter lock released.

Every answer is checked against what was asked (`read_range()`): obstore itself checks the status and refuses a
``206`` of another range than asked (an error: retried); an answer with the whole object (``200``: HTTP allows a
server to ignore ``Range``) is read and sliced; a body shorter than asked keeps what arrived, so the caller's retry
resumes at the first missing byte (`RangeReader`: the one retry rule, so obstore's own retries are
off); a body longer than asked is a broken answer. A store's failure is a `StoreError` (transient: counted as
the store's, never as bad data); a missing object a `FileNotFoundError`; a refused request a
`PermissionError`.

Options this module does not map (a proxy, requester pays, server-side encryption keys, version-aware paths) and the
environment ``STREAMBATCH_OBSTORE=0`` keep the fsspec path (`store_for()` answers None).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

from ..errors import StorageError

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
_CONFIG_KWARGS = {"connect_timeout", "read_timeout", "retries", "max_pool_connections", "s3", "signature_version"}
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy")


class StoreError(StorageError, ConnectionError):
    """A request the store did not answer as asked (a 5xx, throttling, a broken or stalled answer, another range
    than asked): transient, retried from the first byte not yet received; the message names the URL."""


def enabled() -> bool:
    """Whether remote range reads go through obstore (not switched off with ``STREAMBATCH_OBSTORE=0``)."""
    return os.environ.get("STREAMBATCH_OBSTORE", "1") != "0"


def handles(url: str) -> bool:
    """Whether ``url``'s scheme is one this module reads (``s3``, ``s3a``, ``http``, ``https``)."""
    return url.partition("://")[0] in ("s3", "s3a", "http", "https") and "::" not in url


def s3_config(storage_options: dict | None) -> tuple[dict, dict] | None:
    """``(S3Store keyword arguments, client options)`` for s3fs-style ``storage_options``; None where they ask for
    something not mapped here (the fsspec path then reads). ``key``/``secret``/``token`` and their ``client_kwargs``
    spellings are the credentials; ``endpoint_url`` (top level or in ``client_kwargs``) the endpoint, path-style
    unless ``config_kwargs["s3"]["addressing_style"]`` is ``"virtual"``, plain HTTP allowed for an ``http://`` one;
    ``region_name`` the region; ``anon`` unsigned requests; ``profile`` a boto3 session's credentials;
    ``client_kwargs["verify"]=False`` accepts any certificate, a path as ``verify`` is the CA bundle;
    ``config_kwargs`` timeouts in seconds. What is not given comes from the ``AWS_*`` environment, as s3fs does."""
    opts = dict(storage_options or {})
    kw: dict[str, Any] = {}
    client: dict[str, Any] = {}
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
            if set(cfg) - _CONFIG_KWARGS or cfg.get("proxies"):
                return None
            for k in ("connect_timeout", "read_timeout"):
                if cfg.get(k):
                    client[k] = timedelta(seconds=float(cfg[k]))
            if (cfg.get("s3") or {}).get("addressing_style") == "virtual":
                kw["virtual_hosted_style_request"] = True
        else:
            return None
    endpoint = kw.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        kw.setdefault("virtual_hosted_style_request", False)
        if str(endpoint).startswith("http://"):
            client["allow_http"] = True
    if "region" not in kw and not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        kw["region"] = "us-east-1"
    return kw, client


# ---- the stores of this process ---------------------------------------------------------------------------------
_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()
#: the process that first handed out a store: obstore's requests run on a tokio runtime that does not survive a
#: fork, so a process forked after that (a loader's worker whose parent read shards itself) reads through fsspec
_USED_BY: int | None = None


def usable(url: str, storage_options: dict | None) -> bool:
    """Whether `store_for()` would read ``url`` here, without making a store (nothing is started: a process
    about to fork its loader's workers asks this)."""
    if not enabled() or not handles(url) or _USED_BY not in (None, os.getpid()):
        return False
    if any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARS):
        return False
    if url.startswith("http"):
        return not storage_options
    return s3_config(storage_options) is not None


def store_for(url: str, storage_options: dict | None, timeout: float | None = None) -> tuple[Any, str] | None:
    """(this process's obstore store for ``url``'s bucket or host, the object's path in it), or None where this
    module does not read ``url`` (another scheme, unmapped options, a proxy in the environment, switched off, a
    process forked from one that used obstore).
    ``timeout``: seconds to connect and to wait for data; a whole request may take four times as long."""
    global _USED_BY
    if not usable(url, storage_options):
        return None
    scheme, _, rest = url.partition("://")
    where, _, path = rest.partition("/")
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), scheme, where, repr(sorted((storage_options or {}).items())), timeout, env)
    with _LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _make(scheme, where, storage_options, timeout)
            if store is None:
                return None
            _STORES[key] = store
        _USED_BY = os.getpid()
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
        client = _timeouts({"allow_http": scheme == "http"}, timeout)
        return HTTPStore.from_url(f"{scheme}://{where}", client_options=client, retry_config=no_retries)
    mapped = s3_config(storage_options)
    if mapped is None:
        return None
    kw, client = mapped
    profile = kw.pop("profile", None)
    if profile is not None:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider

        kw["credential_provider"] = Boto3CredentialProvider(boto3.Session(profile_name=profile))
    return S3Store(where, client_options=_timeouts(client, timeout), retry_config=no_retries, **kw)


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
    """``ETAG@SECONDS[#VERSIONID]`` of an obstore ``ObjectMeta`` (`object_version()`)."""
    from .s3_direct import object_version as version

    modified = meta.get("last_modified")
    return version(meta.get("e_tag"), modified.timestamp() if modified is not None else None, meta.get("version"))


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
