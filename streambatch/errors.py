"""Errors a user can act on: bad input records and bad arguments.

``InputProblem`` is one bad input record, reported as ``FILE:LINE: problem`` (or ``FILE: problem``).
``ShardifyError`` is a mistake in what the user asked for (the CLI prints it and exits with 2);
``InputErrors`` carries the list of bad records when ``on_error="fail"``. ``BudgetError`` and
``EmptyEpochError`` (also ``ValueError``) are a loader's options that would give no batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

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


class ShardifyError(Exception):
    """A user error (bad arguments, bad input, refusing to overwrite): reported without a traceback."""


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


class BudgetError(ShardifyError, ValueError):
    """A batch budget that is not a positive finite number (or duration), or that no sample fits."""


class EmptyEpochError(ShardifyError, ValueError):
    """An epoch that would yield no batch at all (every sample filtered out, dropped or too long)."""


class MissingCredentials(ShardifyError, PermissionError):
    """Object storage refused a URL for want of credentials; the message names the URL and where they come from."""


class ShardReadError(IOError):
    """A shard that cannot be opened or is not a valid tar stream; the message names its URL."""
