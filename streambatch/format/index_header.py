"""The shape of an ``index.json``, checked before anything in it is used: an index is data, not configuration.

Every field the reader uses is checked for its type and range here, once (`check_header()`), so a
damaged or hostile header is one `IndexFormatError` naming the field, never a ``KeyError``,
``TypeError`` or an allocation sized by a number in the file.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ..errors import IndexFormatError

#: the dtypes a version 1 index may pack lengths in (what `shards.encode_lengths()` writes, and their kin)
V1_DTYPES = ("<u4", "<i4", "<u8", "<i8", "<f4", "<f8")
_HASHES = ("sha256", "keys_sha1")


def check_header(d: dict[str, Any], version: int, source: str) -> None:
    """Raise `IndexFormatError` naming the first field of ``d`` (a parsed ``index.json`` of ``version``)
    that is missing or not of its type."""
    sample_rate = d.get("sample_rate")
    if sample_rate is not None and not (_is_int(sample_rate) and sample_rate > 0):
        _bad(source, "sample_rate", sample_rate, "a positive whole number or null")
    if d.get("meta") is not None and not isinstance(d["meta"], dict):
        _bad(source, "meta", d["meta"], "an object")
    if not isinstance(d.get("unit"), str):
        _bad(source, "unit", d.get("unit"), "a unit name")
    if version == 2:
        _check_v2(d, source)
    else:
        _check_v1(d, source)


def _check_v2(d: dict[str, Any], source: str) -> None:
    for name in ("num_shards", "num_samples"):
        _count(d, name, source)
    if d.get("total_bytes") is not None:  # absent from indexes written before the header carried it
        _count(d, "total_bytes", source)
    if not isinstance(d.get("id"), str):
        _bad(source, "id", d.get("id"), "a string")
    columns: Any = d.get("columns")
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        _bad(source, "columns", columns, "an object of column names and type names")
    if "length" not in columns:
        _bad(source, "columns", columns, "an object naming the length column")
    tables = d.get("tables")
    if not isinstance(tables, dict) or not isinstance(tables.get("samples"), list):
        _bad(source, "tables", tables, 'an object with "shards" and a list of "samples"')
    _table_entry(tables.get("shards"), "tables.shards", source, ("bytes", "rows"))
    for i, entry in enumerate(tables["samples"]):
        _table_entry(entry, f"tables.samples[{i}]", source, ("bytes", "rows", "row_groups"))


def _table_entry(entry: Any, where: str, source: str, counts: tuple[str, ...]) -> None:
    """A table's entry: a relative file path beside the index, and its counts (whole numbers, not negative)."""
    if not isinstance(entry, dict):
        _bad(source, where, entry, "an object")
    rel: Any = entry.get("path")
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") for p in parts) or "://" in rel or "\\" in rel:
        _bad(source, f"{where}.path", rel, "a file path beside the index")
    for name in counts:
        _count(entry, name, source, where)


def _check_v1(d: dict[str, Any], source: str) -> None:
    shards = d.get("shards")
    if not isinstance(shards, list):
        _bad(source, "shards", shards, "a list")
    for i, s in enumerate(shards):
        where = f"shards[{i}]"
        if not isinstance(s, dict):
            _bad(source, where, s, "an object")
        if not isinstance(s.get("url"), str) or not s["url"]:
            _bad(source, f"{where}.url", s.get("url"), "a path or URL")
        _count(s, "count", source, where)
        _count(s, "bytes", source, where)
        for name in _HASHES:
            if s.get(name) is not None and not isinstance(s[name], str):
                _bad(source, f"{where}.{name}", s[name], "a hex string or null")
        for name in ("lengths", "output_lengths"):
            if name in s or name == "lengths":
                _packed(s.get(name), f"{where}.{name}", source)


def _packed(p: Any, where: str, source: str) -> None:
    """Packed lengths: a known dtype and base64 text."""
    if not isinstance(p, dict) or p.get("dtype") not in V1_DTYPES or not isinstance(p.get("b64"), str):
        _bad(source, where, p, f'{{"dtype": one of {", ".join(V1_DTYPES)}, "b64": text}}')
    if len(p["b64"]) % 4:
        _bad(source, f"{where}.b64", p["b64"][:20], "base64 text")


def _count(d: dict[str, Any], name: str, source: str, where: str = "") -> None:
    value: Any = d.get(name)
    if not (_is_int(value) and value >= 0):
        _bad(source, f"{where}.{name}" if where else name, value, "a whole number, not negative")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bad(source: str, field: str, value: Any, want: str) -> NoReturn:
    shown = repr(value)
    shown = shown[:60] + "..." if len(shown) > 60 else shown
    raise IndexFormatError(f"{source}: field {field} is {shown}, not {want}")
