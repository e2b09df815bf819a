"""Worker processes that end with the process that started them.

A pool worker outlives a parent killed by SIGKILL unless it is told otherwise: it sleeps on its task queue
forever and holds the parent's inherited pipes open (a caller's ``communicate()`` never returns).
`die_with_parent()` is the pool initializer that prevents it: Linux's parent-death signal, and a thread
that watches the parent for the platforms (and the race) the signal does not cover.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
#: how often the watch thread looks at the parent (seconds)
WATCH_INTERVAL = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends; False where that is
    not available (another OS, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet waited for, does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: kill(pid, 0) is all there is


def watch_parent(parent: int, interval: float = WATCH_INTERVAL) -> threading.Thread:
    """Start a daemon thread that SIGKILLs this process once ``parent`` has died (this process re-parented,
    or ``parent`` gone)."""
    ppid = os.getppid()

    def watch() -> None:
        while os.getppid() == ppid and alive(parent):
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Thread(target=watch, name="streambatch-parent-watch", daemon=True)
    t.start()
    return t


def die_with_parent(parent: int | None = None) -> None:
    """Pool initializer (``initargs=(os.getpid(),)``): end this worker when ``parent`` (default: this
    process's parent) dies, even by SIGKILL, so a killed ``shardify write`` strands no worker."""
    parent = os.getppid() if parent is None else parent
    set_parent_death_signal()
    if not alive(parent):  # died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    watch_parent(parent)
