"""The limits on what a data file may hold: how deep its JSON nests, how large one tar member may be, how many
metadata columns an adopted index stores by default. Data files are untrusted input (a tar, a manifest, a
sample's ``.json``); these bounds keep a hostile or broken one from exhausting the stack or the memory.

Each limit has a default that no real dataset comes near, and an environment variable that raises it (read
when the limit is used, so it reaches DataLoader workers too): ``STREAMBATCH_MAX_JSON_DEPTH``,
``STREAMBATCH_MAX_MEMBER_BYTES``, ``STREAMBATCH_MAX_LINE_BYTES``, ``STREAMBATCH_MAX_LENGTH``,
``STREAMBATCH_FILTER_MEMORY`` (sizes like ``16G``) and ``STREAMBATCH_FILTER_SECONDS``. `loads()` is the one
JSON parser for untrusted text: every manifest reader, ``shardify index`` and the loader's ``.json`` members go
through it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .errors import DataError, UsageError

#: how deep arrays and objects may nest in one JSON document (a lhotse cut nests about 6 deep)
MAX_JSON_DEPTH = 100
#: the largest tar member read, in bytes (a larger one is a bad sample, read past without being held)
MAX_MEMBER_BYTES = 4 << 30
#: the largest GNU long-name or pax header record (they hold a member's name, nothing else)
MAX_NAME_RECORD_BYTES = 1 << 20
#: the longest line of a JSON-lines manifest, in bytes (a gzipped one can inflate one line without end)
MAX_LINE_BYTES = 64 << 20
#: the largest length an index may give one sample, in its unit (2⁴⁰: 265 days of audio at 48 kHz; a shard of 2²³
#: samples this long still sums in int64)
MAX_LENGTH = 1 << 40
#: metadata columns ``shardify index`` stores when ``--columns`` is not given (the first scalar fields seen)
DEFAULT_MAX_COLUMNS = 64
#: scalar fields kept per adopted sample to choose columns from (the first ones in the ``.json``)
MAX_FIELDS_KEPT = 1024

#: bytes a ``where=`` filter may use to check its expression or evaluate one row group (its engine's address
#: space is capped on Linux: more is a one-line error naming the filter)
FILTER_MEMORY = 2 << 30
#: seconds a ``where=`` filter may take to check its expression or evaluate one row group (then interrupted)
FILTER_SECONDS = 60.0

_DEPTH_ENV = "STREAMBATCH_MAX_JSON_DEPTH"
_MEMBER_ENV = "STREAMBATCH_MAX_MEMBER_BYTES"
_LINE_ENV = "STREAMBATCH_MAX_LINE_BYTES"
LENGTH_ENV = "STREAMBATCH_MAX_LENGTH"
FILTER_MEMORY_ENV = "STREAMBATCH_FILTER_MEMORY"
FILTER_SECONDS_ENV = "STREAMBATCH_FILTER_SECONDS"


class LimitExceeded(DataError, ValueError):
    """A data file that holds more than a limit allows (JSON nested too deep, a tar member too large); the
    message names the limit and the environment variable that raises it."""


def _env_int(name: str, default: int) -> int:
    """The environment variable ``name`` as a size of at least 16 (``"16G"`` allowed), else ``default``. A value
    that is not one is the user's mistake (`UsageError`, not a ``ValueError`` a parser would take for
    the data's)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    from .units import parse_bytes

    try:
        value = parse_bytes(text, name)
    except ValueError as e:
        raise UsageError(f"{name}={text!r} is not a size: {e}") from None
    if value is None or value < 16:
        raise UsageError(f"{name}={text!r} must be at least 16")
    return int(value)


def max_json_depth() -> int:
    """How deep JSON may nest: `MAX_JSON_DEPTH`, or ``STREAMBATCH_MAX_JSON_DEPTH``."""
    return _env_int(_DEPTH_ENV, MAX_JSON_DEPTH)


def max_member_bytes() -> int:
    """The largest tar member read: `MAX_MEMBER_BYTES`, or ``STREAMBATCH_MAX_MEMBER_BYTES``."""
    return _env_int(_MEMBER_ENV, MAX_MEMBER_BYTES)


def max_line_bytes() -> int:
    """The longest manifest line read: `MAX_LINE_BYTES`, or ``STREAMBATCH_MAX_LINE_BYTES``."""
    return _env_int(_LINE_ENV, MAX_LINE_BYTES)


def max_length() -> int:
    """The largest length an index may give a sample: `MAX_LENGTH`, or ``STREAMBATCH_MAX_LENGTH``."""
    return _env_int(LENGTH_ENV, MAX_LENGTH)


def filter_memory() -> int:
    """The memory a filter may use: `FILTER_MEMORY`, or ``STREAMBATCH_FILTER_MEMORY``."""
    return _env_int(FILTER_MEMORY_ENV, FILTER_MEMORY)


def filter_seconds() -> float:
    """The time a filter may take per request: `FILTER_SECONDS`, or ``STREAMBATCH_FILTER_SECONDS`` (a
    number of seconds above 0)."""
    text = os.environ.get(FILTER_SECONDS_ENV, "").strip()
    if not text:
        return FILTER_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UsageError(f"{FILTER_SECONDS_ENV}={text!r} must be a number of seconds above 0")
    return value


def line_too_long(limit: int) -> str:
    """Why a manifest line is not read."""
    return f"a line longer than {limit} bytes (raise the limit with {_LINE_ENV}=BYTES)"


def member_too_large(size: int, limit: int) -> str:
    """Why a member of ``size`` bytes is not read."""
    return f"a member of {size} bytes, more than the limit of {limit} (raise it with {_MEMBER_ENV}=BYTES)"


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth_over(raw: bytes | str, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects more than ``limit`` deep (brackets inside
    strings do not count). Text with fewer opening brackets than the limit is answered without a scan."""
    if isinstance(raw, str):
        if raw.count("[") + raw.count("{") <= limit:
            return False
        raw = raw.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _too_deep(limit: int) -> LimitExceeded:
    return LimitExceeded(f"JSON nested more than {limit} deep (raise the limit with {_DEPTH_ENV}=N if meant to be)")


def raw_decode(decoder: json.JSONDecoder, text: str, pos: int) -> tuple[Any, int]:
    """``decoder.raw_decode(text, pos)`` (one JSON value of a larger text, and where it ends) under the depth
    limit of `loads()`."""
    limit = max_json_depth()
    try:
        value, end = decoder.raw_decode(text, pos)
    except RecursionError:
        raise _too_deep(limit) from None
    if json_depth_over(text[pos:end], limit):
        raise _too_deep(limit)
    return value, end


#: JSON with no more opening brackets than this is parsed without looking the limit up (the loader's hot path)
_SHALLOW = 16


def loads(raw: bytes | str) -> Any:
    """``json.loads`` for untrusted text: `LimitExceeded` where it nests deeper than
    `max_json_depth()`, else what ``json.loads`` gives or raises (``ValueError``, ``UnicodeDecodeError``)."""
    if isinstance(raw, bytes) and raw.count(b"[") + raw.count(b"{") <= _SHALLOW:
        return json.loads(raw)
    limit = max_json_depth()
    if json_depth_over(raw, limit):
        raise _too_deep(limit)
    try:
        return json.loads(raw)
    except RecursionError:  # a limit raised past what the parser's stack holds
        raise _too_deep(limit) from None


def key_problem(key: str) -> str | None:
    """Why a sample key read from a tar is refused, or None: a key names files where samples are written out
    (``KEY.flac``), so it may not be absolute, climb out with ``..``, hold control characters or bytes that are
    not UTF-8. It cannot be renamed either (the index's key must be the one the tar holds)."""
    if key.startswith("/") or key.startswith("\\"):
        return f"key {key!r} is an absolute path"
    if ".." in re.split(r"[/\\]", key):
        return f"key {key!r} climbs out of its folder (..)"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in key):
        return f"key {key!r} holds control characters"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return f"key {key!r} is not UTF-8"
    return None
