"""Preparing a dataset on Ray: ``shardify write SRC OUT --engine ray`` and ``shardify index SRC --engine ray``.

`RayEngine` is an `Engine`: the records are probed, the planned shards written and the
tars scanned in Ray tasks, each on a contiguous slice. The calling process (the driver) keeps what needs the
whole list: the write order, the shard plan (so each task owns fixed global shard names, ``shard-000123.tar``,
whatever the number of tasks), the index's sample rate, and the index, assembled from the tasks' results in shard
order. The shards are written by the same `write_shard()` as every other write, so the dataset is
byte for byte the one a single-process ``shardify write`` makes (index tables alike, but for the write's time and
id). A task that dies (a node lost, a worker killed) is retried by Ray; the retry first removes the temporary files
its killed attempt left beside its own shards.

Ray is an optional extra (``pip install 'streambatch[ray]'``), imported only here, when an engine is made.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

from ..errors import OptionError, ShardifyError, StreamBatchError, os_problem
from ..format.index import ShardIndex, ShardInfo
from ..io import storage
from .adopt.index import index_tars, scan_tars
from .adopt.scan import ShardScan
from .parts import part_range, remove_quiet
from .probe import Probed, probe_slice
from .records import Record
from .tarwrite import ShardTask, write_shard
from .writer import write_planned, write_shards

#: how to install Ray, for the error when it is missing
EXTRA = "pip install 'streambatch[ray]'"
#: test hook: ``"J:MARKER"`` makes the first attempt of write task J die (SIGKILL) after writing part of its
#: shards, once (while the file MARKER does not exist); Ray then retries the task
KILL_HOOK = "STREAMBATCH_RAY_TEST_KILL"
#: Ray's retries of a task whose worker died (a killed process, a lost node)
MAX_RETRIES = 3
#: seconds to wait for a cluster address to accept a connection before Ray is asked to join it
CONNECT_TIMEOUT = 10.0
#: Ray's setting, read once when Ray is imported, that keeps a node on 127.0.0.1: with it on (Ray's default on
#: Linux) Ray rewrites ``127.0.0.1`` to the machine's interface address and runs its local instance there
LOOPBACK_SETTING = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

T = TypeVar("T")


def import_ray(local: bool = False) -> Any:
    """The ``ray`` module, or a one-line error naming the extra that installs it. ``local``: a local instance will
    be started, so it is kept on 127.0.0.1 with every process it starts (`LOOPBACK_SETTING` off, unless the
    environment sets it), which only works before the process first imports Ray."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_SETTING, "0")
    try:
        import ray
    except ImportError:
        raise ShardifyError(f"the Ray engine needs Ray: {EXTRA}") from None
    return ray


def check_reachable(address: str | None, timeout: float = CONNECT_TIMEOUT) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) cluster address something listens at, else a `ShardifyError`
    naming it: Ray itself retries an address that does not answer for minutes, printing warnings. ``auto``,
    ``local`` and None (a local instance) are Ray's to find."""
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ShardifyError(f"Ray address {address!r}: expected HOST:PORT, ray://HOST:PORT, auto or local")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        reason = os_problem(e)
        raise ShardifyError(f"Ray address {address}: no Ray cluster answers there ({reason})") from None


class RayEngine:
    """Runs a write's probing, shard writing and tar scanning as Ray tasks (see the module's text).

    ``address``: the cluster to join (``"host:port"``, ``"auto"``, ``ray://...``); default ``RAY_ADDRESS``, else a
    local Ray instance started for the write and stopped after it, on 127.0.0.1 (see `import_ray()`). In a
    process already connected to Ray (``ray.init`` done), that connection is used and left open. ``tasks``: Ray
    tasks per step (default: the cluster's CPUs); the output does not depend on it. ``max_retries``: Ray's retries
    of a task whose worker died. Use it as a context manager, or call `close()`.
    """

    def __init__(self, address: str | None = None, tasks: int | None = None, max_retries: int = MAX_RETRIES) -> None:
        if tasks is not None and (isinstance(tasks, bool) or not isinstance(tasks, int) or tasks <= 0):
            raise OptionError(f"tasks must be a positive whole number, not {tasks!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise OptionError(f"max_retries must be a whole number >= 0, not {max_retries!r}")
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.ray = import_ray(local=self.address is None)
        self.tasks, self.max_retries = tasks, max_retries
        self._started = False
        if not self.ray.is_initialized():
            check_reachable(self.address)
            self.ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            self._started = True

    def __enter__(self) -> RayEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the cluster (or stop the local instance) if this engine joined (or started) it."""
        if self._started:
            self.ray.shutdown()
            self._started = False

    # ---- the engine's steps ------------------------------------------------------------------------
    def probe(
        self, records: Sequence[Record], kind: str, workers: int, progress: bool, storage_options: dict | None
    ) -> Probed:
        """Probe contiguous slices of ``records`` in Ray tasks; joined in record order."""
        slices = self._slices(records)
        found = self._run(_probe, [(s, kind, storage_options) for s in slices], [len(s) for s in slices], progress)
        items = [x for got, _ in found for x in got]
        return items, [p for _, problems in found for p in problems]

    def write(
        self, tasks: Sequence[ShardTask], workers: int, progress: bool, stats: dict[str, int] | None
    ) -> list[ShardInfo]:
        """Write contiguous runs of the planned shards in Ray tasks; infos in shard order."""
        groups = self._slices(tasks)
        sizes = [sum(len(t.samples) for t in g) for g in groups]
        done = self._run(_write, [(g, j) for j, g in enumerate(groups)], sizes, progress)
        if stats is not None:
            stats["kept"] = stats.get("kept", 0) + sum(s["kept"] for _, s in done)
            stats["written"] = stats.get("written", 0) + sum(s["written"] for _, s in done)
        return [info for infos, _ in done for info in infos]

    def scan(
        self, tars: Sequence[str], workers: int, progress: bool, storage_options: dict | None, suffixes: tuple[str, ...]
    ) -> list[ShardScan]:
        """Scan contiguous runs of the tars in Ray tasks; scans in tar order."""
        groups = self._slices(tars)
        found = self._run(_scan, [(g, storage_options, suffixes) for g in groups], [len(g) for g in groups], progress)
        return [scan for scans in found for scan in scans]

    # ---- running tasks -----------------------------------------------------------------------------
    def _slices(self, items: Sequence[T]) -> list[list[T]]:
        """``items`` cut into as many contiguous slices as there are tasks (at most one per item)."""
        n = self.tasks or max(1, int(self.ray.cluster_resources().get("CPU", 1)))
        n = max(1, min(n, len(items)))
        return [list(items[slice(*part_range(len(items), i, n))]) for i in range(n)]

    def _run(self, fn: Callable[..., T], calls: list[tuple], sizes: list[int], progress: bool) -> list[T]:
        """``fn(*args)`` for each of ``calls`` as Ray tasks; results in call order. A task's error is raised here
        as the error it was (one line in the CLI), not as Ray's wrapper."""
        remote = self.ray.remote(fn).options(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False)
        refs = [remote.remote(*args) for args in calls]
        where = {ref: i for i, ref in enumerate(refs)}
        desc = {"_probe": "probing", "_write": "writing", "_scan": "indexing"}.get(fn.__name__, fn.__name__)
        bar = tqdm(total=sum(sizes), desc=desc, file=sys.stderr, disable=None if progress else True)
        results: dict[int, T] = {}
        try:
            pending = list(refs)
            while pending:
                ready, pending = self.ray.wait(pending, num_returns=1)
                i = where[ready[0]]
                results[i] = self._get(ready[0])
                bar.update(sizes[i])
        except BaseException:
            for ref in refs:
                self.ray.cancel(ref, force=True)
            raise
        finally:
            bar.close()
        return [results[i] for i in range(len(refs))]

    def _get(self, ref: Any) -> Any:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, StreamBatchError):
                raise cause from None
            raise


# ---- what the tasks run (module functions: Ray ships them by name) ---------------------------------------
def _probe(records: list[Record], kind: str, storage_options: dict | None) -> Probed:
    return probe_slice(records, kind, 1, False, storage_options)


def _write(tasks: list[ShardTask], number: int) -> tuple[list[ShardInfo], dict[str, int]]:
    """Write task ``number``'s shards, after removing what an earlier, killed attempt of it left half-written."""
    _remove_own_temporaries(tasks)
    _die_once_for_tests(tasks, number)
    stats: dict[str, int] = {}
    return write_planned(tasks, 1, False, stats), stats


def _scan(tars: list[str], storage_options: dict | None, suffixes: tuple[str, ...]) -> list[ShardScan]:
    return scan_tars(tars, 1, False, storage_options, suffixes)


def _remove_own_temporaries(tasks: Sequence[ShardTask]) -> None:
    """Remove the temporary files (``NAME.tmp-*``) beside these tasks' shards: a write task owns its shard
    names, so no other task writes them."""
    if not tasks:
        return
    first = tasks[0]
    out = first.url[: -len(first.name)].rstrip("/") or "/"
    own = {t.name for t in tasks}
    for name in storage.listdir(out, first.storage_options):
        base, sep, _ = name.partition(".tmp-")
        if sep and base in own:
            remove_quiet(storage.join_url(out, name), first.storage_options)


def _die_once_for_tests(tasks: Sequence[ShardTask], number: int) -> None:
    """The `KILL_HOOK` test hook: a worker killed mid-write, as a lost node would be."""
    number_text, _, marker = os.environ.get(KILL_HOOK, "").partition(":")
    if not marker or number_text != str(number) or os.path.exists(marker) or not tasks:
        return
    with open(marker, "w") as f:
        f.write(f"{os.getpid()}\n")
    write_shard(tasks[0])
    if len(tasks) > 1:
        with open(storage.local_path(tasks[1].url) + ".tmp-killed", "wb") as f:
            f.write(b"\0" * 512)  # half a tar header: where the next shard's write was cut short
    os.kill(os.getpid(), signal.SIGKILL)


# ---- the public functions ------------------------------------------------------------------------
def write_shards_ray(
    src: str, out: str, *, address: str | None = None, tasks: int | None = None, **options: Any
) -> ShardIndex:
    """`write_shards()` with its probing and shard writing in Ray tasks: the same dataset, byte for
    byte, whatever ``tasks``. ``address``, ``tasks``: see `RayEngine`; ``options``: ``write_shards``'s."""
    with RayEngine(address, tasks) as engine:
        return write_shards(src, out, engine=engine, **options)


def index_tars_ray(
    src: str, out: str | None = None, *, address: str | None = None, tasks: int | None = None, **options: Any
) -> ShardIndex:
    """`index_tars()` with the tars scanned in Ray tasks: the same index whatever ``tasks``.
    ``address``, ``tasks``: see `RayEngine`; ``options``: ``index_tars``'s."""
    with RayEngine(address, tasks) as engine:
        return index_tars(src, out, engine=engine, **options)
