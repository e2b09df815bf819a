"""Streams closed while the interpreter is still whole.

A script that stops iterating early (``next(iter(loader))``, a ``break``) and then exits leaves a stream's
generators suspended. Python closes them only while it tears the modules down, when a module's names may already
be ``None``: their ``except`` and ``finally`` clauses then fail with "Exception ignored in ..." noise on stderr,
and a reading thread may be left mid-request. `closed_at_exit()` closes such streams first, from ``atexit``.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Generator
from typing import Any

_open: weakref.WeakSet[Generator[Any, None, None]] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def closed_at_exit(stream: Generator[Any, None, None]) -> Generator[Any, None, None]:
    """``stream``, to be closed at interpreter exit if it is still open then (it is not kept alive for that)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(close_open_streams)
            _registered = True
        _open.add(stream)
    return stream


def close_open_streams() -> None:
    """Close every stream `closed_at_exit()` was given that is still open (a stream that fails to close
    is skipped: the process is ending)."""
    with _lock:
        streams = list(_open)
        _open.clear()
    for stream in streams:
        try:
            stream.close()
        except Exception:  # noqa: BLE001, S112 - exiting: one stream's failure must not keep the others open
            continue
