"""``shardify inspect``: a dataset's counts, hours or tokens, length percentiles, a suggested budget and
bucket boundaries, as a table, JSON or a histogram."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .dataset.index import ShardIndex
from .dataset.mixture import datasets_of
from .errors import BudgetError, ShardifyError
from .plan.buckets import estimate_boundaries, suggest_budget
from .plan.config import parse_budget as parse_any_budget
from .plan.stats import LengthStats


def total_text(index: ShardIndex) -> str:
    spu = index.seconds_per_unit()
    if spu:
        return _hours(index.total_length * spu / 3600)
    return f"{_fmt(index.total_length)} {index.unit}"


def length_text(x: float, index: ShardIndex | None) -> str:
    """A length in the dataset's unit, with seconds for audio: ``"12,000 samples (1.5 s)"``."""
    if index is None:
        return _fmt(x)
    spu = index.seconds_per_unit()
    seconds = f" ({float(x) * spu:.3g} s)" if spu and index.unit != "seconds" else ""
    return f"{_fmt(x)} {index.unit}{seconds}"


def _hours(h: float) -> str:
    return f"{h:,.2f} h" if h >= 1 else f"{h * 60:,.2f} min"


def _fmt(x: float) -> str:
    """1,234 for whole or large numbers, else up to 3 decimals."""
    x = float(x)
    if x.is_integer() or abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:,.3f}".rstrip("0").rstrip(".")


def parse_budget(text: str, index: ShardIndex) -> float:
    """``--budget``: a number in the dataset's unit, or a duration like ``60s`` for audio (the loader's parser)."""
    try:
        return parse_any_budget(text, index.unit, index.sample_rate)
    except BudgetError as e:
        raise BudgetError(f"--{e}") from None


def inspect_dataset(
    index: ShardIndex,
    dataset: str,
    budget_text: str | None = None,
    num_buckets: int | None = None,
    plot: str | None = None,
    as_json: bool = False,
    where: str | None = None,
) -> int:
    """``shardify inspect``: print the summary (or JSON), optionally save a histogram; returns the exit code.
    The lengths are streamed shard by shard (bounded memory at any dataset size). ``where``: summarise only
    the samples this filter keeps (:mod:`~streambatch.dataset.where`), and what fraction that is."""
    lengths = index.length_stats(progress=not as_json) if where is None else _kept(index, where)
    summary = _summary(index, dataset, lengths)
    if where is not None:
        total = sum(ix.num_samples for _, ix in datasets_of(index))
        summary["where"] = {
            "expression": where,
            "kept": lengths.count,
            "of": total,
            "fraction": lengths.count / total if total else 0.0,
        }
    budget = boundaries = None
    if lengths.count:
        budget, boundaries = _suggestions(index, lengths, budget_text, num_buckets, summary)
    if plot:
        summary["plot"] = _plot(lengths, index, boundaries, plot)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary, index, budget, boundaries)
    return 0


def _kept(index: ShardIndex, where: str) -> LengthStats:
    from .dataset.where import kept_stats

    try:
        return kept_stats(index, where)
    except (ValueError, ImportError) as e:
        raise ShardifyError(str(e)) from None


def _summary(index: ShardIndex, dataset: str, lengths: LengthStats) -> dict[str, Any]:
    """Counts, totals and percentiles, with the seconds view for audio."""
    shards = sum(ix.num_shards for _, ix in datasets_of(index))
    stats = lengths.summary(index.unit, index.seconds_per_unit(), num_shards=shards)
    spu = index.seconds_per_unit()
    summary: dict[str, Any] = {"dataset": dataset, "sample_rate": index.sample_rate, **stats}
    if hasattr(index, "draws"):  # a mixture: its datasets and what each epoch takes of them
        from .dataset.mixture import mixture_table

        summary["datasets"] = mixture_table(index)
    if spu and lengths.count:
        summary["seconds"] = {
            "min": lengths.min * spu,
            "mean": lengths.mean * spu,
            "max": lengths.max * spu,
            "percentiles": {p: v * spu for p, v in stats["percentiles"].items()},
        }
    return summary


def _suggestions(
    index: ShardIndex, lengths: LengthStats, budget_text: str | None, num_buckets: int | None, summary: dict[str, Any]
) -> tuple[float, list[float]]:
    """The given or a suggested budget, and bucket boundaries under it (also recorded in ``summary``)."""
    if budget_text:
        budget = parse_budget(budget_text, index)
        summary["budget_source"] = "given"
    else:
        budget = float(suggest_budget(lengths, index.unit, index.sample_rate))
        summary["budget_source"] = "suggested"
    boundaries = [float(b) for b in np.asarray(estimate_boundaries(lengths, budget, num_buckets)).ravel()]
    summary["budget"] = _plain(budget)
    summary["bucket_boundaries"] = [_plain(b) for b in boundaries]
    return budget, boundaries


def _plain(x: float) -> float | int:
    x = float(x)
    return int(x) if x.is_integer() else x


def _print_summary(s: dict[str, Any], index: ShardIndex, budget: float | None, boundaries: list[float] | None) -> None:
    spu = index.seconds_per_unit()
    unit = index.unit + (f" @ {index.sample_rate} Hz" if index.unit == "samples" and index.sample_rate else "")

    def both(x: float) -> str:
        return f"{_fmt(x)} {index.unit}" + (f" ({float(x) * spu:.2f} s)" if spu and index.unit != "seconds" else "")

    rows = [
        ("dataset", s["dataset"]),
        ("unit", unit),
        ("shards", f"{s['num_shards']:,}"),
        ("samples", f"{s['num_samples']:,}"),
    ]
    if s["num_samples"]:
        total = f"{_fmt(s['total_length'])} {index.unit}"
        if "total_hours" in s:
            total = f"{_hours(s['total_hours'])} ({total})"
        rows += [("total", total), ("min", both(s["min"])), ("mean", both(s["mean"])), ("max", both(s["max"]))]
    if "where" in s:
        w = s["where"]
        rows.append(("where", f"{w['expression']}: keeps {w['kept']:,} of {w['of']:,} samples ({w['fraction']:.1%})"))
    skipped = index.meta.get("skipped")
    if skipped:
        rows.append(("skipped", f"{skipped} bad inputs when written (errors.jsonl)"))
    for k, v in rows:
        print(f"{k:<10} {v}")
    for name, d in s.get("datasets", {}).items():
        hours = f", {_hours(d['hours_per_epoch'])}" if "hours_per_epoch" in d else ""
        print(f"  {name}: {d['samples']:,} samples, weight {d['weight']:g}: {d['per_epoch']:,} per epoch{hours}")
    if s["num_samples"]:
        within = s.get("percentiles_within")
        print("length percentiles" + (f" (each within {within:.1%}, from a streamed histogram):" if within else ":"))
        for p, v in s["percentiles"].items():
            print(f"  p{p:<3} {both(v)}")
    if budget is not None:
        print(f"budget     {both(budget)} [{s['budget_source']}]")
    if boundaries:
        n = len(boundaries)
        print(f"buckets    {n + 1} ({n} boundar{'y' if n == 1 else 'ies'}): " + ", ".join(both(b) for b in boundaries))
    elif boundaries is not None:
        print(
            f"buckets    1 (no boundaries: {s['num_samples']:,} samples are too few to split into buckets "
            "that each fill whole batches; --num-buckets K asks for K)"
        )
    if s.get("plot"):
        print(f"plot       {s['plot']}")


#: the most bucket boundaries a histogram draws (more would hide the histogram)
MAX_PLOTTED_BOUNDARIES = 12


def plotted_boundaries(boundaries: list[float], most: int = MAX_PLOTTED_BOUNDARIES) -> list[float]:
    """The boundaries a plot draws: all of them up to ``most``, else ``most`` spread evenly (first and last kept)."""
    if len(boundaries) <= most:
        return list(boundaries)
    picks = np.unique(np.round(np.linspace(0, len(boundaries) - 1, most)).astype(int))
    return [boundaries[i] for i in picks]


def _plot(lengths: LengthStats, index: ShardIndex, boundaries: list[float] | None, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardifyError("--plot needs matplotlib: pip install 'streambatch[plot]'") from None
    spu = index.seconds_per_unit()
    scale, label = (spu, "seconds") if spu else (1.0, index.unit)
    fig, ax = plt.subplots(figsize=(8, 4))
    counts, edges = lengths.histogram(min(100, max(10, int(lengths.count**0.5))), scale)
    ax.stairs(counts, edges, fill=True, color="#4477aa")
    drawn = plotted_boundaries(boundaries or [])
    for b in drawn:
        ax.axvline(b * scale, color="#cc6677", linewidth=0.8)
    ax.set_xlabel(f"length ({label})")
    ax.set_ylabel("samples")
    some = f"{len(drawn)} of {len(boundaries)}" if boundaries and len(drawn) < len(boundaries) else ""
    ax.set_title(
        f"{index.num_samples:,} samples in {index.num_shards:,} shards"
        + (f" (lines: {some or 'the'} bucket boundaries)" if boundaries else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
