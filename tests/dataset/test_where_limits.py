"""What a ``where=`` filter may do: deterministic functions only (every rank and worker must keep the same
samples), within a bounded memory and time; whatever it may not do is one line naming the expression (an
:class:`OptionError`; ``shardify inspect --where`` exits 2), and an ordinary filter keeps what it kept before."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
from conftest import TESTS

from streambatch import StreamBatchLoader
from streambatch.cli import main
from streambatch.errors import OptionError
from streambatch.select.where import Where, engine
from streambatch.select.where_engine import EngineError
from streambatch.select.where_sandbox import Engine
from streambatch.write.writer import write_shards

pytest.importorskip("duckdb")

N = 80
TITLES = ("Alpha", "beta", "GAMMA", "delta", "Epsilon")


def row(i: int) -> dict:
    return {"id": f"s{i:03d}", "input_ids": list(range(1, 2 + (i * 7) % 45)), "title": f"{TITLES[i % 5]} {i}"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("where_limits")
    with open(d / "m.jsonl", "w") as f:
        for i in range(N):
            f.write(json.dumps(row(i)) + "\n")
    write_shards(str(d / "m.jsonl"), str(d / "shards"), progress=False, max_count=16)
    return str(d / "shards")


def kept_ids(dataset: str, where: str) -> list[str]:
    loader = StreamBatchLoader(dataset, budget=4000, seed=3, where=where)
    return sorted(k for b in loader for k in b["keys"])


# ---- only deterministic functions --------------------------------------------------------------------------
REFUSED = {
    "random() < 0.5": "random()",
    "uuid() IS NOT NULL": "uuid()",
    "gen_random_uuid() IS NULL": "gen_random_uuid()",
    "now() > TIMESTAMP '2020-01-01'": "now()",
    "current_timestamp > TIMESTAMP '2020-01-01'": "current_timestamp",
    "current_date > DATE '2020-01-01'": "current_date()",
    "setseed(0.5) IS NULL": "setseed()",
    "nextval('s') > 0": "nextval()",
    "sleep_ms(60000) IS NULL": "sleep_ms()",
    "pg_sleep(60) IS NULL": "pg_sleep()",  # a macro over sleep_ms
    "ago(INTERVAL 1 DAY) < TIMESTAMP '2020-01-01'": "ago()",  # a macro over the clock
    "current_setting('threads') = '1'": "current_setting()",
    "count(*) > 1": "aggregate",
    "row_number() OVER () < 10": "window",
}


@pytest.mark.parametrize("expr", list(REFUSED))
def test_non_deterministic_functions_are_refused_naming_the_expression(dataset, expr):
    with pytest.raises(OptionError) as e:
        StreamBatchLoader(dataset, budget=4000, where=expr)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"where={expr!r}: ") and REFUSED[expr] in msg
    assert "title (string)" in msg  # the columns there are


def test_cli_refuses_a_random_filter_with_exit_2(dataset, capsys):
    assert main(["inspect", dataset, "--where", "random() < 0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "random() < 0.5" in err[0] and "not deterministic" in err[0]


def test_a_second_statement_or_clause_is_refused(dataset):
    for expr in ("length > 1 FROM t WHERE random() < 0.5", "length > 1 -- x\n OR random() < 0.5"):
        with pytest.raises(OptionError, match=re.escape(f"where={expr!r}")):
            StreamBatchLoader(dataset, budget=4000, where=expr)


# ---- ordinary filters keep what they kept --------------------------------------------------------------------
ORDINARY = {
    "lower(title) LIKE '%a%'": lambda r: "a" in r["title"].lower(),
    "length < 20": lambda r: len(r["input_ids"]) < 20,
    "regexp_matches(title, '^[A-Z]') AND length >= 10": lambda r: r["title"][0].isupper() and len(r["input_ids"]) >= 10,
    "list_contains(list_transform([1, 2], lambda x: x * 3), length % 7)": lambda r: len(r["input_ids"]) % 7 in (3, 6),
}


@pytest.mark.parametrize("expr", list(ORDINARY))
def test_deterministic_filters_keep_the_same_samples(dataset, expr):
    want = sorted(r["id"] for r in map(row, range(N)) if ORDINARY[expr](r))
    assert want and len(want) < N
    assert kept_ids(dataset, expr) == want
    assert kept_ids(dataset, expr) == want  # and again: the same rows every time


def test_in_process_and_engine_answers_agree():
    """The workers evaluate in their own process what the engine evaluated in its child: the same answers."""
    table = pa.table({"title": [f"{TITLES[i % 5]} {i}" for i in range(5000)], "length": list(range(5000))})
    columns = {"title": "string", "length": "int64"}
    with engine() as e:
        w = Where("regexp_matches(title, 'a [0-9]*7$') OR length % 13 = 0", columns, checker=e)
        try:
            assert (w.evaluate(table, e) == w.evaluate(table)).all()
            assert 0 < w.evaluate(table).sum() < 5000
        finally:
            w.close()  # no DuckDB connection left in this process for later forks


# ---- bounded memory and time ------------------------------------------------------------------------------
PROBE = textwrap.dedent(
    """
    import json, os, resource, sys
    import pyarrow as pa
    from streambatch.select import where
    from streambatch.errors import OptionError

    os.environ["STREAMBATCH_FILTER_MEMORY"] = "256M"
    columns = {"title": "string", "length": "int64"}
    table = pa.table({"title": ["a", "b", "c"], "length": [1, 2, 3]})
    out = {}
    for expr in sys.argv[1:]:
        try:
            with where.engine() as e:
                where.Where(expr, columns, checker=e).evaluate(table, e)
            out[expr] = "kept"
        except OptionError as err:
            out[expr] = str(err)
    mib = lambda who: resource.getrusage(who).ru_maxrss / 1024
    # this process's own peak (VmHWM): ru_maxrss of RUSAGE_SELF starts from the parent's peak at fork+exec
    own = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
    out["rss"] = [own, mib(resource.RUSAGE_CHILDREN)]
    print(json.dumps(out))
    """
)
HUNGRY = ["length(repeat('a', 2000000000)) > 1", "len(range(200000000)) > 1", "length(repeat(title, 400000000)) > 1"]


def test_memory_hungry_filters_fail_in_one_line_within_the_bound():
    """Each would take 1.6 GB or more; with a 256 MiB limit each is one line naming it, and neither the
    process nor its filter engine grew past 1 GiB (peak resident memory)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *HUNGRY, "repeat('a', 2e9) IS NOT NULL"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for expr in HUNGRY:
        msg = out[expr]
        assert "\n" not in msg and msg.startswith(f"where={expr!r}: ")
        assert "256 MiB" in msg and "STREAMBATCH_FILTER_MEMORY" in msg  # DuckDB's error, or the engine ended by it
    assert out["repeat('a', 2e9) IS NOT NULL"].startswith("where=")  # refused (2e9 is no count)
    assert max(out["rss"]) < 1024, out["rss"]


def test_a_filter_that_runs_too_long_is_stopped(monkeypatch):
    """Minutes of work (a regular expression over 6,000 characters a row, 200,000 rows) with a 1 s limit:
    interrupted after the row group's limit, one line naming it and the limit."""
    monkeypatch.setenv("STREAMBATCH_FILTER_SECONDS", "1")
    n = 200_000
    table = pa.table({"title": ["abc"] * n, "length": list(range(n))})
    expr = "regexp_matches(repeat(title, 2000), '(a|b)*c(a|b)*d')"
    with engine() as e:
        w = Where(expr, {"title": "string", "length": "int64"}, checker=e)
        with pytest.raises(OptionError) as err:
            w.evaluate(table, e)
    msg = str(err.value)
    assert msg.startswith(f"where={expr!r}: it took more than 1 s") and "STREAMBATCH_FILTER_SECONDS" in msg


def test_an_engine_that_stops_answering_is_killed(monkeypatch):
    """Work that does not even stop at DuckDB's interrupt (here: a child frozen by SIGSTOP) is killed once
    twice its time limit and the grace have passed: the same one line, and no process is left."""
    monkeypatch.setattr(Engine, "grace", 0.5)
    table = pa.table({"length": [1, 2, 3]})
    with Engine(256 << 20, 0.2) as e:
        e.check("length > 1", {"length": "int64"})
        assert e.proc is not None
        os.kill(e.proc.pid, signal.SIGSTOP)
        with pytest.raises(EngineError, match=r"took more than 0\.2 s .*FILTER_SECONDS"):
            e.keep("length > 1", table)
        assert e.proc is None  # killed and reaped
        assert list(e.keep("length > 1", table)) == [False, True, True]  # a fresh child for the next request
