"""The parent's side of the filter engine: a child process (`where_engine`, run by path) that checks and
evaluates filters within a memory and a time limit, killed if it stops answering."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

import numpy as np

from . import where_engine
from .where_engine import HEAD, EngineError, require_duckdb, send


class Engine:
    """A child process that checks and evaluates filters within ``memory`` bytes (on top of what it maps at
    start) and ``seconds`` per request; a context manager (the child ends with it)."""

    #: seconds past twice the time limit after which a child that has not answered is killed
    grace = 10.0
    #: seconds a child may take to start (import DuckDB and Arrow) before it is given up
    startup = 120.0

    def __init__(self, memory: int, seconds: float):
        self.memory, self.seconds = int(memory), float(seconds)
        self.proc: subprocess.Popen[bytes] | None = None
        self._late = False

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            if importlib.util.find_spec("duckdb") is None:
                require_duckdb()  # the ImportError that says how to install it
            code = "import runpy, sys; del sys.path[0]; sys.argv[:] = sys.argv[1:]; runpy.run_path(sys.argv[0])"
            args = [sys.executable, "-c", code, where_engine.__file__, str(self.memory), repr(self.seconds)]
            try:
                self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            except OSError as e:
                raise EngineError(f"could not start the filter engine ({sys.executable}: {e})") from None
            assert self.proc.stdout is not None
            try:
                self._answer(self.proc.stdout.fileno(), self.startup)  # its "ready"
            except EngineError:
                late, self._late = self._late, False
                self.close(kill=True)
                why = f"did not start in {self.startup:g} s" if late else "ended as it started (its error is above)"
                raise EngineError(f"the filter engine (a DuckDB child process) {why}") from None
        return self.proc

    def check(self, expr: str, columns: dict[str, str]) -> None:
        """Refuse (EngineError) anything but one deterministic true/false expression over ``columns``."""
        self._ask(expr, [json.dumps({"expr": expr, "columns": columns}).encode()])

    def keep(self, expr: str, table: Any) -> np.ndarray:
        """Which rows of an Arrow table ``expr`` keeps (`evaluate()`, in the child)."""
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        answer = self._ask(expr, [json.dumps({"expr": expr}).encode(), sink.getvalue().to_pybytes()])
        keep = np.frombuffer(answer, dtype=np.uint8).astype(bool)
        if len(keep) != table.num_rows:
            raise EngineError(f"{len(keep)} results for {table.num_rows} rows")
        return keep

    def _ask(self, expr: str, frames: list[bytes]) -> bytes:
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        self._late = False
        try:
            for i, frame in enumerate(frames):
                send(proc.stdin, b"J" if i == 0 else b"A", frame)
            kind, payload = self._answer(proc.stdout.fileno(), 2 * self.seconds + self.grace)
        except (BrokenPipeError, EngineError):
            late = self._late
            code = self.close(kill=late)  # one stuck past its own interrupt: nothing else stops it
            raise self._gone(late, code) from None
        if kind == b"M":
            self.close()  # a child out of memory ends after saying so
        if kind != b"K":
            raise EngineError(self._why(kind, payload.decode(errors="replace")))
        return payload

    def _answer(self, fd: int, wait: float) -> tuple[bytes, bytes]:
        """The child's next answer; EngineError if it ends first or takes more than ``wait`` seconds (for a
        request: twice the time limit at which the child interrupts itself, and `grace`)."""
        deadline = time.monotonic() + wait
        head = self._read(fd, HEAD.size, deadline)
        kind, n = HEAD.unpack(head)
        return kind, self._read(fd, n, deadline)

    def _read(self, fd: int, n: int, deadline: float) -> bytes:
        parts: list[bytes] = []
        while n > 0:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._late = True
                raise EngineError("late")
            data = os.read(fd, min(n, 1 << 20))
            if not data:
                raise EngineError("ended")
            parts.append(data)
            n -= len(data)
        return b"".join(parts)

    def _gone(self, late: bool, code: int | None) -> EngineError:
        """Why the child stopped answering: out of time (killed), or ended while working (a library that
        aborts when an allocation fails: most likely the memory cap), or another end."""
        if late:
            return EngineError(self._why(b"T"))
        if code is not None and code < 0:
            return EngineError(
                f"the filter engine ended (signal {-code}) while evaluating it, most likely for want of memory "
                f"(over {self.memory >> 20} MiB for one row group: raise STREAMBATCH_FILTER_MEMORY "
                "if it really needs more)"
            )
        return EngineError(f"the filter engine (a DuckDB child process) ended unexpectedly (exit code {code})")

    def _why(self, kind: bytes, what: str = "") -> str:
        if kind == b"M":
            return (
                f"it needs more than {self.memory >> 20} MiB of memory for one row group (raise "
                "STREAMBATCH_FILTER_MEMORY if it really does)"
            )
        if kind == b"T":
            return (
                f"it took more than {self.seconds:g} s for one row group (raise "
                "STREAMBATCH_FILTER_SECONDS if it really does)"
            )
        return what

    def close(self, kill: bool = False) -> int | None:
        """End the child (closing its input ends it; one that does not, or with ``kill``, is killed); its exit
        status (None: there was none)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if kill:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
