"""How well the loader fed the training loop in a pass, measured in the main process as batches are handed
over: padding and budget use of the delivered batches, batches and samples per second, time to the first
batch, the time the training loop waited on the loader, and (under a mixture) each dataset's share. The time
the readers waited on storage is counted where they read (`waiting_on_storage()`)."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..read.faults import FAULT_FIELDS, STORAGE_WAIT

if TYPE_CHECKING:  # annotations only: `shardify inspect` plans with these figures without torch
    import torch


class EpochMeter:
    """The running figures of one pass. ``budget``/``cost``: the batching budget and cost model, to say how
    full each batch is; ``unit_per_element``: dataset units per tensor element along T (1, or 1/rate for a
    budget in seconds)."""

    def __init__(self, epoch: int, budget: float | None, cost: Any, unit_per_element: float = 1.0):
        self.epoch, self.budget, self.cost, self.unit = epoch, budget, cost, unit_per_element
        self.start = time.perf_counter()
        self.first: float | None = None
        self.waited = 0.0
        self.batches = self.samples = 0
        self.real = self.padded = 0
        self.used: list[float] = []
        self.datasets: collections.Counter = collections.Counter()

    def record(self, batch: Any, waited: float) -> None:
        """One batch handed to the training loop after the loop waited ``waited`` seconds for it."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self.start
        self.waited += waited
        self.batches += 1
        for part in batch if isinstance(batch, list) else [batch]:  # a batch's micro-batches count together
            if isinstance(part, dict):
                self._measure(part)

    def _measure(self, batch: dict[str, Any]) -> None:
        lengths = batch.get("lengths")
        if lengths is not None and len(lengths):
            n = int(len(lengths))
            longest = _width(batch, lengths)
            self.samples += n
            self.real += int(np.asarray(lengths).sum())
            self.padded += n * longest
            if self.budget and not getattr(self.cost, "packed", False):
                self.used.append(float(self.cost.cost(n, longest * self.unit)) / self.budget)
        for name in batch.get("dataset") or ():
            self.datasets[name] += 1

    def summary(self) -> dict[str, Any]:
        """The pass's figures (docs: guide/metrics.md)."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "batches": self.batches,
            "samples": self.samples,
            "seconds": seconds,
            "batches_per_s": self.batches / seconds,
            "samples_per_s": self.samples / seconds,
            "time_to_first_batch_s": self.first,
            "waited_on_loader_s": self.waited,
            "padding_pct": 100.0 * (1 - self.real / self.padded) if self.padded else None,
            "budget_utilisation_pct": 100.0 * float(np.mean(self.used)) if self.used else None,
        }
        total = sum(self.datasets.values())  # no dataset names (a single dataset): no shares, an empty dict
        out["dataset_shares"] = {k: v / total for k, v in sorted(self.datasets.items())}
        return out


def _width(batch: dict[str, Any], lengths: Any) -> int:
    """The padded length T of a batch (its padding mask's width), else its longest sample."""
    mask = batch.get("padding_mask")
    if mask is not None and getattr(mask, "ndim", 0) == 2:
        return int(mask.shape[1])
    return int(np.asarray(lengths).max())


def metered(batches: Iterable[Any], meter: EpochMeter) -> Iterator[Any]:
    """Stage: pass batches on, timing how long each was waited for and recording it in ``meter``."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        meter.record(batch, time.perf_counter() - t0)
        yield batch


def planned_batches(plan: Any, rank: int, lengths: Any, budget: float, cost: Any) -> dict[str, np.ndarray]:
    """Per batch the plan gives ``rank`` (repeats of ``pad`` included, as they are delivered): its ``size``, the
    ``real`` and ``padded`` lengths it holds, and ``used``, its cost over the budget (from the index lengths)."""
    rows = []
    for s in plan.rank_slots(rank):
        slot = plan.slots[s]
        for b in slot.batches:
            x = np.asarray(lengths[slot.gids[b]], dtype=np.float64)
            rows.append((len(x), x.sum(), len(x) * x.max(), float(cost.cost(len(x), float(x.max()))) / budget))
    table = np.asarray(rows, dtype=np.float64).reshape(-1, 4)
    return dict(zip(("size", "real", "padded", "used"), table.T))


def batch_figures(b: dict[str, np.ndarray]) -> dict[str, Any]:
    """Padding % and mean budget use of some batches (`planned_batches()`)."""
    padded = float(b["padded"].sum())
    return {
        "padding_pct": 100.0 * (1 - float(b["real"].sum()) / padded) if padded else None,
        "budget_utilisation_pct": 100.0 * float(b["used"].mean()) if len(b["used"]) else None,
        "batches": len(b["size"]),
    }


def planned_figures(plan: Any, rank: int, lengths: Any, budget: float, cost: Any) -> dict[str, Any]:
    """Padding and budget use of the batches the plan gives ``rank``."""
    return batch_figures(planned_batches(plan, rank, lengths, budget, cost))


def storage_waits(ns_per_worker: list[int]) -> dict[str, Any]:
    """Seconds the readers were blocked waiting for shard bytes in a pass: in all (``waited_on_storage_s``) and
    per DataLoader worker (one entry with ``num_workers=0``: the main process)."""
    per = [n / 1e9 for n in ns_per_worker]
    return {"waited_on_storage_s": sum(per), "waited_on_storage_per_worker_s": per}


def metrics_line(m: dict[str, Any]) -> str:
    """The once-per-epoch log line."""

    def pct(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}%"

    first = "-" if m["time_to_first_batch_s"] is None else f"{m['time_to_first_batch_s']:.2f} s"
    shares = "".join(f", {k} {v:.1%}" for k, v in m.get("dataset_shares", {}).items())
    return (
        f"epoch {m['epoch']}: {m['batches']} batches, {m['samples']} samples in {m['seconds']:.1f} s "
        f"({m['batches_per_s']:.2f} batches/s, {m['samples_per_s']:.1f} samples/s); first batch after {first}; "
        f"waited on the loader {m['waited_on_loader_s']:.1f} s; readers waited on storage "
        f"{m.get('waited_on_storage_s', 0.0):.2f} s; padding {pct(m['padding_pct'])}, budget used "
        f"{pct(m['budget_utilisation_pct'])}{shares}"
    )


def fault_summary(counts: torch.Tensor, bad: torch.Tensor, urls: Sequence[str]) -> dict[str, Any]:
    """What storage faults cost a rank in a pass, from its workers' shared counters (``counts``: per worker, one
    column per `FAULT_FIELDS`; ``bad``: a flag per shard): the counters summed, and
    the URLs of the bad shards."""
    out: dict[str, Any] = dict(zip(FAULT_FIELDS, (int(x) for x in counts.sum(0).tolist())))
    del out[STORAGE_WAIT]  # a time, not a fault: storage_figures() reports it
    out["bad_shard_urls"] = [urls[i] for i in bad.nonzero().flatten().tolist()]
    return out


#: what bad shards and bad samples cost a pass, in ``metrics()["faults"]`` (from `fault_stats()`)
FAULT_FIGURES = ("bad_shards", "bad_shard_urls", "lost_samples", "redrawn_samples", "shrunk_batches")


def storage_figures(counts: torch.Tensor, faults: dict[str, Any]) -> dict[str, Any]:
    """The storage part of ``metrics()``: request counters, the time the readers waited on storage, and what bad
    shards and samples cost (`FAULT_FIGURES`)."""
    out: dict[str, Any] = {
        "storage": {k: faults[k] for k in ("retries", "bytes_read", "cache_downloads", "cache_hits")},
        "faults": {k: faults[k] for k in FAULT_FIGURES},
    }
    out.update(storage_waits(counts[:, FAULT_FIELDS.index(STORAGE_WAIT)].tolist()))
    return out


def fault_warning(faults: dict[str, Any], epoch: int, rank: int, max_bad_shards: int) -> str | None:
    """The one WARNING line a pass that skipped bad shards (``max_bad_shards`` > 0) or lost samples logs at its end:
    how many shards (the first few named), samples lost and re-drawn, batches that came out smaller; None for a
    pass that lost nothing."""
    bad, lost, redrawn = faults["bad_shards"], faults["lost_samples"], faults["redrawn_samples"]
    if not (bad or lost or redrawn):
        return None
    urls = faults["bad_shard_urls"]
    named = ", ".join(urls[:5]) + (f" and {len(urls) - 5} more" if len(urls) > 5 else "")
    shards = (
        f"skipped {bad} bad shard{'s' if bad != 1 else ''} ({named}; max_bad_shards={max_bad_shards}), " if bad else ""
    )
    return (
        f"streambatch: epoch {epoch} on rank {rank} {shards}lost {lost} planned sample{'s' if lost != 1 else ''}, "
        f"re-drew {redrawn} from samples already emitted to keep the steps equal, "
        f"{faults['shrunk_batches']} batch{'es' if faults['shrunk_batches'] != 1 else ''} came out smaller "
        "(loader.metrics()['faults'])"
    )
