"""A ``where=`` filter keeps the same samples whichever path evaluates it: plain comparisons by Arrow in the
loader's process (no DuckDB, no engine process), anything else by DuckDB in the engine; NULL, NaN, -0.0, large
integers, non-ASCII strings and upper-case column names answer as DuckDB answers them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from conftest import SR, make_audio, popen, write_jsonl

from streambatch.select.where import Where, engine
from streambatch.select.where_arrow import compile_where
from streambatch.write.writer import write_shards

pytest.importorskip("duckdb")

NAN, INF = float("nan"), float("inf")
COLUMNS = {"f": "double", "i": "int64", "s": "string", "b": "bool", "Spk": "string", "g": "double"}


def _table() -> pa.Table:
    f = [1.0, NAN, -0.0, 0.0, INF, -INF, None, 7.5, 10.0, -3.25, 1e300, NAN, 2.675, 0.1, 7.0, None]
    g = [NAN, NAN, 0.0, -0.0, 1.0, None, 3.0, 7.5, 11.0, -3.25, INF, 2.0, 2.675, 0.3, 7.0, 1.0]
    i = [1, 2**62 + 1, 0, -5, None, 2**63 - 1, -(2**63), 7, 10, 3, 2**53 + 1, 2**53, 8, 0, 7, None]
    s = ["de", "en", "", None, "é", "z", "DE", "de ", "fr", "ß", "a'b", "en", "de", "zz", "😀", "e"]
    b = [True, False, None, True, False, True, None, False, True, True, False, False, True, None, True, False]
    spk = [f"spk{k % 3}" if k % 5 else None for k in range(16)]
    return pa.table(
        {
            "f": pa.array(f, pa.float64()),
            "i": pa.array(i, pa.int64()),
            "s": pa.array(s, pa.string()),
            "b": pa.array(b, pa.bool_()),
            "Spk": pa.array(spk, pa.string()),
            "g": pa.array(g, pa.float64()),
        }
    )


#: plain comparisons: the short path's
PLAIN = [
    "f < 7",
    "f <= 7.5",
    "f > 0",
    "f >= -0.0",
    "f = 0",
    "f <> 0",
    "f != 1",
    "f == 7",
    "f > 1e299",
    "f < -1e3",
    "f = 2.675",
    "f = 0.1",
    "g < f",
    "g = f",
    "g <> f",
    "g >= f",
    "f <= g",
    "i > 2",
    "i = 9223372036854775807",
    "i < -9223372036854775807",
    "i >= 4611686018427387905",
    "i = 9007199254740993",
    "i <= i",
    "s = 'de'",
    "s <> 'de'",
    "s < 'e'",
    "s >= 'é'",
    "s > ''",
    "s = 'a''b'",
    "s = 'ß' OR s = '😀'",
    "b",
    "NOT b",
    "b = TRUE",
    "b <> false",
    "b IS NULL",
    "b IS NOT NULL",
    "f IS NULL",
    "s IS NOT NULL AND f IS NOT NULL",
    "f IN (1, 7.5, 0)",
    "f NOT IN (1, 7.5)",
    "f IN (1, NULL)",
    "f NOT IN (1, NULL)",
    "i IN (7, 8, 2305843009213693952)",
    "s IN ('de', 'en', 'fr')",
    "s NOT IN ('de')",
    "f BETWEEN 0 AND 7.5",
    "f NOT BETWEEN -1 AND 1",
    "i BETWEEN 0 AND 9",
    "s BETWEEN 'd' AND 'f'",
    "spk = 'spk1'",
    '"SPK" = \'spk2\' OR "Spk" IS NULL',
    "SpK IN ('spk0', 'spk1')",
    "(f < 7 OR s = 'de') AND NOT (i > 5)",
    "NOT (f < 7 AND b)",
    "(f > 1) = b",
    "(f > 1) <> (s = 'de')",
    "f < 7 AND i > 2 AND s <> 'x' OR b",
    "TRUE",
    "NULL",
    "b OR NULL",
    "b AND TRUE",
    "NOT NULL",
    "-5 < i",
    "7 > f",
    "'de' = s",
]

#: everything else: DuckDB's, in the engine
OTHER = [
    "f > i",
    "i = f",
    "f + 1 > 2",
    "s LIKE 'd%'",
    "i = 1.5",
    "i > 2.5",
    "abs(f) < 2",
    "f = NULL",
    "1 = 1",
    "i = 7.0",
    "f > 1 -- a comment",
    "i = 1e3",
    "CAST(i AS DOUBLE) > 2",
    "f > 0.1234567890123456789",
]


@pytest.fixture(scope="module")
def checker():
    with engine() as e:
        yield e


@pytest.fixture(scope="module")
def answers(checker):
    """(expression -> DuckDB's answer in the engine) for every expression of PLAIN and OTHER."""
    table = _table()
    return {x: checker.keep(x, table) for x in PLAIN + OTHER}


@pytest.mark.parametrize("expr", PLAIN + OTHER)
def test_a_filter_keeps_what_duckdb_keeps(expr, answers, checker):
    assert (compile_where(expr, COLUMNS) is not None) == (expr in PLAIN)  # plain ones by Arrow, the rest by DuckDB
    got = Where(expr, COLUMNS, checker=checker).evaluate(_table(), within=checker)
    assert got.dtype == bool
    assert got.tolist() == answers[expr].tolist()


def test_random_plain_filters_keep_what_duckdb_keeps():
    """Combinations of comparisons under AND, OR and NOT, each answered as DuckDB answers it."""
    atoms = ["f < 7", "f = g", "g >= 0", "i > 3", "i IN (0, 7)", "s < 'e'", "b", "s IS NULL", "f BETWEEN 0 AND 8"]
    rng = np.random.default_rng(0)
    exprs = []
    for _ in range(60):
        a, b, c = (atoms[k] for k in rng.choice(len(atoms), 3, replace=False))
        op1, op2 = rng.choice(["AND", "OR"], 2)
        neg = "NOT " if rng.random() < 0.5 else ""
        exprs.append(f"{neg}({a} {op1} {b}) {op2} NOT {c}")
    table = _table()
    with engine() as e:
        for x in exprs:
            assert compile_where(x, COLUMNS) is not None
            assert Where(x, COLUMNS).evaluate(table).tolist() == e.keep(x, table).tolist(), x


_NO_DUCKDB = """
import json, sys
sys.modules["duckdb"] = None  # as where DuckDB is not installed
from streambatch import StreamBatchLoader
loader = StreamBatchLoader(sys.argv[1], budget=2 * 16000, where=sys.argv[2], decode="none")
keys = sorted(k for b in loader for k in b["keys"])
try:
    StreamBatchLoader(sys.argv[1], budget=2 * 16000, where="abs(snr) < 3")
    other = "ran"
except ImportError as e:
    other = "ImportError"
print(json.dumps({"keys": keys, "other": other}))
"""


def test_plain_filters_need_no_duckdb(tmp_path):
    """A filter of plain comparisons runs where DuckDB is not installed (no engine process to start); one that
    calls a function still needs it, and says so."""
    rows = []
    for k in range(24):
        path = f"wavs/c{k:02d}.wav"
        frames = make_audio(tmp_path / path, 0.1, seed=k)
        rows.append(
            {"audio_filepath": path, "duration": frames / SR, "snr": float(k % 8), "lang": "de" if k % 3 else "en"}
        )
    out = str(tmp_path / "ds")
    write_shards(str(write_jsonl(tmp_path / "m.jsonl", rows)), out, max_count=5, progress=False)
    where = "snr >= 2 AND lang IN ('de') OR snr = 7"
    proc = popen([sys.executable, "-c", _NO_DUCKDB, out, where], stdout=subprocess.PIPE)
    got, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"the loader exited with {proc.returncode}"
    result = json.loads(got)
    want = sorted(
        f"wavs__c{k:02d}" for k, r in enumerate(rows) if (r["snr"] >= 2 and r["lang"] == "de") or r["snr"] == 7
    )
    assert result == {"keys": want, "other": "ImportError"}


def test_the_short_path_reads_every_row_group_alike():
    """A table in several chunks, and a slice of one, give the answers of the whole."""
    table = _table()
    whole = Where("f < 7 OR s = 'de'", COLUMNS).evaluate(table)
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5, 6), table.slice(11)])
    assert Where("f < 7 OR s = 'de'", COLUMNS).evaluate(chunked).tolist() == whole.tolist()
    assert Where("f < 7 OR s = 'de'", COLUMNS).evaluate(table.slice(3, 9)).tolist() == whole[3:12].tolist()
