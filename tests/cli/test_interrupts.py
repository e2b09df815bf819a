"""Interrupts: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) and SIGTERM (from SLURM,
Kubernetes, ``timeout``) end a write promptly with one line (``shardify: interrupted``, 130; ``shardify:
terminated``, 143), its workers gone and nothing left in the output folder but whole shards, so the next run
finishes it; a signal once the command is done does not turn its success into a failure. And an error about
read-only storage names the file the write failed on, not the lock."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import members, popen, proc_table

from streambatch.cli import main
from streambatch.io.lock import LOCK_NAME

#: generous: a loaded machine may be slow, a hang must fail the test, not hang it
TIMEOUT = 120
SHARDIFY = [sys.executable, "-m", "streambatch.cli"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """120 short utterances: one shard each is far more than is written between a shard's appearing and a
    signal's arriving."""
    from streambatch.synthetic import write_audio_corpus

    folder = tmp_path_factory.mktemp("interrupts") / "audio"
    write_audio_corpus(str(folder), 120, seed=1, fmt="wav")
    return str(folder)


def _write(corpus: str, out: Path, *extra: str, **kw) -> subprocess.Popen:
    cmd = [*SHARDIFY, "write", corpus, str(out), "--max-count", "1", "--no-progress", *extra]
    return popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Wait for ``path`` to appear while ``proc`` runs (the write is under way)."""
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert proc.poll() is None, f"the write ended ({proc.returncode}) before {path.name}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"{path.name} did not appear in {TIMEOUT} s"
        time.sleep(0.002)


def _ended(proc: subprocess.Popen) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of a signalled run; a run that does not end fails the test (the
    process group is killed by conftest's teardown)."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end in {TIMEOUT} s after the signal (hung)")
    return proc.returncode, out, err


def _no_process_left(proc: subprocess.Popen) -> None:
    """No process of the run's session (its workers) still runs."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        table = proc_table()
        left = [p for p in members([proc.pid], table) if table[p][1] not in "ZX"]
        if not left:
            return
        assert time.monotonic() < deadline, f"processes of the run still run: {left}"
        time.sleep(0.05)


def _only_whole_shards(out: Path) -> None:
    """What an interrupted write leaves: whole shards, no lock, no temporary file, no index yet."""
    names = sorted(os.listdir(out)) if out.exists() else []
    stray = [n for n in names if not (n.startswith("shard-") and n.endswith(".tar"))]
    assert not stray, f"left in {out}: {stray}"


def _finishes(corpus: str, out: Path) -> None:
    """The next run (--resume) finishes the dataset, and it verifies."""
    done = subprocess.run(
        [*SHARDIFY, "write", corpus, str(out), "--max-count", "1", "--no-progress", "--resume"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    check = subprocess.run(
        [*SHARDIFY, "verify", str(out), "--no-progress"], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert check.returncode == 0, check.stdout + check.stderr


def _interrupted(corpus: str, out: Path, signals: list[int], group: bool, workers: int = 2) -> tuple[int, str]:
    """Start a write, send ``signals`` (to the process group, or to the main process only) once it has written
    its second shard; its exit code and stderr, once it has ended with all its processes."""
    proc = _write(corpus, out, "--workers", str(workers))
    _wait_for(out / "shard-000001.tar", proc)
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.01)
        os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
    code, _, err = _ended(proc)
    _no_process_left(proc)
    return code, err


@pytest.mark.parametrize("signals, runs", [(1, 6), (2, 2)], ids=["ctrl-c", "double-ctrl-c"])
def test_ctrl_c_with_workers_ends_promptly_in_one_line(corpus, tmp_path, signals, runs):
    """A race (a worker interrupted while it takes its next task) hung the run now and then, or printed the
    workers' tracebacks: the workers leave Ctrl-C to the parent, which stops them. A second Ctrl-C while the
    first one's cleanup runs does not cut it short (nor hang the exit)."""
    for i in range(runs):
        out = tmp_path / f"out{i}"
        code, err = _interrupted(corpus, out, [signal.SIGINT] * signals, group=True)
        assert (code, err.strip()) == (130, "shardify: interrupted")
        _only_whole_shards(out)
    _finishes(corpus, out)


@pytest.mark.parametrize(
    "group, workers", [(False, 2), (True, 2), (False, 1)], ids=["main-process", "process-group", "single-process"]
)
def test_sigterm_cleans_up_like_ctrl_c(corpus, tmp_path, group, workers):
    """SIGTERM to the main process (Kubernetes, timeout) or to all of them (SLURM): the cleanup of Ctrl-C, its
    own line and exit code."""
    out = tmp_path / "out"
    code, err = _interrupted(corpus, out, [signal.SIGTERM], group=group, workers=workers)
    assert (code, err.strip()) == (143, "shardify: terminated")
    _only_whole_shards(out)
    _finishes(corpus, out)


def test_a_signal_after_the_summary_keeps_the_success(corpus, tmp_path):
    """Once the summary is printed the dataset is complete: a Ctrl-C while the process exits changes nothing."""
    for i in range(3):
        out = tmp_path / f"out{i}"
        proc = _write(corpus, out, "--max-count", "40", env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = proc.stdout.readline()
        assert line.startswith("wrote 120 samples"), line + proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)
        code, _, err = _ended(proc)
        assert (code, err) == (0, "")
        check = subprocess.run([*SHARDIFY, "verify", str(out), "--no-progress"], capture_output=True, timeout=TIMEOUT)
        assert check.returncode == 0


def test_a_process_pool_left_on_an_interrupt_stops_its_workers(tmp_path):
    """The pool behind write, index and verify: left on an interrupt, it stops a worker in the middle of a task
    (whose cleanup runs) instead of waiting for the task to end."""
    script = f"""
import os, sys, time
from streambatch.write.probe import process_pool

def task(path):
    open(path, "w").close()
    try:
        time.sleep(600)
    finally:
        os.remove(path)

marker = {str(tmp_path / "running")!r}
try:
    with process_pool(2, remote=False) as ex:
        ex.submit(task, marker)
        while not os.path.exists(marker):
            time.sleep(0.01)
        raise KeyboardInterrupt
except KeyboardInterrupt:
    print("stopped", os.path.exists(marker))
"""
    proc = popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, out, err = _ended(proc)
    assert (code, out.strip(), err) == (0, "stopped False", "")
    _no_process_left(proc)


# ---- read-only storage --------------------------------------------------------------------------------------
def _denied(real, match: str):
    """``real`` (os.replace, os.remove, os.open) raising EACCES where its path (a rename's target) ends in
    ``match``, as read-only storage does."""

    rename = real is os.replace

    def denied(path, *args, **kw):
        target = args[0] if rename else path
        if str(target).endswith(match):
            raise PermissionError(errno.EACCES, "Permission denied", str(path), None, *(args[:1] if rename else ()))
        return real(path, *args, **kw)

    return denied


def test_the_lock_release_does_not_hide_the_write_error(corpus, tmp_path, monkeypatch, capsys):
    """A folder made read-only mid-write: the error names the shard that could not be renamed; the lock file
    that could not be removed is a warning."""
    out = tmp_path / "out"
    monkeypatch.setattr(os, "replace", _denied(os.replace, ".tar"))
    monkeypatch.setattr(os, "remove", _denied(os.remove, LOCK_NAME))
    code = main(["write", corpus, str(out), "--max-count", "40", "--no-progress"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, err
    assert "shard-000000.tar.tmp-" in errors[0] and "permission denied" in errors[0], err
    assert LOCK_NAME not in errors[0]
    assert f"warning: could not remove the lock file {out / LOCK_NAME}" in err
    monkeypatch.undo()
    assert main(["write", corpus, str(out), "--max-count", "40", "--no-progress", "--resume"]) == 0  # takes it over


@pytest.fixture(scope="module")
def tars(corpus, tmp_path_factory) -> Path:
    """A folder of tars (and nothing else), to index."""
    folder = tmp_path_factory.mktemp("tars")
    assert main(["write", corpus, str(folder / "ds"), "--max-count", "40", "--no-progress"]) == 0
    for tar in (folder / "ds").glob("*.tar"):
        shutil.copy(tar, folder)
    shutil.rmtree(folder / "ds")
    return folder


def test_index_of_a_read_only_folder_says_to_pass_out(tars, monkeypatch, capsys):
    """The lock cannot be made beside the tars: the command says to pass --out, not that the lock is denied."""
    monkeypatch.setattr(os, "open", _denied(os.open, LOCK_NAME))
    code = main(["index", str(tars)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "pass --out DIR" in err and LOCK_NAME not in err


def test_index_of_a_really_read_only_folder(tars, tmp_path):
    """As above with the folder's permissions (as root: without the capabilities that ignore them)."""
    deny: list[str] = []
    if os.geteuid() == 0:
        caps = "--bounding-set=-dac_override,-dac_read_search,-fowner"
        if shutil.which("setpriv") is None or subprocess.run(["setpriv", caps, "true"]).returncode != 0:
            pytest.skip("running as root without setpriv: permissions cannot deny a folder")
        deny = ["setpriv", caps]
    ro = tmp_path / "ro"
    shutil.copytree(tars, ro)
    ro.chmod(0o555)
    try:
        p = subprocess.run([*deny, *SHARDIFY, "index", str(ro)], capture_output=True, text=True, timeout=TIMEOUT)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "pass --out DIR" in p.stderr and LOCK_NAME not in p.stderr
        idx = tmp_path / "idx"
        p = subprocess.run(
            [*deny, *SHARDIFY, "index", str(ro), "--out", str(idx)], capture_output=True, timeout=TIMEOUT
        )
        assert p.returncode == 0, p.stderr
        assert sorted(os.listdir(ro)) == sorted(os.listdir(tars))  # nothing new beside the tars
    finally:
        ro.chmod(0o755)
