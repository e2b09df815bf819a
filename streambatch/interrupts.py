"""A signal handler's KeyboardInterrupt, raised only where Python can unwind it.

A signal handler runs between two bytecodes of whatever the main thread runs. Where that is a Python function a C
library calls back (soundfile's virtual file I/O, which libsndfile calls through cffi), an exception cannot
propagate: cffi prints ``Exception ignored from cffi callback`` with a traceback, hands C a default value, and the
interrupt is lost. Receiving a tensor's file descriptor from a DataLoader worker (multiprocessing's resource
sharer) is the same in effect: cut in the middle, the worker prints the broken connection's traceback.
`Interrupter` raises KeyboardInterrupt at once, unless the code interrupted is one of those: then it has the
same signal sent to the thread again a moment later, and its handler raises it then, once that code has returned.
A finalizer (``__del__``: a DataLoader iterator's, stopping its workers, as a pass ends) is the same: what it raises
is printed as ``Exception ignored in`` and dropped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from types import FrameType

#: where an exception must not be raised: (file name, function names, None: all of them) — soundfile's code
#: (its callbacks from libsndfile, and its objects half-opened or half-closed around a C handle: an interrupt there
#: left a handle to be freed twice at exit, "double free or corruption", once in 60 interrupted decodes), and
#: multiprocessing's receiving of a file descriptor from another process
_UNINTERRUPTIBLE: dict[str, frozenset[str] | None] = {"soundfile.py": None, "resource_sharer.py": frozenset({"detach"})}
#: seconds between two looks at whether the code the signal interrupted has returned
RETRY_AFTER = 0.005
#: the longest an interrupt is held back (seconds): then it is raised wherever the code is
MAX_DELAY = 2.0


def uninterruptible(frame: FrameType | None) -> bool:
    """Whether ``frame`` (a signal handler's) or one of its callers is code an exception must not be raised in."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":  # a finalizer: Python prints what it raises and drops it
            return True
        name = os.path.basename(frame.f_code.co_filename)
        if name in _UNINTERRUPTIBLE:
            names = _UNINTERRUPTIBLE[name]
            if names is None or frame.f_code.co_name in names:
                return True
        frame = frame.f_back
    return False


class Interrupter:
    """Raises KeyboardInterrupt for a signal handler (`interrupt()`), holding it back while the interrupted
    code is a callback from C (`uninterruptible()`) — once `arm()` has started the thread that sends the
    signal again (a handler cannot start one: threading's own locks may be held by the code it interrupted);
    `pending` says one is held back, and `close()` drops it (the handler is gone)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the interrupt held back now first came
        self.closed = False
        self._again: tuple[int, int] | None = None  # (thread, signal) to interrupt again
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """Start the thread that sends a held-back signal again (before the handler is needed, not in it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._resend, name="streambatch-interrupt", daemon=True)
            self._thread.start()

    @property
    def pending(self) -> bool:
        """An interrupt is held back: the next delivery of the signal is its retry, not a new signal."""
        return self.since is not None and not self.closed

    def interrupt(self, signum: int, frame: FrameType | None) -> None:
        """Raise KeyboardInterrupt, as Ctrl-C does; or, while ``frame`` is in code an exception must not be raised
        in (for at most `MAX_DELAY` seconds), have ``signum`` sent to this thread again in
        `RETRY_AFTER` seconds and return (the handler calls this again then)."""
        now = time.monotonic()
        since = now if self.since is None else self.since
        armed = self._thread is not None and not self.closed
        if armed and now - since < MAX_DELAY and uninterruptible(frame):
            self.since, self._again = since, (threading.get_ident(), signum)
            self._wake.set()
            return
        self.since = None
        signal.default_int_handler(signum, frame)

    def _resend(self) -> None:
        """The armed thread: send the held-back signal again, `RETRY_AFTER` seconds after each request."""
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(RETRY_AFTER)
            if self.pending and self._again is not None:
                with contextlib.suppress(OSError):  # the thread is gone: nothing left to interrupt
                    signal.pthread_kill(*self._again)

    def close(self) -> None:
        """Drop an interrupt held back (its handler is no longer installed)."""
        self.closed = True
