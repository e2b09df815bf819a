"""The filter engine: DuckDB with file access, extensions and configuration locked, and, for anything a
``where=`` expression runs before it was proven harmless, a child process whose memory and time are bounded.

DuckDB's own ``memory_limit`` does not bound what an expression allocates (``repeat(text, 100000000)`` or
``range(100000000)`` grow past it), nor does it have a statement timeout. So the check of an expression and the
first pass over every row group (the planner's) run in a child process started for it: its address space is
capped (``RLIMIT_AS``: DuckDB then fails with a clean out-of-memory error), a watchdog thread interrupts a row
group that runs past its time limit, and the parent kills the child if even that does not stop it. The loader
keeps the child's answers (a bit a sample) and its workers read them: neither loads DuckDB.

The check admits only deterministic expressions (`refusal()`): DuckDB parses the expression and every
function it calls must be one DuckDB lists as *consistent* (the same answer for the same arguments, no side
effects), or a macro made only of such functions. Clocks, random numbers, sequences, sleeps, settings and the
session are refused by that rule, as are subqueries, aggregates and window functions (a filter sees one sample
at a time).

The child runs this module by path (``python <this file>``), so it imports nothing of streambatch there (only
DuckDB, Arrow and NumPy); in the package, `EngineError` derives from the package's root error. The
parent's handle on the child is `Engine`.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

#: DuckDB's configuration for filters: no file or network access, no extension loaded on demand, one thread
#: (nothing to fork mid-lock), nothing printed, and no statement may change it
CONFIG = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "threads": 1,
}
#: the settings that change what an expression answers, pinned for every connection (the planner's, the check's
#: and each worker's), so a rank never answers by its process's ``TZ`` or locale: time zone and calendar (DuckDB's
#: ICU extension reads them from the environment; they decide what a cast to TIMESTAMPTZ, DATE or a part such as
#: ``hour()`` gives), collation and ordering (``list_sort``, comparisons) and integer division. A setting this DuckDB
#: does not have (ICU's two, in a build without it: then its timestamps are UTC already) is left out
PINNED = {
    "TimeZone": "'UTC'",
    "Calendar": "'gregorian'",
    "default_collation": "''",
    "default_order": "'ASC'",
    "default_null_order": "'NULLS_LAST'",
    "integer_division": "false",
}
#: the node types an expression may hold (anything else, e.g. SUBQUERY, WINDOW, STAR, PARAMETER, is refused)
NODES = {"CONJUNCTION", "COMPARISON", "CONSTANT", "FUNCTION", "COLUMN_REF", "CAST", "CASE", "BETWEEN", "OPERATOR"}
NODES |= {"LAMBDA", "TYPE", "COLLATE"}
#: SQL's clock keywords (written without parentheses, so they parse as names)
_CLOCKS = {"current_timestamp", "current_time", "localtime", "localtimestamp"}
_CLOCK = "reads the clock, the session or a setting, so ranks and runs can disagree"
_TABLE = "streambatch_rows"
#: a message's head: its kind (one byte) and its length
HEAD = struct.Struct("<cQ")


def require_duckdb() -> Any:
    """The duckdb module, or an ImportError that says how to install it."""
    try:
        import duckdb
    except ImportError:
        raise ImportError("where= needs DuckDB: pip install 'streambatch[filters]'") from None
    return duckdb


def connect(memory: int) -> Any:
    """A DuckDB connection for filters (`CONFIG`, the settings of `PINNED`), its memory limit
    ``memory`` bytes."""
    con = require_duckdb().connect(config={**CONFIG, "memory_limit": f"{max(1, memory >> 20)}MB"})
    con.execute("SET enable_progress_bar = false")  # a connection's setting, not one of the database
    known = {str(r[0]) for r in con.execute("SELECT name FROM duckdb_settings()").fetchall()}
    for name, value in PINNED.items():
        if name in known:
            con.execute(f"SET {name} = {value}")
    con.execute("SET lock_configuration = true")
    return con


def evaluate(con: Any, expr: str, table: Any) -> np.ndarray:
    """Which rows of an Arrow table ``expr`` keeps (True; NULL is False), in row order; DuckDB errors as
    `EngineError` with DuckDB's first line (running out of memory or time as DuckDB raised it)."""
    duckdb = require_duckdb()
    try:
        rel = _select(con, expr, table)
        keep = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()  # a table, whole
    except (duckdb.OutOfMemoryException, duckdb.InterruptException):
        raise
    except duckdb.Error as e:
        raise EngineError(_first_line(e)) from None
    arr = truth(keep.column("keep").combine_chunks())
    if len(arr) != table.num_rows:
        raise EngineError(f"{len(arr)} results for {table.num_rows} rows")
    return np.asarray(arr, dtype=bool)


def truth(col: Any) -> np.ndarray:
    """Which values of an Arrow boolean (or all-NULL) array are true, NULL as false, read from its bit buffers
    (Arrow's ``fill_null(False)`` makes a scalar, which imports pandas: seconds in a fresh child)."""
    n, bits = len(col), np.zeros(len(col), dtype=bool)
    buffers = col.buffers()
    if len(buffers) < 2 or buffers[1] is None or n == 0:
        return bits  # the NULL type: nothing is true

    def unpack(buf: Any) -> np.ndarray:
        raw = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
        return raw[col.offset : col.offset + n].astype(bool)

    bits = unpack(buffers[1])
    if buffers[0] is not None and col.null_count:
        bits &= unpack(buffers[0])
    return bits


def result_type(con: Any, expr: str, table: Any) -> str:
    """The SQL type ``expr`` gives over ``table``'s columns."""
    return str(_select(con, expr, table).types[0]).upper()


def _select(con: Any, expr: str, table: Any) -> Any:
    duckdb = require_duckdb()
    try:
        return con.from_arrow(table).select(duckdb.SQLExpression(expr).alias("keep"))
    except (duckdb.OutOfMemoryException, duckdb.InterruptException):
        raise
    except duckdb.Error as e:
        raise EngineError(_first_line(e)) from None


def _first_line(e: BaseException) -> str:
    msg = re.sub(r"^[A-Za-z ]*Error: ", "", (str(e).strip().splitlines() or [""])[0]).rstrip("!")
    missing = re.match(r'Referenced column "(.+?)" not found', msg)
    return f"no column {missing.group(1)!r}" if missing else msg


try:
    from ..errors import UsageError as _Root
except ImportError:  # the child, run by path: no package around it
    _Root = Exception  # type: ignore[misc, assignment]


class EngineError(_Root):
    """What is wrong with a filter (one line, without the expression: the caller names it as an OptionError)."""


# ---- what an expression may call ------------------------------------------------------------------------
class Catalog:
    """DuckDB's functions by name: which are deterministic scalars, which macros (checked on first use)."""

    def __init__(self, con: Any):
        self.con = con
        if "stability" not in con.sql("SELECT * FROM duckdb_functions() LIMIT 0").columns:
            raise EngineError("this DuckDB does not say which functions are deterministic: upgrade DuckDB")
        rows = con.sql(
            "SELECT lower(function_name), function_type, stability, has_side_effects, parameters, macro_definition "
            "FROM duckdb_functions()"
        ).fetchall()
        self.kinds: dict[str, set[str]] = {}
        self.macros: dict[str, list[tuple[list[str], str]]] = {}
        for name, kind, stability, effects, params, definition in rows:
            self.kinds.setdefault(name, set()).add(str(stability) if kind == "scalar" and not effects else kind)
            if kind == "macro":
                self.macros.setdefault(name, []).append((list(params or []), str(definition)))
        self._done: dict[str, str | None] = {}

    def refusal(self, name: str) -> str | None:
        """Why function ``name`` may not be called in a filter (None: it may)."""
        if name not in self._done:
            self._done[name] = "calls itself"  # a macro that reaches itself again is refused
            self._done[name] = self._why(name)
        return self._done[name]

    def _why(self, name: str) -> str | None:
        kinds = self.kinds.get(name)
        if not kinds:
            return f"there is no function {name}()"
        if kinds & {"VOLATILE", "scalar"}:  # "scalar": one with side effects
            return f"{name}() is not deterministic (it gives other answers on other calls, ranks or runs)"
        if "CONSISTENT" in kinds:
            return None
        if "CONSISTENT_WITHIN_QUERY" in kinds:
            return f"{name}() {_CLOCK}"
        if "macro" in kinds:
            for params, definition in self.macros[name]:
                why = refusal(self, f"SELECT\n{definition}\nFROM {_TABLE}", set(params), {})
                if why:
                    return f"{name}() is a macro that is not allowed: {why}"
            return None
        if "aggregate" in kinds or "window" in kinds:
            return f"{name}() is an aggregate: a filter sees one sample at a time"
        return f"{name}() is not a scalar function"


def parse(con: Any, sql: str) -> dict[str, Any]:
    """DuckDB's syntax tree of one statement (`json_serialize_sql()`); EngineError if it is not one."""
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0])
    if tree.get("error"):
        raise EngineError(str(tree.get("error_message") or "syntax error"))
    if len(tree.get("statements", ())) != 1:
        raise EngineError("only an expression is allowed (no ';', no SELECT)")
    return tree["statements"][0]["node"]


def _one_expression(node: dict[str, Any]) -> Any:
    """The single select-list item of ``SELECT <expr> FROM <table>``, or EngineError if the text made more of it."""
    plain = (
        node.get("type") == "SELECT_NODE"
        and len(node.get("select_list", ())) == 1
        and (node.get("from_table") or {}).get("table_name") == _TABLE
        and not node.get("modifiers")
        and not (node.get("cte_map") or {}).get("map")
        and not node.get("group_expressions")
        and all(node.get(k) is None for k in ("where_clause", "having", "qualify", "sample"))
    )
    if not plain:
        raise EngineError("only an expression is allowed (no ';', no SELECT, no FROM or WHERE clause)")
    return node["select_list"][0]


def refusal(catalog: Catalog, sql: str, names: set[str], columns: dict[str, str]) -> str | None:
    """Why the expression of ``sql`` (``SELECT <expr> FROM <table>``) may not be a filter, or None. ``names``:
    the lower-case names it may refer to (columns, macro parameters); ``columns``: name each by its spelling."""
    try:
        expr = _one_expression(parse(catalog.con, sql))
    except EngineError as e:
        return str(e)
    return _walk(catalog, expr, names, columns)


def _walk(catalog: Catalog, node: Any, names: set[str], columns: dict[str, str]) -> str | None:
    """The first thing in ``node`` (a syntax tree, depth first) that a filter may not hold, or None."""
    if isinstance(node, list):
        return next((w for w in (_walk(catalog, v, names, columns) for v in node) if w), None)
    if not isinstance(node, dict):
        return None
    kind = node.get("class")
    if kind is None:
        return _walk(catalog, list(node.values()), names, columns)
    if kind not in NODES:
        what = str(node.get("type") or kind).lower().replace("_", " ")
        return f"a {what} is not allowed: a filter is one expression over one sample's columns"
    if kind == "COLUMN_REF":
        first = str(node["column_names"][0])
        if first.lower() in names:
            return None
        if first.lower() in _CLOCKS:
            return f"{first} {_CLOCK}"
        return catalog.refusal(first.lower()) if first.lower() in catalog.kinds else f"no column {first!r}"
    if kind == "LAMBDA":
        params = {str(c["column_names"][0]).lower() for c in _refs(node.get("lhs"))}
        return _walk(catalog, node.get("expr"), names | params, columns)
    if kind == "FUNCTION":
        why = catalog.refusal(str(node.get("function_name", "")).lower())
        if why:
            return why
    return _walk(catalog, [v for k, v in node.items() if k != "class"], names, columns)


def _refs(node: Any) -> list[dict[str, Any]]:
    """The column references in a lambda's parameter list."""
    if isinstance(node, dict):
        if node.get("class") == "COLUMN_REF":
            return [node]
        return [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def check(con: Any, catalog: Catalog, expr: str, columns: dict[str, str]) -> None:
    """Refuse (EngineError) anything but one deterministic true/false expression over ``columns``
    (``{name: arrow type}``)."""
    import pyarrow as pa

    why = refusal(catalog, f"SELECT\n{expr}\nFROM {_TABLE}", {k.lower() for k in columns}, columns)
    if why:
        raise EngineError(why)
    schema = pa.schema([(k, pa.type_for_alias(t)) for k, t in columns.items()])
    empty = pa.Table.from_batches([], schema=schema)  # (Schema.empty_table() imports pandas: seconds, for nothing)
    kind = result_type(con, expr, empty)
    if kind not in ("BOOLEAN", "NULL"):
        raise EngineError(f"it gives {kind}, not true/false (compare it: e.g. snr > 10)")


# ---- the child process ----------------------------------------------------------------------------------
def send(out: Any, kind: bytes, payload: bytes) -> None:
    out.write(HEAD.pack(kind, len(payload)) + payload)
    out.flush()


def _receive(inp: Any) -> tuple[bytes, bytes] | None:
    head = inp.read(HEAD.size)
    if len(head) < HEAD.size:
        return None
    kind, n = HEAD.unpack(head)
    return kind, inp.read(n)


def _cap_memory(memory: int) -> None:
    """Cap this process's address space at what it maps now plus ``memory`` bytes (on Linux; elsewhere only
    DuckDB's own ``memory_limit`` applies)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))
    except (ImportError, OSError, ValueError):
        pass


def _serve(inp: Any, out: Any, memory: int, seconds: float) -> None:
    """Answer requests until the parent closes the pipe: ``J`` {"expr", "columns"} checks an expression, ``J``
    {"expr"} then ``A`` (an Arrow IPC stream) evaluates it. Answers: ``K`` (a byte per row; empty for a check),
    ``E`` (why not, one line), ``M`` (out of memory: then the child ends, its memory in disarray) or ``T``
    (out of time)."""
    duckdb = require_duckdb()
    con = connect(memory)
    try:
        catalog: Catalog | str = Catalog(con)
    except EngineError as e:
        catalog = str(e)
    watchdog = _Watchdog(con.interrupt, seconds)  # its thread exists before the cap, as does everything else
    _cap_memory(memory)
    send(out, b"R", b"")  # ready: the parent's clock for each request starts after this
    while (msg := _receive(inp)) is not None:
        request = json.loads(msg[1])
        table = _read_table(inp) if "columns" not in request else None
        watchdog.arm()
        try:
            if table is None:
                if isinstance(catalog, str):
                    raise EngineError(catalog)
                check(con, catalog, request["expr"], request["columns"])
                answer = b""
            else:
                answer = evaluate(con, request["expr"], table).astype(np.uint8).tobytes()
            send(out, b"K", answer)
        except EngineError as e:
            send(out, b"E", str(e).encode())
        except RecursionError:
            send(out, b"E", b"the expression is nested too deeply")
        except (duckdb.OutOfMemoryException, MemoryError):
            send(out, b"M", b"")
            return
        except duckdb.InterruptException:
            send(out, b"T", b"")
        finally:
            watchdog.disarm()


class _Watchdog:
    """One thread that calls ``interrupt`` when a request runs past ``seconds`` (started once: under the
    memory cap a new thread per request might not start)."""

    def __init__(self, interrupt: Any, seconds: float):
        self.interrupt, self.seconds = interrupt, seconds
        self.deadline: float | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._run, name="streambatch-filter-watchdog", daemon=True).start()

    def arm(self) -> None:
        with self.cond:
            self.deadline = time.monotonic() + self.seconds
            self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.deadline = None
            self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while True:
                if self.deadline is None:
                    self.cond.wait()
                elif time.monotonic() >= self.deadline:
                    self.interrupt()
                    self.deadline = None
                else:
                    self.cond.wait(self.deadline - time.monotonic())


def _read_table(inp: Any) -> Any:
    import pyarrow as pa

    got = _receive(inp)
    return pa.ipc.open_stream(got[1] if got else b"").read_all()


def main() -> None:
    """The child: answers go to the pipe that was its standard output; anything a library prints goes to its
    standard error instead."""
    sys.setrecursionlimit(20_000)  # DuckDB's parser stops at 1,000 levels; the walk takes a few frames a level
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, answers, int(sys.argv[1]), float(sys.argv[2]))
    answers.flush()
    os._exit(0)  # every answer is sent: no interpreter teardown (DuckDB's takes a while) for the parent to wait on


if __name__ == "<run_path>":  # the child (run by path, so it imports nothing of streambatch)
    main()
