"""Calibration: measure how much memory the user's training step takes, and fit the cost model to it.

``calibrate(step_fn, source, device=...)`` runs ``step_fn(batch)`` — the user's forward + backward — on
synthetic batches shaped like the dataset's (the same keys and dtypes the loader yields), and for each probe
length ``L`` searches for the largest batch size ``n`` that fits under the memory limit. From all the
measurements it fits the peak memory as

    peak(n, L) = a + b·n·L + c·n·L²          (least squares, b ≥ 0, c ≥ 0)

and derives the budget of a :mod:`streambatch.cost` model: ``budget = (limit - a) / b`` with
``cost="quadratic"`` and ``quadratic_factor = b / c`` (so that ``b × cost(n, L)`` is the fitted memory above
``a``) when the quadratic term matters over the dataset's lengths, else ``cost="padded"`` with ``b`` taken at
the longest length (safe for every shorter one). The budget is then shrunk until no probe length admits more
samples than were measured to fit, minus a small ``margin`` (a probe length at which not even one sample
fits therefore ends up over the budget: such samples are skipped and counted by the loader, and a warning
says so). The budget is in the dataset's length unit. The result is a small JSON file that
``StreamBatchLoader(source, cost="calib.json")`` and ``plan_batches(..., cost="calib.json")`` read
(:func:`streambatch.cost.resolve_cost`)::

    {"format": "streambatch-calibration", "version": 1, "cost": "quadratic", "quadratic_factor": 1860.2,
     "budget": 3210000, "unit": "samples", "sample_rate": 16000, "device": "cuda:0 (NVIDIA H100 ...)",
     "limit": 72000000000, "fit": {"a", "b", "c", ...}, "per_length": [{"length", "max_batch_size",
     "min_failing", "admitted", ...}], "measurements": [{"n", "length", "peak", "fits", ...}, ...]}

How a trial is measured:

* **CUDA**: in this process. Before each trial: ``gc.collect()``, ``torch.cuda.empty_cache()``,
  ``torch.cuda.reset_peak_memory_stats()``; the trial fits when it raises no ``torch.cuda.OutOfMemoryError``
  and ``torch.cuda.max_memory_allocated()`` (model, gradients and optimizer state included) stays within
  ``memory_fraction × total memory`` (or ``memory_limit`` bytes). An out-of-memory is caught, the memory
  freed, and the trial counts as not fitting. One warm-up step at the shortest length runs first (cuBLAS
  workspaces, lazily created optimizer state).
* **CPU** (Linux): each trial runs in a forked child process, so that nothing it allocates survives it; the
  child resets its peak RSS (``/proc/self/clear_refs``), runs the step and reports its peak RSS
  (``VmHWM``) above the RSS it had before the step, less the library code it paged in (shared with the
  parent, not allocated by the step); good to a fraction of a MiB. The trial fits when that stays within
  ``memory_limit`` bytes — memory the step may take on top of what the process already holds (the model's
  parameters are in the baseline; its gradients, when the step creates them, are not); default
  ``memory_fraction`` of the memory available now. A watchdog thread ends a child whose anonymous RSS
  passes 1.5 × the limit. This is how the search is tested in CI without a GPU.

The search per length starts from what the lengths measured before predict (the longest length goes
first, from ``n = 1``), grows geometrically until a trial fails, then narrows the bracket by interpolating
the measured peaks (a bisection step whenever that stalls) until the largest fitting ``n`` is known to
``rel_tol`` (1 %). A handful of trials per length suffice because peak memory is close to linear in ``n``.

The step function gets a batch exactly like the loader's: ``{"audio": float32 [n, L], "lengths": int64 [n],
"padding_mask": bool [n, L]}`` for audio (``unit="samples"``; ``"seconds"`` converts with the sample rate),
``{"input_ids": int64 [n, L], ...}`` for ``unit="tokens"`` and ``{"inputs": float32 [n, L, 80], ...}`` for
``"frames"`` — CPU tensors, so it should move them to its device as the training loop does. Pass
``make_batch(n, L)`` for anything else (packed batches, extra fields). A typical step::

    def step_fn(batch):
        opt.zero_grad(set_to_none=True)
        loss = model(batch["audio"].to(dev), batch["lengths"].to(dev))
        loss.backward()
        opt.step()

Calibrate with a throwaway model and optimizer: on CUDA the trials really update them.

On the command line, ``python -m streambatch.calibrate SOURCE --model MODULE:FACTORY --device cpu
--memory-limit 2G --out calib.json`` imports ``MODULE`` (a dotted module or a ``path/to/file.py``), calls
``FACTORY(device)`` (or ``FACTORY()`` when it takes no argument), which returns the ``step_fn`` (or a
``(step_fn, make_batch)`` pair), runs :func:`calibrate`, and prints the per-length largest batches and the
fitted model.

For training loops, :class:`OOMGuard` (``oom_guard(step_fn)``) and :func:`run_with_oom_split` catch an
out-of-memory in a step, free memory, split the batch in two halves along the batch dimension and run each
(recursively, down to ``min_size`` samples), counting and logging every split. See :class:`OOMGuard` for
how the halves' losses combine.

Because ``streambatch.calibrate`` is both this module and its main function, the module itself is
callable: ``import streambatch.calibrate; streambatch.calibrate(step_fn, source, device="cuda")`` works.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..plan.cost import CALIBRATION_FORMAT, PaddedCost, QuadraticCost

log = logging.getLogger("streambatch.calibrate")

CALIBRATION_VERSION = 1
AUDIO_UNITS = ("samples", "seconds")
#: share of the per-sample cost at the longest length above which the quadratic model is chosen
QUADRATIC_THRESHOLD = 0.05


class CalibrationError(RuntimeError):
    """The step function failed for a reason other than running out of memory, or nothing fits."""


# ---- synthetic batches --------------------------------------------------------------------------------
def default_make_batch(
    unit: str = "samples", sample_rate: int | None = None, *, vocab_size: int = 1000, feature_dim: int = 80, seed: int = 0
) -> Callable[[int, float], dict[str, Any]]:
    """``make_batch(n, L)`` building a batch of ``n`` samples of length ``L`` shaped like the loader's.

    Audio units (``samples``, ``seconds``): ``audio`` float32 ``[n, T]``; ``tokens``: ``input_ids`` int64
    ``[n, L]`` (random ids below ``vocab_size``); ``frames``: ``inputs`` float32 ``[n, L, feature_dim]``.
    Each with ``lengths`` int64 ``[n]`` and ``padding_mask`` bool ``[n, T]`` (all False: every sample is
    as long as the longest, the worst case the budget admits).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)

    def make_batch(n: int, length: float) -> dict[str, Any]:
        n = int(n)
        if unit == "seconds":
            if not sample_rate:
                raise ValueError("unit 'seconds' needs a sample_rate to build audio batches")
            t = int(round(length * sample_rate))
        else:
            t = int(math.ceil(length))
        if unit in AUDIO_UNITS:
            batch = {"audio": torch.randn(n, t, generator=gen)}
        elif unit == "tokens":
            batch = {"input_ids": torch.randint(0, vocab_size, (n, t), generator=gen)}
        else:
            batch = {"inputs": torch.randn(n, t, feature_dim, generator=gen)}
        batch["lengths"] = torch.full((n,), t, dtype=torch.int64)
        batch["padding_mask"] = torch.zeros(n, t, dtype=torch.bool)
        return batch

    return make_batch


# ---- measuring one trial ------------------------------------------------------------------------------
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

        oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t)
        if oom_types and isinstance(exc, oom_types):
            return True
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in ("out of memory", "can't allocate memory", "cannot allocate memory", "alloc_failed"))
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


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _anon_rss() -> int:
    """Resident memory that is not file-backed or shared (``statm``: resident - shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def _status(*fields: str) -> dict[str, int]:
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


class _ForkMeasure:
    """CPU trials in forked children: peak RSS above the RSS at the start of the step."""

    def __init__(self, step_fn, make_batch, limit: float, abort_at: float, timeout: float | None,
                 threads: int | None = None):
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
        pid = os.fork()
        if pid == 0:  # child: never returns
            os.close(r)
            self._child(w, n, length)
        os.close(w)
        chunks, deadline = [], (time.monotonic() + self.timeout) if self.timeout else None
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([r], [], [], wait)
                if not ready:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise CalibrationError(f"step with n={n}, length={length} ran past {self.timeout} s")
                data = os.read(r, 65536)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(r)
        _, status = os.waitpid(pid, 0)
        seconds = time.perf_counter() - t0
        raw = b"".join(chunks).decode("utf-8", "replace").strip()
        if not raw:
            why = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
            return Trial(n, length, None, False, f"child {why} (out of memory?)", seconds)
        res = json.loads(raw.splitlines()[-1])
        if res.get("error"):
            raise CalibrationError(f"step_fn failed with n={n}, length={length}:\n{res['error']}")
        peak = res.get("peak")
        fits = not res.get("oom") and not res.get("aborted") and peak is not None and peak <= self.limit
        note = "out of memory" if res.get("oom") else "stopped past the limit" if res.get("aborted") else ""
        return Trial(n, length, None if (res.get("oom") or res.get("aborted")) else peak, fits, note, seconds)

    def _child(self, w: int, n: int, length: float) -> None:
        # The peak is the high-water RSS above the RSS before the step, less the file-backed pages the step
        # faulted in: library code is shared with the parent (whose page tables fork does not copy for
        # file mappings), not memory the step allocates. A watchdog thread also samples the anonymous RSS,
        # and the larger of the two estimates counts.
        out: dict[str, Any] = {}
        try:
            batch = None
            torch = sys.modules.get("torch")
            if self.threads is not None and torch is not None:
                torch.set_num_threads(self.threads)
            json.dumps({"warm": [1.0, None]})  # page in what runs after the step, before the baseline
            threading.Event().set()
            _status("VmHWM", "RssAnon", "RssFile")
            _malloc_trim()  # free heap pages the step could reuse without its RSS growing
            clear = _reset_hwm()
            start = _status("RssFile")
            base = _rss()
            anon0 = _anon_rss()
            sampled = [0]
            stop = threading.Event()

            def watchdog() -> None:  # also ends a runaway trial before it takes the machine down
                while not stop.wait(0.002):
                    grown = _anon_rss() - anon0
                    sampled[0] = max(sampled[0], grown)
                    if grown > self.abort_at:
                        os.write(w, (json.dumps({"aborted": True, "peak": None}) + "\n").encode())
                        os._exit(0)

            threading.Thread(target=watchdog, daemon=True).start()
            try:
                batch = self.make_batch(n, length)
                self.step_fn(batch)
                del batch
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                if is_oom(e):
                    out["oom"] = True
                else:
                    out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            stop.set()
            end = _status("VmHWM", "RssFile")
            hwm = end.get("VmHWM") if clear else None
            if hwm is None:
                import resource

                hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            file_growth = max(0, end.get("RssFile", 0) - start.get("RssFile", 0))
            out["peak"] = float(max(0, hwm - base - file_growth, sampled[0], _anon_rss() - anon0))
        except BaseException as e:  # noqa: BLE001
            out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        finally:
            try:
                os.write(w, (json.dumps(out) + "\n").encode())
                sys.stdout.flush()  # what the step printed
                sys.stderr.flush()
            finally:
                os._exit(0)


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


# ---- the search ---------------------------------------------------------------------------------------
def search_max_batch(
    measure: Callable[[int, float], Trial],
    length: float,
    limit: float,
    *,
    max_batch_size: int = 4096,
    guess: int | None = None,
    slope: float | None = None,
    intercept: float | None = None,
    rel_tol: float = 0.01,
    max_trials: int = 40,
) -> tuple[int, int | None, list[Trial]]:
    """The largest ``n`` for which ``measure(n, length)`` fits, to ``rel_tol``.

    Returns ``(lo, hi, trials)``: ``lo`` fits (0: not even one sample), ``hi`` the smallest size seen not to
    fit (None: ``max_batch_size`` fits). ``guess`` (a first size), ``slope`` and ``intercept`` (a predicted
    ``peak ≈ intercept + slope·n``) come from the lengths measured before and only speed the search up.
    """
    trials: list[Trial] = []
    fits: dict[int, float | None] = {}  # n -> peak
    fails: dict[int, float | None] = {}
    lo, hi = 0, None
    n = int(min(max(1, guess or 1), max_batch_size))
    widths: list[int] = []
    while len(trials) < max_trials:
        t = measure(n, length)
        trials.append(t)
        log.debug("n=%d length=%g peak=%s fits=%s %s", n, length, t.peak, t.fits, t.note)
        if t.fits:
            fits[n] = t.peak
        else:
            fails[n] = t.peak
        hi = min(fails) if fails else None
        # the largest fit below every failure (noisy measurements can make a larger batch fit: distrust it)
        lo = max((k for k in fits if hi is None or k < hi), default=0)
        if hi is not None and hi <= 1:
            return 0, hi, trials
        if lo >= max_batch_size:
            return lo, None, trials
        if hi is None:  # growing: aim at the limit along the measured line, at most ×8 per step
            pts = sorted((k, p) for k, p in fits.items() if p is not None)
            nxt = lo * 4
            line = None
            if len(pts) >= 2 and pts[-1][1] - pts[0][1] > 0.02 * limit:
                (n0, p0), (n1, p1) = pts[0], pts[-1]
                line = ((p1 - p0) / (n1 - n0), p1, n1)
            elif pts and slope and slope > 0:
                line = (slope, pts[-1][1], pts[-1][0])
            elif pts and intercept is not None and pts[-1][1] > intercept:
                line = ((pts[-1][1] - intercept) / pts[-1][0], pts[-1][1], pts[-1][0])
            if line is not None and line[0] > 0:
                nxt = int(line[2] + (limit - line[1]) / line[0])
            n = int(min(max(nxt, lo + max(1, int(rel_tol * lo))), lo * 8, max_batch_size))
            continue
        if lo == 0:  # shrinking: even the first guess failed
            p = fails.get(hi)
            nxt = hi // 4
            if p is not None and p > 0:
                nxt = int(hi * limit / p * 0.98)
            n = max(1, min(nxt, hi // 2 if p is None else hi - 1))
            continue
        tol = max(1, int(rel_tol * lo))
        if hi - lo <= tol:
            return lo, hi, trials
        widths.append(hi - lo)
        pl, ph = fits.get(lo), fails.get(hi)
        if pl is not None and ph is not None and ph > pl and not (len(widths) >= 3 and widths[-1] > widths[-3] / 2):
            cand = lo + (limit - pl) * (hi - lo) / (ph - pl)
        else:
            cand = (lo + hi) / 2  # bisection (no peak to interpolate, or interpolation stalls)
        cand = int(round(cand))
        cand = max(cand, lo + tol) if cand - lo < tol else cand
        cand = min(cand, hi - tol) if hi - cand < tol else cand
        n = int(min(max(cand, lo + 1), hi - 1))
    log.warning("length %g: search stopped after %d trials (largest fitting batch %d)", length, max_trials, lo)
    return lo, hi, trials


# ---- fitting ------------------------------------------------------------------------------------------
def fit_memory_model(trials: Sequence[Trial], limit: float) -> dict[str, float]:
    """Least squares ``peak ≈ a + b·n·L + c·n·L²`` over the completed trials, with ``b, c ≥ 0``.

    Residuals are relative (weights ``1 / max(peak, limit/20)``), so the many trials near the limit, which
    decide the budget, weigh as they should. Returns ``a``, ``b``, ``c`` and the largest relative error.
    """
    pts = [(t.n, float(t.length), float(t.peak)) for t in trials if t.peak is not None]
    if len(pts) < 2:
        raise CalibrationError(f"only {len(pts)} completed trials: not enough to fit a memory model")
    n = np.array([p[0] for p in pts], dtype=np.float64)
    length = np.array([p[1] for p in pts], dtype=np.float64)
    y = np.array([p[2] for p in pts], dtype=np.float64)
    x1, x2 = n * length, n * length * length
    w = 1.0 / np.maximum(y, limit / 20.0)
    # scale the columns so that the solve is well conditioned
    s1, s2 = max(x1.max(), 1.0), max(x2.max(), 1.0)
    cols = {"a": np.ones_like(y), "b": x1 / s1, "c": x2 / s2}
    best = None
    for active in (("a", "b", "c"), ("a", "b"), ("a", "c"), ("a",)):  # the non-negative least-squares candidates
        A = np.stack([cols[k] for k in active], axis=1) * w[:, None]
        coef, *_ = np.linalg.lstsq(A, y * w, rcond=None)
        sol = dict(zip(active, coef))
        if sol.get("b", 0.0) < 0 or sol.get("c", 0.0) < 0:
            continue
        res = float(np.sum((A @ coef - y * w) ** 2))
        if best is None or res < best[0] - 1e-15:
            best = (res, sol)
    sol = best[1]
    a, b, c = float(sol.get("a", 0.0)), float(sol.get("b", 0.0)) / s1, float(sol.get("c", 0.0)) / s2
    pred = a + b * x1 + c * x2
    err = float(np.max(np.abs(pred - y) / np.maximum(y, limit / 20.0)))
    return {"a": a, "b": b, "c": c, "max_rel_error": err, "points": len(pts)}


def budget_from_fit(
    fit: dict[str, float],
    limit: float,
    max_length: float,
    per_length: Sequence[dict[str, Any]],
    *,
    margin: float = 0.02,
    quadratic_threshold: float = QUADRATIC_THRESHOLD,
    integer: bool = True,
) -> dict[str, Any]:
    """The cost model and budget from a fitted memory model (see the module docstring).

    ``per_length`` holds each probe length's ``length``, ``max_batch_size`` (measured to fit) and
    ``min_failing`` (measured not to fit, or None); the budget is lowered until no length admits more than
    its measured ``max_batch_size``, then by ``margin``.
    """
    a, b, c = fit["a"], fit["b"], fit["c"]
    share = c * max_length / (b + c * max_length) if (b + c * max_length) > 0 else 0.0
    if share >= quadratic_threshold and c > 0:
        if b <= 0:  # pure L²: keep a (tiny) linear term so that the factor is finite
            b = c * max_length * 1e-3
        model: Any = QuadraticCost(b / c)
        per_cost = b
    else:
        model = PaddedCost()
        per_cost = b + c * max_length  # the worst case over the dataset's lengths
    if per_cost <= 0:
        raise CalibrationError("the measured memory does not grow with the batch: cannot fit a budget (is step_fn a no-op?)")
    fitted = (limit - a) / per_cost
    budget = fitted
    for row in per_length:
        if row.get("max_batch_size") is None:
            continue
        lo, L = int(row["max_batch_size"]), float(row["length"])
        capped = row.get("min_failing") is None and lo > 0
        if not capped:  # n = lo + 1 was not seen to fit: keep its cost over the budget
            budget = min(budget, float(model.cost(lo + 1, L)) * (1 - 1e-9))
    budget *= 1 - margin
    if budget <= 0:
        raise CalibrationError(f"no budget fits the limit ({limit:.4g} bytes): the fixed memory a={a:.4g} leaves no room")
    if integer:
        budget = float(math.floor(budget))
    out = {"cost": model.name, "quadratic_factor": getattr(model, "factor", None), "budget": budget,
           "fitted_budget": fitted, "quadratic_share": share}
    return out


# ---- the whole calibration ----------------------------------------------------------------------------
def _resolve_lengths(source: Any) -> tuple[np.ndarray | None, str | None, int | None]:
    """(lengths, unit, sample_rate) from a dataset folder, an index file, a ShardIndex or a length array."""
    from ..dataset.index import ShardIndex

    if source is None:
        return None, None, None
    if isinstance(source, ShardIndex):
        return source.lengths, source.unit, source.sample_rate
    if isinstance(source, (str, os.PathLike)):
        ix = ShardIndex.load(os.fspath(source))
        return ix.lengths, ix.unit, ix.sample_rate
    return np.asarray(source), None, None


def probe_lengths(lengths: np.ndarray, count: int = 7, integer: bool = True) -> list[float]:
    """Default probe lengths: quantiles of the dataset's lengths from the 5th percentile to the maximum."""
    lengths = np.asarray(lengths, dtype=np.float64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise CalibrationError("the dataset has no lengths to calibrate on")
    qs = np.array([0.05, 0.25, 0.5, 0.75, 0.9, 0.97, 1.0]) if count == 7 else np.linspace(0.05, 1.0, count)
    ls = np.quantile(lengths, qs)
    if integer:
        ls = np.ceil(ls)
    return [float(x) for x in np.unique(ls)]


def _resolve_device(device: Any):
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def calibrate(
    step_fn: Callable[[Any], Any],
    source: Any = None,
    *,
    device: Any = "cpu",
    memory_fraction: float = 0.9,
    memory_limit: int | str | None = None,
    lengths: Sequence[float] | None = None,
    max_batch_size: int = 4096,
    unit: str | None = None,
    sample_rate: int | None = None,
    out: str | None = None,
    make_batch: Callable[[int, float], Any] | None = None,
    rel_tol: float = 0.01,
    margin: float = 0.02,
    warmup: bool = True,
    trial_timeout: float | None = 600.0,
    quadratic_threshold: float = QUADRATIC_THRESHOLD,
    cpu_threads: int | None = None,
) -> dict[str, Any]:
    """Measure ``step_fn`` on synthetic batches and fit the cost model and budget (module docstring).

    ``source``: a dataset folder or ``index.json`` (lengths, unit and sample rate come from its index), a
    :class:`~streambatch.index.ShardIndex`, an array of lengths, or None with explicit ``lengths``.
    ``lengths``: the probe lengths (default :func:`probe_lengths` of the dataset). ``memory_limit``: bytes
    (or ``"2G"``) the step may use — on CPU above the process's memory before the step (default
    ``memory_fraction`` of the memory available now), on CUDA in all (default ``memory_fraction`` of the
    device's memory). ``max_batch_size`` caps the search. ``out``: where to write the JSON (path or URL).
    ``rel_tol``: how precisely each length's largest batch is searched. ``margin``: the budget's safety
    margin below what was measured to fit. ``trial_timeout``: seconds one CPU trial may run.
    ``cpu_threads``: torch threads in the CPU trials; by default unchanged when this process has a single
    thread, else 1 — OpenMP (torch's CPU thread pool) hangs in a forked child once the parent has used it,
    so CPU trials of a process that already ran parallel torch code are single-threaded (the per-thread
    scratch memory of multi-threaded kernels is then not measured). Returns the calibration as a dict
    (what ``out`` receives).
    """
    from ..dataset.storage import parse_bytes, write_bytes_atomic

    ds_lengths, ds_unit, ds_rate = _resolve_lengths(source)
    unit = unit or ds_unit or "samples"
    sample_rate = sample_rate or ds_rate
    integer = unit != "seconds"
    if lengths is None:
        if ds_lengths is None:
            raise ValueError("calibrate needs a dataset (source) or probe lengths")
        lengths = probe_lengths(ds_lengths, integer=integer)
    probes = sorted({float(x) for x in lengths if x > 0}, reverse=True)  # longest first: the riskiest size
    if not probes:
        raise ValueError("no positive probe lengths")
    make_batch = make_batch or default_make_batch(unit, sample_rate)
    dev = _resolve_device(device)
    limit = parse_bytes(memory_limit, "memory_limit")
    if dev.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(dev).total_memory
        limit = float(limit if limit is not None else memory_fraction * total)
        measure: Callable[[int, float], Trial] = _CudaMeasure(step_fn, make_batch, limit, dev)
        device_name = f"{dev} ({torch.cuda.get_device_name(dev)})"
        if warmup:
            measure(1, min(probes))
    elif dev.type == "cpu":
        avail = available_memory()
        if limit is None:
            limit = memory_fraction * avail
            log.warning("no memory_limit on CPU: using %.0f%% of the available memory, %.2f GiB",
                        100 * memory_fraction, limit / 2**30)
        limit = float(limit)
        abort_at = max(limit * 1.001, min(1.5 * limit, 0.9 * avail))
        if cpu_threads is None and _thread_count() > 1:
            cpu_threads = 1
        measure = _ForkMeasure(step_fn, make_batch, limit, abort_at, trial_timeout, cpu_threads)
        device_name = "cpu"
    else:
        raise ValueError(f"calibrate runs on 'cpu' or 'cuda' devices, not {dev}")

    trials: list[Trial] = []
    per_length: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for L in probes:
        guess = slope = intercept = None
        done = [r for r in per_length if r["max_batch_size"]]
        if done:
            # the intercept a is known from one length already; the split of the per-sample memory into its
            # n·L and n·L² parts only from two lengths (before that, assume n·L)
            try:
                fit = fit_memory_model(trials, limit)
                intercept = fit["a"]
                if len({t.length for t in trials if t.peak is not None}) >= 2:
                    per = fit["b"] * L + fit["c"] * L * L
                    if per > 0:
                        slope = per
                        guess = int((limit - fit["a"]) / per * (1 - 2 * rel_tol))
            except CalibrationError:
                pass
            if guess is None or guess < 1:
                r = done[-1]
                guess = int(r["max_batch_size"] * r["length"] / L * (1 - 2 * rel_tol))
        lo, hi, ts = search_max_batch(measure, L, limit, max_batch_size=max_batch_size, guess=guess,
                                      slope=slope, intercept=intercept, rel_tol=rel_tol)
        trials.extend(ts)
        peak_at = next((t.peak for t in ts if t.n == lo and t.fits), None)
        per_length.append({"length": L, "max_batch_size": lo, "min_failing": hi, "peak": peak_at, "trials": len(ts)})
        log.info("length %g: largest batch %d (%d trials)", L, lo, len(ts))
    if all(r["max_batch_size"] == 0 for r in per_length):
        raise CalibrationError(f"not even one sample of the shortest probe length fits in {limit:.4g} bytes")
    too_long = [r["length"] for r in per_length if r["max_batch_size"] == 0]
    if too_long:
        log.warning("a single sample of length %g does not fit in %.4g bytes: the budget leaves such samples "
                    "out (the loader counts them as skipped)", min(too_long), limit)
    fit = fit_memory_model(trials, limit)
    model = budget_from_fit(fit, limit, max(probes), per_length, margin=margin,
                            quadratic_threshold=quadratic_threshold, integer=integer)
    cost_model = QuadraticCost(model["quadratic_factor"]) if model["cost"] == "quadratic" else PaddedCost()
    for row in per_length:
        row["admitted"] = int(cost_model.capacity(np.array([row["length"]]), model["budget"], max_batch_size)[0])
        row["predicted"] = _predict_n(fit, row["length"], limit, max_batch_size)
    result = {
        "format": CALIBRATION_FORMAT,
        "version": CALIBRATION_VERSION,
        "cost": model["cost"],
        "quadratic_factor": model["quadratic_factor"],
        "budget": model["budget"],
        "unit": unit,
        "sample_rate": sample_rate,
        "device": device_name,
        "cpu_threads": cpu_threads if dev.type == "cpu" else None,
        "limit": limit,
        "memory_fraction": memory_fraction if memory_limit is None else None,
        "margin": margin,
        "max_batch_size": max_batch_size,
        "fit": {**fit, "fitted_budget": model["fitted_budget"], "quadratic_share": model["quadratic_share"]},
        "per_length": per_length,
        "measurements": [asdict(t) for t in trials],
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if out is not None:
        write_bytes_atomic(os.fspath(out), (json.dumps(result, indent=1) + "\n").encode())
    return result


def _predict_n(fit: dict[str, float], length: float, limit: float, max_batch_size: int) -> int:
    per = fit["b"] * length + fit["c"] * length * length
    if per <= 0:
        return max_batch_size
    return int(max(0, min(max_batch_size, (limit - fit["a"]) / per)))


def format_report(result: dict[str, Any]) -> str:
    """The per-length table and the fitted model, as the CLI prints them."""
    unit, rate = result["unit"], result.get("sample_rate")
    seconds = unit == "samples" and rate
    header = ["length", "seconds"] if seconds else ["length"]
    header += ["max batch", "fails at", "peak MiB", "budget admits", "trials"]
    rows = []
    for r in sorted(result["per_length"], key=lambda r: r["length"]):
        row = [f"{r['length']:g}"] + ([f"{r['length'] / rate:.2f}"] if seconds else [])
        row += [str(r["max_batch_size"]), "-" if r["min_failing"] is None else str(r["min_failing"]),
                "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f}", str(r["admitted"]), str(r["trials"])]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    f = result["fit"]
    lines.append("")
    lines.append(f"device {result['device']}, limit {result['limit'] / 2**20:.1f} MiB, "
                 f"{len(result['measurements'])} trials in {result['seconds']:.1f} s")
    lines.append(f"peak bytes ≈ {f['a']:.4g} + {f['b']:.4g}·n·L + {f['c']:.4g}·n·L²  "
                 f"(max error {100 * f['max_rel_error']:.1f} %, quadratic share at the longest length "
                 f"{100 * f['quadratic_share']:.1f} %)")
    if result["cost"] == "quadratic":
        lines.append(f"cost='quadratic', quadratic_factor={result['quadratic_factor']:.6g}, "
                     f"budget={result['budget']:.10g} {unit}")
    else:
        lines.append(f"cost='padded', budget={result['budget']:.10g} {unit}")
    return "\n".join(lines)


# ---- OOM guard for training loops ----------------------------------------------------------------------
def batch_size_of(batch: Any) -> int:
    """Samples in a batch: ``len(cu_seqlens) - 1`` for packed batches, ``len(lengths)``, or the first
    tensor's (or list's) leading dimension."""
    if isinstance(batch, dict):
        if batch.get("cu_seqlens") is not None:
            return int(len(batch["cu_seqlens"]) - 1)
        if batch.get("lengths") is not None and hasattr(batch["lengths"], "__len__"):
            return len(batch["lengths"])
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)) and batch and all(_is_array(v) for v in batch):
        values = list(batch)
    else:
        values = [batch]
    for v in values:
        if _is_array(v) and getattr(v, "ndim", 0) >= 1:
            return int(v.shape[0])
    for v in values:
        if isinstance(v, (list, tuple)):
            return len(v)
    raise ValueError("cannot tell the batch size: no tensor, array or list in the batch")


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "__getitem__")


def split_batch(batch: Any, sizes: Sequence[int], *, weight_by: str = "samples") -> list[tuple[Any, float]]:
    """Cut a batch into consecutive pieces of ``sizes`` samples; returns ``(piece, share)`` pairs.

    Tensors and arrays whose leading dimension is the batch size are sliced, and lists/tuples of that
    length; other values are shared. A packed batch (``cu_seqlens``) is cut at sample boundaries: the
    token-level tensors (leading dimension = total length) are sliced by token range, ``cu_seqlens``
    rebased and ``max_seqlen`` recomputed. ``share`` is the piece's share of the samples, or with
    ``weight_by="frames"`` of the real lengths (``lengths`` or ``cu_seqlens``). Dict batches get
    ``loss_weight`` = the share times the batch's own ``loss_weight`` (a loader micro-batch's), tuples and
    bare tensors only the share. Pieces keep the batch's padded length.
    """
    n = batch_size_of(batch)
    if sum(sizes) != n:
        raise ValueError(f"piece sizes {list(sizes)} do not add up to the batch size {n}")
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    frames = _frames(batch, n) if weight_by == "frames" else None
    if weight_by not in ("samples", "frames"):
        raise ValueError(f"weight_by must be 'samples' or 'frames', not {weight_by!r}")
    out = []
    for i in range(len(sizes)):
        s, e = int(bounds[i]), int(bounds[i + 1])
        share = (e - s) / n if frames is None else float(frames[s:e].sum() / max(frames.sum(), 1e-30))
        out.append((_slice(batch, n, s, e, share), share))
    return out


def _frames(batch: Any, n: int) -> np.ndarray:
    if isinstance(batch, dict):
        if batch.get("cu_seqlens") is not None:
            return np.diff(np.asarray(_to_numpy(batch["cu_seqlens"]), dtype=np.float64))
        if batch.get("lengths") is not None:
            return np.asarray(_to_numpy(batch["lengths"]), dtype=np.float64)
    return np.ones(n)


def _to_numpy(v: Any) -> np.ndarray:
    return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)


def _slice(batch: Any, n: int, s: int, e: int, share: float) -> Any:
    if isinstance(batch, dict):
        packed = batch.get("cu_seqlens") is not None
        if packed:
            cu = batch["cu_seqlens"]
            t0, t1 = int(cu[s]), int(cu[e])
            total = int(cu[-1])
        piece = {}
        for k, v in batch.items():
            if packed and k == "cu_seqlens":
                piece[k] = v[s:e + 1] - v[s]
            elif packed and k == "max_seqlen":
                seg = np.diff(np.asarray(_to_numpy(cu[s:e + 1])))
                m = int(seg.max()) if seg.size else 0
                piece[k] = type(v)(m) if isinstance(v, (int, float)) else (v.new_tensor(m) if hasattr(v, "new_tensor") else m)
            elif packed and _is_array(v) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == total and total != n:
                piece[k] = v[t0:t1]
            elif _is_array(v) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == n:
                piece[k] = v[s:e]
            elif isinstance(v, (list, tuple)) and len(v) == n:
                piece[k] = type(v)(v[s:e]) if isinstance(v, tuple) else v[s:e]
            else:
                piece[k] = v
        piece["loss_weight"] = float(batch.get("loss_weight", 1.0)) * share
        return piece
    if isinstance(batch, (list, tuple)):
        return type(batch)(v[s:e] if _is_array(v) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == n else v for v in batch)
    return batch[s:e]


@dataclass
class SplitResult:
    """What :func:`run_with_oom_split` did: the combined ``value``, the ``pieces`` the batch ran as,
    the ``ooms`` caught and the ``splits`` made (one per out-of-memory, halving a piece)."""

    value: Any
    pieces: int
    ooms: int
    splits: int


def _combine(values: list[Any], shares: list[float]) -> Any:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    if all(v is None for v in values):
        return None
    first = values[0]
    if isinstance(first, dict):
        return {k: _combine([v[k] for v in values], shares) for k in first}
    if hasattr(first, "detach"):
        return sum(s * v.detach() for v, s in zip(values, shares))
    if isinstance(first, (int, float, np.floating, np.integer)) and not isinstance(first, bool):
        return float(sum(s * float(v) for v, s in zip(values, shares)))
    return values


def run_with_oom_split(
    step_fn: Callable[[Any], Any],
    batch: Any,
    *,
    min_size: int = 1,
    reset: Callable[[], Any] | None = None,
    weight_by: str = "samples",
    device: Any = None,
    logger: logging.Logger | None = None,
) -> SplitResult:
    """Run ``step_fn(batch)``; on an out-of-memory split the batch in halves and run those (recursively).

    Every split is logged (warning) and counted. The pieces carry ``loss_weight`` = their share of the
    samples (or frames) times the batch's own ``loss_weight``: a step that multiplies its mean loss by
    ``batch.get("loss_weight", 1.0)`` before ``backward()`` accumulates the same gradient over the pieces as
    over the whole batch. The returned ``value`` combines the pieces' return values weighted by share (the
    whole batch's mean loss when ``step_fn`` returns its piece's unweighted mean loss).

    A step that runs out of memory in ``backward()`` may already have added part of its gradient. Without
    ``reset`` the failed piece is simply retried in halves (that part stays: usually a small error, logged);
    with ``reset`` (e.g. ``lambda: opt.zero_grad(set_to_none=True)``, when the gradients were zero before
    this batch) every out-of-memory resets the gradients and restarts the whole batch cut into twice as
    many pieces, which is exact. A piece of ``min_size`` samples that still runs out of memory re-raises.
    """
    logger = logger or log
    n = batch_size_of(batch)
    state = {"ooms": 0, "splits": 0, "pieces": 0}

    def attempt(b: Any) -> tuple[bool, Any, BaseException | None]:
        try:
            return True, step_fn(b), None
        except Exception as e:
            if not is_oom(e):
                raise
            err = e
            where = "".join(traceback.format_tb(e.__traceback__)[-3:])
        # outside the except block, and without its traceback, so the frames' tensors can be freed
        err.__traceback__ = None
        if hasattr(err, "add_note") and where:
            err.add_note("out of memory at (traceback cut to free memory):\n" + where)
        free_memory(device)
        return False, None, err

    if reset is None:
        def run(b: Any, size: int) -> Any:
            ok, value, err = attempt(b)
            if ok:
                state["pieces"] += 1
                return value
            state["ooms"] += 1
            if size <= min_size or size < 2:
                raise err
            h = size // 2
            state["splits"] += 1
            logger.warning("out of memory on a batch of %d samples: splitting into %d + %d", size, h, size - h)
            halves = split_batch(b, [h, size - h], weight_by=weight_by)
            values = [run(p, size_) for (p, _), size_ in zip(halves, (h, size - h))]
            return _combine(values, [s for _, s in halves])

        value = run(batch, n)
        return SplitResult(value, state["pieces"], state["ooms"], state["splits"])

    k = 1
    while True:
        if k == 1:
            pieces = [(batch, 1.0)]
        else:
            sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
            pieces = split_batch(batch, [s for s in sizes if s > 0], weight_by=weight_by)
        values, failed = [], None
        for p, _ in pieces:
            ok, value, err = attempt(p)
            if not ok:
                failed = err
                break
            values.append(value)
        if failed is None:
            return SplitResult(_combine(values, [s for _, s in pieces]), len(pieces), state["ooms"], state["splits"])
        state["ooms"] += 1
        if math.ceil(n / k) <= min_size or k >= n:
            raise failed
        reset()
        k *= 2
        state["splits"] += 1
        logger.warning("out of memory on a batch of %d samples: restarting it in %d pieces", n, min(k, n))
        k = min(k, n)


class OOMGuard:
    """Wrap a training step so that an out-of-memory splits the batch instead of ending the run.

    ``guard = OOMGuard(step_fn); for batch in loader: loss = guard(batch)`` calls
    :func:`run_with_oom_split` (same arguments) and keeps counters: ``calls``, ``ooms`` (out-of-memory
    errors caught), ``splits`` and ``split_batches`` (batches that needed any split). How the pieces' losses
    combine: each piece gets ``loss_weight`` = its share of the batch's samples (``weight_by="frames"``: of
    its real frames, for a loss averaged over frames); multiply the piece's mean loss by it before
    ``backward()``, and the accumulated gradient is the whole batch's. Under DDP each ``backward()`` outside
    ``no_sync()`` all-reduces, so a split on one rank only would leave the ranks' collectives out of step (a
    hang): run the step's ``backward()`` inside ``model.no_sync()`` and all-reduce the gradients once after
    the guard returns (``dist.all_reduce(p.grad); p.grad /= world_size`` for each parameter).
    """

    def __init__(self, step_fn: Callable[[Any], Any], **kwargs: Any):
        self.step_fn = step_fn
        self.kwargs = kwargs
        self.calls = self.ooms = self.splits = self.split_batches = 0
        self.last: SplitResult | None = None

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        res = run_with_oom_split(self.step_fn, batch, **self.kwargs)
        self.ooms += res.ooms
        self.splits += res.splits
        self.split_batches += bool(res.splits)
        self.last = res
        return res.value

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "ooms": self.ooms, "splits": self.splits, "split_batches": self.split_batches}


def oom_guard(step_fn: Callable[[Any], Any], **kwargs: Any) -> OOMGuard:
    """``OOMGuard(step_fn, **kwargs)``: see :class:`OOMGuard` and :func:`run_with_oom_split`."""
    return OOMGuard(step_fn, **kwargs)


# ---- command line -------------------------------------------------------------------------------------
def load_factory(spec: str) -> Callable[..., Any]:
    """``MODULE:FACTORY`` → the factory; ``MODULE`` is a dotted module name or a path to a ``.py`` file."""
    if ":" not in spec:
        raise ValueError(f"--model wants MODULE:FACTORY, got {spec!r}")
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py") or os.sep in mod_name:
        name = os.path.splitext(os.path.basename(mod_name))[0]
        spec_ = importlib.util.spec_from_file_location(name, mod_name)
        if spec_ is None or spec_.loader is None:
            raise ImportError(f"cannot import {mod_name}")
        module = importlib.util.module_from_spec(spec_)
        sys.modules[name] = module
        spec_.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(mod_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{mod_name} has no {attr!r}") from None


def _call_factory(factory: Callable[..., Any], device: Any) -> tuple[Callable, Callable | None]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {"device": None}
    made = factory(device) if params else factory()
    if isinstance(made, tuple):
        return made[0], made[1]
    return made, None


def main(argv: Sequence[str] | None = None, prog: str = "python -m streambatch.calibrate") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Measure the largest batch per length your training step fits in, and write the cost model "
                    "(cost, quadratic_factor, budget) that StreamBatchLoader(cost=FILE) reads.",
        epilog="FACTORY is called as FACTORY(device) (or FACTORY()) and returns step_fn(batch) — forward, backward "
               "and optimizer step on one batch as the loader yields it (CPU tensors) — or a (step_fn, make_batch) "
               "pair. Example: python -m streambatch.calibrate data/ --model mymodel.py:make_step --device cuda "
               "--out calib.json",
    )
    p.add_argument("source", help="dataset folder or index.json (probe lengths, unit and sample rate come from its index)")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="factory returning the step function")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--memory-limit", default=None, help="bytes the step may use, e.g. 2G (CPU default: a fraction of the available memory)")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="share of the device memory to fill (default 0.9)")
    p.add_argument("--lengths", default=None, help="comma-separated probe lengths (default: quantiles of the dataset's)")
    p.add_argument("--max-batch-size", type=int, default=4096)
    p.add_argument("--rel-tol", type=float, default=0.01, help="precision of each length's largest batch (default 0.01)")
    p.add_argument("--margin", type=float, default=0.02, help="budget safety margin (default 0.02)")
    p.add_argument("--out", default=None, help="write the calibration JSON here")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    step_fn, make_batch = _call_factory(load_factory(args.model), args.device)
    lengths = [float(x) for x in args.lengths.split(",")] if args.lengths else None
    result = calibrate(step_fn, args.source, device=args.device, memory_fraction=args.memory_fraction,
                       memory_limit=args.memory_limit, lengths=lengths, max_batch_size=args.max_batch_size,
                       out=args.out, make_batch=make_batch, rel_tol=args.rel_tol, margin=args.margin)
    print(format_report(result))
    if args.out:
        print(f"wrote {args.out}: StreamBatchLoader(source, cost={args.out!r}) uses it")
    return 0


class _CallableModule(types.ModuleType):
    """Lets ``streambatch.calibrate(...)`` call :func:`calibrate` once the submodule shadows the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return calibrate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
