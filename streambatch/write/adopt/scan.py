"""Reading one existing tar for ``shardify index``: its samples as the loader will group them, where each lies
in the tar, and what each one's members say about its length; the tar itself is only read.

The members are walked with the one tar parser (`streambatch.format.tar`) and grouped by key exactly as
the loader groups them, so sample ``i`` of the index is sample ``i`` of the stream. Audio members are probed
from their bytes (header, and the end of the audio: a member cut short is caught here), ``.json`` members are
parsed, text is counted in whitespace tokens (or ``input_ids.npy`` entries).
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ... import limits
from ...errors import ShardReadError, shown
from ...format.audio import AUDIO_EXTENSIONS, AudioError, TruncatedAudio, probe
from ...format.members import TokenIdsError, token_ids
from ...format.tar import Oversize, iter_members, split_name
from ...io import storage
from ...io.digest import HashingReader


@dataclass
class SampleScan:
    """What one sample's members say: its audio member's extension, rate and frames (0 where none), the
    ``length`` and ``duration`` of its ``.json`` (None where absent), its text tokens (-1: no text), an audio
    sample's transcript (``.txt``, else the ``.json`` ``text``), its ``.json`` fields but ``text`` (for
    ``--columns`` and ``--output-length column:FIELD``), and the problem that keeps the loader from using it
    (None when it is fine)."""

    key: str
    exts: tuple[str, ...]
    audio: str | None = None
    rate: int = 0
    frames: int = 0
    length: float | None = None
    duration: float | None = None
    tokens: int = -1
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


@dataclass
class ShardScan:
    """One tar read whole: its size and sha256, its samples in tar order with their byte ranges,
    ``fatal``: why the loader cannot read the tar at all (then the shard is left out of the index), and
    ``dropped``: the members that are no sample's (links, sparse files: the readers pass over them), each with why."""

    url: str
    bytes: int = 0
    sha256: str = ""
    samples: list[SampleScan] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    fatal: str | None = None
    dropped: list[tuple[str, str]] = field(default_factory=list)  # members no reader reads: (name, why)


def scan_tar(url: str, storage_options: dict | None = None, suffixes: tuple[str, ...] = ()) -> ShardScan:
    """Read the tar at ``url`` once: every sample (members grouped by key, as the loader groups them: by
    ``suffixes`` where the layout knows them, see `members`), the byte range its
    members span, and the tar's size and sha256."""
    scan = ShardScan(url)
    try:
        with storage.open_url(url, "rb", storage_options) as f:
            reader = HashingReader(f.read)
            _walk(iter_members(reader, url, scan.dropped), reader, scan, suffixes)
            if scan.fatal:
                return scan
            digest = reader.drain()
    except FileNotFoundError:
        scan.fatal = "tar not found"
        return scan
    except (ShardReadError, OSError) as e:
        msg = str(e).removeprefix(f"{url}: ")
        scan.fatal = f"unreadable tar after {len(scan.samples)} samples ({msg})"
        return scan
    scan.bytes, scan.sha256 = digest.bytes, digest.hexdigest()
    return scan


def _walk(members: Any, reader: HashingReader, scan: ShardScan, suffixes: tuple[str, ...] = ()) -> None:
    """Group the members into samples (consecutive members with one key) and scan each: a sample's range
    starts where the member before it ended (its headers included) and ends with its last member's padding."""
    key: str | None = None
    group: dict[str, bytes] = {}
    twice: list[str] = []  # member suffixes of the current sample met more than once
    start = end = 0
    for name, data in members:
        k, ext = split_name(name, suffixes)
        if k != key:
            if key is not None:
                _add(scan, key, group, start, end, twice)
            key, group, twice, start = k, {}, [], end
        if ext in group:
            twice.append(ext)
        group[ext] = data
        end = reader.digest.bytes
        if scan.fatal:
            return
    if key is not None:
        _add(scan, key, group, start, end, twice)
    _refuse_repeated_keys(scan)


def _add(scan: ShardScan, key: str, group: dict[str, bytes], start: int, end: int, twice: list[str]) -> None:
    sample = scan_sample(key, group)
    if sample.problem is not None and sample.problem.startswith(_FATAL):
        scan.fatal = f"{key}.json: {sample.problem[len(_FATAL) :]}"
    if twice:  # the readers keep the last member of a name: the first would be lost without a word
        sample.problem = (
            f"{key}.{twice[0]}: two members of this name in a row, of which the loader reads only the last; "
            "give each member its own name"
        )
    scan.samples.append(sample)
    scan.offsets.append(start)
    scan.sizes.append(end - start)


def _refuse_repeated_keys(scan: ShardScan) -> None:
    """Mark every sample whose key another sample of the tar has too (``shardify verify`` refuses such a tar:
    samples are told apart by key), naming where each one is."""
    where: dict[str, list[int]] = {}
    for i, sample in enumerate(scan.samples):
        where.setdefault(sample.key, []).append(i)
    for key, at in where.items():
        if len(at) > 1:
            listed = ", ".join(str(i) for i in at[:5]) + (", ..." if len(at) > 5 else "")
            for i in at:
                scan.samples[i].problem = (
                    f"{key}: {len(at)} samples of this tar have this key (samples {listed}); samples are told "
                    "apart by key: give each its own name"
                )


#: the mark of a member problem that stops the loader reading the whole tar (an invalid ``.json``)
_FATAL = "\0"


def scan_sample(key: str, members: dict[str, bytes]) -> SampleScan:
    """One sample's members (extension → bytes) as a `SampleScan`. Its audio member is known from the names
    alone, so a sample whose ``.json`` or text is bad still shows the layout, and its problem names the member."""
    s = SampleScan(key, tuple(members))
    s.audio = next((e for e in AUDIO_EXTENSIONS if e in members), None)
    s.problem = _over_limits(key, members)
    if s.problem is not None:
        return s
    meta = _json(key, members, s)
    if meta is None:
        return s
    if s.audio is not None:
        got = audio_header(members[s.audio])
        if isinstance(got, str):
            s.problem = f"{key}.{s.audio}: {got}"
        else:
            s.rate, s.frames = got
    s.tokens = _tokens(members, meta)
    if s.tokens == -2:
        s.problem = s.problem or _text_problem(key, members)
    elif s.audio is not None:  # a transcript (short); a text sample's document is not carried
        s.text = members["txt"].decode("utf-8").strip() if "txt" in members else _str(meta.get("text"))
    s.meta = kept_fields(meta)
    return s


def _json(key: str, members: dict[str, bytes], s: SampleScan) -> dict[str, Any] | None:
    """The sample's ``.json`` as a dict (``{}``: none), its ``length`` and ``duration`` set on ``s``; None (and
    ``s.problem``) where it is not valid JSON, not an object, or declares a length or duration that is not a number
    (the loader checks the ``length`` against the index: one it cannot compare fails the run)."""
    try:
        meta = limits.loads(members["json"]) if "json" in members else {}
    except limits.LimitExceeded as e:  # the loader counts it as a bad sample
        s.problem = f"{key}.json: {e}"
        return None
    except (ValueError, UnicodeDecodeError) as e:  # the loader gives up the tar on an invalid .json
        s.problem = f"{_FATAL}invalid JSON ({e})"
        return None
    if not isinstance(meta, dict):
        s.problem = f"{key}.json: not a JSON object (a {type(meta).__name__})"
        return None
    for name in ("length", "duration"):
        value = meta.get(name)
        if value is not None and finite_number(value) is None:
            s.problem = f"{key}.json: {name} {shown(value, 40)} is not a finite number"
            return None
    s.length, s.duration = finite_number(meta.get("length")), finite_number(meta.get("duration"))
    return meta


def _text_problem(key: str, members: dict[str, bytes]) -> str:
    """Why the sample's text member cannot be counted (`_tokens()` gave -2), naming the member."""
    if "input_ids.npy" in members:
        try:
            token_ids(members["input_ids.npy"])
        except TokenIdsError as e:
            return f"{key}.input_ids.npy: {e}"
        return f"{key}.input_ids.npy: not a 1-D array of token ids"
    try:
        members["txt"].decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{key}.txt: not UTF-8 text ({e.reason} at byte {e.start})"
    return f"{key}.txt: text that cannot be read"


def _over_limits(key: str, members: dict[str, bytes]) -> str | None:
    """Why the sample cannot be adopted whatever its members say: a refused key, a member over the size limit."""
    bad = limits.key_problem(key)
    if bad is not None:
        return f"{key!r}: {bad}"
    for ext, data in members.items():
        if isinstance(data, Oversize):
            return f"{key}.{ext}: {data.reason}"
    return None


def kept_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``.json`` fields kept to choose columns from: the first `MAX_FIELDS_KEPT`
    but ``text``, a value that is not a scalar replaced by ``...`` (it can never be a column; not held)."""
    out: dict[str, Any] = {}
    for k, v in meta.items():
        if len(out) >= limits.MAX_FIELDS_KEPT:
            break
        if k != "text":
            out[k] = v if v is None or isinstance(v, (bool, int, float, str)) else ...
    return out


def _str(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def finite_number(x: Any) -> float | None:
    """``x`` as a float where it is a finite real number (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        value = float(x)
    except OverflowError:  # an integer too large for a float
        return None
    return value if math.isfinite(value) else None


def _tokens(members: dict[str, bytes], meta: dict[str, Any]) -> int:
    """Tokens of the sample's text: ``input_ids.npy`` entries, else whitespace tokens of ``.txt``, else of the
    ``.json`` ``text``; -1 when it has none, -2 when it cannot be read."""
    try:
        if "input_ids.npy" in members:
            return len(token_ids(members["input_ids.npy"]))
        if "txt" in members:
            return len(members["txt"].decode("utf-8").split())
    except (ValueError, UnicodeDecodeError, OSError):
        return -2
    text = meta.get("text")
    return len(text.split()) if isinstance(text, str) else -1


def audio_header(data: bytes) -> tuple[int, int] | str:
    """``(sample_rate, frames)`` of an audio member from its bytes, or what is wrong with it (a member whose
    audio ends before its header says is a problem here, not a crash in training)."""
    if not data:
        return "empty audio member (0 bytes)"
    try:
        info = probe(io.BytesIO(data), check_end=True)
    except TruncatedAudio as e:
        return str(e)
    except AudioError as e:
        msg = (str(e.__cause__ or e).strip().splitlines() or ["?"])[-1]
        msg = re.sub(r"^Error opening <.*?>: ", "", msg)
        return "audio member has no frames" if "header reports" in msg else f"not readable audio ({msg.rstrip('.')})"
    if info.frames <= 0:
        return "audio member has no frames"
    return info.sample_rate, info.frames
