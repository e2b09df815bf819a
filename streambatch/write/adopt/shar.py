"""A lhotse Shar folder's transcripts: its tars hold each cut's audio (``<cut id>.flac`` + the recording's
``.json``), its ``cuts.NNNNNN.jsonl.gz`` files the cuts themselves, whose supervisions carry the text. ``shardify
index`` reads them so the adopted samples keep their transcripts (``batch["text"]``, ``--output-length``)."""

from __future__ import annotations

import gzip
import io
import re
from typing import Any

from ... import limits
from ...errors import ShardifyError
from ...io import storage

#: the cuts files of a Shar folder (lhotse writes them gzipped; plain JSON lines read too)
SHAR_CUTS = re.compile(r"^cuts\.\d+\.jsonl(?:\.gz)?$")


def shar_transcripts(src: str, storage_options: dict | None = None) -> dict[str, str]:
    """``{cut id: transcript}`` of every cut in the Shar folder ``src`` with text: its supervisions' texts in order,
    joined by a space (a cut without a supervision text has none)."""
    out: dict[str, str] = {}
    names = sorted(n for n in storage.listdir(src, storage_options) if SHAR_CUTS.match(n))
    for name in names:
        url = storage.join_url(src, name)
        with storage.open_url(url, "rb", storage_options) as raw:
            f: Any = gzip.open(raw) if name.endswith(".gz") else raw
            for n, line in enumerate(io.TextIOWrapper(f, encoding="utf-8"), 1):
                if line.strip():
                    _add(out, line, f"{url}:{n}")
    return out


def _add(out: dict[str, str], line: str, where: str) -> None:
    try:
        cut = limits.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardifyError(f"{where}: not a JSON line ({e}); a Shar cuts file holds one cut per line") from None
    if not isinstance(cut, dict) or not isinstance(cut.get("id"), str):
        raise ShardifyError(f"{where}: not a lhotse cut (a JSON object with an id)")
    sups = cut.get("supervisions")
    texts = (
        [s["text"] for s in sups if isinstance(s, dict) and isinstance(s.get("text"), str)]
        if isinstance(sups, list)
        else []
    )
    if texts:
        out[cut["id"]] = " ".join(t.strip() for t in texts)
