"""``shardify upgrade`` as a writer: a version 1 index rewritten as version 2 while holding the dataset folder's
lock (`lock`), as ``write``, ``index`` and ``merge`` do.

The upgrade reads the index and writes it again; without the lock a ``write --overwrite`` of the same folder
running meanwhile would have its new shards listed by the old index the upgrade writes last. Under the lock the
index is read and rewritten with no other writer in between, and an upgrade started while another writer holds
the folder is refused in one line naming it.
"""

from __future__ import annotations

import inspect

from ..errors import ShardifyError, os_problem
from ..format.index import INDEX_NAME, ShardIndex, is_index_file
from ..io import storage
from ..io.lock import Where, holds_lock


def index_file(url: str) -> str:
    """The index file of ``url``: a folder's ``index.json``, or the ``.json`` named."""
    url = str(url).rstrip("/") or "/"
    return url if is_index_file(url) else storage.join_url(url, INDEX_NAME)


def _folder(a: inspect.BoundArguments) -> Where:
    """The folder whose lock an upgrade of ``url`` holds: the one its index file is in."""
    folder = storage.parent_url(index_file(a.arguments["url"])) or "."
    return folder, None, a.arguments["storage_options"]


def _unwritable(folder: str, e: OSError) -> Exception:
    why = os_problem(e)
    return ShardifyError(f"{folder}: {why}: the index is rewritten in place, so its folder must be writable")


@holds_lock(_folder, unwritable=_unwritable)
def upgrade_dataset(
    url: str, storage_options: dict | None = None, progress: bool = True
) -> tuple[ShardIndex, str | None]:
    """Rewrite the version 1 index of ``url`` (a folder or index file) as version 2, under its folder's lock:
    the tables first, the index file last. Returns the index as it was, and the upgraded file's URL (None when
    it was version 2 already: nothing is written)."""
    index_url = index_file(url)
    before = ShardIndex.load(index_url, storage_options)
    if before.version >= 2:
        return before, None
    return before, before.save(index_url, storage_options, version=2, progress=progress)
