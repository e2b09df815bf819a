"""Object storage through obstore (Rust ``object_store``): ``s3://``, ``gs://``, ``az://`` (``abfs://``) and
``http(s)://``, for the shard reader's range reads and heads and for `storage`'s whole-object reads, writes,
listings and sizes; every other scheme (and local paths) through fsspec.

A store is made per process and kept per (process, scheme, bucket or host, options, the store's environment,
timeouts, retries), from the same fsspec-style ``storage_options`` users pass for every other storage call: s3fs's
for ``s3://`` (`s3_config()`), gcsfs's for ``gs://`` (`gcs_config()`), adlfs's for ``az://`` (`azure_config()`); the
mapping is in the storage guide. Requests run in Rust with the interpreter lock released.

**Fork.** obstore runs its requests on one tokio runtime per process, started by the first request, and a tokio
runtime does not survive ``fork()``: the child inherits the runtime's state but not its threads, and its first
request waits forever. So a loader's workers are forked only from a process where no such runtime runs
(`fork_unsafe()`, asked where the workers are started): a process where this module made a request runs it (a
flag of the process, set by the calls that make them: `call()`, `head()`, `read_range()`), and so does one where
the runtime's threads are in ``/proc/self/task`` (they are there whoever started them: the user's own obstore
calls, another library built on tokio; obstore has no call that tells, and its threads take their ``tokio-``
names a moment after they start, so the flag is what answers at once for this package's own requests); where one
runs, the workers start by ``forkserver`` instead, from a clean process.
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

Options this module does not map (``s3://``: requester pays, server-side encryption keys, version-aware paths;
``gs://``: requester pays, user credentials; ``az://``: a credential object) go through fsspec instead (`store_for()`
answers None), which for ``gs://`` and ``az://`` needs gcsfs or adlfs installed.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

from ..errors import MissingCredentials, StorageError, UsageError

#: seconds to wait for a connection to object storage (where the options set none: every store `storage` makes, and
#: every ``s3://`` filesystem for the fsspec path)
CONNECT_TIMEOUT = 10.0
#: seconds a request to object storage may wait for data (as the shard reader's default ``timeout``)
READ_TIMEOUT = 60.0
#: tries of a request to object storage (the first and two retries)
ATTEMPTS = 3
#: the slowest upload that is not taken for a stalled one, in bytes per second (256 KiB/s, about 2 Mbit/s)
UPLOAD_RATE = 256 * 1024
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


#: the schemes of each kind of store (fsspec's names for them)
S3_SCHEMES = ("s3", "s3a")
GCS_SCHEMES = ("gs", "gcs")
AZURE_SCHEMES = ("az", "abfs", "abfss")
HTTP_SCHEMES = ("http", "https")
#: the environment variables each kind of store reads (a store made under other values is not reused)
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")


def handles(url: str) -> bool:
    """Whether ``url``'s scheme is one this module reads (`S3_SCHEMES`, `GCS_SCHEMES`, `AZURE_SCHEMES`,
    `HTTP_SCHEMES`)."""
    return url.partition("://")[0] in S3_SCHEMES + GCS_SCHEMES + AZURE_SCHEMES + HTTP_SCHEMES and "::" not in url


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


#: gcsfs options that only tune gcsfs itself (caches, its session): nothing for a request to honour
_GCSFS_ONLY = {
    "project",
    "access",
    "consistency",
    "cache_timeout",
    "secure_serialize",
    "check_connection",
    "block_size",
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "asynchronous",
    "loop",
    "session_kwargs",
    "retries",
}


def gcs_config(storage_options: dict | None) -> tuple[dict, dict] | None:
    """``(GCSStore keyword arguments, client options)`` for gcsfs-style ``storage_options``; None where they ask for
    something not mapped here (gcsfs then serves). ``token``: a service account's JSON key file (a path) or its
    parsed contents (a dict), ``"anon"`` for unsigned requests, ``None``/``"google_default"``/``"cloud"`` for the
    default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server); ``endpoint_url`` the endpoint (an
    emulator's; plain HTTP allowed for an ``http://`` one); ``requests_timeout`` seconds to connect and to wait
    for data. Requester pays and user (OAuth) credentials are not mapped."""
    import json

    kw: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for name, value in (storage_options or {}).items():
        if name in _GCSFS_ONLY:
            continue
        if name == "token":
            if value in (None, "google_default", "cloud"):
                continue
            if value == "anon":
                kw["skip_signature"] = True
            elif isinstance(value, dict) and value.get("type") == "service_account":
                kw["service_account_key"] = json.dumps(value)
            elif isinstance(value, (str, os.PathLike)) and str(value) not in ("browser",):
                kw["service_account"] = os.fspath(value)
            else:
                return None
        elif name == "endpoint_url":
            if value:
                kw["base_url"] = str(value).rstrip("/")
                if str(value).startswith("http://"):
                    client["allow_http"] = True
        elif name == "requests_timeout":
            if value:
                client["connect_timeout"] = client["read_timeout"] = timedelta(seconds=float(value))
        elif name == "requester_pays":
            if value:
                return None
        else:
            return None
    return kw, client


#: adlfs options that only tune adlfs itself (block sizes, caches, its threads): nothing for a request to honour
_ADLFS_ONLY = {
    "blocksize",
    "default_fill_cache",
    "default_cache_type",
    "version_aware",
    "assume_container_exists",
    "max_concurrency",
    "timeout",
    "connection_timeout",
    "read_timeout",
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "asynchronous",
    "loop",
}
#: adlfs's names for what a store is told, and obstore's
_AZURE_NAMES = {
    "account_name": "account_name",
    "account_key": "account_key",
    "sas_token": "sas_key",
    "tenant_id": "tenant_id",
    "client_id": "client_id",
    "client_secret": "client_secret",
}
#: a connection string's fields, and obstore's names for them
_CONNECTION_FIELDS = {"AccountName": "account_name", "AccountKey": "account_key", "SharedAccessSignature": "sas_key"}


def azure_config(storage_options: dict | None, where: str = "") -> tuple[dict, dict] | None:
    """``(AzureStore keyword arguments, client options)`` for adlfs-style ``storage_options`` and the URL's
    container part ``where`` (``container`` or ``container@account.host``); None where they ask for something not
    mapped here (adlfs then serves). ``account_name``, ``account_key``, ``sas_token``, ``tenant_id``/``client_id``/
    ``client_secret`` (a service principal) as named; ``connection_string`` read for the account, key, SAS and blob
    endpoint (``UseDevelopmentStorage=true``: the Azurite emulator); ``account_host`` the host of the endpoint;
    ``anon`` unsigned requests. What is not given comes from the ``AZURE_STORAGE_*`` environment, as adlfs does.
    A credential object (``credential``) is not mapped."""
    kw: dict[str, Any] = {}
    client: dict[str, Any] = {}
    container, _, host = where.partition("@")
    if host:
        kw["account_name"] = host.split(".", 1)[0]
    for name, value in (storage_options or {}).items():
        if name in _ADLFS_ONLY:
            continue
        if name in _AZURE_NAMES:
            if value is not None:
                kw[_AZURE_NAMES[name]] = str(value).lstrip("?") if name == "sas_token" else str(value)
        elif name == "connection_string":
            if not value:
                continue
            fields = dict(p.split("=", 1) for p in str(value).split(";") if "=" in p)
            if fields.get("UseDevelopmentStorage", "").lower() == "true":
                kw["use_emulator"] = True
            for field, key in _CONNECTION_FIELDS.items():
                if fields.get(field):
                    kw[key] = fields[field].lstrip("?") if key == "sas_key" else fields[field]
            if fields.get("BlobEndpoint"):
                kw["endpoint"] = fields["BlobEndpoint"].rstrip("/")
        elif name == "account_host":
            if value:
                kw["endpoint"] = f"https://{value}"
        elif name == "anon":
            if value:
                kw["skip_signature"] = True
        else:
            return None
    if str(kw.get("endpoint", "")).startswith("http://"):
        client["allow_http"] = True
    if kw.get("use_emulator"):
        client["allow_http"] = True
    return kw, client


def credentials_hint(url: str) -> str:
    """Where credentials for ``url``'s storage come from."""
    if url.partition("://")[0] in ("s3", "s3a"):
        return (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass --storage-option key=... "
            "--storage-option secret=... (Python: storage_options={'key': ..., 'secret': ...}); anon=true for a "
            "public bucket"
        )
    return "pass them with --storage-option KEY=VALUE (Python: storage_options={...})"


# ---- the stores of this process ---------------------------------------------------------------------------------
_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()
#: the process that made an obstore request through this module (its runtime runs there: `runtime_running()`); a
#: forked child is another process, so it starts unset there
_REQUESTED_IN: int | None = None


def _requesting() -> None:
    """Note that this process makes an obstore request (so its runtime runs here from now on)."""
    global _REQUESTED_IN
    _REQUESTED_IN = os.getpid()


def usable(url: str, storage_options: dict | None) -> bool:
    """Whether `store_for()` serves ``url`` through obstore, without making a store."""
    if not handles(url):
        return False
    scheme, _, rest = url.partition("://")
    if scheme in HTTP_SCHEMES:
        return not storage_options
    if scheme in GCS_SCHEMES:
        return gcs_config(storage_options) is not None
    if scheme in AZURE_SCHEMES:
        return azure_config(storage_options, rest.partition("/")[0]) is not None
    return s3_config(storage_options) is not None


def runtime_running() -> bool:
    """Whether a tokio runtime runs in this process, so that a process forked from this one cannot make obstore
    requests: this module made a request here, or a thread named ``tokio-...`` runs (someone else's runtime; not
    seen where ``/proc/self/task`` cannot be read)."""
    if _REQUESTED_IN == os.getpid():
        return True
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
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


def store_for(
    url: str,
    storage_options: dict | None,
    timeout: float | None = None,
    *,
    connect: float | None = None,
    retries: int = 0,
    part: int | None = None,
) -> tuple[Any, str] | None:
    """(this process's obstore store for ``url``'s bucket or host, the object's path in it), or None where this
    module does not serve ``url`` (another scheme, unmapped options).
    ``timeout``: seconds to wait for data, and to connect unless ``connect`` says (where the options set neither).
    A whole request may take four times ``timeout``; with ``part`` (the largest body a request sends, in bytes)
    the two timeouts plus a second per `UPLOAD_RATE` bytes of it instead (a stalled upload fails, a slow one
    finishes), and without ``part`` or ``timeout`` no limit beyond them. ``retries``: obstore's own retries of a
    failed request (backoff with jitter; 0 for the shard reader, whose one retry rule resumes at the byte)."""
    if not usable(url, storage_options):
        return None
    scheme, _, rest = url.partition("://")
    where, _, path = rest.partition("/")
    env = tuple(
        sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k.lower().endswith("proxy"))
    )
    options = repr(sorted((storage_options or {}).items()))
    key = (os.getpid(), scheme, where, options, timeout, connect, retries, part, env)
    with _LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _make(url, scheme, where, storage_options, (timeout, connect, part), retries)
            if store is None:
                return None
            _STORES[key] = store
    return store, path


def _timeouts(client: dict, limits: tuple) -> Any:
    """``client`` with the timeouts of `store_for()`'s ``(timeout, connect, part)`` where the options set none."""
    timeout, connect, part = limits
    if timeout:
        client.setdefault("connect_timeout", timedelta(seconds=connect or timeout))
        client.setdefault("read_timeout", timedelta(seconds=timeout))
        if part:
            waits = client["connect_timeout"] + client["read_timeout"]
            client.setdefault("timeout", waits + timedelta(seconds=part / UPLOAD_RATE))
        elif connect is None:
            client.setdefault("timeout", timedelta(seconds=4 * timeout))
    return client


def _make(url: str, scheme: str, where: str, storage_options: dict | None, limits: tuple, retries: int) -> Any:
    """A new store for bucket, container (or host) ``where``; None where the options are not mapped."""
    from obstore.store import AzureStore, GCSStore, HTTPStore, S3Store

    retry: Any = {"max_retries": retries}
    if scheme in HTTP_SCHEMES:
        if storage_options:  # aiohttp's client options (auth, headers, ...): fsspec's HTTP reads them
            return None
        client = _timeouts({"allow_http": scheme == "http", **_proxy(f"{scheme}://", None)}, limits)
        return HTTPStore.from_url(f"{scheme}://{where}", client_options=client, retry_config=retry)
    if scheme in GCS_SCHEMES:
        mapped = gcs_config(storage_options)
        if mapped is None:
            return None
        kw, client = mapped
        client.update(_proxy(kw.get("base_url"), None))
        return GCSStore(where, client_options=_timeouts(client, limits), retry_config=retry, **kw)
    if scheme in AZURE_SCHEMES:
        mapped = azure_config(storage_options, where)
        if mapped is None:
            return None
        kw, client = mapped
        client.update(_proxy(kw.get("endpoint"), None))
        container = where.partition("@")[0]
        return AzureStore(container, client_options=_timeouts(client, limits), retry_config=retry, **kw)
    mapped = s3_config(storage_options)
    if mapped is None:
        return None
    kw, client = mapped
    provider = _credentials(url, kw.pop("profile", None), kw)
    if provider is not None:
        kw["credential_provider"] = provider
    return S3Store(where, client_options=_timeouts(client, limits), retry_config=retry, **kw)


def _credentials(url: str, profile: str | None, kw: dict) -> Any:
    """Where a store's credentials come from where the options name no keys: botocore's chain (a boto3 session, of
    ``profile`` where given), the one s3fs uses, so the shared credentials and config files, ``AWS_PROFILE``, SSO and
    the instance's role serve as they do for the index; None where the options or ``AWS_ACCESS_KEY_ID`` give keys,
    requests go unsigned, or boto3 is not installed (then obstore reads the ``AWS_*`` environment itself). A chain that
    finds none is a `MissingCredentials` naming ``url`` (obstore would otherwise ask the instance metadata service,
    which a machine outside AWS does not answer)."""
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
    session = boto3.Session(profile_name=profile)
    if session.get_credentials() is None:
        raise MissingCredentials(f"{url}: no credentials for s3 storage (NoCredentialsError): {credentials_hint(url)}")
    return Boto3CredentialProvider(session)


# ---- requests ---------------------------------------------------------------------------------------------------
#: words of a transport failure in an obstore error (the request never got an answer)
_NO_ANSWER = ("error sending request", "timed out", "connection", "dns error")


def _error(e: BaseException, url: str, writes: bool = False) -> BaseException:
    """An obstore error as the caller classifies it: a missing object (``writes``: a missing bucket is a
    `StorageError` naming it), an object a create-only put found there (`FileExistsError`), a refusal, or the store's
    failure (`StoreError`: no answer in time, a 5xx after the store's retries)."""
    from obstore.exceptions import (
        AlreadyExistsError,
        NotFoundError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )

    said = str(e)
    if isinstance(e, (NotFoundError, FileNotFoundError)):  # obstore raises the built-in one for a 404
        if writes and "NoSuchBucket" in said:  # S3's error code for the bucket, in its answer's body
            bucket = url.split("://", 1)[1].split("/", 1)[0]
            return StorageError(f"{url}: the bucket {bucket!r} does not exist; create it, or check the URL")
        return FileNotFoundError(f"{url}: no such object")
    if isinstance(e, (AlreadyExistsError, PreconditionError, FileExistsError)):
        return FileExistsError(f"{url}: already there")
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError, PermissionError)):
        return PermissionError(f"{url}: the store refused the request ({type(e).__name__})")
    first = said.strip().splitlines()[0] if said.strip() else type(e).__name__
    if any(w in said.lower() for w in _NO_ANSWER):
        return StoreError(
            f"{url}: the storage did not answer ({first}); check the endpoint and the network (the storage options' "
            "timeouts set how long it is waited for)"
        )
    return StoreError(f"{url}: {first}")


def call(url: str, fn: Any, writes: bool = False) -> Any:
    """``fn()`` (an obstore request about ``url``), its error raised as the package classifies it (`_error()`).

    On the main thread the request runs on a daemon thread while the main thread waits: obstore blocks in Rust
    until its request ends (a stalled store: its whole deadline), and Python runs a signal's handler (Ctrl-C,
    ``SIGTERM``) only between its own instructions, so waiting on a helper keeps a stalled request from delaying
    an interrupt and its cleanup. An abandoned request ends on its own, and does not hold up the exit."""
    _requesting()
    try:
        return fn() if threading.current_thread() is not threading.main_thread() else _on_helper(fn)
    except (StorageError, UsageError):
        raise
    except Exception as e:
        if _is_obstore(e):
            raise _error(e, url, writes) from e
        raise


def _on_helper(fn: Any) -> Any:
    """``fn()`` on a daemon thread, waited for in a way a signal interrupts."""
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="streambatch-objstore", daemon=True).start()
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _is_obstore(e: BaseException) -> bool:
    """Whether ``e`` is obstore's: its own exception classes, or the built-in OS errors it raises for a missing
    object, a refusal or a transport failure."""
    from obstore.exceptions import BaseError

    return isinstance(e, (BaseError, OSError))


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

    _requesting()
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

    _requesting()

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
