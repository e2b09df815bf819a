"""``shardify inspect DS --plan``: what a planned epoch looks like before a job runs — steps per rank, batch
sizes, padding and budget use — as a table (and a plot)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .dataset.mixture import selection_of
from .errors import ShardifyError
from .loader.metrics import batch_figures, planned_batches
from .loader.options import batching_config
from .plan.epoch import make_epoch_plan
from .plan.layout import Layout
from .plan.lengths import index_lengths


def planned_epoch(
    index: Any, budget: float, world_size: int, num_workers: int, epoch: int = 0, **options: Any
) -> dict[str, Any]:
    """The epoch's plan summarised: steps (every rank's), batches and samples per rank, batch-size histogram,
    padding % and mean budget use over the batches (from the index lengths)."""
    lengths = index_lengths(index)
    config = batching_config(budget, index, dict(options))  # the loader's own: the same window, buckets, cost
    layout = Layout(world_size, num_workers)
    plan = make_epoch_plan(lengths, config, epoch, layout, excluded=selection_of(index, epoch, config.seed))
    ranks = [planned_batches(plan, r, lengths, config.budget, config.cost) for r in range(world_size)]
    every = {k: np.concatenate([b[k] for b in ranks]) for k in ranks[0]}
    sizes = every["size"].astype(np.int64).tolist()
    counts, edges = np.histogram(sizes, bins=min(20, max(1, len(set(sizes))))) if sizes else (np.zeros(0), np.zeros(1))
    return {
        "budget": config.budget,
        "world_size": world_size,
        "num_workers": num_workers,
        "steps": plan.steps,
        "samples_per_rank": [int(b["size"].sum()) for b in ranks],
        **batch_figures(every),
        "left_out": plan.surplus_samples,
        "skipped": plan.skipped_samples,
        "batch_sizes": {
            "counts": counts.astype(int).tolist(),
            "edges": edges.tolist(),
            "min": min(sizes, default=0),
            "max": max(sizes, default=0),
            "mean": float(np.mean(sizes)) if sizes else 0.0,
        },
    }


def print_planned(p: dict[str, Any], as_json: bool = False) -> None:
    """The summary as a table (or JSON)."""
    if as_json:
        print(json.dumps(p, indent=2))
        return
    pct = lambda x: "-" if x is None else f"{x:.1f}%"  # noqa: E731
    print(
        f"plan       {p['world_size']} ranks x {p['num_workers']} workers, budget {p['budget']:g}: "
        f"{p['steps']:,} steps per rank, {p['batches']:,} batches"
    )
    print(f"padding    {pct(p['padding_pct'])}; budget used {pct(p['budget_utilisation_pct'])} per batch on average")
    print(
        f"samples    per rank {min(p['samples_per_rank']):,} to {max(p['samples_per_rank']):,}; "
        f"{p['left_out']:,} left out to equalise steps, {p['skipped']:,} skipped"
    )
    h = p["batch_sizes"]
    print(f"batch size {h['min']} to {h['max']} (mean {h['mean']:.1f}):")
    top = max(h["counts"], default=1) or 1
    for c, lo, hi in zip(h["counts"], h["edges"], h["edges"][1:]):
        print(f"  {lo:7.1f}-{hi:<7.1f} {'#' * int(round(40 * c / top)):<40} {c:,}")


def plot_planned(p: dict[str, Any], path: str) -> str:
    """Batch sizes and samples per rank of a planned epoch as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardifyError("--plot needs matplotlib: pip install 'streambatch[plot]'") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    h = p["batch_sizes"]
    a.stairs(h["counts"], h["edges"], fill=True, color="#4477aa")
    a.set_xlabel("samples per batch")
    a.set_ylabel("batches")
    b.bar(range(len(p["samples_per_rank"])), p["samples_per_rank"], color="#228833")
    b.set_xlabel("rank")
    b.set_ylabel("samples")
    fig.suptitle(f"{p['steps']:,} steps per rank, padding {p['padding_pct'] or 0:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
