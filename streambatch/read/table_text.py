"""Transcripts from the sample table: a sample whose tar holds no text gets the index's ``text`` column as its
text, so ``batch["text"]`` carries it (an adopted NeMo dataset's tars hold only audio: ``shardify index`` stores
the manifest's transcripts there). The column is read per shard, from the shard's row group, when a batch holding
one of its samples is formed; the shards read last are kept.
"""

from __future__ import annotations

import collections
from typing import Any

from ..select.mixture import AnyIndex

TEXT_COLUMN = "text"
#: shards whose texts a worker keeps (a batch's samples come from the shards of one buffer window)
CACHED_SHARDS = 64


def has_text(sample: dict[str, Any]) -> bool:
    """Whether the sample's own members carry a text (a ``.txt``, or a ``.json`` ``text``)."""
    meta = sample.get("json")
    return "txt" in sample or (isinstance(meta, dict) and "text" in meta)


class TableText:
    """Gives each sample of a formed batch that has no text of its own its ``text`` from the sample table (as
    ``sample["__text__"]``, which `collate()` puts in ``batch["text"]``)."""

    def __init__(self, index: AnyIndex):
        self.index = index
        self.cache: collections.OrderedDict[int, list[Any] | None] = collections.OrderedDict()

    @classmethod
    def of(cls, index: AnyIndex | None) -> TableText | None:
        """One for an index with a ``text`` column; None otherwise (nothing to attach)."""
        return cls(index) if index is not None and index.has_column(TEXT_COLUMN) else None

    def __call__(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for s in batch:
            if not has_text(s):
                texts = self._texts(int(s["__shard__"]))
                if texts is not None:
                    s["__text__"] = texts[int(s["__index__"])]
        return batch

    def _texts(self, shard: int) -> list[Any] | None:
        if shard in self.cache:
            self.cache.move_to_end(shard)
            return self.cache[shard]
        texts = self.cache[shard] = self.index.shard_values(shard, TEXT_COLUMN)
        if len(self.cache) > CACHED_SHARDS:
            self.cache.popitem(last=False)
        return texts
