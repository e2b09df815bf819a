"""Every exception streambatch raises on purpose, under one root: `StreamBatchError`, in four kinds.

- `UsageError` (options): what the caller asked for — an option, a command-line argument, the user's own
  step function (`OptionError`, `BudgetError`, `EmptyEpochError`, `UnknownStorage`,
  `CalibrationError`, and `ShardifyError`, the ``shardify`` command's own);
- `DataError` (data): a dataset's files — an index, a shard, a sample, audio, a URL a data file names
  (`IndexFormatError`, `ShardReadError`, `SampleError`, `UntrustedURL`, ...);
- `StorageError` (storage, an ``OSError``): a place that could not be used — missing credentials, no
  dataset there, an endpoint that does not answer, no room to write (`MissingCredentials`,
  `DatasetNotFound`, `RetriesExhausted`, `OutputError`);
- `StateError` (state): a ``state_dict`` that is not one, or that another loader saved.

``except`` a kind to handle a whole kind (the ``shardify`` command exits 2 for each, `KINDS`). Each class also
keeps the builtin base users caught before the kinds existed (``ValueError``, ``OSError``, ``PermissionError``,
``RuntimeError``), so ``except ValueError`` still works.
``InputProblem`` is one bad input record, reported as ``FILE:LINE: problem`` (or ``FILE: problem``).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: how many problems an error message lists before saying "... and N more"
MAX_LISTED = 20


@dataclass(frozen=True)
class InputProblem:
    """One bad input: where it is (file and 1-based line, when known), its key if known, what is wrong."""

    source: str
    error: str
    line: int | None = None
    key: str | None = None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.line is not None else self.source

    def __str__(self) -> str:
        return f"{self.where}: {self.error}"

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "line": self.line, "key": self.key, "error": self.error}


class StreamBatchError(Exception):
    """The root of every exception streambatch raises on purpose: ``except StreamBatchError`` catches them all."""


class UsageError(StreamBatchError):
    """The options kind: what the caller asked for (an option, a command-line argument, the user's own code) cannot
    be done as asked; the message names the option or argument and the fix."""


class DataError(StreamBatchError):
    """The data kind: a dataset's files (an index, a shard, a sample, its audio, a manifest) are not what they must
    be; the message names the file, URL or sample."""


class StorageError(StreamBatchError, OSError):
    """The storage kind, and an ``OSError``: storage that could not be used — an object store that did not answer in
    time (after its retries) or has no such bucket, a local file where data is read that is not a regular file (a
    FIFO, a device), an input/output error of a disk while a file was written; the message names the file or URL."""


class StateError(StreamBatchError, ValueError):
    """The state kind: a ``state_dict`` that is not one, or that another loader saved (another dataset, seed,
    mixture, filter, or batching options mid-epoch): refused before anything is planned; the message says what
    differs."""


#: the kinds of error, one of which every error the package raises on purpose is (the ``shardify`` command reports
#: each in one line and exits with 2; anything else is unexpected: exit 1)
KINDS: tuple[type[StreamBatchError], ...] = (UsageError, DataError, StorageError, StateError)


class ShardifyError(UsageError):
    """A user error of the ``shardify`` command or the writer (bad arguments, bad input, refusing to overwrite):
    reported without a traceback. The loader's option errors are `OptionError`, not this."""


class InputErrors(ShardifyError):
    """The input has bad records and ``on_error="fail"``: nothing was written."""

    def __init__(self, problems: Sequence[InputProblem], hint: str = "nothing was written"):
        self.problems = list(problems)
        self.hint = hint
        super().__init__(format_problems(self.problems, hint))


def format_problems(problems: Sequence[InputProblem], hint: str = "") -> str:
    n = len(problems)
    lines = [f"{n} problem{'s' if n != 1 else ''} in the input{' (' + hint + ')' if hint else ''}:"]
    lines += [f"  {p}" for p in problems[:MAX_LISTED]]
    if n > MAX_LISTED:
        lines.append(f"  ... and {n - MAX_LISTED} more")
    return "\n".join(lines)


class EmptyEpochError(UsageError, ValueError):
    """An epoch that would yield no batch at all (every sample filtered out, dropped or too long)."""


class MissingCredentials(StorageError, PermissionError):
    """Object storage refused a URL for want of credentials; the message names the URL and where they come from."""


class UntrustedURL(DataError, ValueError):
    """A URL a data file names (a shard, a mixture's dataset) outside the dataset's root and every root the user
    allowed (``shard_roots`` / ``--shard-root``): refused before it is opened; the message names it and the option."""


class DatasetNotFound(StorageError, FileNotFoundError):
    """Nothing at a dataset's folder or URL, or no ``index.json`` in it: the message names the place and what a
    dataset is. Still a ``FileNotFoundError``, as it was before it had a name of its own."""


class UnknownStorage(UsageError, ValueError):
    """A URL whose scheme no installed fsspec back-end serves (``foo://``, or ``gs://`` without gcsfs); the message
    names the URL and what to install, if anything."""


class OutputError(StorageError):
    """An output file that could not be written for want of space (disk or quota full, a file size limit); the
    message names the file, and nothing was left under its name. An ``OSError`` (its ``errno`` is not set)."""


def os_problem(e: BaseException) -> str:
    """What an OS error says went wrong, as a clause of a message: the OS's sentence in lower case ("no space
    left on device"), else the error's text, else its class's name; no errno number and no file name (the message
    names the file itself)."""
    strerror = getattr(e, "strerror", None)
    return strerror.lower() if strerror else str(e) or type(e).__name__


#: the OS errors of an output that does not fit (no space, over a quota, bigger than a file may be)
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


@contextlib.contextmanager
def output_fits(url: str, what: str = "it") -> Iterator[None]:
    """Run the block that writes ``url``; an OS error saying the output does not fit (`NO_SPACE_ERRNOS`)
    becomes an `OutputError` naming ``url`` (the block's writer has removed its temporary file)."""
    try:
        yield
    except OSError as e:
        if e.errno not in NO_SPACE_ERRNOS:
            raise
        problem = os_problem(e)
        at = f" ({e.filename2})" if e.filename2 and str(e.filename2) != url else ""  # a rename into another name
        raise OutputError(f"{url}: {problem} while writing {what}{at}; nothing was left under its name") from None


class OptionError(UsageError, ValueError):
    """An option with a value of the wrong type or out of its range; the message names the option."""


class BudgetError(OptionError):
    """A batch budget that is not a positive finite number (or duration), or that no sample fits."""


class ShardReadError(DataError, IOError):
    """A shard that cannot be opened or is not a valid tar stream; the message names its URL. The loader raises it
    for the first such shard of a pass unless ``max_bad_shards`` lets it skip some."""


class ChecksumMismatch(ShardReadError):
    """The shard's sha256 differs from the index's (found once its last byte was read)."""


class TooManyBadShards(DataError, RuntimeError):
    """More bad shards in one epoch on one rank than ``max_bad_shards`` allows."""


class RetriesExhausted(StorageError):
    """A request failed with transient errors on every try; ``last`` is the final error."""

    def __init__(self, what: str, attempts: int, last: BaseException):
        self.last = last
        self.attempts = attempts
        super().__init__(f"{what}: failed {attempts} times, last error: {type(last).__name__}: {last}")


class IndexFormatError(DataError, ValueError):
    """An index file that cannot be read or does not describe a streambatch dataset."""


#: the name `IndexFormatError` had before (kept so code that catches it keeps working)
IndexError_ = IndexFormatError


class IndexMismatch(DataError, RuntimeError):
    """The shards do not hold what the index says (a sample's length, a shard's sample count or byte spans): the
    index is stale or the shards changed after it was written. Found while reading; ``shardify verify`` finds every
    such shard at once."""


class SampleError(DataError, ValueError):
    """A sample that cannot give what the batch asks of it: a ``.json`` member that is not JSON or holds no length
    (without an index, batches are cut by that length), or no audio member to decode; the message names it."""


class ColumnError(DataError, ValueError):
    """A metadata column that cannot be stored as asked (named but absent, not scalar, mixed kinds)."""


class AudioError(DataError, ValueError):
    """A file or byte string that cannot be read as audio."""


class TruncatedAudio(AudioError):
    """A file whose audio data ends before the frames its header declares (cut short, or corrupt at the end)."""


class SampleTooLongError(DataError, ValueError):
    """Raised in ``strict`` mode for a sample that can never fit the budget or ``max_length``."""


class CalibrationError(UsageError, RuntimeError):
    """The step function failed for a reason other than running out of memory, or nothing fits."""


# ---- option checks: each option's value is checked once, where its group is built, by one of these -------------
def shown(value: Any, most: int = 60) -> str:
    """``value`` as a message shows it: its ``repr``, cut after ``most`` characters (a data file's or a caller's
    value can be any size)."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python turns into text
        return f"<a whole number of {value.bit_length():,} bits>"
    return text if len(text) <= most else text[:most] + "..."


def int_option(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int once it is a whole number (not a bool, a float or a string) from ``minimum`` to
    ``maximum``, else an `OptionError` naming the option."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(f"{name} must be a whole number, got {value!r}")
    n = int(value)
    if minimum is not None and n < minimum:
        raise OptionError(f"{name} must be at least {minimum}, got {value!r}")
    if maximum is not None and n > maximum:
        raise OptionError(f"{name} must be at most {maximum:,}, got {value!r}")
    return n


def number_option(
    name: str,
    value: Any,
    minimum: float | None = None,
    positive: bool = False,
    maximum: float | None = None,
    below: float | None = None,
) -> float:
    """``value`` as a float once it is a finite real number (not a bool or a string), at least ``minimum`` or
    (``positive``) above 0, and at most ``maximum`` or (``below``) less than ``below``, else an
    `OptionError` naming the option (with both ends bounded it gives the interval, like ``(0, 1]``)."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise OptionError(f"{name} must be a finite number, got {value!r}")
    x = float(value)
    low_ok = not (positive and x <= 0) and not (minimum is not None and x < minimum)
    high_ok = not (maximum is not None and x > maximum) and not (below is not None and x >= below)
    if low_ok and high_ok:
        return x
    lower = "(0" if positive else None if minimum is None else f"[{minimum:g}"
    upper = None if maximum is None and below is None else f"{maximum:g}]" if maximum is not None else f"{below:g})"
    if lower and upper:
        raise OptionError(f"{name} must be in {lower}, {upper}, got {value!r}")
    if positive and x <= 0:
        raise OptionError(f"{name} must be positive, got {value!r}")
    if minimum is not None and x < minimum:
        raise OptionError(f"{name} must be at least {minimum}, got {value!r}")
    if maximum is not None and x > maximum:
        raise OptionError(f"{name} must be at most {maximum:g}, got {value!r}")
    raise OptionError(f"{name} must be below {below:g}, got {value!r}")


def bool_option(name: str, value: Any) -> bool:
    """``value`` once it is True or False (numpy's booleans too), else an `OptionError`."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise OptionError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def path_option(name: str, value: Any, what: str) -> str:
    """``value`` as text once it is a path (text or ``os.PathLike``) or URL that is not empty, else an
    `OptionError`: ``{name} must be {what}, got ...``."""
    import os

    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text:
        raise OptionError(f"{name} must be {what}, got {shown(value)}")
    return text


def callable_option(name: str, fn: Any, expected: str, positional: int) -> Any:
    """``fn`` once it is a callable that takes ``positional`` arguments, as it will be called (``expected``, like
    ``"fn(sample, rng) -> sample"``), else an `OptionError` now rather than a ``TypeError`` at its first call
    (in a worker, mid-epoch). Defaults and ``*args`` count; a callable whose signature cannot be read (some
    builtins) is taken as it is."""
    import inspect

    if not callable(fn):
        raise OptionError(f"{name} must be a callable {expected}, got {shown(fn)}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    try:
        signature.bind(*range(positional))
    except TypeError:
        raise OptionError(
            f"{name}={shown(fn)} takes {signature}, but it is called as {expected}: give a callable with "
            f"{positional} positional argument{'s' if positional != 1 else ''}"
        ) from None
    return fn


def choice_option(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` once it is one of ``choices``, else an `OptionError` listing them."""
    if not isinstance(value, (str, type(None))) or value not in choices:
        named = [c for c in choices if c is not None]
        either = "None or one of" if None in choices else "one of"
        raise OptionError(f"{name} must be {either} {', '.join(map(repr, named))}, got {value!r}")
    return value
