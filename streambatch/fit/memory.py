"""Measuring how much memory one training step takes, for calibration.

On CUDA a trial runs in this process and reads the allocator's peak statistics; on CPU (Linux) it runs in a
forked child, so that nothing it allocates survives it, and reports its peak RSS from ``/proc``. Also here:
what counts as an out-of-memory error and how memory is freed after one, which the OOM guard shares.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CalibrationError, OptionError
from ..procs import set_parent_death_signal

log = logging.getLogger("streambatch.calibrate")


@dataclass
class Trial:
    """One run of the step: ``n`` samples of length ``length``; ``peak`` bytes (None when the run did not
    complete, e.g. out of memory, so only a lower bound is known), and whether it fits under the limit."""

    n: int
    length: float
    peak: float | None
    fits: bool
    note: str = ""
    seconds: float = 0.0


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an out-of-memory: ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA and, in
    recent torch, CPU) or a ``RuntimeError`` whose message says the allocator could not allocate."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        oom_types = tuple(
            t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t
        )
        if oom_types and isinstance(exc, oom_types):
            return True
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(
            m in msg for m in ("out of memory", "can't allocate memory", "cannot allocate memory", "alloc_failed")
        )
    return False


def free_memory(device: Any = None) -> None:
    """Collect garbage and return cached CUDA blocks to the driver."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and (device is None or _device_type(device) == "cuda"):
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def _format_error(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


# ---- /proc: this process's memory ---------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _anon_rss() -> int:
    """Resident memory that is not file-backed or shared (``statm``: resident - shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def proc_status(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (``VmHWM``, ``RssAnon``, ``RssFile``, ...)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in fields:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _thread_count() -> int:
    """Threads of this process (``/proc/self/status``), 1 when unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 1


def _malloc_trim() -> None:
    """Return the C heap's free pages to the system (glibc), so that reusing them shows in the RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_memory() -> int:
    """Bytes of memory available to new allocations now (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _baseline() -> tuple[bool, dict[str, int], int, int]:
    """Reset the peak RSS just before the step: ``(reset worked, RssFile, RSS, anonymous RSS)`` now."""
    json.dumps({"warm": [1.0, None]})  # page in what runs after the step, before the baseline
    threading.Event().set()
    proc_status("VmHWM", "RssAnon", "RssFile")
    _malloc_trim()  # free heap pages the step could reuse without its RSS growing
    clear = _reset_hwm()
    start = proc_status("RssFile")
    return clear, start, _rss(), _anon_rss()


def _peak_above(clear: bool, start: dict[str, int], base: int, anon0: int, sampled: list[int]) -> float:
    """The step's peak: the high-water RSS above ``base`` less the file pages it faulted in, or what the
    watchdog ``sampled``, whichever is larger."""
    end = proc_status("VmHWM", "RssFile")
    hwm = end.get("VmHWM") if clear else None
    if hwm is None:
        import resource

        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    file_growth = max(0, end.get("RssFile", 0) - start.get("RssFile", 0))
    return float(max(0, hwm - base - file_growth, sampled[0], _anon_rss() - anon0))


# ---- the measurers --------------------------------------------------------------------------------------
class _ForkMeasure:
    """CPU trials in forked children: peak RSS above the RSS at the start of the step."""

    def __init__(
        self, step_fn, make_batch, limit: float, abort_at: float, timeout: float | None, threads: int | None = None
    ):
        if not os.path.exists("/proc/self/statm") or not hasattr(os, "fork"):
            raise CalibrationError("CPU calibration measures memory through /proc and fork(): it needs Linux")
        self.step_fn, self.make_batch = step_fn, make_batch
        self.limit, self.abort_at, self.timeout = float(limit), float(abort_at), timeout
        self.threads = threads

    def __call__(self, n: int, length: float) -> Trial:
        t0 = time.perf_counter()
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        # no signal while forking: its handler would run in os.fork's hooks, which print an exception and drop it
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:  # child: never returns
            os.close(r)
            self._child(w, n, length, mask)
        os.close(w)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal that came meanwhile is handled here
            raw = self._read(r, n, length)
        except BaseException:  # past the timeout, or interrupted (Ctrl-C, SIGTERM): the trial ends with us
            _end_child(pid)
            raise
        _, status = os.waitpid(pid, 0)
        return self._trial(raw, status, n, length, time.perf_counter() - t0)

    def _read(self, r: int, n: int, length: float) -> str:
        """What the child reports, read until it closes the pipe; past the timeout a `CalibrationError`."""
        chunks, deadline = [], (time.monotonic() + self.timeout) if self.timeout else None
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([r], [], [], wait)
                if not ready:
                    raise CalibrationError(f"step with n={n}, length={length} ran past {self.timeout} s")
                data = os.read(r, 65536)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(r)
        return b"".join(chunks).decode("utf-8", "replace").strip()

    def _trial(self, raw: str, status: int, n: int, length: float, seconds: float) -> Trial:
        """The trial from the child's report (its last line) and exit status."""
        if not raw:
            why = (
                f"killed by signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exit status {os.WEXITSTATUS(status)}"
            )
            return Trial(n, length, None, False, f"child {why} (out of memory?)", seconds)
        res = json.loads(raw.splitlines()[-1])
        if res.get("error"):
            raise CalibrationError(f"step_fn failed with n={n}, length={length}:\n{res['error']}")
        peak = res.get("peak")
        fits = not res.get("oom") and not res.get("aborted") and peak is not None and peak <= self.limit
        note = "out of memory" if res.get("oom") else "stopped past the limit" if res.get("aborted") else ""
        return Trial(n, length, None if (res.get("oom") or res.get("aborted")) else peak, fits, note, seconds)

    def _child(self, w: int, n: int, length: float, mask: set[int | signal.Signals]) -> None:
        # The peak is the high-water RSS above the RSS before the step, less the file-backed pages the step
        # faulted in: library code is shared with the parent (whose page tables fork does not copy for
        # file mappings), not memory the step allocates. A watchdog thread also samples the anonymous RSS,
        # and the larger of the two estimates counts.
        out: dict[str, Any] = {}
        try:
            _leave_signals_to_parent(mask)
            torch = sys.modules.get("torch")
            if self.threads is not None and torch is not None:
                torch.set_num_threads(self.threads)
            clear, start, base, anon0 = _baseline()
            sampled = [0]
            stop = threading.Event()
            threading.Thread(target=self._watchdog, args=(w, anon0, sampled, stop), daemon=True).start()
            self._run_step(n, length, out)
            stop.set()
            out["peak"] = _peak_above(clear, start, base, anon0, sampled)
        except BaseException as e:  # noqa: BLE001
            out["error"] = _format_error(e)
        finally:
            try:
                os.write(w, (json.dumps(out) + "\n").encode())
                sys.stdout.flush()  # what the step printed
                sys.stderr.flush()
            finally:
                os._exit(0)

    def _watchdog(self, w: int, anon0: int, sampled: list[int], stop: threading.Event) -> None:
        """Sample the child's anonymous RSS; end a runaway trial before it takes the machine down."""
        while not stop.wait(0.002):
            grown = _anon_rss() - anon0
            sampled[0] = max(sampled[0], grown)
            if grown > self.abort_at:
                os.write(w, (json.dumps({"aborted": True, "peak": None}) + "\n").encode())
                os._exit(0)

    def _run_step(self, n: int, length: float, out: dict[str, Any]) -> None:
        """One step on a fresh batch; an out-of-memory or another error is noted in ``out``."""
        try:
            batch = self.make_batch(n, length)
            self.step_fn(batch)
            del batch
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            if is_oom(e):
                out["oom"] = True
            else:
                out["error"] = _format_error(e)


#: the signals that stop a calibration, blocked while a trial child is forked
_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def _leave_signals_to_parent(mask: set[int | signal.Signals]) -> None:
    """A trial child's signals, then ``mask`` (the signal mask before the fork) restored: Ctrl-C (sent to the
    whole process group) is left to the parent, which kills the child; SIGTERM ends it; and it dies with the
    parent, even one killed outright."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    set_parent_death_signal()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _end_child(pid: int) -> None:
    """Kill a trial child and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # ended already (a zombie until reaped below)
        pass
    os.waitpid(pid, 0)


class _CudaMeasure:
    """CUDA trials in this process: ``torch.cuda.max_memory_allocated`` after a reset of the peak stats."""

    def __init__(self, step_fn, make_batch, limit: float, device):
        import torch

        self.torch = torch
        self.step_fn, self.make_batch, self.limit, self.device = step_fn, make_batch, float(limit), device

    def __call__(self, n: int, length: float) -> Trial:
        torch = self.torch
        t0 = time.perf_counter()
        free_memory(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        oom = False
        try:
            batch = self.make_batch(n, length)
            self.step_fn(batch)
            del batch
            torch.cuda.synchronize(self.device)
        except Exception as e:
            if not is_oom(e):
                raise CalibrationError(f"step_fn failed with n={n}, length={length}: {e!r}") from e
            oom = True
        # outside the except block, so the traceback's frames (and their tensors) are gone
        peak = float(torch.cuda.max_memory_allocated(self.device))
        free_memory(self.device)
        if oom:
            return Trial(n, length, None, False, "out of memory", time.perf_counter() - t0)
        return Trial(n, length, peak, peak <= self.limit, "", time.perf_counter() - t0)


# ---- choosing the measurer for a device -----------------------------------------------------------------
@dataclass
class DeviceMeasure:
    """How the trials run on one device: ``measure(n, L)``, the memory ``limit`` in bytes, the device's
    name for the report, and the torch threads of the CPU trials (None on CUDA)."""

    measure: Callable[[int, float], Trial]
    limit: float
    device_name: str
    cpu_threads: int | None = None


def resolve_device(device: Any, name: str = "device") -> Any:
    """``device`` as the ``torch.device`` calibration runs on: the CPU or a CUDA device this machine has
    (``cuda``: the current one); anything else is an `OptionError` naming ``name`` and the value."""
    import torch

    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise OptionError(f"{name} {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise OptionError(f"{name} {device!r}: calibration runs on cpu or cuda devices")
    if not torch.cuda.is_available():
        raise OptionError(f"{name} {device!r}: CUDA is not available on this machine")
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise OptionError(f"{name} {device!r}: this machine has {count} CUDA device{'s' if count != 1 else ''}")
    return dev


def device_measure(
    step_fn: Callable[[Any], Any],
    make_batch: Callable[[int, float], Any],
    dev: Any,
    memory_limit: int | str | None,
    *,
    memory_fraction: float,
    trial_timeout: float | None,
    cpu_threads: int | None,
    warmup_length: float | None,
) -> DeviceMeasure:
    """The measurer for ``dev`` (a ``torch.device`` `resolve_device()` checked) and the limit its trials must
    fit in (see `calibrate()`).

    On CUDA one warm-up step at ``warmup_length`` (when not None) runs first: cuBLAS workspaces, lazily
    created optimizer state. On CPU, ``cpu_threads`` defaults to 1 once this process has other threads.
    """
    from ..units import parse_bytes

    given = parse_bytes(memory_limit, "memory_limit")
    if dev.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(dev).total_memory
        limit = float(given if given is not None else memory_fraction * total)
        measure = _CudaMeasure(step_fn, make_batch, limit, dev)
        device_name = f"{dev} ({torch.cuda.get_device_name(dev)})"
        if warmup_length is not None:
            measure(1, warmup_length)
        return DeviceMeasure(measure, limit, device_name)
    avail = available_memory()
    limit = float(given if given is not None else memory_fraction * avail)
    if given is None:
        log.warning(
            "no memory_limit on CPU: using %.0f%% of the available memory, %.2f GiB",
            100 * memory_fraction,
            limit / 2**30,
        )
    abort_at = max(limit * 1.001, min(1.5 * limit, 0.9 * avail))
    if cpu_threads is None and _thread_count() > 1:
        cpu_threads = 1
    forked = _ForkMeasure(step_fn, make_batch, limit, abort_at, trial_timeout, cpu_threads)
    return DeviceMeasure(forked, limit, "cpu", cpu_threads)
