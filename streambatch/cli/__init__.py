"""The ``shardify`` command: write (whole, as parts, resumed), index (existing tars), merge, stage, inspect,
verify, export, upgrade, demo, calibrate — one module per subcommand, named as it is, each with ``HELP`` and
``DESCRIPTION`` (and an ``EPILOG`` where it has one), ``add_arguments(parser)`` and ``run(args)`` (its exit
code); `build_parser()` builds the parser from them and `main()` turns errors into exit codes.

Exit codes: 0 success; 1 ``verify`` found mismatches, or an unexpected error (one line; the traceback
with ``STREAMBATCH_DEBUG=1``); 2 an error of one of `EXIT_2` — the kinds of
`streambatch.errors`: the options (bad arguments, bad input records, a non-empty output folder, an unknown
storage scheme), the data (a bad shard or index, unreadable audio), the storage (no index, missing credentials,
retries exhausted, no room) and the state — and an OS error about a path the user gave (denied, of the wrong kind).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import gc
import os
import re
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..errors import KINDS, NO_SPACE_ERRNOS, InputErrors
from ..interrupts import Interrupter
from ..io.lock import writers
from . import calibrate, demo, export, index, inspect, merge, stage, upgrade, verify, write
from .args import PROG, os_error_text

#: the subcommands, in the order ``shardify --help`` lists them
COMMANDS = (write, index, merge, stage, inspect, verify, export, upgrade, demo, calibrate)

#: the width a laid-out help's description is wrapped at
HELP_WIDTH = 79

#: the kinds of error reported in one line with exit code 2 (each raised on purpose, its message says what and where)
EXIT_2 = KINDS

#: OS errors about the paths a user gave (permissions, a file where a folder belongs, ...) or their room (no
#: space, a quota, a file size limit): exit 2, one line
INPUT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EROFS, errno.ENOENT}
INPUT_ERRNOS |= NO_SPACE_ERRNOS


def build_parser() -> argparse.ArgumentParser:
    """The ``shardify`` parser with every subcommand of `COMMANDS`."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``shardify`` parser and each subcommand's, by name."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write, inspect and verify length-annotated WebDataset shards for streambatch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subcommands = {}
    for command in COMMANDS:
        name = command.__name__.rsplit(".", 1)[-1]
        epilog = getattr(command, "EPILOG", None)
        laid_out = bool(epilog and "\n" in epilog)  # an epilog laid out in lines (examples) is printed as written
        p = sub.add_parser(
            name,
            help=command.HELP,
            description=textwrap.fill(command.DESCRIPTION, HELP_WIDTH) if laid_out else command.DESCRIPTION,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter if laid_out else argparse.HelpFormatter,
        )
        command.add_arguments(p)
        p.set_defaults(func=command.run)
        subcommands[name] = p
    return parser, subcommands


def _parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; an argument the command does not take is a usage error of that command (its usage, not
    the top-level one), naming the closest option it has."""
    parser, subcommands = _parsers()
    args, unknown = parser.parse_known_args(argv)
    if not unknown:
        return args
    command = subcommands.get(getattr(args, "command", None) or "")
    if command is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    options = sorted(set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", command.format_help())))
    flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=", 1)[0]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6) if flag.startswith("-") else []
    hint = f"; did you mean {close[0]}?" if close else f"; `{PROG} {args.command} --help` lists its options"
    command.error(f"unrecognized argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}{hint}")
    raise AssertionError("argparse's error() exits")  # pragma: no cover


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardify`` with ``argv`` (default: the process's arguments); returns the exit code."""
    program = argv is None  # the process's own run: nothing may change its exit code once the command is done
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not getattr(args, "func", None):
        build_parser().print_help(sys.stderr)
        return 2
    with _Signals(program) as signals:
        if args.func is calibrate.run:  # runs the user's step: its errors keep their full traceback
            return _calibrate(args, signals)
        return _run(args, signals)


def _run(args: argparse.Namespace, signals: _Signals) -> int:
    """Run the command; its exit code (errors and interrupts reported in one line)."""
    try:
        code = int(args.func(args))
    except KeyboardInterrupt:
        return signals.stopped()
    except Exception as e:
        if signals.got is not None:  # the signal reached a worker first and broke the pool: it is still the cause
            return signals.stopped()
        return _failed(e)
    signals.done = True
    return code


def _calibrate(args: argparse.Namespace, signals: _Signals) -> int:
    """Run ``calibrate``: an interrupt is one line, as for every command (its trial process is stopped by then);
    what the user's own code raises keeps its traceback (calibrate reports its own errors in one line)."""
    try:
        code = int(calibrate.run(args))
    except KeyboardInterrupt:
        return signals.stopped()
    except Exception:
        if signals.got is not None:  # the interrupt broke the step first: it is still the cause
            return signals.stopped()
        raise
    signals.done = True
    return code


#: what a run ended by a signal says, and its exit code: Ctrl-C, or the SIGTERM of a scheduler (SLURM, Kubernetes)
STOPPED: dict[int, tuple[str, int]] = {signal.SIGINT: ("interrupted", 130), signal.SIGTERM: ("terminated", 143)}
#: seconds after the first signal during which another one is ignored (the cleanup it started runs: workers get
#: 2 s to unwind); a signal after that ends the process at once, without cleaning up
FORCE_AFTER = 5.0


class _Signals:
    """SIGINT and SIGTERM while a command runs: the first raises KeyboardInterrupt in the main thread (each
    writer's cleanup runs: workers stopped, temporary files removed, the lock released) — as soon as the code it
    lands in can unwind it, never inside a callback from C (`Interrupter`); another
    within `FORCE_AFTER` seconds is ignored, a later one ends the process at once. Once the command's writes
    are complete (its writer has released its lock after succeeding: only its report is left) or the command is
    done, they are ignored; then the handlers set before come back (``program``: they stay ignored until the process
    exits), so a late Ctrl-C cannot turn a finished run into a failure. A process forked meanwhile (a DataLoader
    worker, a calibration trial) inherits the handler but not its job: there Ctrl-C is left to this process, which
    stops it, and SIGTERM ends it quietly."""

    def __init__(self, program: bool) -> None:
        self.program, self.done = program, False
        self.got: int | None = None  # the first signal
        self.first_at = 0.0
        self.before: dict[int, Any] = {}
        self.finished = 0  # the writers of this process that had finished before the command
        self.pid = os.getpid()
        self.interrupter = Interrupter()
        self.sigchld: Any = None  # the SIGCHLD handler set aside once stopping (see _children_may_end)

    def __enter__(self) -> _Signals:
        self.finished = writers()[1]
        if threading.current_thread() is threading.main_thread():
            for sig in STOPPED:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (a background job): left ignored
                    self.interrupter.arm()
                    self.before[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done = True
        self.interrupter.close()
        if self.got is not None:  # what the interrupted run held (DataLoader workers, shared tensors) ends now,
            gc.collect()  # with its modules still there, not in the interpreter's teardown (whose errors it prints)
        for sig, before in self.before.items():
            signal.signal(sig, signal.SIG_IGN if self.program else before)
        if self.sigchld is not None:
            signal.signal(signal.SIGCHLD, self.sigchld)

    def handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:  # a forked process (see the class)
            if signum != signal.SIGINT:
                os._exit(128 + signum)
            return
        running, finished = writers()
        if self.done or (not running and finished > self.finished):  # the command's writes are complete
            return
        if self.got is None:
            self.got, self.first_at = signum, time.monotonic()
            self._children_may_end()
            self.interrupter.interrupt(signum, frame)  # KeyboardInterrupt, as Ctrl-C
            return
        if self.interrupter.pending:  # the first one, sent again: the code it came in has returned by now
            self.interrupter.interrupt(signum, frame)
            return
        if time.monotonic() - self.first_at > FORCE_AFTER:
            os.write(2, f"{PROG}: {STOPPED[self.got][0]} again: exiting without cleaning up\n".encode())
            os._exit(STOPPED[self.got][1])

    def _children_may_end(self) -> None:
        """Stopping: a child process that ends now (a DataLoader worker the same signal reached) is expected, so
        torch's SIGCHLD handler, which raises about it wherever the main thread is, is set aside until the end."""
        if hasattr(signal, "SIGCHLD") and callable(signal.getsignal(signal.SIGCHLD)):
            self.sigchld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def stopped(self) -> int:
        """Say why the run stopped; its exit code (130 for Ctrl-C, 143 for SIGTERM). An interrupt still held back
        (the run ended on an error the signal caused first) is dropped: it would land in the exit's cleanup."""
        self.interrupter.close()
        what, code = STOPPED[self.got if self.got is not None else signal.SIGINT]
        print(f"{PROG}: {what}", file=sys.stderr)
        return code


def _failed(e: Exception) -> int:
    """Report an error in one line and give its exit code: 2 for an error of a kind of `EXIT_2` (and an OS
    error about a path the user gave), 1 for anything else."""
    if isinstance(e, InputErrors):
        print(f"{PROG}: error: {e}", file=sys.stderr)
        print(f"{PROG}: fix them, or pass --on-error skip to write the rest", file=sys.stderr)
        return 2
    if isinstance(e, EXIT_2):
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, BrokenPipeError):  # output piped into head & co.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    debug = os.environ.get("STREAMBATCH_DEBUG") == "1"
    if isinstance(e, OSError) and e.errno in INPUT_ERRNOS and not debug:
        print(f"{PROG}: error: {os_error_text(e)}", file=sys.stderr)  # the user's paths, not our bug
        return 2
    if debug:
        raise e
    msg = (str(e).strip().splitlines() or [""])[0]
    print(
        f"{PROG}: unexpected error: {type(e).__name__}: {msg} (STREAMBATCH_DEBUG=1 shows the traceback)",
        file=sys.stderr,
    )
    return 1
