"""Small helpers shared by the benchmarks in tools/: plain-text tables, timing, batch statistics."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np


def table(rows: Sequence[Sequence[object]], header: Sequence[str], align: str | None = None) -> str:
    """A plain-text table: ``align`` has one letter per column, ``l`` or ``r`` (default: first left)."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    ncol = len(header)
    align = align or "l" + "r" * (ncol - 1)
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


def best_of(fn: Callable[[], object], repeat: int = 3) -> tuple[float, object]:
    """(fastest wall time in seconds, result of the last call) over ``repeat`` calls."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, numpy {np.__version__}"


def batch_stats(batches: Sequence[np.ndarray], lengths: np.ndarray, budget: float) -> dict[str, float]:
    """Padding, counts, cost and order randomness of a list of batches (arrays of sample indices).

    ``padding`` = 1 - real / padded elements, padded = sum over batches of n x max_len; ``corr`` is the
    Pearson correlation between a batch's position in the epoch and its longest sample.
    """
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    nonempty = sizes > 0
    flat = lengths[np.concatenate(batches)] if len(batches) else np.zeros(0)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])[nonempty]
    maxlen = np.maximum.reduceat(flat, starts).astype(np.float64) if flat.size else np.zeros(0)
    cost = sizes[nonempty] * maxlen
    real = float(flat.sum())
    padded = float(cost.sum())
    corr = float(np.corrcoef(np.arange(len(maxlen)), maxlen)[0, 1]) if len(maxlen) > 2 and maxlen.std() > 0 else 0.0
    return {
        "batches": int(len(batches)),
        "samples": int(sizes.sum()),
        "distinct": int(np.unique(np.concatenate(batches)).size) if len(batches) else 0,
        "padding": 1.0 - real / padded if padded else 0.0,
        "over": int((cost > budget).sum()),
        "max_cost": float(cost.max()) if cost.size else 0.0,
        "corr": corr,
        "mean_size": float(sizes.mean()) if sizes.size else 0.0,
    }


# ---- memory: peak RSS of this process and of its children (DataLoader workers) ----------------------------
def _proc_mb(path: str, field: str) -> float:
    """A ``kB`` field of a /proc file in MB, 0 once the process is gone."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak_rss_mb(pid: int | str = "self") -> float:
    """Peak resident memory (VmHWM) of a process in MB, 0 once it is gone."""
    return _proc_mb(f"/proc/{pid}/status", "VmHWM")


def pss_mb(pid: int | str = "self") -> float:
    """Proportional set size of a process in MB (pages shared with N processes count 1/N), 0 once it is gone.
    Reading it walks the page tables (milliseconds): for snapshots, not for polling."""
    return _proc_mb(f"/proc/{pid}/smaps_rollup", "Pss")


def footprint_mb() -> float:
    """This process's and its children's (DataLoader workers') PSS summed: their memory on the node."""
    return pss_mb() + sum(pss_mb(pid) for pid in _children())


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return pids


class WorkerPeaks:
    """Polls the peak RSS (VmHWM) of this process's children (the DataLoader workers) while they live."""

    def __init__(self, every: float = 0.02):
        import threading

        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            for pid in _children():
                self.peaks[pid] = max(self.peaks.get(pid, 0.0), peak_rss_mb(pid))
            self._stop.wait(every)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return [v for v in self.peaks.values() if v > 0]
