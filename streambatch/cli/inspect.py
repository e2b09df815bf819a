"""``shardify inspect``: a dataset's counts, hours or tokens, length percentiles, a suggested budget and bucket
boundaries; with ``--plan``, what a planned epoch looks like before a job runs (steps per rank, batch sizes,
padding, budget use); with ``--step K``, the samples of step K on every rank. A table, JSON, or a plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BudgetError, ShardifyError
from ..format.describe import hours_text, number_text
from ..format.index import ShardIndex
from ..plan.balance import STEP_TIMES, rank_step_times, step_balance
from ..plan.buckets import MAX_BUCKETS, estimate_boundaries, suggest_budget
from ..plan.config import MAX_SEED
from ..plan.config import parse_budget as parse_any_budget
from ..plan.epoch import make_epoch_plan
from ..plan.freshness import epoch_batches, pairs_kept
from ..plan.layout import EVEN_BATCHES, Layout
from ..plan.lengths import index_lengths
from ..select.mixture import AnyIndex, MixedIndex, datasets_of, mixture_table, open_index, selection_of
from ..stats import LengthStats
from .args import (
    SHARED,
    add_shared,
    add_storage,
    at_most,
    non_negative,
    not_empty,
    opened,
    plot_path,
    plot_suffix,
    positive_int,
    saved_whole,
    shard_roots,
    storage_options,
)

#: the last epoch the loader plans (`streambatch.loader.state.MAX_EPOCH`, which imports torch: the command line
#: starts without it)
MAX_EPOCH = 2**31 - 1
#: what ``inspect`` reports on: one dataset's index, or a mixture's datasets as one
Dataset = ShardIndex | MixedIndex

HELP = "counts, hours/tokens, length percentiles, a suggested budget and bucket boundaries"
DESCRIPTION = (
    "Summarise a dataset from its index.json: sample and shard counts, total hours (audio) or "
    "tokens, length percentiles (in the dataset's unit and, for audio, seconds), a suggested batch "
    "budget and bucket boundaries."
)
#: ``shardify inspect OUT``: a dataset (as every command names one) or a mixture file
OUT_HELP = SHARED["out"][1]["help"] + ", or a mixture file (.yaml/.json naming datasets and weights)"


def add_arguments(i: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify inspect`` (read back by `run()`)."""
    add_shared(i, "out", OUT_HELP)
    i.add_argument(
        "--budget",
        type=not_empty,
        metavar="B",
        help="batch budget (max padded length per batch) in the dataset's unit, or seconds with "
        "an 's' suffix for audio (e.g. 60s); default: suggested from the lengths",
    )
    i.add_argument(
        "--num-buckets",
        type=at_most(MAX_BUCKETS, "the boundaries snap to where a batch's capacity changes"),
        metavar="K",
        help="number of buckets for the boundaries (default: chosen from the lengths)",
    )
    i.add_argument(
        "--where",
        metavar="EXPR",
        help="summarise only the samples this SQL expression over the sample table's columns keeps, "
        "e.g. \"language = 'de' AND snr > 10\" (needs duckdb: pip install 'streambatch[filters]')",
    )
    i.add_argument(
        "--plot",
        type=plot_path,
        metavar="FILE.png",
        help="save a length histogram (needs matplotlib); the suffix picks the format (.png, .svg, .pdf, ...), PNG "
        "without one",
    )
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.add_argument(
        "--plan",
        action="store_true",
        help="plan --epoch (default 0) with --budget and --seed on --world-size ranks x --num-workers workers "
        "(--even-batches) and show its steps "
        "per rank, batch-size histogram, padding and budget use, and how many batch-mate pairs meet again in the "
        "next epoch (--plot draws them)",
    )
    i.add_argument("--world-size", type=positive_int, default=1, metavar="W", help="ranks for --plan (default 1)")
    i.add_argument(
        "--num-workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="DataLoader workers per rank for --plan (default 1)",
    )
    i.add_argument(
        "--step",
        type=non_negative,
        metavar="K",
        help="print the samples of step K of --epoch on each rank (one line per rank), as the loader with --budget, "
        "--seed, --world-size, --num-workers, --even-batches, --num-buckets and --where plans it (no shard is read)",
    )
    i.add_argument(
        "--epoch",
        type=at_most(MAX_EPOCH, "the loader's last epoch", non_negative),
        default=0,
        metavar="E",
        help="epoch for --step and --plan (default 0)",
    )
    i.add_argument(
        "--seed",
        type=at_most(MAX_SEED, "the loader's seeds", non_negative),
        default=0,
        metavar="S",
        help="the loader's seed for --step and --plan (default 0)",
    )
    i.add_argument(
        "--even-batches",
        choices=EVEN_BATCHES,
        default="split",
        help="how the ranks get equal steps, for --step and --plan (the loader's even_batches; default split)",
    )
    add_shared(i, "shard_root")
    add_storage(i)


def run(args: argparse.Namespace) -> int:
    """The dataset's (or mixture's) summary, or with ``--plan`` its planned epoch 0, or with ``--step`` a step."""
    index = opened(open_index, args)
    _check_tables(index)
    if args.step is not None:
        return inspect_step(args)
    if args.plan:
        return _inspect_plan(index, args)
    return inspect_dataset(index, args.out, args.budget, args.num_buckets, args.plot, args.json, args.where)


def _check_tables(index: Dataset) -> None:
    """Every table of every dataset read in full first, as the loader reads it: a damaged index is an error
    naming the table (exit 2), never a summary that looks fine (`index_check`)."""
    from ..errors import IndexFormatError
    from ..format.index_check import check_tables

    for _, ix in datasets_of(index):
        try:
            check_tables(ix)
        except IndexFormatError as e:
            raise ShardifyError(f"{e}; the loader refuses this index (`shardify verify` lists every problem)") from None


def _inspect_plan(index: Dataset, args: argparse.Namespace) -> int:
    if not args.budget:
        raise ShardifyError("--plan needs --budget (`shardify inspect DS` suggests one)")
    if args.where is not None:
        raise ShardifyError("--where filters the summary and --step; --plan plans every sample: drop one of them")
    options = {"num_buckets": args.num_buckets, "seed": args.seed} if args.num_buckets else {"seed": args.seed}
    budget = parse_budget(args.budget, index, args.out)
    layout = Layout(args.world_size, args.num_workers, args.even_batches)
    p = planned_epoch(index, budget, layout.world_size, layout.num_workers, args.epoch, layout.even_batches, **options)
    if args.plot:
        p["plot"] = plot_planned(p, args.plot)
    print_planned(p, args.json)
    return 0


# ---- the dataset's summary ---------------------------------------------------------------------
def parse_budget(text: str, index: Dataset, name: str) -> float:
    """``--budget``: a number in the dataset's unit, or a duration like ``60s`` for audio (the loader's parser),
    refused as the loader refuses it where not even the dataset's shortest sample fits it alone (``name``: the
    dataset, as the message names it)."""
    try:
        budget = parse_any_budget(text, index.unit, index.sample_rate)
    except BudgetError as e:
        raise BudgetError(f"--{e}") from None
    from ..loader.messages import check_shortest_fits  # the loader's own rule (without torch)
    from ..plan.config import BatchingConfig

    check_shortest_fits(BatchingConfig.make(budget), index, None, name)
    return budget


def inspect_dataset(
    index: Dataset,
    dataset: str,
    budget_text: str | None = None,
    num_buckets: int | None = None,
    plot: str | None = None,
    as_json: bool = False,
    where: str | None = None,
) -> int:
    """``shardify inspect``: print the summary (or JSON), optionally save a histogram; returns the exit code.
    The lengths are streamed shard by shard (bounded memory at any dataset size). ``where``: summarise only
    the samples this filter keeps (`where`), and what fraction that is."""
    given = parse_budget(budget_text, index, dataset) if budget_text else None  # refused before any length is read
    bar = not as_json and sys.stderr.isatty()  # a bar redraws itself with \r: on a terminal only, never in a log
    lengths = index.length_stats(progress=bar) if where is None else _kept(index, where)
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
        budget, boundaries = _suggestions(index, lengths, given, num_buckets, summary)
    if plot:
        summary["plot"] = _plot(lengths, index, boundaries, plot)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary, index, budget, boundaries)
    return 0


def _kept(index: Dataset, where: str) -> LengthStats:
    from ..select.where import kept_stats

    try:
        return kept_stats(index, where)
    except (ValueError, ImportError) as e:
        raise ShardifyError(str(e)) from None


def _summary(index: Dataset, dataset: str, lengths: LengthStats) -> dict[str, Any]:
    """Counts, totals and percentiles, with the seconds view for audio."""
    shards = sum(ix.num_shards for _, ix in datasets_of(index))
    stats = lengths.summary(index.unit, index.seconds_per_unit(), num_shards=shards)
    spu = index.seconds_per_unit()
    summary: dict[str, Any] = {"dataset": dataset, "sample_rate": index.sample_rate, **stats}
    if isinstance(index, MixedIndex):  # a mixture: its datasets and what each epoch takes of them
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
    index: Dataset, lengths: LengthStats, given: float | None, num_buckets: int | None, summary: dict[str, Any]
) -> tuple[float, list[float]]:
    """The given or a suggested budget, and bucket boundaries under it (also recorded in ``summary``)."""
    if given is not None:
        budget = given
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


def _print_summary(s: dict[str, Any], index: Dataset, budget: float | None, boundaries: list[float] | None) -> None:
    spu = index.seconds_per_unit()
    unit = index.unit + (f" @ {index.sample_rate} Hz" if index.unit == "samples" and index.sample_rate else "")

    def both(x: float) -> str:
        return f"{number_text(x)} {index.unit}" + (
            f" ({float(x) * spu:.2f} s)" if spu and index.unit != "seconds" else ""
        )

    rows = [
        ("dataset", s["dataset"]),
        ("unit", unit),
        ("shards", f"{s['num_shards']:,}"),
        ("samples", f"{s['num_samples']:,}"),
    ]
    if s["num_samples"]:
        total = f"{number_text(s['total_length'])} {index.unit}"
        if "total_hours" in s:
            total = f"{hours_text(s['total_hours'])} ({total})"
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
        hours = f", {hours_text(d['hours_per_epoch'])}" if "hours_per_epoch" in d else ""
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


def _plot(lengths: LengthStats, index: Dataset, boundaries: list[float] | None, path: str) -> str:
    """The length histogram (in seconds for audio) with the bucket boundaries as lines."""
    spu = index.seconds_per_unit()
    scale, label = (spu, "seconds") if spu else (1.0, index.unit)
    drawn = plotted_boundaries(boundaries or [])
    some = f"{len(drawn)} of {len(boundaries)}" if boundaries and len(drawn) < len(boundaries) else ""

    def draw(fig: Any, axes: list[Any]) -> None:
        (ax,) = axes
        counts, edges = lengths.histogram(min(100, max(10, int(lengths.count**0.5))), scale)
        ax.stairs(counts, edges, fill=True, color="#4477aa")
        for b in drawn:
            ax.axvline(b * scale, color="#cc6677", linewidth=0.8)
        ax.set_xlabel(f"length ({label})")
        ax.set_ylabel("samples")
        ax.set_title(
            f"{index.num_samples:,} samples in {index.num_shards:,} shards"
            + (f" (lines: {some or 'the'} bucket boundaries)" if boundaries else "")
        )

    return save_plot(path, (8, 4), 1, draw)


def save_plot(path: str, size: tuple[float, float], panels: int, draw: Callable[[Any, list[Any]], None]) -> str:
    """The one plotting function of ``inspect --plot``: ``draw(figure, axes)`` fills ``panels`` side-by-side
    axes of a figure of ``size`` inches, saved as a PNG at ``path`` (returned)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardifyError("--plot needs matplotlib: pip install 'streambatch[plot]'") from None
    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    try:
        draw(fig, list(axes[0]))
        fig.tight_layout()
        # the format the suffix names (plot_path checked it); PNG for a bare name, which matplotlib would save as
        # NAME.png: the file goes at the very name given, whole (a temporary name, then a rename)
        saved_whole(path, lambda f: fig.savefig(f, dpi=100, format=plot_suffix(path) or "png"), "the plot")
    finally:
        plt.close(fig)
    return path


# ---- a planned epoch (--plan) ------------------------------------------------------------------
def planned_epoch(
    index: AnyIndex,
    budget: float,
    world_size: int,
    num_workers: int,
    epoch: int = 0,
    even_batches: str = "split",
    **options: Any,
) -> dict[str, Any]:
    """The epoch's plan summarised: steps (every rank's), batches and samples per rank, batch-size histogram,
    padding % and mean budget use over the batches (from the index lengths), and freshness: the share of the
    epoch's batch-mate pairs that are batch-mates again in the next epoch (`freshness`)."""
    lengths = index_lengths(index)
    # the loader's option building pulls in torch (its workers' collate options): only `--plan` needs it
    from ..loader.metrics import batch_figures, planned_batches
    from ..loader.options import batching_config

    config = batching_config(budget, index, dict(options))  # the loader's own: the same window, buckets, cost
    if not isinstance(config.seed, int):
        raise ShardifyError(f"a planned epoch takes one whole-number seed, not {config.seed!r}")
    layout = Layout(world_size, num_workers, even_batches)
    plan = make_epoch_plan(lengths, config, epoch, layout, excluded=selection_of(index, epoch, config.seed))
    after = make_epoch_plan(lengths, config, epoch + 1, layout, excluded=selection_of(index, epoch + 1, config.seed))
    kept = pairs_kept(epoch_batches(plan), epoch_batches(after), lengths.num_samples)
    timed = config.balance.time if config.balance is not None else STEP_TIMES["attention"]  # step balance, timed so
    even = step_balance(rank_step_times(plan, lengths, timed))
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
        "pairs_kept_pct": 100 * kept,  # of this epoch's batch-mate pairs, batch-mates again in the next
        "step_balance": {**even, "balanced": config.balance is not None, "time": timed.to_dict()},
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
    """The planned epoch as a table (or JSON)."""
    if as_json:
        print(json.dumps(p, indent=2))
        return

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}%"

    print(
        f"plan       {p['world_size']} ranks x {p['num_workers']} workers, budget {p['budget']:g}: "
        f"{p['steps']:,} steps per rank, {p['batches']:,} batches"
    )
    print(f"padding    {pct(p['padding_pct'])}; budget used {pct(p['budget_utilisation_pct'])} per batch on average")
    print(f"freshness  {p['pairs_kept_pct']:.1f}% of the batch-mate pairs meet again in the next epoch")
    b = p["step_balance"]
    print(
        f"balance    slowest rank's step {b['max_mean']:.3f}x the mean rank's, "
        f"{100 * b['idle']:.1f}% of rank-time idle "
        f"({'balanced' if b['balanced'] else 'random'} order; step time {_terms(b['time'])})"
    )
    print(
        f"samples    per rank {min(p['samples_per_rank']):,} to {max(p['samples_per_rank']):,}; "
        f"{p['left_out']:,} left out to equalise steps, {p['skipped']:,} skipped"
    )
    h = p["batch_sizes"]
    print(f"batch size {h['min']} to {h['max']} (mean {h['mean']:.1f}):")
    top = max(h["counts"], default=1) or 1
    for c, lo, hi in zip(h["counts"], h["edges"], h["edges"][1:]):
        print(f"  {lo:7.1f}-{hi:<7.1f} {'#' * int(round(40 * c / top)):<40} {c:,}")


def _terms(coefficients: dict[str, float]) -> str:
    """A step-time model's non-zero terms, e.g. ``1·n·max²``."""
    names = {"a": "", "b": "·n", "c": "·ΣL", "d": "·ΣL²", "e": "·n·max", "f": "·n·max²"}
    return " + ".join(f"{v:.3g}{names[k]}" for k, v in coefficients.items() if k in names and v) or "0"


def plot_planned(p: dict[str, Any], path: str) -> str:
    """Batch sizes and samples per rank of a planned epoch as a PNG."""

    def draw(fig: Any, axes: list[Any]) -> None:
        a, b = axes
        h = p["batch_sizes"]
        a.stairs(h["counts"], h["edges"], fill=True, color="#4477aa")
        a.set_xlabel("samples per batch")
        a.set_ylabel("batches")
        b.bar(range(len(p["samples_per_rank"])), p["samples_per_rank"], color="#228833")
        b.set_xlabel("rank")
        b.set_ylabel("samples")
        fig.suptitle(f"{p['steps']:,} steps per rank, padding {p['padding_pct'] or 0:.1f}%")

    return save_plot(path, (10, 4), 2, draw)


# ---- one step's samples (--step) ---------------------------------------------------------------------------
def inspect_step(args: argparse.Namespace) -> int:
    """``--step K``: the samples of step K of ``--epoch`` on each rank, as the loader with these options plans it
    (`step_samples()`; no shard is read)."""
    if not args.budget:
        raise ShardifyError("--step needs --budget (`shardify inspect DS` suggests one)")
    from ..loader.core import StreamBatchLoader  # pulls in torch: only --step needs it

    loader = StreamBatchLoader(
        args.out,
        budget=args.budget,
        where=args.where,
        storage_options=storage_options(args),
        shard_roots=shard_roots(args),
        num_buckets=args.num_buckets,
        seed=args.seed,
        rank=0,
        world_size=args.world_size,
        num_workers=args.num_workers,
        even_batches=args.even_batches,
    )
    got = loader.step_samples(args.step, epoch=args.epoch)
    if args.json:
        ranks = {r: [dataclasses.asdict(s) for s in b.samples] for r, b in got.batches.items()}
        print(json.dumps({"epoch": got.epoch, "step": got.step, "ranks": ranks}, indent=2))
        return 0
    layout = f"{args.world_size} ranks x {args.num_workers} workers, seed {args.seed}"
    print(f"step {got.step} of epoch {got.epoch} ({layout}):")
    for line in got.lines():
        print(line)
    return 0
