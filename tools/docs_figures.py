#!/usr/bin/env python
"""Draw the manual's two pictures into docs/img/ (needs matplotlib: the ``plot`` extra).

- ``padding.png``: the same 600 LibriSpeech-like utterances batched three ways under one budget of 200 s of
  audio: fixed-size batches in random order, fixed-size batches of a global sort, and streambatch's planned
  batches. Each batch is a column as wide as its padded length; the real audio is dark, the padding light.
- ``dataflow.png``: the data flow of the package, from a source folder to padded batches (the architecture guide).

Run it after a change to either: ``python tools/docs_figures.py`` (seeded: the same pictures every run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from streambatch import plan_batches  # noqa: E402
from streambatch.synthetic import SAMPLE_RATE, librispeech_like  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"
BUDGET_S = 200.0


def fixed_batches(order: np.ndarray, size: int) -> list[np.ndarray]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def draw_padding(path: Path, n: int = 600, seed: int = 0) -> None:
    lengths = librispeech_like(n, seed) / SAMPLE_RATE  # seconds
    budget = BUDGET_S
    planned = [np.asarray(b) for b in plan_batches(lengths, budget, buffer_size=n, seed=seed)]
    size = max(1, round(n / len(planned)))  # as many fixed batches as planned ones
    rng = np.random.default_rng(seed)
    ways = {
        "fixed size, random order": fixed_batches(rng.permutation(n), size),
        "fixed size, globally sorted": fixed_batches(np.argsort(lengths), size),
        "streambatch (planned, budget-bounded)": planned,
    }
    fig, axes = plt.subplots(3, 1, figsize=(10, 6.5), sharex=True)
    for ax, (title, batches) in zip(axes, ways.items()):
        real = sum(float(lengths[b].sum()) for b in batches)
        padded = sum(len(b) * float(lengths[b].max()) for b in batches)
        over = sum(len(b) * float(lengths[b].max()) > budget for b in batches)
        x = 0
        for b in batches:
            longest = float(lengths[b].max())
            for j, i in enumerate(sorted(b, key=lambda i: -lengths[i])):
                ax.add_patch(plt.Rectangle((x + j, 0), 1, longest, color="#dfe7f2", lw=0))
                ax.add_patch(plt.Rectangle((x + j, 0), 1, lengths[i], color="#2f5d8a", lw=0))
            x += len(b) + 2
        ax.set_xlim(0, x)
        ax.set_ylim(0, float(lengths.max()) * 1.05)
        ax.set_ylabel("seconds")
        ax.set_title(
            f"{title}: padding {100 * (1 - real / padded):.0f} %, batches over the budget: {over}", fontsize=10
        )
        ax.set_xticks([])
    axes[-1].set_xlabel(
        f"{n} utterances in batches (a column per utterance, a gap between batches); budget {budget:.0f} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FLOW = [
    ("sources", "an audio folder; NeMo, SpeechBrain, lhotse or Kaldi manifests; text; HF datasets"),
    ("shardify write", "every length probed from headers; tar shards and the index written (write/)"),
    ("index + shards", "header, shard table, sample table beside length-annotated tars (format/)"),
    ("plan, on every rank", "shard order, (rank, worker) slots, budget-bounded batches, equal steps (plan/)"),
    ("stream, in the workers", "byte ranges (io/), tar members, samples held raw until their batch (read/)"),
    ("padded batches", "decoded, transformed, padded; len() and state_dict() (loader/)"),
]


def draw_flow(path: Path) -> None:
    import textwrap

    fig, ax = plt.subplots(figsize=(10, 4.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    spots = [(0.2, 2.5), (3.55, 2.5), (6.9, 2.5), (6.9, 0.2), (3.55, 0.2), (0.2, 0.2)]  # a U: left to right, back
    w, h = 2.9, 1.9
    for k, ((name, what), (x, y)) in enumerate(zip(FLOW, spots)):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04", fc="#eef3f9", ec="#2f5d8a"))
        ax.text(x + w / 2, y + h - 0.32, name, ha="center", va="center", fontsize=11, weight="bold")
        ax.text(x + w / 2, y + h / 2 - 0.2, textwrap.fill(what, 34), ha="center", va="center", fontsize=8.5)
        if k:
            px, py = spots[k - 1]
            if py == y:  # beside: from the side of the one before
                start = (px + w, py + h / 2) if px < x else (px, py + h / 2)
                end = (x, y + h / 2) if px < x else (x + w, y + h / 2)
            else:  # below
                start, end = (px + w / 2, py), (x + w / 2, y + h)
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, color="#2f5d8a"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the pictures (default: docs/img)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    draw_padding(args.out / "padding.png")
    draw_flow(args.out / "dataflow.png")
    print(f"wrote {args.out / 'padding.png'} and {args.out / 'dataflow.png'}")


if __name__ == "__main__":
    main()
