"""Metadata columns of the sample table: which of the samples' scalar ``.json`` fields (speaker, language,
duration, scores, ...) become typed columns beside shard, key, length, offset and size, so a filter
(`where`) can select samples from the index without reading a shard.

By default the first `DEFAULT_MAX_COLUMNS` fields whose values are all scalars of one kind
(numbers, booleans or strings) become columns, except the transcript (``text``) and the fields that would shadow
the table's own columns (a manifest or ``.json`` is data: its field count must not size the index); a writer may
name the columns instead (``--columns``). Types are Arrow type names as the index header lists them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, overload

from ..errors import ColumnError, OptionError, shown
from ..limits import DEFAULT_MAX_COLUMNS

#: the sample table's own columns: a field of the same name cannot be a metadata column
RESERVED = ("shard", "key", "length", "offset", "size", "output_length", "segment_start", "segment_frames")
#: fields never stored by default (transcripts are long, and a filter has no use for them)
NOT_BY_DEFAULT = ("text",)
_RANK = {"bool": 0, "int64": 1, "double": 2}


def _kind(v: Any) -> str | None:
    """The Arrow type of one scalar value (None: null; ``"other"``: not a scalar)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int64" if -(2**63) <= v < 2**63 else "other"
    if isinstance(v, float):
        return "double"
    if isinstance(v, str):
        return "string"
    return "other"


@overload
def unify(a: str | None, b: str) -> str: ...
@overload
def unify(a: str | None, b: str | None) -> str | None: ...
def unify(a: str | None, b: str | None) -> str | None:
    """The type that holds values of types ``a`` and ``b``: numbers widen to ``double``; else ``"other"``."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if a in ("int64", "double") and b in ("int64", "double"):
        return "double"
    return "other"


def field_types(metas: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Each field's type over all the samples' ``.json`` dicts (``"other"`` where not one scalar kind),
    in the order the fields first appear."""
    types: dict[str, str | None] = {}
    for meta in metas:
        for k, v in meta.items():
            types[k] = unify(types.get(k), _kind(v)) if k in types else _kind(v)
    return {k: (t or "other") for k, t in types.items()}  # a field that is always null: no type to store


def bounded(chosen: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The default columns kept (the first `DEFAULT_MAX_COLUMNS`) and the names left out."""
    names = list(chosen)
    return {k: chosen[k] for k in names[:DEFAULT_MAX_COLUMNS]}, names[DEFAULT_MAX_COLUMNS:]


def left_out_note(stored: int, left_out: int) -> str:
    """What a command says when the default left scalar fields out of the index."""
    return (
        f"stored the first {stored} scalar fields as columns, not {left_out} more; "
        "name the ones filters need with --columns"
    )


def choose_columns(metas: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> dict[str, str]:
    """The metadata columns to store, ``{name: arrow type}``: ``names`` (``--columns``) or every scalar
    field but the transcript and reserved names. A named field that is missing or not scalar is an error
    listing the fields that can be columns."""
    types = field_types(metas)
    usable = {k: t for k, t in types.items() if t != "other" and k not in RESERVED}
    if names is None:
        return {k: t for k, t in usable.items() if k not in NOT_BY_DEFAULT}
    out: dict[str, str] = {}
    for name in names:
        if name not in usable:
            why = (
                "is one of the sample table's own columns"
                if name in RESERVED
                else "is not a scalar of one kind (number, boolean or string) in every sample"
                if name in types
                else "is in no sample's .json"
            )
            raise ColumnError(f"--columns: {name!r} {why}; fields that can be columns: {', '.join(usable) or '(none)'}")
        out[name] = usable[name]
    return out


def parse_columns(text: str | Sequence[str] | None) -> list[str] | None:
    """``--columns``: a comma-separated list (``""`` for none); None keeps the default choice."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else text
    if isinstance(items, (bytes, Mapping)) or not isinstance(items, Iterable):
        raise OptionError(f"columns must be field names, as a list or 'a,b' (\"\" for none), got {shown(text)}")
    items = list(items)
    if not all(isinstance(s, str) for s in items):
        raise OptionError(f"columns must be field names (text), got {shown(text)}")
    return [s.strip() for s in items if s.strip()]


def merged_columns(schemas: Sequence[Mapping[str, str]], where: Sequence[str]) -> dict[str, str]:
    """The columns of several indexes merged into one (parts of a dataset): every column of any of them
    (null in the others), numbers widened to ``double``; one name with two kinds is an error naming both."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for schema, url in zip(schemas, where):
        for k, t in schema.items():
            u = unify(out.get(k), t)
            if u == "other":
                raise ColumnError(
                    f"column {k!r} is {out[k]} in {seen[k]} but {t} in {url}: the parts cannot be "
                    "merged into one sample table (write them with the same --columns)"
                )
            out[k], seen[k] = u, seen.get(k, url)
    return out


def column_values(metas: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> dict[str, list[Any]]:
    """The values of each column for these samples (None where a sample lacks the field)."""
    return {k: [m.get(k) for m in metas] for k in columns}


def arrow_column(values: Any, typ: str, n: int) -> Any:
    """One shard's values of a column as an Arrow array of ``typ`` (``values`` None: all null; an Arrow array
    read back from a table is cast, a list converted)."""
    import pyarrow as pa

    t = pa.type_for_alias(typ)
    if values is None:
        return pa.nulls(n, t)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return values if values.type == t else values.cast(t)
    return pa.array(list(values), t)
