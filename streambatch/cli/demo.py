"""``shardify demo``: a small synthetic speech dataset written and streamed (:mod:`streambatch.demo`)."""

from __future__ import annotations

import argparse
from typing import Any

from .args import command, positive_int


def add(sub: Any) -> None:
    """Register ``shardify demo`` on the subcommand parsers ``sub``."""
    d = command(
        sub,
        "demo",
        run,
        "write a small synthetic dataset and show streambatch on it",
        "Write a small synthetic speech dataset to OUT and run streambatch on it.",
    )
    d.add_argument("out", metavar="OUT", help="folder for the demo dataset")
    d.add_argument(
        "--num-utterances", type=positive_int, default=2400, metavar="N", help="synthetic utterances (default 2400)"
    )
    d.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> int:
    """Run the demo (its exit code)."""
    from ..demo import run_demo

    return int(run_demo(args.out, num_utterances=args.num_utterances, seed=args.seed))
