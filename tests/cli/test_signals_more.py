"""Interrupts and failures the first round missed: Ctrl-C and SIGTERM end every command in one line (130/143) with
no traceback — worker processes decoding audio (soundfile's callbacks from C swallow an exception raised there),
the demo's DataLoader workers, calibrate and its trial process, the imports before any command runs — and no
process left; an object store that stops answering fails or ends a write in bounded time, the lock and the error
naming the URL; a write never leaves its lock behind when interrupted while taking it; the demo writes only into
its own folder; a FIFO named like a shard and an I/O error of the disk are one line naming the file."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import members, popen, proc_table
from faultproxy import Rule

from streambatch.cli import main
from streambatch.io.lock import LOCK_NAME

pytest_plugins = ["conftest_s3"]

#: generous: a loaded machine may be slow, a hang must fail the test, not hang it
TIMEOUT = 120
SHARDIFY = [sys.executable, "-m", "streambatch.cli"]
#: the console script (its entry module sets the signal handlers before the package is imported)
SCRIPT = Path(sys.executable).with_name("shardify")
ONE_LINE = {signal.SIGINT: (130, "shardify: interrupted"), signal.SIGTERM: (143, "shardify: terminated")}


# ---- helpers -------------------------------------------------------------------------------------------------------
def _start(cmd: list[str], **kw) -> subprocess.Popen:
    """``cmd`` in a session of its own (stopped by the test's teardown whatever happens), output captured."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    return popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _ended(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str]:
    """The exit code and stderr of a run, once it and every process of its session have ended."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end in {timeout} s (hung)")
    deadline = time.monotonic() + TIMEOUT
    while True:
        table = proc_table()
        left = [p for p in members([proc.pid], table) if table[p][1] not in "ZX"]
        if not left:
            return proc.returncode, err
        assert time.monotonic() < deadline, f"processes of the run still run: {left}"
        time.sleep(0.05)


def _wait(cond, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT) -> None:
    """Wait for ``cond()`` while ``proc`` runs."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.002)


def _session(proc: subprocess.Popen) -> list[int]:
    """The processes of the run's session but the run itself (its workers, children)."""
    table = proc_table()
    return [p for p in members([proc.pid], table) if p != proc.pid and table[p][1] not in "ZX"]


def _reading(proc: subprocess.Popen, folder: Path) -> bool:
    """Whether a process of the run has a file of ``folder`` open (a shard being read)."""
    for pid in [proc.pid, *_session(proc)]:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(folder)):
                    return True
            except OSError:
                continue
    return False


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A corpus of 1500 FLAC utterances (decoding it takes a second or two) and its dataset."""
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    root = tmp_path_factory.mktemp("signals")
    write_audio_corpus(str(root / "audio"), 1500, seed=3)
    write_shards(str(root / "audio"), str(root / "ds"), max_count=20, progress=False, workers=4)
    return root


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A dataset of 40 utterances in 2 shards, laid out as :func:`corpus`, for the tests that need a dataset to name
    but not the time its reading takes (making the large corpus is most of what those tests would cost)."""
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    root = tmp_path_factory.mktemp("signals-small")
    write_audio_corpus(str(root / "audio"), 40, seed=3)
    write_shards(str(root / "audio"), str(root / "ds"), max_count=20, progress=False)
    return root


# ---- signals in worker processes, in C callbacks -----------------------------------------------------------------
@pytest.mark.parametrize(
    "sig, workers, group",
    [(signal.SIGTERM, 2, True), (signal.SIGINT, 2, True), (signal.SIGINT, 1, False)],
    ids=["sigterm-workers", "ctrl-c-workers", "ctrl-c-single"],
)
def test_verify_decode_interrupted_in_one_line(corpus, sig, workers, group):
    """Decoding runs inside soundfile's callbacks from C: an interrupt raised there was printed by cffi ("Exception
    ignored from cffi callback ... KeyboardInterrupt") and lost — the workers' tracebacks before the line, and in one
    process the run went on to exit 0. It is raised once the callback has returned."""
    for _ in range(3):
        proc = _start([*SHARDIFY, "verify", str(corpus / "ds"), "--decode", "--workers", str(workers), "--no-progress"])
        _wait(lambda proc=proc: _reading(proc, corpus / "ds"), proc, "shard read")
        time.sleep(0.2)
        os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
        code, err = _ended(proc)
        assert (code, err.strip()) == ONE_LINE[sig]


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    """A demo folder with its data written (the runs below only stream it)."""
    from streambatch.demo import prepare_data

    out = tmp_path_factory.mktemp("demo") / "demo"
    prepare_data(str(out), 1200, 0)
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_demo_interrupted_while_streaming_in_one_line(demo_folder, sig):
    """Ctrl-C (or SLURM's SIGTERM) to the whole process group while the demo streams: the DataLoader workers ran the
    command line's handler (its KeyboardInterrupt inside soundfile's callbacks), torch complained of workers the
    signal ended; now the workers leave Ctrl-C to the main process and the run ends in one line."""
    for delay in (0.3, 1.0):
        proc = _start([*SHARDIFY, "demo", str(demo_folder)])
        _wait(lambda proc=proc: proc.stdout.readline().startswith("streaming:"), proc, "streaming")
        time.sleep(delay)
        os.killpg(proc.pid, sig)
        code, err = _ended(proc)
        assert (code, err.strip()) == ONE_LINE[sig]


SLOW_MODEL = """\
import time


def make(device):
    def step(batch):
        time.sleep(60)

    return step
"""


@pytest.mark.parametrize(
    "sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm-main-process"]
)
def test_calibrate_interrupted_in_one_line_its_trial_stopped(corpus, tmp_path, sig, group):
    """calibrate runs the user's code outside the one-line error reports, and also ran outside the signal handlers:
    Ctrl-C printed a KeyboardInterrupt traceback, SIGTERM ended it without a word and left its trial process running.
    Now an interrupt is one line and the trial process is stopped with the run."""
    (tmp_path / "slow_model.py").write_text(SLOW_MODEL)
    cmd = [*SHARDIFY, "calibrate", str(corpus / "ds"), "--model", "slow_model.py:make", "--memory-limit", "500M"]
    proc = _start([*cmd, "--max-batch-size", "8"], cwd=tmp_path)
    _wait(lambda: bool(_session(proc)), proc, "trial process")
    time.sleep(0.2)
    os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
    code, err = _ended(proc, timeout=30)  # the trial sleeps 60 s: it must be stopped, not waited for
    assert (code, err.strip().splitlines()[-1]) == ONE_LINE[sig]
    assert "Traceback" not in err


# ---- signals before a command runs -------------------------------------------------------------------------------
def _imports_under_way(proc: subprocess.Popen) -> bool:
    """numpy's core is mapped: ``import streambatch`` is under way (the command line's handlers are not set yet)."""
    try:
        with open(f"/proc/{proc.pid}/maps") as f:
            return "_multiarray_umath" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_the_imports_is_one_line(small_corpus, sig):
    """The console script sets its handlers before it imports the package: a signal in the first few tenths of a
    second was a KeyboardInterrupt traceback, or (SIGTERM) an exit without a word."""
    if "streambatch_shardify" not in SCRIPT.read_text():
        pytest.skip(f"{SCRIPT} is an older entry point: pip install -e . makes the new one")
    proc = _start([str(SCRIPT), "verify", str(small_corpus / "ds"), "--no-progress"])
    _wait(lambda: _imports_under_way(proc), proc, "import of numpy", timeout=30)
    os.kill(proc.pid, sig)
    code, err = _ended(proc)
    assert (code, err) == (ONE_LINE[sig][0], ONE_LINE[sig][1] + "\n")


def test_importing_the_package_sets_no_signal_handler():
    """The early handlers are the script's: the library leaves a program's signals alone."""
    probe = (
        "import signal, streambatch, streambatch.cli, streambatch_shardify; "
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.stdout.split() == ["True", "True"], out.stderr


# ---- object storage that stops answering -------------------------------------------------------------------------
def _s3_write(corpus: Path, url: str, endpoint: str, *extra: str) -> subprocess.Popen:
    opts = ["key=testing", "secret=testing", f"client_kwargs.endpoint_url={endpoint}"]
    options = [a for o in opts for a in ("--storage-option", o)]
    src = str(corpus / "audio")
    return _start([*SHARDIFY, "write", src, url, "--max-count", "1", "--no-progress", *options, *extra])


def _s3_exists(endpoint: str, url: str) -> bool:
    import s3fs
    from conftest_s3 import s3_options

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options(endpoint))
    return fs.exists(url)


def _bucket() -> str:
    from conftest_s3 import BUCKET

    return BUCKET


def _put(proxy, name: str) -> bool:
    """Whether the proxy has forwarded a PUT of an object named ``name``."""
    with proxy.lock:
        return any(method == "PUT" and path.split("?")[0].endswith(name) for method, path, _, _ in proxy.requests)


#: every request answers nothing for a minute (for an object, and for a bucket: a listing, a bulk delete)
STALL = Rule("stall", seconds=60, methods=("GET", "HEAD", "PUT", "POST", "DELETE"), buckets=True)


def test_an_interrupted_write_to_a_stalled_store_ends_in_seconds(corpus, proxy, watchdog):
    """The endpoint stops answering mid-write, then Ctrl-C: the cleanup's calls (the lock's removal) waited for
    the storage without a timeout — still running 50 s later. Now each gets a few seconds, then a warning names
    the lock left."""
    url = f"s3://{_bucket()}/stalled-{uuid.uuid4().hex[:8]}"
    proc = _s3_write(corpus, url, proxy.url)
    _wait(lambda: _put(proxy, "shard-000002.tar"), proc, "third shard")
    proxy.add(STALL)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    code, err = _ended(proc, timeout=60)
    took = time.monotonic() - t0
    lines = err.strip().splitlines()
    assert code == 130 and lines[-1] == "shardify: interrupted", err
    assert len(lines) == 2 and f"gave up removing the lock file {url}/{LOCK_NAME}" in lines[0], err
    assert took < 20, f"took {took:.1f} s to end"


def test_a_write_to_a_stalled_store_fails_naming_the_url(corpus, proxy, watchdog):
    """No signal: the write waited through the stall without end. Now a request times out (retried, then
    given up) and the write fails in one line naming the object."""
    url = f"s3://{_bucket()}/stalled-{uuid.uuid4().hex[:8]}"
    fast = ["config_kwargs.read_timeout=1", "config_kwargs.connect_timeout=1"]
    proc = _s3_write(corpus, url, proxy.url, *[a for o in fast for a in ("--storage-option", o)])
    _wait(lambda: _put(proxy, "shard-000002.tar"), proc, "third shard")
    proxy.add(STALL)
    code, err = _ended(proc, timeout=90)
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith(f"shardify: error: {url}/shard-") and "did not answer" in errors[0], err


def test_an_interrupt_while_the_lock_is_written_leaves_no_lock(corpus, proxy, moto_endpoint, watchdog):
    """The lock was ours only once read back after its upload: Ctrl-C in between left it, refusing the next writer
    on another host for 5 minutes. Now it is ours from the moment its create-only upload may land, and removed.
    (Its first read, before the upload, is slowed so that the interrupt comes just after the upload.)"""
    url = f"s3://{_bucket()}/locked-{uuid.uuid4().hex[:8]}"
    proxy.add(Rule("latency", match=LOCK_NAME, limit=1, seconds=2, methods=("GET", "HEAD")))
    proc = _s3_write(corpus, url, proxy.url)
    _wait(lambda: _put(proxy, LOCK_NAME), proc, "lock upload")
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = _ended(proc, timeout=60)
    assert (code, err.strip()) == ONE_LINE[signal.SIGINT]
    assert not _s3_exists(moto_endpoint, f"{url}/{LOCK_NAME}")


def test_a_bucket_that_does_not_exist_is_one_line_naming_it(corpus, moto_endpoint):
    proc = _s3_write(corpus, "s3://no-such-bucket-here/x", moto_endpoint)
    code, err = _ended(proc)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'no-such-bucket-here' does not exist" in err and "s3://no-such-bucket-here/x" in err


def test_object_store_filesystems_have_timeouts_the_user_can_set():
    pytest.importorskip("s3fs")
    from streambatch.io import storage

    url = "s3://b/x"
    fs, _ = storage.filesystem(url, {"anon": True})
    cfg = fs.config_kwargs
    assert (cfg["connect_timeout"], cfg["read_timeout"], fs.retries) == (10.0, 60.0, 1)
    assert cfg["retries"] == {"mode": "standard", "total_max_attempts": 3}
    fs, _ = storage.filesystem(url, {"anon": True, "config_kwargs": {"read_timeout": 5}})
    assert (fs.config_kwargs["read_timeout"], fs.config_kwargs["connect_timeout"]) == (5, 10.0)


# ---- local files --------------------------------------------------------------------------------------------------
def test_a_fifo_named_like_a_shard_is_a_problem_not_a_hang(corpus, tmp_path):
    """verify opened it without looking: opening a FIFO to read waits for a writer forever."""
    from streambatch.errors import StorageError
    from streambatch.io import storage

    ds = tmp_path / "ds"
    subprocess.run(["cp", "-r", str(corpus / "ds"), str(ds)], check=True)
    (ds / "shard-000003.tar").unlink()
    os.mkfifo(ds / "shard-000003.tar")
    proc = _start([*SHARDIFY, "verify", str(ds), "--no-progress"])
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("verify hangs on the FIFO")
    assert proc.returncode == 1, out + err
    assert f"{ds / 'shard-000003.tar'}: size is 0 bytes" in out and "a FIFO, not a regular file" in out, out
    with pytest.raises(StorageError, match="a FIFO"):
        storage.open_url(str(ds / "shard-000003.tar"))


def test_a_disk_input_output_error_names_the_file(corpus, tmp_path, monkeypatch, capsys):
    """EIO from fsync was "unexpected error: OSError: [Errno 5] Input/output error", no file named."""

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    out = tmp_path / "out"
    code = main(["write", str(corpus / "audio"), str(out), "--max-count", "500", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{out / 'shard-000000.tar'}: input/output error" in err
    code = main(["index", str(corpus / "ds"), "--out", str(tmp_path / "idx")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(tmp_path / "idx") in err and "input/output error" in err


# ---- the demo's folder ---------------------------------------------------------------------------------------------
def test_the_demo_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    """Without shards/index.json the demo deleted OUT/audio/utt-* and overwrote OUT/shards, whoever's they were."""
    out = tmp_path / "mine"
    (out / "audio").mkdir(parents=True)
    (out / "audio" / "utt-000001.flac").write_bytes(b"the user's own")
    (out / "notes.txt").write_text("keep")
    assert main(["demo", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(out) in err and "not empty" in err, err
    assert (out / "audio" / "utt-000001.flac").read_bytes() == b"the user's own"
    assert sorted(p.name for p in out.rglob("*")) == ["audio", "notes.txt", "utt-000001.flac"]


def test_the_demo_claims_a_missing_or_empty_folder_and_its_own(tmp_path):
    from streambatch.demo import DEMO_MARK, claim_folder

    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        claim_folder(str(out))
        assert (out / DEMO_MARK).is_file()
        (out / "audio").mkdir()
        claim_folder(str(out))  # its own, not empty now: still the demo's


def test_a_disk_input_output_error_while_staging_names_the_shard(small_corpus, tmp_path, monkeypatch, capsys):
    """stage's own copy: EIO from its fsync was retried as a read error, then "OSError: [Errno 5]", no file named;
    DEST keeps no shard under its name."""
    fsync = os.fsync

    def eio(fd):  # the shards' copies only (the staging marker's own failure is named already)
        if "shard-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", eio)
    dest = tmp_path / "dest"
    code = main(["stage", str(small_corpus / "ds"), str(dest), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{dest}/shard-0000" in err and ".tar: input/output error while writing it" in err, err
    assert not list(dest.glob("shard-*.tar")), list(dest.iterdir())


def test_a_temporary_file_that_cannot_be_removed_does_not_hide_the_error(corpus, tmp_path, monkeypatch, capsys):
    """The folder went read-only while a shard was written: removing its temporary file failed too, and that
    PermissionError replaced the write's own error. The write's error is the one line; the file a warning."""
    remove = os.remove

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    def refuse(path, *a, **kw):
        if ".tmp" in os.path.basename(str(path)) or "shardify-" in os.path.basename(str(path)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return remove(path, *a, **kw)

    monkeypatch.setattr(os, "fsync", eio)
    monkeypatch.setattr(os, "remove", refuse)
    out = tmp_path / "out"
    code = main(["write", str(corpus / "audio"), str(out), "--max-count", "500", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "warning" not in line]
    assert code == 2 and len(errors) == 1, err
    assert f"{out / 'shard-000000.tar'}: input/output error" in errors[0]
    assert any("could not remove the temporary file" in line and "permission denied" in line for line in err), err


def test_no_interrupt_is_raised_inside_soundfiles_code():
    """Raised in soundfile's own code (a SoundFile half-opened or half-closed around libsndfile's handle), an
    interrupt once left the handle to be freed twice at exit ("double free or corruption", SIGABRT, 1 run in 60 of
    the Ctrl-C test above); only the callbacks were held back then. Code elsewhere is interrupted at once."""
    import sys

    from streambatch.interrupts import uninterruptible

    def frame_in(path: str):
        """A frame of a function ``close`` defined in the file ``path``."""
        scope: dict = {"sys": sys}
        exec(compile("def close():\n    return sys._getframe()\n", path, "exec"), scope)
        return scope["close"]()

    assert uninterruptible(frame_in("/site-packages/soundfile.py"))
    assert not uninterruptible(frame_in("/site-packages/other.py"))


FINALIZER = """\
import os, signal, time
from streambatch.interrupts import Interrupter

interrupter = Interrupter()
interrupter.arm()
signal.signal(signal.SIGINT, interrupter.interrupt)


class Held:
    def __del__(self):  # the signal arrives while a finalizer runs (a DataLoader iterator's, as a pass ends)
        os.kill(os.getpid(), signal.SIGINT)
        start = time.monotonic()
        while time.monotonic() - start < 0.05:
            pass


try:
    held = Held()
    del held
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        pass
    print("lost")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_an_interrupt_that_lands_in_a_finalizer_is_not_lost():
    """Ctrl-C during a finalizer (a DataLoader iterator's ``__del__`` stopping its workers at the end of a pass):
    Python prints what a finalizer raises as "Exception ignored" and drops it, and the run went on to exit 0. The
    interrupt is raised once the finalizer has returned."""
    out = subprocess.run([sys.executable, "-c", FINALIZER], capture_output=True, text=True, timeout=60)
    assert (out.stdout.strip(), out.stderr.strip()) == ("interrupted", "")
