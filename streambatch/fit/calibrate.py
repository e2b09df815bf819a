"""Calibration: measure the largest batch per length the user's training step fits in, and fit the cost model.

``calibrate(step_fn, source, device=...)`` runs the step on synthetic batches shaped like the dataset's at a
few probe lengths, searches each length's largest fitting batch (`search`, measured by `memory`),
fits the peak memory and writes the cost model and budget that ``StreamBatchLoader(cost="calib.json")``
reads. ``shardify calibrate`` is its command line (`streambatch.cli.calibrate`). The guide "Fitting
batches to the model" describes the measurements, the search, the fit and the JSON file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import OptionError, bool_option, int_option, number_option, output_fits, shown
from ..plan.balance import COEFFICIENTS, StepTime
from ..plan.cost import CALIBRATION_FORMAT, PaddedCost, QuadraticCost
from ..units import Unit, parse_bytes
from .memory import CalibrationError, DeviceMeasure, Trial, device_measure, resolve_device
from .search import QUADRATIC_THRESHOLD, budget_from_fit, fit_memory_model, predict_max_batch, search_max_batch

log = logging.getLogger("streambatch.calibrate")

CALIBRATION_VERSION = 1

#: the largest ``max_batch_size``: batch sizes are counted in 32-bit integers by many kernels
MAX_BATCH_SIZE = 2**31 - 1


# ---- synthetic batches --------------------------------------------------------------------------------
def default_make_batch(
    unit: Unit | str = Unit.SAMPLES,
    sample_rate: int | None = None,
    *,
    vocab_size: int = 1000,
    feature_dim: int = 80,
    seed: int = 0,
) -> Callable[[int, float], dict[str, Any]]:
    """``make_batch(n, L)`` building a batch of ``n`` samples of length ``L`` shaped like the loader's.

    Audio units (``samples``, ``seconds``): ``audio`` float32 ``[n, T]``; ``tokens``: ``input_ids`` int64
    ``[n, L]`` (random ids below ``vocab_size``); ``frames``: ``inputs`` float32 ``[n, L, feature_dim]``.
    Each with ``lengths`` int64 ``[n]`` and ``padding_mask`` bool ``[n, T]`` (all False: every sample is
    as long as the longest, the worst case the budget admits).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    unit = Unit.parse(unit)

    def make_batch(n: int, length: float) -> dict[str, Any]:
        n = int(n)
        if unit is Unit.SECONDS:
            if not sample_rate:
                raise OptionError("unit 'seconds' needs a sample_rate to build audio batches")
            t = int(round(length * sample_rate))
        else:
            t = int(math.ceil(length))
        if unit.is_audio:
            batch = {"audio": torch.randn(n, t, generator=gen)}
        elif unit is Unit.TOKENS:
            batch = {"input_ids": torch.randint(0, vocab_size, (n, t), generator=gen)}
        else:
            batch = {"inputs": torch.randn(n, t, feature_dim, generator=gen)}
        batch["lengths"] = torch.full((n,), t, dtype=torch.int64)
        batch["padding_mask"] = torch.zeros(n, t, dtype=torch.bool)
        return batch

    return make_batch


# ---- probe lengths ------------------------------------------------------------------------------------
def _resolve_lengths(source: Any) -> tuple[np.ndarray | None, Unit | None, int | None]:
    """(lengths, unit, sample_rate) from a dataset folder, an index file, a ShardIndex or a length array."""
    from ..format.index import ShardIndex

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


def _probes(
    source: Any, lengths: Sequence[float] | None, unit: Unit | str | None, sample_rate: int | None
) -> tuple[list[float], Unit, int | None]:
    """The probe lengths (longest first: the riskiest size), the unit and the sample rate to calibrate at."""
    ds_lengths, ds_unit, ds_rate = _resolve_lengths(source)
    unit = Unit.parse(unit or ds_unit or Unit.SAMPLES)
    sample_rate = sample_rate or ds_rate
    if lengths is None:
        if ds_lengths is None:
            raise OptionError("calibrate needs a dataset (source) or probe lengths")
        lengths = probe_lengths(ds_lengths, integer=unit.whole)
    return sorted(set(lengths), reverse=True), unit, sample_rate


# ---- the options, checked before anything runs ---------------------------------------------------------
@dataclass(frozen=True)
class CalibrationOptions:
    """What a calibration measures and writes, every option checked (`calibration_options()`): the probe
    lengths (longest first), the unit and sample rate, the ``torch.device``, the memory limit in bytes (None:
    ``memory_fraction`` of the memory), the search's cap and precision, the budget's margin and the output."""

    probes: list[float]
    unit: Unit
    sample_rate: int | None
    device: Any
    memory_limit: int | None
    memory_fraction: float
    max_batch_size: int
    rel_tol: float
    margin: float
    out: str | None


def calibration_options(
    source: Any = None,
    *,
    device: Any = "cpu",
    memory_fraction: float = 0.9,
    memory_limit: int | str | None = None,
    lengths: Sequence[float] | None = None,
    max_batch_size: int = 4096,
    unit: Unit | str | None = None,
    sample_rate: int | None = None,
    out: str | os.PathLike | None = None,
    rel_tol: float = 0.01,
    margin: float = 0.02,
    flag: Callable[[str], str] = str,
) -> CalibrationOptions:
    """`calibrate()`'s options checked, before any step runs (arguments as there): an `OptionError`
    names the first bad one as ``flag(keyword)`` (the CLI passes its ``--option`` names); the dataset's index
    is read last (its errors: ``FileNotFoundError``, ``IndexFormatError``). The ranges: ``memory_fraction``
    in (0, 1], ``memory_limit`` above 0 bytes, ``max_batch_size`` from 1 to `MAX_BATCH_SIZE`,
    ``rel_tol`` in [0, 0.5) (0: exact to one sample), ``margin`` in [0, 1), lengths finite and positive."""
    fraction = number_option(flag("memory_fraction"), memory_fraction, positive=True, maximum=1)
    limit = parse_bytes(memory_limit, flag("memory_limit"))
    if limit == 0:
        raise OptionError(f"{flag('memory_limit')} must be more than 0 bytes, got {memory_limit!r}")
    cap = int_option(flag("max_batch_size"), max_batch_size, 1, MAX_BATCH_SIZE)
    tol = number_option(flag("rel_tol"), rel_tol, 0, below=0.5)
    margin = number_option(flag("margin"), margin, 0, below=1)
    if lengths is not None:
        lengths = [number_option(flag("lengths"), x, positive=True) for x in lengths]
        if not lengths:
            raise OptionError(f"{flag('lengths')} names no length")
    dev = resolve_device(device, flag("device"))
    target = check_output(out, flag("out"))
    probes, unit, rate = _probes(source, lengths, unit, sample_rate)
    return CalibrationOptions(probes, unit, rate, dev, limit, fraction, cap, tol, margin, target)


def check_output(out: str | os.PathLike | None, name: str = "out") -> str | None:
    """``out`` as a path or URL once a file can be written there: a local one must not be a folder nor lie
    under a file, and its nearest existing folder must be writable; else an `OptionError`."""
    if out is None:
        return None
    from ..io.storage import is_local, local_path

    url = os.fspath(out)
    if not is_local(url):
        return url
    path = local_path(url)
    if not path:
        raise OptionError(f"{name} is empty: name the JSON file to write")
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise OptionError(f"{name} {url!r} is a folder: name the JSON file to write")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise OptionError(f"{name} {url!r}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OptionError(f"{name} {url!r}: cannot write in {folder} (permission denied)")
    return url


# ---- the steps of a calibration -----------------------------------------------------------------------
def _start_from(
    trials: list[Trial], per_length: list[dict[str, Any]], length: float, limit: float, rel_tol: float
) -> tuple[int | None, float | None, float | None]:
    """``(guess, slope, intercept)`` for the search at ``length``, predicted from the lengths done before."""
    guess = slope = intercept = None
    done = [r for r in per_length if r["max_batch_size"]]
    if not done:
        return guess, slope, intercept
    # the intercept a is known from one length already; the split of the per-sample memory into its
    # n·L and n·L² parts only from two lengths (before that, assume n·L)
    try:
        fit = fit_memory_model(trials, limit)
        intercept = fit["a"]
        if len({t.length for t in trials if t.peak is not None}) >= 2:
            per = fit["b"] * length + fit["c"] * length * length
            if per > 0:
                slope = per
                guess = int((limit - fit["a"]) / per * (1 - 2 * rel_tol))
    except CalibrationError:
        pass
    if guess is None or guess < 1:
        r = done[-1]
        guess = int(r["max_batch_size"] * r["length"] / length * (1 - 2 * rel_tol))
    return guess, slope, intercept


def _search_lengths(
    measure: Callable[[int, float], Trial], probes: list[float], limit: float, max_batch_size: int, rel_tol: float
) -> tuple[list[Trial], list[dict[str, Any]]]:
    """Every trial, and per probe length its largest fitting batch and smallest failing one."""
    trials: list[Trial] = []
    per_length: list[dict[str, Any]] = []
    for L in probes:
        guess, slope, intercept = _start_from(trials, per_length, L, limit, rel_tol)
        lo, hi, ts = search_max_batch(
            measure,
            L,
            limit,
            max_batch_size=max_batch_size,
            guess=guess,
            slope=slope,
            intercept=intercept,
            rel_tol=rel_tol,
        )
        trials.extend(ts)
        peak_at = next((t.peak for t in ts if t.n == lo and t.fits), None)
        per_length.append({"length": L, "max_batch_size": lo, "min_failing": hi, "peak": peak_at, "trials": len(ts)})
        log.info("length %g: largest batch %d (%d trials)", L, lo, len(ts))
    if all(r["max_batch_size"] == 0 for r in per_length):
        raise CalibrationError(f"not even one sample of the shortest probe length fits in {limit:.4g} bytes")
    too_long = [r["length"] for r in per_length if r["max_batch_size"] == 0]
    if too_long:
        log.warning(
            "a single sample of length %g does not fit in %.4g bytes: the budget leaves such samples "
            "out (the loader counts them as skipped)",
            min(too_long),
            limit,
        )
    return trials, per_length


def _add_admitted(
    per_length: list[dict[str, Any]], fit: dict[str, float], model: dict[str, Any], limit: float, max_batch_size: int
) -> None:
    """Add to each row what the budget admits at its length and what the fitted model predicts fits."""
    cost_model = QuadraticCost(model["quadratic_factor"]) if model["cost"] == "quadratic" else PaddedCost()
    for row in per_length:
        row["admitted"] = int(cost_model.capacity(np.array([row["length"]]), model["budget"], max_batch_size)[0])
        row["predicted"] = predict_max_batch(fit, row["length"], limit, max_batch_size)


def calibrate(
    step_fn: Callable[[Any], Any],
    source: Any = None,
    *,
    device: Any = "cpu",
    memory_fraction: float = 0.9,
    memory_limit: int | str | None = None,
    lengths: Sequence[float] | None = None,
    max_batch_size: int = 4096,
    unit: Unit | str | None = None,
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
    """Measure ``step_fn`` on synthetic batches and fit the cost model and budget (guide: fitting batches).

    ``source``: a dataset folder or ``index.json`` (lengths, unit and sample rate come from its index), a
    `ShardIndex`, an array of lengths, or None with explicit ``lengths``.
    ``lengths``: the probe lengths (default `probe_lengths()` of the dataset). ``memory_limit``: bytes
    (or ``"2G"``) the step may use — on CPU above the process's memory before the step (default
    ``memory_fraction`` of the memory available now), on CUDA in all (default ``memory_fraction`` of the
    device's memory). ``max_batch_size`` caps the search. ``out``: where to write the JSON (path or URL).
    ``rel_tol``: how precisely each length's largest batch is searched. ``margin``: the budget's safety
    margin below what was measured to fit. ``trial_timeout``: seconds one CPU trial may run.
    ``cpu_threads``: torch threads in the CPU trials; by default unchanged when this process has a single
    thread, else 1 — OpenMP (torch's CPU thread pool) hangs in a forked child once the parent has used it,
    so CPU trials of a process that already ran parallel torch code are single-threaded (the per-thread
    scratch memory of multi-threaded kernels is then not measured). Every option is checked before the first
    trial (`calibration_options()`, which gives the ranges), ``out`` included. Returns the calibration as a
    dict (what ``out`` receives).
    """
    options = calibration_options(
        source,
        device=device,
        memory_fraction=memory_fraction,
        memory_limit=memory_limit,
        lengths=lengths,
        max_batch_size=max_batch_size,
        unit=unit,
        sample_rate=sample_rate,
        out=out,
        rel_tol=rel_tol,
        margin=margin,
    )
    result = measure_and_fit(
        step_fn,
        options,
        make_batch=make_batch,
        warmup=warmup,
        trial_timeout=trial_timeout,
        quadratic_threshold=quadratic_threshold,
        cpu_threads=cpu_threads,
    )
    if options.out is not None:
        write_calibration(result, options.out)
    return result


def _check_trial_options(warmup: Any, timeout: Any, threshold: Any, threads: Any) -> None:
    """How the trials run, checked before the first one (an OptionError naming the option)."""
    bool_option("warmup", warmup)
    if timeout is not None:
        number_option("trial_timeout", timeout, positive=True)
    number_option("quadratic_threshold", threshold, 0, maximum=1)
    if threads is not None:
        int_option("cpu_threads", threads, 1)


def measure_and_fit(
    step_fn: Callable[[Any], Any],
    options: CalibrationOptions,
    *,
    make_batch: Callable[[int, float], Any] | None = None,
    warmup: bool = True,
    trial_timeout: float | None = 600.0,
    quadratic_threshold: float = QUADRATIC_THRESHOLD,
    cpu_threads: int | None = None,
) -> dict[str, Any]:
    """`calibrate()` once its ``options`` are checked (`calibration_options()`): run the trials, fit
    the model and return the calibration; ``options.out`` is not written (`write_calibration()` does). The
    trial options are checked here, before the first trial: ``trial_timeout`` above 0 (or None),
    ``quadratic_threshold`` in [0, 1], ``cpu_threads`` from 1 (or None), ``warmup`` True or False."""
    _check_trial_options(warmup, trial_timeout, quadratic_threshold, cpu_threads)
    o = options
    setup = device_measure(
        step_fn,
        make_batch or default_make_batch(o.unit, o.sample_rate),
        o.device,
        o.memory_limit,
        memory_fraction=o.memory_fraction,
        trial_timeout=trial_timeout,
        cpu_threads=cpu_threads,
        warmup_length=min(o.probes) if warmup else None,
    )
    t0 = time.perf_counter()
    trials, per_length = _search_lengths(setup.measure, o.probes, setup.limit, o.max_batch_size, o.rel_tol)
    fit = fit_memory_model(trials, setup.limit)
    model = budget_from_fit(
        fit,
        setup.limit,
        max(o.probes),
        per_length,
        margin=o.margin,
        quadratic_threshold=quadratic_threshold,
        integer=o.unit.whole,
    )
    _add_admitted(per_length, fit, model, setup.limit, o.max_batch_size)
    result = _record(model, fit, trials, per_length, setup, o.unit, o.sample_rate, o.max_batch_size, o.margin)
    result["memory_fraction"] = o.memory_fraction if o.memory_limit is None else None
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def write_calibration(result: dict[str, Any], out: str) -> None:
    """Write the calibration JSON to ``out`` (a path or URL) whole or not at all; a disk or quota that is full
    is an `OutputError` naming ``out``."""
    from ..io.storage import write_bytes_atomic

    with output_fits(out, "the calibration"):
        write_bytes_atomic(out, (json.dumps(result, indent=1) + "\n").encode())


def _record(
    model: dict[str, Any],
    fit: dict[str, Any],
    trials: list[Trial],
    per_length: Any,
    setup: DeviceMeasure,
    unit: Unit,
    sample_rate: int | None,
    max_batch_size: int,
    margin: float,
) -> dict[str, Any]:
    """The calibration file's fields (the JSON ``calibrate`` returns and writes), in their file order."""
    return {
        "format": CALIBRATION_FORMAT,
        "version": CALIBRATION_VERSION,
        "cost": model["cost"],
        "quadratic_factor": model["quadratic_factor"],
        "budget": model["budget"],
        "unit": unit.value,
        "sample_rate": sample_rate,
        "device": setup.device_name,
        "cpu_threads": setup.cpu_threads,
        "limit": setup.limit,
        "memory_fraction": None,
        "margin": margin,
        "max_batch_size": max_batch_size,
        "fit": {**fit, "fitted_budget": model["fitted_budget"], "quadratic_share": model["quadratic_share"]},
        "per_length": per_length,
        "measurements": [asdict(t) for t in trials],
        "seconds": None,
    }


def format_report(result: dict[str, Any]) -> str:
    """The per-length table and the fitted model, as the CLI prints them."""
    unit, rate = result["unit"], result.get("sample_rate")
    seconds = unit == Unit.SAMPLES and rate
    header = ["length", "seconds"] if seconds else ["length"]
    header += ["max batch", "fails at", "peak MiB", "budget admits", "trials"]
    rows = []
    for r in sorted(result["per_length"], key=lambda r: r["length"]):
        row = [f"{r['length']:g}"] + ([f"{r['length'] / rate:.2f}"] if seconds else [])
        row += [
            str(r["max_batch_size"]),
            "-" if r["min_failing"] is None else str(r["min_failing"]),
            "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f}",
            str(r["admitted"]),
            str(r["trials"]),
        ]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    f = result["fit"]
    lines.append("")
    lines.append(
        f"device {result['device']}, limit {result['limit'] / 2**20:.1f} MiB, "
        f"{len(result['measurements'])} trials in {result['seconds']:.1f} s"
    )
    lines.append(
        f"peak bytes ≈ {f['a']:.4g} + {f['b']:.4g}·n·L + {f['c']:.4g}·n·L²  "
        f"(max error {100 * f['max_rel_error']:.1f} %, quadratic share at the longest length "
        f"{100 * f['quadratic_share']:.1f} %)"
    )
    if result["cost"] == "quadratic":
        lines.append(
            f"cost='quadratic', quadratic_factor={result['quadratic_factor']:.6g}, "
            f"budget={result['budget']:.10g} {unit}"
        )
    else:
        lines.append(f"cost='padded', budget={result['budget']:.10g} {unit}")
    return "\n".join(lines)


# ---- step time (balanced steps) ----------------------------------------------------------------------------
def fit_step_time(timed: Sequence[tuple[Sequence[float], float]], terms: Sequence[str] | None = None) -> StepTime:
    """A `StepTime` fitted to timed training steps, for ``step_balance``: ``timed`` holds each step's batch
    (its samples' lengths, in the index's unit) and its time in seconds (at least as many steps as ``terms``, of
    several shapes). ``terms``: the coefficients to fit (default all of `COEFFICIENTS`: ``a`` + ``b·n`` +
    ``c·ΣL`` + ``d·ΣL²`` + ``e·n·max`` + ``f·n·max²``). The fit weighs each step's error relative to its time
    (short steps count as much as long ones) and keeps every coefficient ≥ 0: a term whose least-squares
    coefficient is negative is dropped and the rest fitted again."""
    names = list(COEFFICIENTS if terms is None else terms)
    unknown = sorted(set(names) - set(COEFFICIENTS))
    if unknown or not names:
        raise OptionError(f"terms: choose from {', '.join(COEFFICIENTS)}, got {shown(terms)}")
    rows, times = [], []
    for lengths, seconds in timed:
        x = np.asarray(lengths, dtype=np.float64)
        t = number_option("step time", seconds, positive=True)
        if x.ndim != 1 or not len(x) or not np.isfinite(x).all() or (x < 0).any():
            raise OptionError(
                f"fit_step_time: a step's lengths must be a non-empty list of lengths ≥ 0, got {shown(lengths)}"
            )
        n, m = float(len(x)), float(x.max())
        feats = {"a": 1.0, "b": n, "c": float(x.sum()), "d": float((x * x).sum()), "e": n * m, "f": n * m * m}
        rows.append([feats[k] / t for k in names])  # relative error: each row divided by its time
        times.append(1.0)
    if len(rows) < len(names):
        raise OptionError(f"fit_step_time: {len(rows)} timed steps cannot fit {len(names)} terms; time more shapes")
    a, y = np.array(rows), np.array(times)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    keep = list(range(len(names)))
    coef = np.zeros(len(names))
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep] / scale[keep], y, rcond=None)
        sol = sol / scale[keep]
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep = [k for k, v in zip(keep, sol) if v >= 0] if (sol > 0).any() else []
    if not coef.any():
        raise OptionError("fit_step_time: no term of the model grows with these steps' times; time more shapes")
    return StepTime(**dict(zip(names, coef.tolist())))


def time_steps(
    step: Callable[[Sequence[float]], Any], batches: Sequence[Sequence[float]], warmup: int = 1, repeat: int = 3
) -> list[tuple[list[float], float]]:
    """Time ``step(lengths)`` (one training step on a batch of samples of those lengths) on each of ``batches``:
    ``warmup`` untimed calls first, then the fastest of ``repeat`` calls, in seconds. What `fit_step_time()`
    takes."""
    int_option("warmup", warmup, 0)
    int_option("repeat", repeat, 1)
    out = []
    for lengths in batches:
        for _ in range(warmup):
            step(lengths)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            step(lengths)
            best = min(best, time.perf_counter() - t0)
        out.append(([float(v) for v in lengths], best))
    return out
