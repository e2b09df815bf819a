"""The ``shardify`` console script: Ctrl-C and SIGTERM answered in one line from its first instant.

Importing streambatch and its command line takes a few tenths of a second (numpy, pyarrow, torch's pieces), and
the command line installs its signal handlers only once it runs: a signal meanwhile printed a KeyboardInterrupt
traceback (Ctrl-C) or ended the process without a word (SIGTERM). This module lies outside the package, since
importing any module inside it imports the package first, and installs handlers before that import: a signal
meanwhile ends the process with the command line's line and exit code (``shardify: interrupted``, 130;
``shardify: terminated``, 143) — nothing has been written yet. The command line's own handlers replace them
once it runs a command. A signal ignored when the process started (a background job's Ctrl-C) stays ignored.
``import streambatch`` sets no handler: this is the script's, not the library's.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

#: what a run stopped by a signal says, and its exit code (as :data:`streambatch.cli.STOPPED`)
_STOPPED: dict[int, tuple[bytes, int]] = {signal.SIGINT: (b"interrupted", 130), signal.SIGTERM: (b"terminated", 143)}


def _stop(signum: int, frame: FrameType | None) -> None:
    """A signal before the command line runs a command: say so and exit (nothing to clean up yet)."""
    what, code = _STOPPED[signum]
    os.write(2, b"shardify: " + what + b"\n")
    os._exit(code)


def main() -> int:
    """Install the early handlers, then import and run the ``shardify`` command line; its exit code."""
    for sig in _STOPPED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _stop)
    from streambatch.cli import main as shardify

    return shardify()
