"""What several ``shardify`` subcommands share: argument types, ``--storage-option``, opening the dataset."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ..dataset.index import IndexFormatError, ShardIndex
from ..errors import ShardifyError

PROG = "shardify"


def positive_int(s: str) -> int:
    """A whole number of at least 1 (an argparse type)."""
    return _whole_number(s, "must be positive")


def at_least_one(s: str) -> int:
    """:func:`positive_int` worded as ``shardify calibrate`` words it."""
    return _whole_number(s, "must be at least 1")


def _whole_number(s: str, problem: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {s!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{problem}: {s!r}")
    return n


def size(s: str) -> int:
    """Bytes from ``123456``, ``500M``, ``2G`` (an argparse type; :func:`~streambatch.write.writer.parse_size`)."""
    from ..write.writer import parse_size

    try:
        return parse_size(s)
    except ShardifyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def part(s: str) -> tuple[int, int]:
    """``I/N`` of ``--part`` (an argparse type; :func:`~streambatch.write.parts.parse_part`)."""
    from ..write.parts import parse_part

    try:
        parsed = parse_part(s)
    except ShardifyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert parsed is not None  # a string is never None
    return parsed


def storage_option(s: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--storage-option``: the value as JSON when it parses, else the string."""
    key, sep, value = s.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key, parsed


def storage_options_from(pairs: Sequence[tuple[str, Any]] | None) -> dict | None:
    """``[("client_kwargs.endpoint_url", "http://...")]`` → ``{"client_kwargs": {"endpoint_url": ...}}``."""
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for key, value in pairs:
        d = out
        *parents, last = key.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return out


def add_storage(p: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--storage-option KEY=VALUE`` (read back by :func:`storage_options`)."""
    p.add_argument(
        "--storage-option",
        dest="storage_option",
        metavar="KEY=VALUE",
        type=storage_option,
        action="append",
        help="fsspec storage option for URLs (repeatable; dotted keys nest, values are JSON when they parse), "
        "e.g. --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000",
    )


def storage_options(args: argparse.Namespace) -> dict | None:
    """The fsspec storage options a command was given (``None`` for none)."""
    return storage_options_from(args.storage_option)


def load_index(args: argparse.Namespace) -> ShardIndex:
    """The dataset ``args.out`` names (a folder, URL or index.json); a missing or bad index is a usage error."""
    try:
        return ShardIndex.load(args.out, storage_options(args))
    except (FileNotFoundError, IndexFormatError) as e:
        raise ShardifyError(str(e)) from None
