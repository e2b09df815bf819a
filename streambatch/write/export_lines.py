"""The lines of NeMo's manifests for one shard (`export_nemo`): its tar read once for member names, ``.json``
transcripts and a segment's rate, its durations from the index."""

from __future__ import annotations

import io
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ShardifyError
from ..format.index import ShardIndex
from ..format.members import SEGMENT_FIELD, ShardMembers
from ..format.tar import group_samples, iter_members
from ..io import storage

#: ``.json`` fields that describe our shards, not the sample, or that NeMo's own keys replace
OWN_FIELDS = frozenset(
    {"audio_filepath", "length", "output_length", "sample_rate", "original_sample_rate", "duration", "text", "offset"}
    | {"shard_id"}
)
#: how an error names NeMo's audio extensions
NEMO_NAMED = "wav, flac, mp3, opus, ogg and libsndfile's other format names; not sph"


@dataclass
class ShardLines:
    """One shard's manifest lines, and its counts of samples written, left out and with a dotted key."""

    lines: bytes = b""
    samples: int = 0
    left_out: int = 0
    dotted: int = 0


def read_shard(
    index: ShardIndex, storage_options: dict | None, empty_text: bool, stop: threading.Event, shard_url: tuple[int, str]
) -> ShardLines:
    """One shard's manifest lines (`shard_entries()`) and counts; cut short once ``stop`` is set."""
    shard, url = shard_url
    done, lines = ShardLines(), []
    for entry in shard_entries(index, shard, url, storage_options, empty_text, done):
        if stop.is_set():  # the export ended (an error, an interrupt): nobody takes these lines
            break
        lines.append(json.dumps(entry, ensure_ascii=False) + "\n")
    done.lines = "".join(lines).encode("utf-8")
    return done


def nemo_audio_extensions() -> frozenset[str]:
    """The member extensions NeMo's webdataset pipeline takes as audio: ``wav``, ``mp3``, ``flac``, ``opus`` and
    every format libsndfile names, lower case (NeMo's ``VALID_FILE_FORMATS``, computed as it computes it)."""
    import soundfile as sf

    return frozenset({"wav", "mp3", "flac", "opus", *(f.lower() for f in sf.available_formats())})


def shard_entries(
    index: ShardIndex, shard: int, url: str, storage_options: dict | None, empty_text: bool, result: ShardLines
) -> Iterator[dict[str, Any]]:
    """The manifest lines of one shard, in tar order: its tar is read once (member names, ``.json`` transcripts,
    the rate of a member that holds segments)."""
    members = index.shard_members(shard)
    lengths = index.shard_lengths([shard])[0]
    texts = index.shard_values(shard, "text")
    seconds = index.seconds_per_unit()
    rate = index.sample_rate if index.unit == "samples" else None  # lengths in samples at this rate
    with storage.open_url(url, "rb", storage_options) as f:
        for group, sample in enumerate(group_samples(iter_members(f, url), url, shard, members.suffixes)):
            if "__bad__" in sample:
                raise ShardifyError(f"{url}: {sample['__bad__']}")
            name = _audio_member(sample, url)
            result.dotted += "." in sample["__key__"]
            for row in _rows(sample, group, members, len(lengths)):
                i = row["__index__"]
                if not lengths[i]:  # left out of every epoch (``shardify index --on-error skip``)
                    result.left_out += 1
                    continue
                text = texts[i] if texts is not None else (row.get("json") or {}).get("text")
                entry = _entry(row, name, float(lengths[i]), seconds, url, rate)
                entry["text"] = _text(text, empty_text, url, row["__key__"])
                entry["shard_id"] = shard
                result.samples += 1
                yield {**entry, **_fields(sample.get("json"))}


def _rows(sample: dict[str, Any], group: int, members: ShardMembers, n: int) -> Iterator[dict[str, Any]]:
    """The samples of one member group: itself, or the segments the index cuts it into."""
    if members.rows is None:
        yield sample
    else:
        yield from members.rows.expand(sample, group, 0, n)


def _audio_member(sample: dict[str, Any], url: str) -> str:
    """The name of the sample's one audio member (NeMo takes the member whose extension is an audio format)."""
    audio = [ext for ext in sample if not ext.startswith("__") and ext in nemo_audio_extensions()]
    if len(audio) != 1:
        found = ", ".join(sorted(e for e in sample if not e.startswith("__"))) or "none"
        raise ShardifyError(
            f"{url}: sample {sample['__key__']!r} has {len(audio)} audio members NeMo reads (members: {found}); "
            f"NeMo's tarred loader needs exactly one, with an extension it takes as audio ({NEMO_NAMED})"
        )
    return f"{sample['__key__']}.{audio[0]}"


def _entry(
    row: dict[str, Any], name: str, length: float, seconds: float | None, url: str, rate: int | None = None
) -> dict[str, Any]:
    """``audio_filepath``, ``duration`` (the index's length in seconds) and a segment's ``offset``, each written so
    that NeMo's reader, which takes ``int(seconds × the file's rate)`` frames, gets the frames the index counts
    (``rate``: the index's rate where its lengths count samples)."""
    if seconds is None:  # lengths in tokens or frames: the ``.json`` knows the duration
        duration = (row.get("json") or {}).get("duration")
        if not isinstance(duration, (int, float)) or isinstance(duration, bool):
            raise ShardifyError(f"{url}: sample {row['__key__']!r}: no duration (the index counts {length} tokens)")
        return {"audio_filepath": name, "duration": float(duration)}
    import soundfile as sf

    native = sf.info(io.BytesIO(row[name.rsplit(".", 1)[1]])).samplerate
    frames = int(length) if rate == native else round(length * seconds * native)
    entry: dict[str, Any] = {"audio_filepath": name, "duration": nemo_seconds(frames, native)}
    if SEGMENT_FIELD in row:
        start, _ = row[SEGMENT_FIELD]
        entry["offset"] = nemo_seconds(start, native)
    return entry


def nemo_seconds(frames: int, rate: int) -> float:
    """``frames`` at ``rate`` as the seconds NeMo reads back as exactly that many: the first float ``d`` with
    ``int(d * rate) == frames`` (``frames / rate`` alone may give one frame less: 88218 / 22050 × 22050 is
    88217.99999999999)."""
    d = frames / rate
    while int(d * rate) < frames:
        d = math.nextafter(d, math.inf)
    return d


def _text(text: Any, empty_text: bool, url: str, key: str) -> str:
    if isinstance(text, str):
        return text
    if empty_text:
        return ""
    raise ShardifyError(
        f'{url}: sample {key!r} has no text (NeMo\'s manifests need one; pass --empty-text to write "")'
    )


def _fields(meta: Any) -> dict[str, Any]:
    """The sample's own scalar ``.json`` fields (speaker, lang, ...), as NeMo's converter carries a manifest's."""
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if k not in OWN_FIELDS and (v is None or isinstance(v, (str, int, float)))}
