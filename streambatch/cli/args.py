"""What several ``shardify`` subcommands share: argument types, the options declared once (`SHARED`,
each command passing its own help), ``--storage-option``, opening the dataset."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, TypeVar

from ..errors import ShardifyError, StreamBatchError, os_problem
from ..format.index import IndexFormatError, ShardIndex
from ..io.tempname import temporary_name
from ..units import Unit

PROG = "shardify"
#: the highest ``--sample-rate`` (libsndfile keeps a rate in a C int)
MAX_SAMPLE_RATE = 2**31 - 1

T = TypeVar("T")


def positive_int(s: str) -> int:
    """A whole number of at least 1 (an argparse type)."""
    return _whole_number(s, "must be positive")


def at_least_one(s: str) -> int:
    """`positive_int()` worded as ``shardify calibrate`` words it."""
    return _whole_number(s, "must be at least 1")


def non_negative(s: str) -> int:
    """A whole number of at least 0 (an argparse type: a seed, a step)."""
    return _whole_number(s, "must be 0 or more", minimum=0)


def at_most(maximum: int, why: str, least: Callable[[str], int] = positive_int) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 (``least=non_negative``: 0) to ``maximum`` (``why``: the reason for
    the bound, for the message)."""

    def parse(s: str) -> int:
        n = least(s)
        if n > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,} ({why}): {s!r}")
        return n

    parse.__name__ = "whole number"  # argparse names the type by it in its messages
    return parse


def _whole_number(s: str, problem: str, minimum: int = 1) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {s!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"{problem}: {s!r}")
    return n


def not_empty(s: str) -> str:
    """Text that is not empty (an argparse type): an empty value is a usage error, not the option left out."""
    if not s:
        raise argparse.ArgumentTypeError("must not be empty: give a value, or leave the option out")
    return s


#: the suffixes ``--plot`` takes: the formats matplotlib's default backend writes
PLOT_FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "pgf", "raw", "rgba")


def plot_path(s: str) -> str:
    """A file to save a plot as (an argparse type): not a folder, a suffix naming a format matplotlib writes (or
    none: PNG), written at the very name given."""
    not_empty(s)
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s} is a folder; name the file, e.g. {os.path.join(s, 'lengths.png')}")
    suffix = plot_suffix(s)
    if suffix and suffix not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{s}: a plot is written as {', '.join(PLOT_FORMATS)}, not .{suffix}")
    return s


def plot_suffix(path: str) -> str:
    """The suffix of ``path``'s file name, lower case, without its dot ("" for none): the plot's format."""
    name = os.path.basename(path)
    return name.rpartition(".")[2].lower() if "." in name else ""


def saved_whole(path: str, write: Callable[[IO[bytes]], None], what: str) -> None:
    """Write the local file ``path`` whole or not at all (``inspect --plot``): ``write(f)`` into a temporary name
    beside it, synced, then renamed over it. On any error or interrupt the temporary file is removed and a file
    already at ``path`` is as it was; an OS error (no space, a folder that is missing or not writable) is one line
    naming ``path``."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        kept = "; the file already there is kept" if os.path.exists(path) else ""
        raise ShardifyError(f"{path}: {os_problem(e)} while writing {what}{kept}") from None


def size(s: str) -> int:
    """Bytes from ``123456``, ``500M``, ``2G`` (an argparse type; `parse_size()`)."""
    from ..write.writer import parse_size

    return _argument(parse_size, s)


def part(s: str) -> tuple[int, int]:
    """``I/N`` of ``--part`` (an argparse type; `parse_part()`)."""
    from ..write.parts import parse_part

    parsed = _argument(parse_part, s)
    assert parsed is not None  # a string is never None
    return parsed


def _argument(parse: Callable[[str], T], s: str) -> T:
    """``parse(s)``, its error (one of the package's: `StreamBatchError`) turned into
    argparse's usage error (exit 2, one line)."""
    try:
        return parse(s)
    except StreamBatchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def os_error_text(e: OSError) -> str:
    """``PATH: problem`` for an OS error (both paths for a rename), without the exception's class."""
    if e.filename is None:
        return str(e)
    names = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{names}: {os_problem(e)}"


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


#: the options several subcommands declare, each once: name -> (flag, ``add_argument`` keywords). A command
#: adds one with `add_shared()`, giving its own help (where the keywords hold none) and any keyword it changes
SHARED: dict[str, tuple[str, dict[str, Any]]] = {
    "out": ("out", {"metavar": "OUT", "help": "dataset folder or URL (or its index.json)"}),
    "unit": ("--unit", {"choices": (Unit.SAMPLES.value, Unit.SECONDS.value, Unit.TOKENS.value)}),
    "sample_rate": (
        "--sample-rate",
        {"type": at_most(MAX_SAMPLE_RATE, "a C int, as libsndfile keeps it"), "metavar": "R"},
    ),
    "workers": ("--workers", {"type": positive_int, "default": 1, "metavar": "N"}),
    "on_error": ("--on-error", {"choices": ("fail", "skip"), "default": "fail"}),
    "overwrite": ("--overwrite", {"action": "store_true"}),
    "part": ("--part", {"metavar": "I/N", "type": part}),
    "output_length": ("--output-length", {"metavar": "chars|tokens:NAME_OR_PATH"}),
    "columns": ("--columns", {"metavar": "NAMES"}),
    "no_progress": ("--no-progress", {"action": "store_true", "help": "no progress bar"}),
    "shard_root": (
        "--shard-root",
        {
            "dest": "shard_root",
            "metavar": "ROOT",
            "action": "append",
            "help": "a folder or URL prefix the dataset's shard URLs (or a mixture file's datasets) may point into "
            "besides its own folder (repeatable); without it an index naming a file elsewhere is refused before "
            "it is opened (Python: shard_roots=[...])",
        },
    ),
    "storage_option": (
        "--storage-option",
        {
            "dest": "storage_option",
            "metavar": "KEY=VALUE",
            "type": storage_option,
            "action": "append",
            "help": "fsspec storage option for URLs (repeatable; dotted keys nest, values are JSON when they "
            "parse), e.g. --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000",
        },
    ),
}


def add_shared(p: argparse.ArgumentParser, name: str, help: str | None = None, **changes: Any) -> None:
    """Add the `SHARED` option ``name`` to ``p`` with this command's ``help`` (default: the shared one)
    and ``changes`` to its keywords (``default=4``, ``metavar=...``)."""
    flag, keywords = SHARED[name]
    keywords = {**keywords, **changes}
    if help is not None:
        keywords["help"] = help
    p.add_argument(flag, **keywords)


def add_storage(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """Add the repeatable ``--storage-option KEY=VALUE`` (read back by `storage_options()`), with this
    command's ``help`` (default: the shared one)."""
    add_shared(p, "storage_option", help)


def add_dest_storage(p: argparse.ArgumentParser, help: str) -> None:
    """Add the repeatable ``--dest-storage-option KEY=VALUE``, parsed as ``--storage-option`` is: the options of
    a command's second place (``stage``'s DEST), read back by `dest_storage_options()`."""
    _, keywords = SHARED["storage_option"]
    p.add_argument("--dest-storage-option", **{**keywords, "dest": "dest_storage_option", "help": help})


def dest_storage_options(args: argparse.Namespace) -> dict | None:
    """The fsspec storage options ``--dest-storage-option`` gave (``None`` for none)."""
    return storage_options_from(getattr(args, "dest_storage_option", None))


def shared_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The values of the `SHARED` options a command declared (but ``OUT``) as the library's keywords, which
    bear the options' names: ``unit=``, ``workers=``, ...; ``--no-progress`` as ``progress=``, ``--storage-option``
    as ``storage_options=``."""
    values = {name: getattr(args, name) for name in SHARED if name != "out" and hasattr(args, name)}
    if "no_progress" in values:
        values["progress"] = not values.pop("no_progress")
    if "storage_option" in values:
        values["storage_options"] = storage_options_from(values.pop("storage_option"))
    if "shard_root" in values:
        values["shard_roots"] = shard_roots(args)
        del values["shard_root"]
    return values


def storage_options(args: argparse.Namespace) -> dict | None:
    """The fsspec storage options a command was given (``None`` for none)."""
    return storage_options_from(args.storage_option)


def shard_roots(args: argparse.Namespace) -> tuple[str, ...]:
    """The roots ``--shard-root`` allowed (none for a command without the option)."""
    return tuple(getattr(args, "shard_root", None) or ())


def load_index(args: argparse.Namespace) -> ShardIndex:
    """The dataset ``args.out`` names (a folder, URL or index.json); a missing or bad index is a usage error."""
    return opened(ShardIndex.load, args)


def opened(open_index: Callable[[str, dict | None, Sequence[str]], T], args: argparse.Namespace) -> T:
    """``open_index(args.out, storage options, --shard-root roots)`` (an index, or a mixture's for ``inspect``),
    a missing or bad index being a usage error (exit 2, one line)."""
    try:
        return open_index(args.out, storage_options(args), shard_roots(args))
    except (FileNotFoundError, IndexFormatError) as e:
        raise ShardifyError(str(e)) from None


#: the engines ``--engine`` offers: ``local`` (this process and its ``--workers``) and ``ray`` (Ray tasks)
ENGINES = ("local", "ray")


def add_engine(p: argparse.ArgumentParser, steps: str) -> None:
    """Add ``--engine``, ``--ray-address`` and ``--tasks`` (read back by `engine()`); ``steps``: what the
    Ray tasks do, for the help."""
    g = p.add_argument_group("engine (where the work runs; the output is the same on every engine)")
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help=f"local (default): this process and its --workers; ray: {steps} in Ray tasks "
        "(pip install 'streambatch[ray]')",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="the Ray cluster to join (HOST:PORT, auto, ray://...; default RAY_ADDRESS, else a local one)",
    )
    g.add_argument("--tasks", type=positive_int, metavar="N", help="Ray tasks per step (default: the cluster's CPUs)")


@contextlib.contextmanager
def engine(args: argparse.Namespace) -> Iterator[Any]:
    """The engine ``--engine`` names (None for local), for the command's run; a Ray connection it opens is
    closed after it."""
    if args.engine != "ray":
        if args.ray_address or args.tasks:
            raise ShardifyError("--ray-address and --tasks are options of --engine ray")
        yield None
        return
    from ..write.ray_engine import RayEngine

    with RayEngine(args.ray_address, args.tasks) as ray_engine:
        yield ray_engine


def count(s: str) -> int:
    """A whole number of at least 1 from ``1000``, ``10k``, ``2.5M`` (an argparse type; `parse_count()`, the
    grammar of amounts)."""
    from ..units import parse_count

    return _argument(lambda text: parse_count(text, "count", minimum=1), s)
