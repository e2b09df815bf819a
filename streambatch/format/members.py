"""How a shard's tar members map to the index's samples: which part of a member's name is its sample's key, and
which stretch of a member a sample is.

Shards written by ``shardify write`` follow webdataset: a sample's key ends at the first dot of the file name, and
each group of members with one key is one sample. Tars adopted in place (``shardify index``) may say more:

* **Keys with dots.** A lhotse Shar tar holds ``<cut id>.<ext>`` members and cut ids often contain dots
  (``ES2011a.Headset-0-40s-46s``); a NeMo member is named by its manifest's ``audio_filepath``. Such an index
  records `SUFFIXES_META` in its ``meta``: the member suffixes the layout knows (``flac``, ``json``, ...). A
  name is then split before the longest listed suffix it ends with, else before its last dot.
* **Segments.** Several samples may be stretches of one recording (a NeMo manifest's ``offset`` + ``duration``
  entries, ``-subN`` names): the tar holds the recording once, and the sample table has one row per segment,
  each with its own key and length, all with the byte offset and size of the one member group. The metadata
  columns `SEGMENT_START` and `SEGMENT_FRAMES` say which frames of the decoded member each row is
  (`WHOLE`: the whole member). Readers expand each member group into its rows (`ShardRows`), so
  sample ``i`` of a shard is row ``i`` of its sample table, as for every other shard.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DataError, IndexFormatError
from .audio import AUDIO_EXTENSIONS

#: the index ``meta`` entry naming the member suffixes by which an adopted layout's names split into key and suffix
SUFFIXES_META = "member_suffixes"
#: metadata columns of a dataset with segments: first frame and frame count of each row's stretch of its member
SEGMENT_START, SEGMENT_FRAMES = "segment_start", "segment_frames"
#: `SEGMENT_FRAMES` of a row that is its whole member
WHOLE = -1
#: what a sample dict carries for a segment: ``(first frame, frames)`` of its member's decoded audio
SEGMENT_FIELD = "__segment__"
#: the suffixes an adopted Shar or NeMo layout records (longest first, so ``input_ids.npy`` wins over ``npy``)
ADOPTED_SUFFIXES: tuple[str, ...] = tuple(
    sorted({"input_ids.npy", "json", "txt", "npy", *AUDIO_EXTENSIONS}, key=lambda s: (-len(s), s))
)


def suffixes_of(meta: dict[str, Any] | None) -> tuple[str, ...]:
    """The member suffixes an index's ``meta`` records (empty: webdataset's first-dot rule)."""
    got = (meta or {}).get(SUFFIXES_META)
    if not isinstance(got, list) or not all(isinstance(s, str) and s for s in got):
        return ()
    return tuple(sorted(got, key=lambda s: (-len(s), s)))


@dataclass(frozen=True)
class ShardRows:
    """The rows of one shard whose member groups hold several samples: each row's group (its ordinal in the
    tar), key and stretch of the group's audio (``start``, ``frames``; frames `WHOLE`: all of it)."""

    group: np.ndarray
    keys: Sequence[str]
    start: np.ndarray
    frames: np.ndarray

    @classmethod
    def build(cls, offsets: np.ndarray, keys: Sequence[str], start: Sequence[Any], frames: Sequence[Any]) -> ShardRows:
        """Rows from the sample table: rows with one byte offset share a member group (they are adjacent)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        group = np.concatenate([[0], np.cumsum(offsets[1:] != offsets[:-1])]).astype(np.int64)
        return cls(group, list(keys), _ints(start), _ints(frames))

    def first_group(self, row: int) -> int:
        """The member group that holds ``row``."""
        return int(self.group[row])

    def first_row(self, group: int) -> int:
        """The first row of member group ``group`` (the number of rows when there is no such group)."""
        return int(np.searchsorted(self.group, group, side="left"))

    def expand(self, sample: dict[str, Any], group: int, lo: int, hi: int) -> Iterator[dict[str, Any]]:
        """The rows in ``[lo, hi)`` of member group ``group`` (``sample``: its members as read), each a sample of its
        own sharing the members' bytes."""
        a = max(lo, self.first_row(group))
        b = min(hi, int(np.searchsorted(self.group, group, side="right")))
        for row in range(a, b):
            yield self.row(sample, row)

    def row(self, sample: dict[str, Any], row: int) -> dict[str, Any]:
        """``sample`` (a member group as read) as the shard's row ``row``: its key, its position, its stretch."""
        out = dict(sample)
        out["__index__"], out["__key__"] = row, self.keys[row]
        frames = int(self.frames[row])
        if frames != WHOLE:
            out[SEGMENT_FIELD] = (int(self.start[row]), frames)
            out["json"] = None  # a member's .json describes the recording; the index holds the segment's length
        return out


@dataclass(frozen=True)
class ShardMembers:
    """How one shard's members map to samples: the key rule (``suffixes``; empty: the first dot) and the rows of
    a shard with segments (None: one sample per member group)."""

    suffixes: tuple[str, ...] = ()
    rows: ShardRows | None = None


PLAIN = ShardMembers()


def shard_members(index: Any, shard: int) -> ShardMembers:
    """`ShardMembers` of shard ``shard`` of a `ShardIndex`."""
    suffixes = suffixes_of(index.meta)
    if SEGMENT_FRAMES not in index.columns:
        return ShardMembers(suffixes) if suffixes else PLAIN
    frames = index.shard_values(shard, SEGMENT_FRAMES) or []
    if all(f is None or f == WHOLE for f in frames):
        return ShardMembers(suffixes)
    spans = index.sample_offsets(shard)
    keys = shard_keys(index, shard)
    if spans is None or keys is None:
        raise IndexFormatError(f"{index.shard_url(shard)}: the index has segments but no byte offsets or keys for them")
    rows = ShardRows.build(spans[0], keys, index.shard_values(shard, SEGMENT_START) or [], frames)
    return ShardMembers(suffixes, rows)


def _ints(values: Sequence[Any]) -> np.ndarray:
    return np.asarray([WHOLE if x is None else int(x) for x in values], dtype=np.int64)


def shard_keys(index: Any, shard: int) -> list[str] | None:
    """The keys of a shard's rows (a version 2 index reads the key column of the shard's row group)."""
    reader = getattr(index.shards, "reader", None)
    if reader is not None:
        return reader.shard_values(int(shard), "key")
    keys = index.shards[int(shard)].keys
    return None if keys is None else list(keys)


class TokenIdsError(DataError, ValueError):
    """An ``input_ids.npy`` member that is not a 1-D array of whole numbers, or whose header claims more data than
    the member holds."""


def token_ids(data: bytes) -> np.ndarray:
    """The token ids of an ``input_ids.npy`` member as a 1-D array. The ``.npy`` header (shape, dtype) is checked
    against the bytes the member holds before anything is allocated: the data never chooses how much memory is
    taken (a header claiming terabytes is a bad member, not a ``MemoryError``)."""
    f = io.BytesIO(data)
    try:
        major, _ = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except (ValueError, OSError, SyntaxError, TypeError) as e:
        raise TokenIdsError(f"not a .npy array ({e})") from None
    if len(shape) != 1 or dtype.hasobject or dtype.kind not in "iu":
        raise TokenIdsError(f"not a 1-D array of token ids (shape {shape}, dtype {dtype})")
    need, held = int(shape[0]) * dtype.itemsize, len(data) - f.tell()
    if need > held:
        raise TokenIdsError(f"its header claims {shape[0]} ids ({need} bytes), the member holds {held} bytes")
    return np.frombuffer(data, dtype=dtype, count=int(shape[0]), offset=f.tell())
