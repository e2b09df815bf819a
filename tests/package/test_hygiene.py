"""Nothing left running: `shardify write --workers N`'s pool ends with it, even after a `kill -9`, and the suite's
check (conftest.py) fails a test that leaves a process behind — including one outside the test's session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import (
    LONG_LIVED,
    TESTS,
    ProcessWatch,
    descendants,
    keep_running,
    kill_tree,
    make_audio,
    popen,
    proc_table,
    running,
)

from streambatch.procs import alive

pytest_plugins = ["pytester"]


def tree(pid: int) -> dict[int, int]:
    """The processes below ``pid`` now: pid → start time."""
    table = proc_table()
    return {p: table[p][2] for p in descendants(pid, (), table)}


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_write_strands_no_worker(tmp_path):
    """SIGKILL of `shardify write --workers 2` mid-write: its pool workers end within seconds, so the pipes they
    inherited close and a caller's communicate() returns."""
    for i in range(300):
        make_audio(tmp_path / "src" / f"u{i:04d}.wav", 0.02, seed=i)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "streambatch.cli",
        "write",
        str(tmp_path / "src"),
        str(out),
        "--max-count",
        "1",
        "--workers",
        "2",
        "--no-progress",
    ]
    proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_until(
        lambda: len(tree(proc.pid)) >= 2 and any(out.glob("shard-*.tar")) or proc.poll() is not None,
        60,
        "the write did not start its workers",
    )
    workers = tree(proc.pid)
    assert proc.poll() is None and len(workers) >= 2, "the write ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=10)  # returns only once no worker holds the pipes
    except subprocess.TimeoutExpired:
        pytest.fail(f"communicate() hangs: pool workers {running(workers)} outlived their parent, holding its pipes")
    wait_until(lambda: not running(workers), 5, f"pool workers still running: {running(workers)}")
    assert proc.returncode == -signal.SIGKILL


def test_the_parent_watch_alone_ends_an_orphan(tmp_path):
    """The fallback where Linux's parent-death signal is not there: the watch thread ends a process whose
    parent was SIGKILLed."""
    ready = tmp_path / "watching"
    code = (
        "import os, time; from streambatch.procs import watch_parent; watch_parent(os.getppid()); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(60)"
    )
    parent = popen(["bash", "-c", f'"{sys.executable}" -c "{code}" & wait'])
    wait_until(lambda: ready.exists(), 30, "the child did not start watching")
    child = tree(parent.pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    wait_until(lambda: not running(child), 5, f"the orphan {running(child)} still runs")


def test_the_check_names_a_left_process_and_not_an_ended_one():
    watch = ProcessWatch().start()
    leaked = subprocess.Popen(["sleep", "60"])  # deliberately left running
    ended = subprocess.Popen(["sleep", "0.2"])  # ends by itself within the grace
    try:
        left = watch.leftovers(grace=1.0)
        assert leaked.pid in left and ended.pid not in left
    finally:
        kill_tree(leaked.pid, grace=0)
        leaked.wait()
        ended.wait()


def test_the_check_finds_a_process_in_another_session_whose_parent_ended(tmp_path):
    """Like torchrun's ranks after torchrun is killed: in a session of their own, re-parented away from us."""
    pid_file = tmp_path / "pid"
    watch = ProcessWatch().start()
    subprocess.run(["bash", "-c", f"setsid sleep 60 & echo $! > {pid_file}; sleep 1"], check=True)
    orphan = int(pid_file.read_text())
    try:
        assert orphan in watch.leftovers(grace=0.5)
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_the_check_leaves_a_session_long_process_alone():
    server = subprocess.Popen(["sleep", "60"])
    keep_running(server.pid)
    watch = ProcessWatch().start()
    try:
        time.sleep(0.3)
        assert server.pid not in watch.leftovers(grace=0.1)
    finally:
        LONG_LIVED.discard(server.pid)
        server.kill()
        server.wait()


def test_a_leaky_test_fails_and_its_process_is_killed(pytester, tmp_path, monkeypatch):
    """The check at work in a real pytest run: the leaky test errors at teardown naming the process (which is
    then killed), the clean one passes, the session-long server is not counted."""
    pid_file = tmp_path / "leaked"
    pytester.makepyfile(
        test_inner=textwrap.dedent(f"""
        import subprocess, sys
        import pytest
        from conftest import LONG_LIVED, keep_running

        @pytest.fixture(scope="session")
        def server():
            p = subprocess.Popen(["sleep", "60"])
            keep_running(p.pid)
            yield p
            p.kill()
            p.wait()
            LONG_LIVED.discard(p.pid)

        def test_leaks(server):
            p = subprocess.Popen(["sleep", "61"])
            open({str(pid_file)!r}, "w").write(str(p.pid))

        def test_clean(server):
            subprocess.run(["true"], check=True)
    """)
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess("-p", "conftest", "-p", "no:cacheprovider", timeout=120)
    leaked = int(pid_file.read_text())
    try:
        result.assert_outcomes(passed=2, errors=1)
        result.stdout.fnmatch_lines(
            ["*ERROR at teardown of test_leaks*", f"*left 1 process(es) running*{leaked}: sleep 61*"]
        )
        assert not alive(leaked)
    finally:
        if alive(leaked):
            os.kill(leaked, signal.SIGKILL)


# --- the code's habits: lint, format and types, each configured in pyproject.toml ---------------------------------

ROOT = TESTS.parent


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``python -m NAME ARGS`` from the repository root (its pyproject.toml holds the tool's configuration)."""
    cmd = [sys.executable, "-m", name, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing_in_the_package():
    result = tool("ruff", "check", "streambatch")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_the_package_is_formatted():
    result = tool("ruff", "format", "--check", "streambatch")
    assert result.returncode == 0, f"run `ruff format streambatch`:\n{result.stdout[-5000:]}{result.stderr[-2000:]}"


def test_mypy_finds_nothing_in_the_package():
    result = tool("mypy")  # files and options from [tool.mypy] in pyproject.toml
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
