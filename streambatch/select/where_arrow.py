"""The short path of a ``where=`` filter: the plain comparisons most filters are (``language = 'de' AND snr > 10``,
``speaker IN ('a', 'b')``, ``snr BETWEEN 3 AND 9``, ``text IS NOT NULL``) evaluated by Arrow's compute kernels in
the loader's own process, so a filtered loader starts no DuckDB process for them.

SQL stays the front end and DuckDB the authority: `compile_where` reads one small part of DuckDB's grammar and
gives None for anything outside it (a function, arithmetic, LIKE, a cast, a comment, a keyword, a name that is not
exactly one column, types that DuckDB would cast in ways Arrow does not), and that expression then goes to the
engine (`where_engine`) as before, which checks it, gives its errors and evaluates it. What the short path admits it
evaluates as DuckDB does, so a rank keeps the same samples whichever path answered:

- three-valued logic (``AND``, ``OR``, ``NOT`` on NULL as SQL's; NULL keeps nothing);
- floating-point NaN is equal to NaN and greater than every other number (DuckDB's order), and -0.0 equals 0.0;
- an integer column is compared with integer literals and integer columns only, exactly (with a decimal literal
  DuckDB's exact decimal arithmetic, with a floating-point column its rounding: the engine's); a floating-point
  column with floating-point columns, integer literals up to 2**53 and decimal literals of at most 15 significant
  digits (each then one double, as DuckDB converts it); strings byte by byte (UTF-8, the pinned binary collation);
  booleans with TRUE and FALSE;
- ``x IN (a, b)`` is ``x = a OR x = b``; ``x BETWEEN a AND b`` is ``x >= a AND x <= b``.

Nothing here can allocate beyond a few arrays of one row group's length per node of the expression, or run longer
than a pass over them per node: the bounds the engine's child process enforces are not needed. The grammar is a
dozen rules, read by a hand-written recursive descent: an SQL parser library would cost more to import than the
engine's start this path saves. Arrow literals are built from buffers (`_array`): Arrow converts Python values
through a check that imports pandas, a slow import in a process that has not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from ..errors import UsageError

#: DuckDB's keywords that are not free to be a bare column name (``duckdb_keywords()`` of DuckDB 2.0, every
#: category but "unreserved"): a bare one in an expression goes to the engine
KEYWORDS = frozenset(
    """all analyse analyze and anti any array as asc asof asymmetric at authorization between bigint binary bit
    boolean both by case cast char character check coalesce collate collation column columns concurrently constraint
    create cross dec decimal default deferrable desc describe distinct do else end except exists extract false fetch
    float for foreign freeze from full generated glob group grouping grouping_id having ilike in initially inner
    inout int integer intersect interval into is isnull join lambda lateral leading left like limit map national
    natural nchar none not notnull null nullif numeric offset on only or order out outer overlaps overlay pivot
    pivot_longer pivot_wider placing position positional precision primary qualify real references returning right
    row select semi setof show similar smallint some struct substring summarize symmetric table tablesample then time
    timestamp to trailing treat trim true try_cast tuple union unique unpack unpivot using values varchar variadic
    verbose when where window with xmlattributes xmlconcat xmlelement xmlexists xmlforest xmlnamespaces xmlparse
    xmlpi xmlroot xmlserialize xmltable""".split()
)
#: the column types the short path reads (Arrow type names as the index header writes them), by kind
KINDS = {"int64": "int", "double": "float", "float64": "float", "string": "string", "bool": "bool"}
_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>'(?:[^']|'')*')
    | (?P<quoted>"(?:[^"]|"")+")
    | (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op><=|>=|<>|!=|==|=|<|>|\(|\)|,|-)
    )""",
    re.VERBOSE,
)
_SWAP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "<>": "<>"}
_EXACT_FLOAT = 2**53  # integers up to this magnitude are one double each
_INT64 = 2**63


class _Decline(UsageError):
    """The expression is outside the short path (the engine takes it): caught here, never raised to a caller."""


# ---- the syntax tree: values (columns, literals) and predicates -------------------------------------------------
@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # int, float, string, bool


@dataclass(frozen=True)
class Literal:
    value: Any  # int, float (from a decimal or exponent literal: ``text`` holds it), str, bool, or None (NULL)
    kind: str  # int, decimal, string, bool, null
    text: str = ""


@dataclass(frozen=True)
class Compare:
    op: str  # = <> < <= > >=
    left: Node
    right: Node
    kind: str  # the kind both sides are compared as: int, float, string, bool


@dataclass(frozen=True)
class In:
    column: Column
    values: tuple[Literal, ...]  # non-NULL, each of the column's kind
    has_null: bool


@dataclass(frozen=True)
class IsNull:
    operand: Node


@dataclass(frozen=True)
class Logic:
    op: str  # and, or, not
    args: tuple[Node, ...]


Node = Column | Literal | Compare | In | IsNull | Logic


# ---- reading it -------------------------------------------------------------------------------------------------
def _tokens(expr: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(expr):
        m = _TOKEN.match(expr, at)
        if m is None or m.end() == at:
            if expr[at:].strip():
                raise _Decline
            break
        kind = m.lastgroup
        assert kind is not None
        text = m.group(kind)
        if kind == "name" and text.lower() in ("and", "or", "not", "in", "is", "null", "between", "true", "false"):
            kind, text = "kw", text.lower()
        out.append((kind, text))
        at = m.end()
    return out


class _Parser:
    def __init__(self, expr: str, columns: dict[str, str]):
        self.toks = _tokens(expr)
        self.at = 0
        self.columns = columns
        self.lower: dict[str, list[str]] = {}
        for name in columns:
            self.lower.setdefault(name.lower(), []).append(name)

    def peek(self, kind: str | None = None, text: str | None = None) -> bool:
        if self.at >= len(self.toks):
            return False
        k, t = self.toks[self.at]
        return (kind is None or k == kind) and (text is None or t == text)

    def take(self, kind: str, text: str | None = None) -> str:
        if not self.peek(kind, text):
            raise _Decline
        self.at += 1
        return self.toks[self.at - 1][1]

    def whole(self) -> Node:
        node = self.disjunction()
        if self.at != len(self.toks):
            raise _Decline
        return _predicate(node)

    def disjunction(self) -> Node:
        args = [self.conjunction()]
        while self.peek("kw", "or"):
            self.at += 1
            args.append(self.conjunction())
        return args[0] if len(args) == 1 else Logic("or", tuple(_predicate(a) for a in args))

    def conjunction(self) -> Node:
        args = [self.negation()]
        while self.peek("kw", "and"):
            self.at += 1
            args.append(self.negation())
        return args[0] if len(args) == 1 else Logic("and", tuple(_predicate(a) for a in args))

    def negation(self) -> Node:
        if self.peek("kw", "not"):
            self.at += 1
            return Logic("not", (_predicate(self.negation()),))
        return self.comparison()

    def comparison(self) -> Node:
        left = self.operand()
        if self.peek("op") and self.toks[self.at][1] in ("=", "==", "<>", "!=", "<", "<=", ">", ">="):
            op = {"==": "=", "!=": "<>"}.get(self.toks[self.at][1], self.toks[self.at][1])
            self.at += 1
            return _compare(op, left, self.operand())
        if self.peek("kw", "is"):
            self.at += 1
            negated = self.peek("kw", "not")
            self.at += negated
            self.take("kw", "null")
            node: Node = IsNull(left)
            return Logic("not", (node,)) if negated else node
        negated = self.peek("kw", "not")
        if negated:
            self.at += 1
        if self.peek("kw", "in"):
            self.at += 1
            node = self.in_list(left)
        elif self.peek("kw", "between"):
            self.at += 1
            low = self.operand()
            self.take("kw", "and")
            high = self.operand()
            node = Logic("and", (_compare(">=", left, low), _compare("<=", left, high)))
        elif negated:
            raise _Decline
        else:
            return left
        return Logic("not", (node,)) if negated else node

    def in_list(self, left: Node) -> Node:
        if not isinstance(left, Column):
            raise _Decline
        self.take("op", "(")
        values = [self.literal()]
        while self.peek("op", ","):
            self.at += 1
            values.append(self.literal())
        self.take("op", ")")
        kept = tuple(_literal_as(v, left.kind) for v in values if v.kind != "null")
        return In(left, kept, any(v.kind == "null" for v in values))

    def operand(self) -> Node:
        if self.peek("op", "("):
            self.at += 1
            node = self.disjunction()
            self.take("op", ")")
            return node
        if self.peek("name") or self.peek("quoted"):
            kind, text = self.toks[self.at]
            self.at += 1
            if kind == "name" and text.lower() in KEYWORDS:
                raise _Decline
            name = text[1:-1].replace('""', '"') if kind == "quoted" else text
            found = self.lower.get(name.lower(), [])
            if len(found) != 1 or self.peek("op", "("):  # no such column, an ambiguous one, or a function
                raise _Decline
            typ = KINDS.get(self.columns[found[0]])
            if typ is None:
                raise _Decline
            return Column(found[0], typ)
        return self.literal()

    def literal(self) -> Literal:
        sign = ""
        if self.peek("op", "-"):
            self.at += 1
            sign = "-"
        if self.peek("number"):
            text = sign + self.take("number")
            if re.fullmatch(r"-?\d+", text):
                return Literal(int(text), "int", text)
            return Literal(float(text), "decimal", text)
        if sign:
            raise _Decline
        if self.peek("string"):
            return Literal(self.take("string")[1:-1].replace("''", "'"), "string")
        if self.peek("kw", "true") or self.peek("kw", "false"):
            return Literal(self.take("kw") == "true", "bool")
        if self.peek("kw", "null"):
            self.at += 1
            return Literal(None, "null")
        raise _Decline


def _kind(node: Node) -> str:
    """What a node gives: a column's or literal's kind, or bool for a predicate."""
    return node.kind if isinstance(node, (Column, Literal)) else "bool"


def _predicate(node: Node) -> Node:
    """``node`` where a truth value is needed: a predicate, a boolean column or TRUE/FALSE/NULL."""
    if _kind(node) not in ("bool", "null"):
        raise _Decline
    return node


def _literal_as(lit: Literal, kind: str) -> Literal:
    """A literal compared with a value of ``kind``, as DuckDB compares them exactly (else `_Decline`)."""
    if kind == "int" and lit.kind == "int" and -_INT64 <= lit.value < _INT64:
        return lit
    if kind == "float":
        if lit.kind == "int" and abs(lit.value) <= _EXACT_FLOAT:
            return Literal(float(lit.value), "float")
        if lit.kind == "decimal" and _short_decimal(lit.text):
            return Literal(lit.value, "float")
    if kind == lit.kind and kind in ("string", "bool"):
        return lit
    raise _Decline


def _short_decimal(text: str) -> bool:
    """Whether a number's text is one double however it is converted: at most 15 significant digits, at most 18
    after the point (DuckDB's decimal), and far from a double's overflow and underflow."""
    try:
        d = Decimal(text)
    except InvalidOperation:
        return False
    point = text.lower().split("e")[0].partition(".")[2]
    far = d == 0 or Decimal("1e-300") < abs(d) < Decimal("1e300")
    return len(d.normalize().as_tuple().digits) <= 15 and len(point) <= 18 and far


def _compare(op: str, left: Node, right: Node) -> Compare:
    if isinstance(left, Literal) and not isinstance(right, Literal):
        left, right, op = right, left, _SWAP[op]
    if isinstance(left, Literal):
        raise _Decline  # two literals: the engine's (a constant filter is rare)
    a = _kind(left)
    if isinstance(right, Literal):
        if right.kind == "null":
            raise _Decline
        return Compare(op, left, _literal_as(right, a), a)
    b = _kind(right)
    if a == b:
        return Compare(op, left, right, a)
    raise _Decline  # an integer column with a floating-point one: DuckDB rounds where Arrow refuses


# ---- evaluating it ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArrowWhere:
    """A filter the short path evaluates: ``keep(table)`` is which rows it keeps; ``used`` the columns it reads."""

    tree: Node
    used: list[str]

    def keep(self, table: Any) -> np.ndarray:
        """Which rows of an Arrow table (holding at least `used`) the expression keeps (NULL does not), in row
        order."""
        from .where_engine import truth

        n = table.num_rows
        if n == 0:
            return np.zeros(0, dtype=bool)
        got = _Evaluator(table).run(self.tree)
        return truth(got.combine_chunks() if hasattr(got, "combine_chunks") else got)


def compile_where(expr: str, columns: dict[str, str]) -> ArrowWhere | None:
    """The short path's filter for ``expr`` over ``columns`` (``{name: arrow type}``), or None: the engine's."""
    try:
        tree = _Parser(str(expr), dict(columns)).whole()
    except (_Decline, RecursionError):
        return None
    names: set[str] = set()
    _columns_of(tree, names.add)
    return ArrowWhere(tree, [c for c in columns if c in names])


def _columns_of(node: Node, add: Callable[[str], None]) -> None:
    if isinstance(node, Column):
        add(node.name)
    elif isinstance(node, Compare):
        _columns_of(node.left, add)
        _columns_of(node.right, add)
    elif isinstance(node, In):
        add(node.column.name)
    elif isinstance(node, IsNull):
        _columns_of(node.operand, add)
    elif isinstance(node, Logic):
        for a in node.args:
            _columns_of(a, add)


def _array(kind: str, values: Any, valid: bool = True) -> Any:
    """An Arrow array of ``values`` (a list or a numpy array; ``valid``: False makes every one NULL), built from
    buffers."""
    import pyarrow as pa

    n = len(values)
    nulls = None if valid else pa.py_buffer(np.zeros(max(1, (n + 7) // 8), dtype=np.uint8))
    if kind == "string":
        data = [str(v).encode() for v in values]
        offsets = np.zeros(n + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(d) for d in data], dtype=np.int64)
        return pa.Array.from_buffers(pa.large_string(), n, [nulls, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])
    if kind == "bool":
        bits = np.packbits(np.asarray(values, dtype=bool), bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), n, [nulls, pa.py_buffer(bits)])
    dtype, typ = (np.int64, pa.int64()) if kind == "int" else (np.float64, pa.float64())
    return pa.Array.from_buffers(typ, n, [nulls, pa.py_buffer(np.asarray(values, dtype=dtype))])


def _truths(n: int, value: bool | None) -> Any:
    """``n`` times TRUE, FALSE or NULL (None)."""
    return _array("bool", np.full(n, bool(value)), valid=value is not None)


#: where either side of a comparison is NaN, its answer by DuckDB's order: (both NaN, only the left, only the right)
_NAN_ANSWER = {
    "=": (True, False, False),
    "<>": (False, True, True),
    "<": (False, False, True),
    "<=": (True, False, True),
    ">": (False, True, False),
    ">=": (True, True, False),
}


class _Evaluator:
    """Arrow's compute functions over one table's columns, as SQL's three-valued logic and DuckDB's order."""

    def __init__(self, table: Any):
        import pyarrow.compute as pc

        self.pc, self.table, self.n = pc, table, table.num_rows

    def run(self, node: Node) -> Any:
        pc = self.pc
        if isinstance(node, Column):
            return self.table.column(node.name)
        if isinstance(node, Literal):  # TRUE, FALSE or NULL where a truth value is needed
            return _truths(self.n, node.value)
        if isinstance(node, IsNull):
            return pc.is_null(self.run(node.operand))
        if isinstance(node, Logic):
            args = [self.run(a) for a in node.args]
            if node.op == "not":
                return pc.invert(args[0])
            out = args[0]
            for a in args[1:]:
                out = (pc.and_kleene if node.op == "and" else pc.or_kleene)(out, a)
            return out
        if isinstance(node, In):
            return self.member(node)
        return self.compare(node)

    def member(self, node: In) -> Any:
        """``x IN (...)``: true where x equals one of the values, NULL where x is NULL (or, with a NULL in the
        list, where it equals none), else false."""
        pc = self.pc
        x = self.run(node.column)
        values = [v.value for v in node.values]
        if node.column.kind == "float":  # Arrow's set lookup tells -0.0 from 0.0; SQL's equality does not
            x = pc.add(x, _array("float", [0.0])[0])  # -0.0 + 0.0 is 0.0
            values = [v + 0.0 for v in values]
        found = pc.is_in(x, value_set=_array(node.column.kind, values)) if values else _truths(self.n, False)
        found = pc.if_else(pc.is_null(x), _truths(self.n, None), found)
        return pc.or_kleene(found, _truths(self.n, None)) if node.has_null else found

    def operand(self, node: Node) -> Any:
        if isinstance(node, Literal):
            return _array(node.kind, [node.value])[0]  # a scalar, broadcast
        return self.run(node)

    def compare(self, node: Compare) -> Any:
        pc = self.pc
        a, b = self.operand(node.left), self.operand(node.right)
        ops = {"=": pc.equal, "<>": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater}
        ieee = ops.get(node.op, pc.greater_equal)(a, b)
        nans = [self.nan(node.left, a), self.nan(node.right, b)]
        if node.kind != "float" or nans == [None, None]:
            return ieee
        # DuckDB orders NaN after every other number and equal to itself; Arrow's comparisons are IEEE's
        a_nan, b_nan = (_truths(self.n, False) if m is None else m for m in nans)
        cases = (pc.and_(a_nan, b_nan), pc.and_not(a_nan, b_nan), pc.and_not(b_nan, a_nan))
        answer = _truths(self.n, False)
        for case, true in zip(cases, _NAN_ANSWER[node.op]):
            answer = pc.or_(answer, case) if true else answer
        return pc.if_else(pc.or_(a_nan, b_nan), answer, ieee)

    def nan(self, node: Node, value: Any) -> Any:
        """Where a floating-point column is NaN (NULL where it is NULL); None for anything else (a literal is
        never NaN)."""
        import pyarrow.types as pt

        if not isinstance(node, Column) or not pt.is_floating(self.table.schema.field(node.name).type):
            return None
        return self.pc.is_nan(value)
