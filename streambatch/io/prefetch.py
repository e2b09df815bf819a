"""Opening an index's small sample files in the background while a loader is being built.

A loader plans its first epoch from the per-sample lengths in ``index.samples/``; on an object store each file
is a round trip (tenths of a second at 100 ms latency) paid when the first epoch starts. When every sample file is
small enough to be read whole and there are few of them, they are fetched concurrently in the background as soon
as the index is open, so that round trip overlaps with whatever the program does before it iterates (building its
model, the rest of the loader). A large index is left alone: its ranks read only the row groups their slots touch.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

#: at most this many sample files are opened ahead (each read whole, so each at most ``SMALL_PART_MAX`` bytes)
PREFETCH_PARTS = 16

_AHEAD: contextvars.ContextVar[bool] = contextvars.ContextVar("streambatch_lengths_ahead", default=False)


@contextlib.contextmanager
def lengths_ahead() -> Iterator[None]:
    """Indexes opened inside this block start opening their sample files at once (where
    `PartPrefetch.wanted()` finds it worth it), beside their shard table's read: a loader is about to plan
    from them. Elsewhere (the command line's ``inspect``, ``verify``, ...) an index reads only what it is asked."""
    token = _AHEAD.set(True)
    try:
        yield
    finally:
        _AHEAD.reset(token)


def asked() -> bool:
    """Whether the index being opened is opened inside `lengths_ahead()`."""
    return _AHEAD.get()


class PartPrefetch:
    """Sample files being opened ahead by a background thread of the process that started it.

    ``open_part(i)`` opens (and caches) file ``i``; errors are dropped here, as the planner's own read of that file
    reports them with its name. `wait()` returns once the opening is over, in the process that started it (a
    forked child has no such thread and opens its own files)."""

    def __init__(self, parts: Sequence[int], open_part: Callable[[int], object]):
        self._pid = os.getpid()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(list(parts), open_part), name="streambatch-index-prefetch", daemon=True
        )
        self._thread.start()

    @staticmethod
    def wanted(part_bytes: Sequence[int], small: int, remote: bool) -> list[int]:
        """The files worth opening ahead: all of them when the index is remote and every one is read whole (at
        most ``small`` bytes) and there are at most `PREFETCH_PARTS`; else none."""
        if not remote or not part_bytes or len(part_bytes) > PREFETCH_PARTS or max(part_bytes) > small:
            return []
        return list(range(len(part_bytes)))

    def _run(self, parts: list[int], open_part: Callable[[int], object]) -> None:
        try:
            with ThreadPoolExecutor(len(parts), thread_name_prefix="streambatch-index-prefetch") as pool:
                for f in [pool.submit(open_part, p) for p in parts]:
                    f.exception()  # wait; a failure is reported by the planner's own read
        finally:
            self._done.set()

    def wait(self) -> None:
        """Block until the files are open (no-op in another process than the one that started the opening)."""
        if os.getpid() == self._pid:
            self._done.wait()

    def __getstate__(self) -> dict[str, object]:
        """Pickled as finished: a process it is sent to opens its own files (`wait()` returns at once)."""
        return {"_pid": -1, "_done": None, "_thread": None}
