"""What ``shardify index`` stores beside each adopted sample's length, with the write side's code: its output length
(``--output-length``: the transcript's characters or tokens as `OutputLength` counts them for
``shardify write``, or ``column:FIELD``, an integer field taken as it is) and its metadata columns (``--columns``,
chosen by `columns` from the scalar fields of the NeMo manifest entry or the sample's
``.json``). A NeMo dataset's transcripts live in its manifest, not in its tars: they are stored as the sample
table's ``text`` column, which the loader gives as ``batch["text"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InputProblem, ShardifyError
from ...format.columns import ColumnError, bounded, choose_columns, column_values, parse_columns
from ...format.index import ShardInfo
from ..tokenize import parse_output_length
from .nemo import Entry
from .scan import SampleScan


@dataclass(frozen=True)
class Seen:
    """One usable sample as the adopter sees it: its transcript, its fields (``text`` included), and where they
    come from (``source``: the manifest line, or the tar; ``member``: what a problem names)."""

    key: str
    text: str | None
    fields: dict[str, Any]
    source: str
    member: str

    def problem(self, error: str) -> InputProblem:
        return InputProblem(self.source, f"{self.member}: {error}", key=self.key)


def seen(s: SampleScan, entry: Entry | None, url: str) -> Seen:
    """A sample's transcript and fields: from its manifest entry (NeMo), else from its ``.txt``/``.json``."""
    if entry is not None:
        return Seen(s.key, entry.text, entry.fields, entry.where, entry.member)
    fields = s.meta if s.text is None else {**s.meta, "text": s.text}
    return Seen(s.key, s.text, fields, url, f"{s.key}.json" if "json" in s.exts else s.key)


class SampleExtras:
    """Collects, tar by tar, the output lengths and field values of the adopted samples; `columns()` then
    chooses the metadata columns over all of them and sets each shard's values."""

    def __init__(self, output_length: str | None, columns: str | Sequence[str] | None):
        self.output = parse_output_length(output_length, column=True)  # a bad spec fails before any tar is read
        self.names = parse_columns(columns)
        self.nemo = False
        self.fields: list[list[dict[str, Any]]] = []
        self.left_out: list[str] = []  # scalar fields past limits.DEFAULT_MAX_COLUMNS, not stored without --columns

    def for_layout(self, layout: str, text_column: bool = False) -> SampleExtras:
        """Checked against the layout the tars turned out to have (text samples have no output length).
        ``text_column``: the transcripts come from beside the tars (a Shar folder's cuts), so the index must hold
        them, as it holds a NeMo manifest's."""
        if self.output is not None and layout == "text":
            raise ShardifyError(
                "--output-length counts the transcripts of audio samples; a text sample's length is its tokens already"
            )
        self.nemo = layout == "nemo" or text_column
        return self

    def add(
        self,
        url: str,
        samples: Sequence[tuple[SampleScan, Entry | None]],
        lengths: np.ndarray,
        problems: list[InputProblem],
    ) -> np.ndarray | None:
        """One tar's samples (each with its manifest entry, if any; ``lengths``: 0 where left out): their fields
        kept for the columns, and their output lengths (None without ``--output-length``). A sample whose output
        length cannot be had is a problem, and left out (its length set to 0)."""
        views = [seen(s, entry, url) if lengths[i] else None for i, (s, entry) in enumerate(samples)]
        self.fields.append([v.fields if v is not None else {} for v in views])
        if self.output is None:
            return None
        out = np.zeros(len(views), dtype=np.int64)
        for i, got in self._output_lengths(views).items():
            if isinstance(got, InputProblem):
                problems.append(got)
                lengths[i] = 0
            else:
                out[i] = got
        return out

    def _output_lengths(self, views: Sequence[Seen | None]) -> dict[int, int | InputProblem]:
        """Each usable sample's output length, or the problem that keeps it from having one."""
        how = self.output
        assert how is not None
        if how.field is not None:
            return {i: column_length(v, how.field) for i, v in enumerate(views) if v is not None}
        got: dict[int, int | InputProblem] = {}
        texts = {i: v.text for i, v in enumerate(views) if v is not None and v.text is not None}
        for i, v in enumerate(views):
            if v is not None and v.text is None:
                got[i] = v.problem(f"no transcript to count for --output-length {how.unit}")
        got.update(zip(texts, how.count(list(texts.values()))))
        return got

    def columns(self, infos: Sequence[ShardInfo]) -> dict[str, str]:
        """The metadata columns, ``{name: arrow type}``, each shard's values set (``infos``: the tars added, in
        order). A NeMo dataset's ``text`` is always one: the loader's transcripts."""
        everything = [f for per_tar in self.fields for f in per_tar]
        names = self.names
        if self.nemo and names is not None:
            names = [n for n in names if n != "text"]
        try:
            chosen = choose_columns(everything, names)
        except ColumnError as e:
            raise ShardifyError(str(e).replace("'s .json", "'s .json or manifest entry")) from None
        if names is None:  # a bounded default; --columns names more
            chosen, self.left_out = bounded(chosen)
        if self.nemo and any(isinstance(f.get("text"), str) for f in everything):
            chosen["text"] = "string"
        for info, per_tar in zip(infos, self.fields):
            info.columns = column_values(per_tar, chosen)
        return chosen

    def meta(self) -> dict[str, Any]:
        """What the index header's meta records: how the output lengths were counted, how many scalar fields
        were not stored as columns (past the default's bound)."""
        out: dict[str, Any] = {} if self.output is None else {"output_length": self.output.describe()}
        if self.left_out:
            out["columns_left_out"] = len(self.left_out)
        return out


def column_length(v: Seen, name: str) -> int | InputProblem:
    """``--output-length column:NAME``: the sample's field ``name``, a whole number >= 0, as it is."""
    if name not in v.fields:
        where = v.member if v.member != v.key else f"{v.key} (it has no .json)"
        return InputProblem(v.source, f"{where}: --output-length column:{name}: no field {name!r}", key=v.key)
    x = v.fields[name]
    whole = isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and x.is_integer()
    if not whole or x < 0:
        return v.problem(f"--output-length column:{name}: field {name!r} is {x!r}, not a whole number >= 0")
    return int(x)
