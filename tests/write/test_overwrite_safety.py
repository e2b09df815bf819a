"""``--overwrite`` keeps the old dataset until the new one is complete, ``--resume`` never replaces a finished one
(robustness probe, items 4 and 5).

A write into a local OUT with ``--overwrite`` that fails (an output that does not fit, an error met on the way) or
is interrupted (SIGINT) leaves OUT holding the old dataset, byte for byte; one killed outright (SIGKILL) leaves it
whole in ``OUT/.shardify-replaced``, and the next write puts it back (``--overwrite``: writes again, the old one
still kept until the new one is complete). ``--resume`` on a complete dataset of another command is refused, and
on this command's own changes nothing. The writes that are interrupted run ``shardify``'s own CLI in a process of
their own whose shard writer stalls after two shards (so a signal lands mid-write at a known point, not after a
guessed delay)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
from conftest import popen, samples_of, stop_tree

from streambatch.errors import OutputError, ShardifyError
from streambatch.io.lock import is_lock_file
from streambatch.write import writer
from streambatch.write.parts import merge_parts
from streambatch.write.publish import Aside
from streambatch.write.writer import write_shards

SHARDIFY = [sys.executable, "-m", "streambatch.cli"]
ASIDE = ".shardify-replaced"
#: ``shardify`` whose shard writer, after $STALL_AFTER shards, touches $STALL_READY and waits to be signalled
STALLING_SHARDIFY = """
import os, sys, time
from pathlib import Path
import streambatch.write.writer as w
from streambatch.cli import main

real, written = w.write_shard, []
def write_shard(task):
    if len(written) == int(os.environ["STALL_AFTER"]):
        Path(os.environ["STALL_READY"]).touch()
        while True:
            time.sleep(0.1)
    written.append(task.url)
    return real(task)
w.write_shard = write_shard
sys.exit(main(sys.argv[1:]))
"""
KW = dict(max_count=4, progress=False)


def _text(path: Path, n: int, word: str) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"{word}{i}", "text": f"{word} " * (3 + i % 11)}) + "\n" for i in range(n))
    )
    return path


@pytest.fixture
def sources(tmp_path) -> tuple[Path, Path]:
    """Two different sources: the old dataset's and the new one's."""
    return _text(tmp_path / "old.jsonl", 40, "old"), _text(tmp_path / "new.jsonl", 60, "new")


def _contents(out: Path) -> dict[str, str]:
    """Every file under OUT (the lock aside) and a hash of its bytes: what a user could tell apart."""
    files = [p for p in sorted(out.rglob("*")) if p.is_file() and not is_lock_file(p.name)]
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _shardify(*args: str, max_bytes: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:  # a file size limit: a write past it fails with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    preexec = limit if max_bytes is not None else None
    return subprocess.run([*SHARDIFY, *args], capture_output=True, text=True, timeout=300, preexec_fn=preexec)


def _verified(out: Path) -> str:
    done = _shardify("verify", str(out), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _old_dataset(src: Path, out: Path) -> tuple[dict[str, str], list[tuple]]:
    """The old dataset written into ``out``: its files and its samples, to compare with after a failed write."""
    assert _shardify("write", str(src), str(out), "--max-count", "4", "--no-progress").returncode == 0
    return _contents(out), samples_of(out)


def _stalled_overwrite(tmp_path: Path, src: Path, out: Path) -> subprocess.Popen:
    """A ``shardify write SRC OUT --overwrite`` stalled after writing two new shards."""
    ready = tmp_path / "stalled"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "STALL_AFTER": "2", "STALL_READY": str(ready), "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["write", str(src), str(out), "--overwrite", "--max-count", "4", "--no-progress"]
    proc = popen([sys.executable, "-c", STALLING_SHARDIFY, *args], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, f"the write exited with {proc.returncode}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "the write did not reach its third shard in 120 s"
        time.sleep(0.02)
    return proc


# ---- --overwrite ------------------------------------------------------------------------------------------
def test_interrupted_overwrite_puts_the_old_dataset_back(tmp_path, sources):
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    proc = _stalled_overwrite(tmp_path, sources[1], out)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        assert "holds the dataset that was there again" in proc.stderr.read()
    finally:
        stop_tree(proc)
    assert _contents(out) == files  # the old dataset, byte for byte, and nothing of the new one
    assert samples_of(out) == samples
    _verified(out)


def test_overwrite_that_does_not_fit_puts_the_old_dataset_back(tmp_path, sources):
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"id": f"b{i}", "text": "word " * (300 + i)}) + "\n" for i in range(40)))
    done = _shardify("write", str(big), str(out), "--overwrite", "--max-count", "4", "--no-progress", max_bytes=4096)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "file too large" in lines[0] and "holds the dataset that was there again" in lines[0]
    assert _contents(out) == files and samples_of(out) == samples
    _verified(out)


def test_overwrite_failing_midway_in_process_puts_the_old_dataset_back(tmp_path, sources, monkeypatch, capsys):
    """An error met while the shards are written (here raised by the third shard's writer) is raised again, and
    OUT holds the old dataset: a user error with the note in its one-line message, any other error as it was."""
    out = tmp_path / "out"
    write_shards(str(sources[0]), str(out), **KW)
    files, samples = _contents(out), samples_of(out)
    real, calls = writer.write_shard, []

    def failing(error: BaseException):
        def write_shard(task):
            calls.append(task)
            if len(calls) % 3 == 0:
                raise error
            return real(task)

        return write_shard

    monkeypatch.setattr(writer, "write_shard", failing(OutputError(f"{out}/shard-000002.tar: no space left")))
    with pytest.raises(OutputError, match="nothing was replaced: .* holds the dataset that was there again"):
        write_shards(str(sources[1]), str(out), overwrite=True, **KW)
    assert _contents(out) == files and samples_of(out) == samples
    monkeypatch.setattr(writer, "write_shard", failing(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OSError, match="Input/output error"):
        write_shards(str(sources[1]), str(out), overwrite=True, **KW)
    assert "holds the dataset that was there again" in capsys.readouterr().err
    assert _contents(out) == files and samples_of(out) == samples
    monkeypatch.undo()
    write_shards(str(sources[1]), str(out), overwrite=True, **KW)  # and a write that finishes replaces it
    assert len(samples_of(out)) == 60 and not (out / ASIDE).exists()


def test_killed_overwrite_is_put_back_by_the_next_write(tmp_path, sources):
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    proc = _stalled_overwrite(tmp_path, sources[1], out)
    try:
        proc.kill()
        proc.wait(timeout=60)
    finally:
        stop_tree(proc)
    assert "ok: 10 shards, 40 samples" in _verified(out / ASIDE)  # the old dataset is whole there, loadable
    done = _shardify("write", str(sources[0]), str(out), "--no-progress")  # no --overwrite: OUT is not empty
    assert done.returncode == 2
    assert f"put back the dataset it was replacing from {out / ASIDE}" in done.stderr
    assert "is not empty" in done.stderr
    assert _contents(out) == files and samples_of(out) == samples
    _verified(out)


def test_killed_overwrite_keeps_the_old_dataset_until_a_new_one_is_complete(tmp_path, sources):
    """After a kill, a second --overwrite that is interrupted too still gives the old dataset back; a third that
    finishes replaces it, leaving nothing aside."""
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    for sig in (signal.SIGKILL, signal.SIGINT):
        proc = _stalled_overwrite(tmp_path, sources[1], out)
        try:
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            stop_tree(proc)
    assert _contents(out) == files and samples_of(out) == samples
    done = _shardify("write", str(sources[1]), str(out), "--overwrite", "--max-count", "4", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "ok: 15 shards, 60 samples" in _verified(out)
    assert not [n for n in os.listdir(out) if n.startswith(ASIDE)]


def test_aside_folder_of_a_finished_write_is_removed(tmp_path, sources, monkeypatch, capsys):
    """Killed after the new index was written but before the old dataset was removed: the next write removes
    it and keeps the new dataset."""
    out = tmp_path / "out"
    write_shards(str(sources[0]), str(out), **KW)

    def killed(self) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(Aside, "discard", killed)
    with pytest.raises(SystemExit):
        write_shards(str(sources[1]), str(out), overwrite=True, **KW)
    monkeypatch.undo()
    new = samples_of(out)
    assert len(new) == 60 and (out / ASIDE).is_dir()
    stats: dict = {}
    write_shards(str(sources[1]), str(out), resume=True, stats=stats, **KW)
    assert stats["written"] == 0 and "removed" in capsys.readouterr().err
    assert samples_of(out) == new and not [n for n in os.listdir(out) if n.startswith(ASIDE)]


def test_failed_overwrite_of_a_part_keeps_its_old_files(tmp_path, sources, monkeypatch, capsys):
    """--part I/N --overwrite that fails puts that part's old files back (the merged index is removed, as the
    other parts may change meanwhile), and one killed leaves them aside without blocking the other parts:
    merging again gives the same dataset."""
    out = tmp_path / "out"
    for i in range(2):
        write_shards(str(sources[0]), str(out), part=(i, 2), **KW)
    merge_parts(str(out))
    samples = samples_of(out)

    def part0() -> dict[str, str]:
        return {n: h for n, h in _contents(out).items() if n.startswith(("shard-p0000", "index.part-0000"))}

    files = part0()

    def interrupted(task):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_shards(str(sources[0]), str(out), part=(0, 2), overwrite=True, **KW)
    assert part0() == files
    monkeypatch.setattr(Aside, "put_back", lambda *a: None)  # as if killed: nothing put back
    with pytest.raises(KeyboardInterrupt):
        write_shards(str(sources[0]), str(out), part=(0, 2), overwrite=True, **KW)
    monkeypatch.undo()
    assert (out / (ASIDE + "-part-0000")).is_dir() and not part0()
    write_shards(str(sources[0]), str(out), part=(1, 2), resume=True, **KW)  # another part's aside: no obstacle
    write_shards(str(sources[0]), str(out), part=(0, 2), resume=True, **KW)
    assert "put back the dataset it was replacing" in capsys.readouterr().err
    merge_parts(str(out))
    assert samples_of(out) == samples  # the part's shards back: only its index was written again
    assert {n: h for n, h in part0().items() if n.endswith(".tar")} == {
        n: h for n, h in files.items() if n.endswith(".tar")
    }


def test_overwrite_on_object_storage_removes_first(tmp_path, sources):
    """No cheap rename on object storage: the old files are removed first, as documented (nothing set aside)."""
    url = "memory://streambatch-overwrite/ds"
    fs = fsspec.filesystem("memory")
    if fs.exists("memory://streambatch-overwrite"):
        fs.rm("memory://streambatch-overwrite", recursive=True)
    try:
        write_shards(str(sources[0]), url, **KW)
        ix = write_shards(str(sources[1]), url, overwrite=True, **KW)
        assert ix.num_samples == 60
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(url, detail=False)]
        assert not [n for n in names if n.startswith(ASIDE)] and len([n for n in names if n.endswith(".tar")]) == 15
    finally:
        fs.rm("memory://streambatch-overwrite", recursive=True)


# ---- --resume -------------------------------------------------------------------------------------------
def _times(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if not is_lock_file(p.name)}


@pytest.mark.parametrize(
    "which, options", [(1, ["--max-count", "4"]), (0, ["--max-count", "5"]), (0, ["--max-count", "4", "--shuffle"])]
)
def test_resume_refuses_another_commands_dataset(tmp_path, sources, which, options):
    """Another source, or other options: refused in one line, not a file touched."""
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    times = _times(out)
    done = _shardify("write", str(sources[which]), str(out), "--resume", *options, "--no-progress")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{out} holds a dataset of another command" in lines[0] and "--overwrite" in lines[0]
    assert _times(out) == times and _contents(out) == files and samples_of(out) == samples


def test_resume_of_a_complete_dataset_touches_nothing(tmp_path, sources):
    """Nothing is removed or rewritten, so an interrupted or failed resume cannot take the dataset away."""
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    times = _times(out)
    done = _shardify("write", str(sources[0]), str(out), "--resume", "--max-count", "4", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "already complete, nothing to do" in done.stdout
    assert _times(out) == times and _contents(out) == files and samples_of(out) == samples


def test_resume_still_finishes_an_interrupted_write(tmp_path, sources):
    """A shard missing (an interrupted write, or one removed): the resume writes it and the index again."""
    out = tmp_path / "out"
    files, samples = _old_dataset(sources[0], out)
    (out / "shard-000003.tar").unlink()
    done = _shardify("write", str(sources[0]), str(out), "--resume", "--max-count", "4", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "wrote 1" in done.stdout and samples_of(out) == samples
    assert {n: h for n, h in _contents(out).items() if n.endswith(".tar")} == {
        n: h for n, h in files.items() if n.endswith(".tar")
    }
    _verified(out)


def test_write_with_bad_input_leaves_old_dataset_untouched(tmp_path, sources):
    out = tmp_path / "out"
    files, _ = _old_dataset(sources[0], out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\nnot json\n')
    done = _shardify("write", str(bad), str(out), "--overwrite", "--no-progress")
    assert done.returncode == 2 and _contents(out) == files
    with pytest.raises(ShardifyError):
        write_shards(str(bad), str(out), overwrite=True, **KW)
    assert _contents(out) == files and not (out / ASIDE).exists()


@pytest.mark.parametrize("stop_at", [1, 4, 12])
def test_killed_while_setting_aside_or_putting_back(tmp_path, sources, monkeypatch, stop_at):
    """A writer killed at any rename of setting the old dataset aside, or of putting it back: the next write puts
    it back whole (nothing new was written before every old file was aside)."""
    out = tmp_path / "out"
    write_shards(str(sources[0]), str(out), **KW)
    files, samples = _contents(out), samples_of(out)
    real_rename, real_replace, calls = os.rename, os.replace, []

    def killed_at(real):
        def rename(src, dst, *a, **k):
            calls.append(dst)
            if len(calls) == stop_at:
                raise SystemExit("killed")
            return real(src, dst, *a, **k)

        return rename

    monkeypatch.setattr(Aside, "put_back", lambda *a: None)  # killed: nothing put back in this process
    monkeypatch.setattr(os, "rename", killed_at(real_rename))
    with pytest.raises(SystemExit):
        write_shards(str(sources[1]), str(out), overwrite=True, **KW)
    monkeypatch.undo()
    write_shards(str(sources[0]), str(out), resume=True, **KW)  # puts it back: this command's, complete
    assert _contents(out) == files and samples_of(out) == samples

    calls.clear()  # now killed while putting back, after a failed write
    monkeypatch.setattr(writer, "write_shard", lambda task: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    monkeypatch.setattr(os, "replace", killed_at(real_replace))
    with pytest.raises(SystemExit):
        write_shards(str(sources[1]), str(out), overwrite=True, **KW)
    monkeypatch.undo()
    write_shards(str(sources[0]), str(out), resume=True, **KW)
    assert _contents(out) == files and samples_of(out) == samples
