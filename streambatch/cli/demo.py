"""``shardify demo``: a small synthetic speech dataset written and streamed (`streambatch.demo`)."""

from __future__ import annotations

import argparse

from ..plan.config import MAX_SEED
from .args import at_most, non_negative

HELP = "write a small synthetic dataset and show streambatch on it"
DESCRIPTION = "Write a small synthetic speech dataset to OUT and run streambatch on it."
#: the most utterances the demo writes (a demo: shardify write takes a corpus of any size)
MAX_UTTERANCES = 100_000


def add_arguments(d: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify demo`` (read back by `run()`)."""
    d.add_argument(
        "out",
        metavar="OUT",
        help="a new or empty folder for the demo dataset (marked as the demo's; a folder an earlier demo made is "
        "reused); a folder of your own is refused",
    )
    d.add_argument(
        "--num-utterances",
        type=at_most(MAX_UTTERANCES, "a demo; shardify write takes a real corpus of any size"),
        default=2400,
        metavar="N",
        help=f"synthetic utterances (default 2400, at most {MAX_UTTERANCES:,})",
    )
    d.add_argument(
        "--seed",
        type=at_most(MAX_SEED, "the loader's seeds", non_negative),
        default=0,
        help=f"random seed (default 0, at most {MAX_SEED:,})",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo (its exit code)."""
    from ..demo import run_demo

    return int(run_demo(args.out, num_utterances=args.num_utterances, seed=args.seed))
