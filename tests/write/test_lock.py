"""One writer per folder (issue #25, item 5): two ``shardify`` writers into one folder never both run; a writer
killed while holding the lock does not block the next one; the parts of an array job still run together."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import popen

from streambatch.io.lock import (
    _HELD,
    HOLDER_SUFFIX,
    LOCK_NAME,
    PART_LOCK_NAME,
    STALE_AFTER,
    LockHeld,
    _FileLock,
    is_lock_file,
    output_lock,
)

SHARDIFY = [sys.executable, "-m", "streambatch.cli"]
ROWS = [{"id": f"s{i}", "text": " ".join(["word"] * (1 + i % 17))} for i in range(40)]


def _text_source(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SHARDIFY, *args], capture_output=True, text=True, timeout=300)


def _wait_for_lock(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    """The info a running writer wrote beside its lock file (once it has)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the writer exited with {proc.returncode} before taking its lock"
        try:
            return json.loads(Path(str(path) + HOLDER_SUFFIX).read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    pytest.fail(f"no lock at {path} after {timeout} s")


def _blocked_writer(tmp_path: Path, out: Path) -> tuple[subprocess.Popen, Path, dict]:
    """A ``shardify write`` holding OUT's lock while it waits for its source (a FIFO nobody writes yet)."""
    fifo = tmp_path / "slow.jsonl"
    os.mkfifo(fifo)
    proc = popen([*SHARDIFY, "write", str(fifo), str(out), "--kind", "text", "--no-progress"], stderr=subprocess.PIPE)
    return proc, fifo, _wait_for_lock(out / LOCK_NAME, proc)


def _feed(fifo: Path) -> None:
    with open(fifo, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)


def test_second_writer_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "out"
    first, fifo, info = _blocked_writer(tmp_path, out)
    second = _run("write", str(_text_source(tmp_path / "other.jsonl")), str(out), "--no-progress")
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    for part in (f"pid {info['pid']}", f"host {info['host']}", info["since"], str(out / LOCK_NAME), "slow.jsonl"):
        assert part in lines[0]
    _feed(fifo)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert not [n for n in os.listdir(out) if is_lock_file(n)]  # a clean exit leaves no lock (nor its holder) behind
    assert _run("verify", str(out), "--no-progress").returncode == 0


def test_two_writers_started_together(tmp_path):
    """Two writers started at once into one empty folder: exactly one succeeds, the other exits 2 (the folder is
    locked, or already holds the first one's dataset), and the dataset there verifies."""
    a, b = _text_source(tmp_path / "a.jsonl"), tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({**r, "text": r["text"] + " more"}) + "\n" for r in ROWS))
    out = tmp_path / "out"
    procs = [popen([*SHARDIFY, "write", str(s), str(out), "--no-progress"], stderr=subprocess.PIPE) for s in (a, b)]
    codes = [p.wait(timeout=300) for p in procs]
    assert sorted(codes) == [0, 2], codes
    loser = procs[codes.index(2)].stderr.read().decode()
    assert "is being written by another shardify" in loser or "is not empty" in loser, loser
    verified = _run("verify", str(out), "--no-progress")
    assert verified.returncode == 0, verified.stdout
    assert "40 samples" in verified.stdout


def test_killed_writer_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    first, _, info = _blocked_writer(tmp_path, out)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert (out / LOCK_NAME).exists()  # what the killed writer left
    second = _run("write", str(_text_source(tmp_path / "src.jsonl")), str(out), "--no-progress")
    assert second.returncode == 0, second.stderr
    assert "taking over the lock of a writer that did not finish" in second.stderr
    assert f"pid {info['pid']}" in second.stderr
    assert _run("verify", str(out), "--no-progress").returncode == 0


def test_lock_file_of_a_dead_pid_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    out.mkdir()
    left = {"host": "elsewhere", "pid": dead.pid, "since": "2020-01-01T00:00:00+00:00", "command": "shardify write x"}
    (out / LOCK_NAME).write_text(json.dumps(left))
    done = _run("write", str(_text_source(tmp_path / "src.jsonl")), str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert f"pid {dead.pid}" in done.stderr and "did not finish" in done.stderr
    assert not (out / LOCK_NAME).exists()


def test_a_holder_file_a_dead_writer_left_blocks_no_one(tmp_path):
    """The holder's details beside a free lock (its writer died): the next writer is not refused, names the dead
    one in its warning, and leaves neither file behind; a part (a shared holder) takes over the same way."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    src = _text_source(tmp_path / "src.jsonl")
    for args in (["--no-progress"], ["--part", "0/1", "--no-progress"]):
        out = tmp_path / f"out{len(args)}"
        out.mkdir()
        left = {"host": "a-host", "pid": dead.pid, "since": "2020-01-01T00:00:00+00:00", "command": "shardify write"}
        (out / (LOCK_NAME + HOLDER_SUFFIX)).write_text(json.dumps(left))
        done = _run("write", str(src), str(out), *args)
        assert done.returncode == 0, done.stderr
        assert f"pid {dead.pid}" in done.stderr and "did not finish" in done.stderr
        assert not [n for n in os.listdir(out) if is_lock_file(n)]


def test_parts_run_together_but_not_beside_a_whole_write(tmp_path):
    """While part 1 of 2 runs (its lock held here), part 0 writes; a whole write, a merge and a second run of
    part 1 are refused naming it. Then part 1 writes and the merged dataset verifies."""
    src, out = _text_source(tmp_path / "src.jsonl"), tmp_path / "out"
    with output_lock(str(out), (1, 2)):
        assert (out / PART_LOCK_NAME.format(1)).exists()
        part0 = _run("write", str(src), str(out), "--part", "0/2", "--no-progress")
        assert part0.returncode == 0, part0.stderr
        whole, again = ["write", str(src), str(out), "--overwrite"], ["write", str(src), str(out), "--part", "1/2"]
        for args in (whole, ["merge", str(out)], again):
            refused = _run(*args)
            assert refused.returncode == 2, (args, refused.stderr)
            assert f"pid {os.getpid()}" in refused.stderr and "another shardify" in refused.stderr, refused.stderr
    part1 = _run("write", str(src), str(out), "--part", "1/2", "--no-progress")
    assert part1.returncode == 0, part1.stderr
    assert _run("merge", str(out)).returncode == 0
    assert _run("verify", str(out), "--no-progress").returncode == 0
    assert not [n for n in os.listdir(out) if is_lock_file(n)]


def test_parts_started_together_all_write(tmp_path):
    src, out = _text_source(tmp_path / "src.jsonl"), tmp_path / "out"
    procs = [
        popen([*SHARDIFY, "write", str(src), str(out), "--part", f"{i}/3", "--no-progress"], stderr=subprocess.PIPE)
        for i in range(3)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0, 0], [p.stderr.read() for p in procs]
    merged = _run("merge", str(out))
    assert merged.returncode == 0, merged.stderr
    assert _run("verify", str(out), "--no-progress").returncode == 0


def test_second_stage_into_one_folder_waits_then_keeps_the_copy(tmp_path):
    """Staging is once per node: a second stage into the same folder (nodes sharing a disk, a requeued job) waits
    for the first, saying whom it waits for, and then finds the copy done."""
    src = tmp_path / "ds"
    assert _run("write", str(_text_source(tmp_path / "src.jsonl")), str(src), "--no-progress").returncode == 0
    dest = tmp_path / "staged"
    assert _run("stage", str(src), str(dest), "--no-progress").returncode == 0
    with output_lock(str(dest)):
        waiting = popen([*SHARDIFY, "stage", str(src), str(dest), "--no-progress"], stderr=subprocess.PIPE, text=True)
        said = waiting.stderr.readline()  # blocks until the stage says it waits
        assert "waiting for another shardify" in said and f"pid {os.getpid()}" in said
        assert waiting.poll() is None  # still waiting while the lock is held
    waiting.communicate(timeout=300)
    assert waiting.returncode == 0
    assert _run("verify", str(dest), "--no-progress").returncode == 0


def test_second_index_into_one_folder_is_refused(tmp_path):
    ds = tmp_path / "ds"
    assert _run("write", str(_text_source(tmp_path / "src.jsonl")), str(ds), "--no-progress").returncode == 0
    with output_lock(str(ds)):
        refused = _run("index", str(ds), "--overwrite", "--no-progress")
    assert refused.returncode == 2 and f"pid {os.getpid()}" in refused.stderr, refused.stderr
    assert _run("index", str(ds), "--overwrite", "--no-progress").returncode == 0


def test_file_lock_without_flock(tmp_path):
    """The lock where flock is not available (object storage): a live holder refuses, a lock file of a dead pid
    on this host or not renewed for STALE_AFTER seconds (another host) is taken over."""
    url = str(tmp_path / LOCK_NAME)
    first = _FileLock(url, None)
    assert first.acquire(shared=False) is None
    assert _FileLock(url, None).acquire(shared=False) is _HELD  # its pid (this process) is alive
    first.release()
    assert not os.path.exists(url)
    other = {"host": "another-host", "pid": 1, "since": "2020-01-01T00:00:00+00:00", "command": "shardify write"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    assert _FileLock(url, None).acquire(shared=False) is _HELD  # renewed just now
    old = time.time() - STALE_AFTER - 60
    os.utime(url, (old, old))
    taken = _FileLock(url, None)
    assert taken.acquire(shared=False)["host"] == "another-host"
    assert json.loads(open(url).read())["pid"] == os.getpid()
    taken.release()
    assert not os.path.exists(url)


HOLD_AND_FORK = """
import os, sys, time
from streambatch.io.lock import output_lock
with output_lock(sys.argv[1]):
    if os.fork() == 0:  # a worker of the writer: it outlives a writer killed with kill -9
        time.sleep(300)
        os._exit(0)
    print("locked", flush=True)
    time.sleep(300)
"""


def test_lock_of_a_killed_writer_is_free_while_its_workers_still_run(tmp_path):
    """A writer killed with ``kill -9`` whose forked workers still run (they end on their own later): its lock
    is released with the writer itself, and the next write takes it over at once."""
    out = tmp_path / "out"
    holder = popen([sys.executable, "-c", HOLD_AND_FORK, str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    second = _run("write", str(_text_source(tmp_path / "src.jsonl")), str(out), "--no-progress")
    assert second.returncode == 0, second.stderr
    assert "taking over the lock of a writer that did not finish" in second.stderr
    assert f"pid {holder.pid}" in second.stderr
    assert _run("verify", str(out), "--no-progress").returncode == 0


def test_one_process_holds_a_folder_lock_once(tmp_path):
    """Two writers of one process (threads of a notebook, say) into one folder: the second is refused naming
    this process, as one in another process is."""
    out = tmp_path / "out"
    with output_lock(str(out)):
        with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
            with output_lock(str(out)):
                pass
        with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
            with output_lock(str(out), (0, 2)):
                pass
        other = _run("write", str(_text_source(tmp_path / "src.jsonl")), str(out), "--no-progress")
        assert other.returncode == 2 and f"pid {os.getpid()}" in other.stderr  # still held after the refusals
    with output_lock(str(tmp_path / "out")):  # released: free again
        pass
