"""``stage``, ``upgrade``, ``export``, ``merge`` and ``inspect --plot`` never lose or half-write data (robustness probe
of the CLI): ``stage`` refuses a DEST holding another dataset (unless ``--overwrite``) and keeps a shard there on
its size only where DEST holds this dataset, with DEST's own storage options; ``upgrade`` holds the folder's lock;
``export --overwrite`` leaves the old export whole or the new one complete, whatever fails or interrupts it, and
clears what earlier runs left; ``merge`` changes ``errors.jsonl`` and ``index.json`` together; ``--plot`` replaces
a file whole. Real shards throughout; failures are injected with strace (skipped where it is missing), a stalled
subprocess, or a patched call."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_tree, popen, stop_tree

from streambatch.cli import main
from streambatch.format.index import ShardIndex
from streambatch.io.lock import is_lock_file, output_lock
from streambatch.write import stage as stage_module
from streambatch.write.verify import verify_dataset
from streambatch.write.writer import write_shards

pytest_plugins = ["conftest_s3"]

SHARDIFY = [sys.executable, "-m", "streambatch.cli"]
STRACE = shutil.which("strace")
TIMEOUT = 300
#: ``shardify`` whose os.rename, after its first rename to a path ending in $STALL_AT, touches $STALL_READY and waits
#: to be signalled (once: the renames that put things back run on)
STALLING_SHARDIFY = """
import os, sys, time
from pathlib import Path
from streambatch.cli import main

real, stalled = os.rename, []
def rename(src, dst, *args, **kw):
    real(src, dst, *args, **kw)
    if os.fspath(dst).endswith(os.environ["STALL_AT"]) and not stalled:
        stalled.append(dst)
        Path(os.environ["STALL_READY"]).touch()
        while True:
            time.sleep(0.1)
os.rename = rename
sys.exit(main(sys.argv[1:]))
"""


# ---- helpers ---------------------------------------------------------------------------------------
def shardify(capsys, *argv) -> tuple[int, str, list[str]]:
    """Run ``shardify`` in this process: its exit code, stdout and stderr lines."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


def contents(folder: Path) -> dict[str, str]:
    """Every file and link under ``folder`` (lock files aside): a hash of its bytes, or where a link points."""
    found = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            found[rel] = "-> " + os.readlink(p)
        elif p.is_file() and not is_lock_file(p.name):
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def leftovers(folder: Path) -> list[str]:
    """Temporary, staging and aside files anywhere under ``folder``."""
    marks = (".tmp-", ".shardify-", ".old-", "shardify-stage-", ".discarded")
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if any(m in p.name for m in marks))


def _retexted(src: Path, dst: Path, first: int = 0) -> Path:
    """A copy of the corpus ``src`` whose transcripts from utterance ``first`` on have their first letter changed
    (same lengths: the shards have the same sizes, other bytes)."""
    shutil.copytree(src, dst)
    for txt in sorted(dst.glob("*.txt"))[first:]:
        text = txt.read_text()
        txt.write_text(("X" if text[0] != "X" else "Y") + text[1:])
    return dst


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Datasets of 6 shards: ``a``; ``b``, its audio with every transcript changed (same shard sizes); ``c``, with
    only the last shard's transcripts changed (its first 5 shards are ``a``'s, byte for byte); ``a3``, ``a`` in
    shards of 3 (10 shards); ``d``, another corpus; and the ``audio`` folder of ``a``."""
    from streambatch.synthetic import write_audio_corpus

    root = tmp_path_factory.mktemp("stage_export")
    audio = root / "audio"
    write_audio_corpus(str(audio), 30, seed=3)
    _retexted(audio, root / "audio_b")
    _retexted(audio, root / "audio_c", first=25)
    write_audio_corpus(str(root / "audio_d"), 24, seed=4)
    for name, folder, count in [("a", "audio", 5), ("b", "audio_b", 5), ("c", "audio_c", 5), ("a3", "audio", 3)]:
        write_shards(str(root / folder), str(root / name), max_count=count, progress=False)
    write_shards(str(root / "audio_d"), str(root / "d"), max_count=4, progress=False)
    sizes = {n: [s.bytes for s in ShardIndex.load(str(root / n)).shards] for n in "abc"}
    assert sizes["a"] == sizes["b"] == sizes["c"], "the corpora must have shards of the same sizes"
    return {n: root / n for n in ("a", "b", "c", "a3", "d", "audio")}


def _shards_of(folder: Path) -> dict[str, str]:
    return {k: v for k, v in contents(folder).items() if k.endswith(".tar")}


# ---- stage: another dataset in DEST ----------------------------------------------------------------
def test_stage_refuses_a_dest_holding_another_dataset_of_the_same_sizes(corpora, tmp_path, capsys):
    dest = tmp_path / "st"
    assert shardify(capsys, "stage", corpora["a"], dest, "--no-progress")[0] == 0
    before = contents(dest)
    code, out, err = shardify(capsys, "stage", corpora["b"], dest, "--no-progress")
    assert code == 2 and len(err) == 1 and not out, err
    assert f"{dest} holds another dataset" in err[0] and "--overwrite" in err[0], err
    assert contents(dest) == before and leftovers(dest) == []
    code, out, err = shardify(capsys, "stage", corpora["b"], dest, "--no-progress", "--overwrite")
    assert code == 0, err
    assert "copied 6" in out and "kept 0" in out, out  # same sizes, other bytes: none kept
    assert verify_dataset(ShardIndex.load(str(dest)), progress=False) == []
    assert (dest / "index.json").read_bytes() == (corpora["b"] / "index.json").read_bytes()
    assert leftovers(dest) == []


def test_stage_never_replaces_a_dataset_folder_without_overwrite(corpora, tmp_path, capsys):
    victim = tmp_path / "victim"
    shutil.copytree(corpora["d"], victim)
    before = contents(victim)
    code, _, err = shardify(capsys, "stage", corpora["a"], victim, "--no-progress")
    assert code == 2 and len(err) == 1 and f"{victim} holds another dataset" in err[0], err
    assert contents(victim) == before and leftovers(victim) == []


def test_stage_overwrite_keeps_only_shards_whose_sha256_matches(corpora, tmp_path, capsys):
    dest = tmp_path / "st"
    assert shardify(capsys, "stage", corpora["a"], dest, "--no-progress")[0] == 0
    code, out, err = shardify(capsys, "stage", corpora["c"], dest, "--no-progress", "--overwrite")
    assert code == 0, err
    assert "copied 1" in out and "kept 5" in out, out  # the 5 shards c shares with a, byte for byte
    assert verify_dataset(ShardIndex.load(str(dest)), progress=False) == []


def test_stage_overwrite_removes_the_replaced_datasets_other_files(corpora, tmp_path, capsys):
    dest = tmp_path / "st"
    (tmp_path / "st").mkdir()
    (dest / "notes.txt").write_text("mine")
    assert shardify(capsys, "stage", corpora["a3"], dest, "--no-progress")[0] == 0
    assert len(_shards_of(dest)) == 10
    code, _, err = shardify(capsys, "stage", corpora["c"], dest, "--no-progress", "--overwrite")
    assert code == 0, err
    assert contents(dest) == {**contents(corpora["c"]), "notes.txt": contents(dest)["notes.txt"]}
    assert (dest / "notes.txt").read_text() == "mine" and leftovers(dest) == []


def test_shards_of_unknown_origin_in_dest_are_kept_only_when_their_sha256_matches(corpora, tmp_path, capsys):
    """Another dataset's shards without its index (copied by hand, a copy cut short of another dataset): same
    sizes, other bytes, so only a re-hash tells them apart."""
    dest = tmp_path / "st"
    dest.mkdir()
    for name in _shards_of(corpora["b"]):
        shutil.copy(corpora["b"] / name, dest / name)
    shutil.copy(corpora["a"] / "shard-000000.tar", dest / "shard-000000.tar")  # this one is a's
    code, out, err = shardify(capsys, "stage", corpora["a"], dest, "--no-progress")
    assert code == 0, err
    assert "copied 5" in out and "kept 1" in out, out
    assert verify_dataset(ShardIndex.load(str(dest)), progress=False) == []


def test_an_interrupted_stage_resumes_keeping_its_own_copies(corpora, tmp_path, monkeypatch):
    dest = tmp_path / "st"
    real, calls = stage_module._copy_one, []

    def copy_one(*args, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(args[1])
        return real(*args, **kw)

    monkeypatch.setattr(stage_module, "_copy_one", copy_one)
    with pytest.raises(KeyboardInterrupt):
        stage_module.stage_dataset(str(corpora["a"]), str(dest), workers=1, progress=False)
    assert not (dest / "index.json").exists()
    monkeypatch.undo()
    res = stage_module.stage_dataset(str(corpora["a"]), str(dest), workers=1, progress=False)
    assert sorted(os.path.join(dest, n) for n in res.kept) == sorted(calls) and len(res.copied) == 3
    assert verify_dataset(ShardIndex.load(str(dest)), progress=False) == []
    assert leftovers(dest) == [] and contents(dest) == contents(corpora["a"])


def test_stage_of_the_same_dataset_again_keeps_its_copy(corpora, tmp_path, capsys):
    dest = tmp_path / "st"
    assert shardify(capsys, "stage", corpora["a"], dest, "--no-progress")[0] == 0
    code, out, _ = shardify(capsys, "stage", corpora["a"], dest, "--no-progress")
    assert code == 0 and "copied 0" in out and "kept 6" in out, out


# ---- stage: DEST's storage options -------------------------------------------------------------------
def test_stage_help_says_which_storage_options_apply_where(capsys):
    code, out, _ = shardify(capsys, "stage", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "--dest-storage-option" in text and "for DEST only" in text and "for SRC and its shards only" in text


def test_storage_options_for_src_only_are_not_used_for_a_remote_dest(corpora, capsys):
    argv = ("stage", corpora["a"], "s3://no-such-bucket/stg", "--no-progress")
    code, _, err = shardify(capsys, *argv, "--storage-option", "client_kwargs.endpoint_url=http://127.0.0.1:9")
    assert code == 2 and len(err) == 1 and "--dest-storage-option" in err[0], err


def test_stage_into_s3_with_dest_storage_options(corpora, moto_endpoint, capsys):
    from conftest_s3 import BUCKET, s3_options

    url = f"s3://{BUCKET}/staged-{os.getpid()}-{time.monotonic_ns()}"
    opts = ["key=testing", "secret=testing", f"client_kwargs.endpoint_url={moto_endpoint}"]
    argv = ["stage", corpora["a"], url, "--no-progress"] + [a for o in opts for a in ("--dest-storage-option", o)]
    code, out, err = shardify(capsys, *argv)
    assert code == 0 and "copied 6" in out, err
    staged = ShardIndex.load(url, s3_options(moto_endpoint))
    assert staged.num_shards == 6
    assert verify_dataset(staged, s3_options(moto_endpoint), progress=False) == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_stage_overwrite_cut_short_leaves_the_old_dataset_readable(corpora, tmp_path, monkeypatch, where, request):
    """An interrupt while the new shards are copied (the long part of a ``stage --overwrite``) leaves the dataset
    DEST held whole and readable there, in a folder or on the loopback S3 server; the next run replaces it."""
    options = None
    url = str(tmp_path / "st")
    if where == "s3":
        from conftest_s3 import BUCKET, s3_options

        options = s3_options(request.getfixturevalue("moto_endpoint"))
        url = f"s3://{BUCKET}/over-{os.getpid()}-{time.monotonic_ns()}"
    stage_module.stage_dataset(str(corpora["a"]), url, dest_storage_options=options, progress=False)
    real, calls = stage_module._copy_one, []

    def copy_one(*args, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(args[1])
        return real(*args, **kw)

    monkeypatch.setattr(stage_module, "_copy_one", copy_one)
    with pytest.raises(KeyboardInterrupt):
        stage_module.stage_dataset(
            str(corpora["b"]), url, overwrite=True, workers=1, dest_storage_options=options, progress=False
        )
    assert len(calls) == 3
    old = ShardIndex.load(url, options)
    assert [s.sha256 for s in old.shards] == [s.sha256 for s in ShardIndex.load(str(corpora["a"])).shards]
    assert verify_dataset(old, options, progress=False) == []
    monkeypatch.undo()
    res = stage_module.stage_dataset(
        str(corpora["b"]), url, overwrite=True, workers=1, dest_storage_options=options, progress=False
    )
    assert len(res.kept) == 3 and len(res.copied) == 3, res  # the copies the interrupted run made are kept
    new = ShardIndex.load(url, options)
    assert [s.sha256 for s in new.shards] == [s.sha256 for s in ShardIndex.load(str(corpora["b"])).shards]
    assert verify_dataset(new, options, progress=False) == []
    from streambatch.io import storage

    assert [n for n in storage.listdir(url, options) if n.startswith(".shardify")] == []


# ---- upgrade: the folder's lock ----------------------------------------------------------------------
def _v1(corpora: dict[str, Path], path: Path) -> Path:
    write_shards(str(corpora["audio"]), str(path), max_count=5, progress=False, index_version=1)
    assert ShardIndex.load(str(path)).version == 1
    return path


def test_upgrade_is_refused_while_another_writer_holds_the_folder(corpora, tmp_path, capsys):
    ds = _v1(corpora, tmp_path / "ds")
    with output_lock(str(ds)):
        code, _, err = shardify(capsys, "upgrade", ds, "--no-progress")
    assert code == 2 and len(err) == 1 and "being written by another shardify" in err[0], err
    assert ShardIndex.load(str(ds)).version == 1
    assert shardify(capsys, "upgrade", ds, "--no-progress")[0] == 0 and ShardIndex.load(str(ds)).version == 2


def test_a_write_overwrite_is_refused_while_an_upgrade_runs(corpora, tmp_path, capsys):
    """The probe's race: an upgrade that has read the old index, a ``write --overwrite`` meanwhile; the old index
    must never land over the new shards."""
    ds = _v1(corpora, tmp_path / "ds")
    ready, go = tmp_path / "ready", tmp_path / "go"
    stall = (
        "import os, sys, time\nfrom pathlib import Path\nfrom streambatch.format.index import ShardIndex\n"
        "from streambatch.cli import main\nreal = ShardIndex.save\n"
        "def save(*a, **k):\n    Path(os.environ['READY']).touch()\n"
        "    while not Path(os.environ['GO']).exists():\n        time.sleep(0.05)\n    return real(*a, **k)\n"
        "ShardIndex.save = save\nsys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "READY": str(ready), "GO": str(go), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = popen([sys.executable, "-c", stall, "upgrade", str(ds), "--no-progress"], stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the upgrade did not reach its save"
            time.sleep(0.02)
        code, _, err = shardify(capsys, "write", corpora["c"].parent / "audio_b", ds, "--overwrite", "--no-progress")
        assert code == 2 and len(err) == 1 and "being written by another shardify" in err[0], err
        go.touch()
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        go.touch()
        stop_tree(proc)
    assert ShardIndex.load(str(ds)).version == 2
    assert verify_dataset(ShardIndex.load(str(ds)), progress=False) == []


# ---- export --overwrite: the old export whole, or the new one complete ------------------------------------
def _export(src: Path, dest: Path, *extra: str, env: dict | None = None, prefix: tuple = ()) -> subprocess.Popen:
    cmd = [*prefix, *SHARDIFY, "export", str(src), "--format", "nemo-tarred", "--out", str(dest), "--no-progress"]
    return popen([*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def exports(corpora, tmp_path_factory) -> dict[str, Path]:
    """``old``: ``d``'s export with links; ``new``: ``a``'s with links, what an ``--overwrite`` must leave."""
    root = tmp_path_factory.mktemp("exports")
    for name, src in (("old", corpora["d"]), ("new", corpora["a"])):
        done = subprocess.run(
            [*SHARDIFY, "export", str(src), "--format", "nemo-tarred", "--out", str(root / name), "--links"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
    return {"old": root / "old", "new": root / "new"}


def _old_or_new(dest: Path, exports: dict[str, Path]) -> str:
    got = contents(dest)
    for which in ("old", "new"):
        if got == contents(exports[which]):
            return which
    pytest.fail(f"{dest} holds a mix of the old and the new export: {sorted(got)}")


@pytest.mark.skipif(STRACE is None, reason="strace is not installed")
def test_export_overwrite_failing_at_any_rename_leaves_one_export_whole(corpora, exports, tmp_path):
    trace = tmp_path / "renames.trace"
    dest = tmp_path / "ex"
    shutil.copytree(exports["old"], dest, symlinks=True)
    count = [STRACE, "-f", "-qq", "-o", str(trace), "-e", "trace=rename,renameat,renameat2"]
    proc = _export(corpora["a"], dest, "--links", "--overwrite", prefix=tuple(count))
    assert proc.wait(timeout=TIMEOUT) == 0, proc.stderr.read()
    renames = len([line for line in trace.read_text().splitlines() if "rename" in line])
    for n in sorted({1, 5, *range(max(1, renames - 8), renames + 1)}):
        shutil.rmtree(dest)
        shutil.copytree(exports["old"], dest, symlinks=True)
        inject = [STRACE, "-f", "-qq", "-o", os.devnull, "-e", "trace=rename,renameat,renameat2"]
        inject += ["-e", f"inject=rename,renameat,renameat2:error=EIO:when={n}"]
        proc = _export(corpora["a"], dest, "--links", "--overwrite", prefix=tuple(inject))
        _, err = proc.communicate(timeout=TIMEOUT)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) <= 1 and "Traceback" not in err, err
        if proc.returncode == 0 and leftovers(dest):  # the old export not removed: the next export removes it
            assert all(p.startswith(".shardify-export-replaced") for p in leftovers(dest)), leftovers(dest)
            again = _export(corpora["a"], dest, "--links", "--overwrite")
            assert again.wait(timeout=TIMEOUT) == 0
            stop_tree(again)
        which = _old_or_new(dest, exports)
        assert which == ("new" if proc.returncode == 0 else "old"), (n, proc.returncode, err)
        assert leftovers(dest) == [], (n, leftovers(dest))


def _stalled_export(src: Path, dest: Path, tmp_path: Path, at: str) -> subprocess.Popen:
    """An ``export --links --overwrite`` stalled just after its first rename into a path holding ``at``."""
    ready = tmp_path / "stalled"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "STALL_AT": at, "STALL_READY": str(ready), "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-c", STALLING_SHARDIFY, "export", str(src), "--format", "nemo-tarred", "--out", str(dest)]
    proc = popen([*cmd, "--links", "--overwrite", "--no-progress"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + TIMEOUT
    while not ready.exists():
        assert proc.poll() is None, f"the export exited with {proc.returncode}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "the export did not reach its publishing"
        time.sleep(0.02)
    return proc


#: where a stalled export is: setting the old export aside (before any new file is in place), or moving the new
#: one in (the old one all aside, the new one partly in place)
STALLS = {"setting aside": ".shardify-export-replaced/tarred_audio_manifest.json", "moving in": "ex/sharded_manifests"}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("stall", sorted(STALLS))
def test_export_interrupted_while_publishing_keeps_the_old_export(corpora, exports, tmp_path, sig, stall):
    dest = tmp_path / "ex"
    shutil.copytree(exports["old"], dest, symlinks=True)
    proc = _stalled_export(corpora["a"], dest, tmp_path, STALLS[stall])
    try:
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        stop_tree(proc)
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err
    assert len(err.splitlines()) == 1, err
    assert _old_or_new(dest, exports) == "old" and leftovers(dest) == []


@pytest.mark.parametrize("stall", sorted(STALLS))
def test_an_export_killed_while_publishing_is_put_right_by_the_next(corpora, exports, tmp_path, capsys, stall):
    dest = tmp_path / "ex"
    shutil.copytree(exports["old"], dest, symlinks=True)
    proc = _stalled_export(corpora["a"], dest, tmp_path, STALLS[stall])
    kill_tree(proc.pid, grace=0)
    stop_tree(proc)
    assert leftovers(dest)  # what a killed export leaves: the next one finishes it
    code, _, err = shardify(capsys, "export", corpora["a"], "--format", "nemo-tarred", "--out", dest, "--no-progress")
    assert code == 2 and any("put it back" in line for line in err) and "already holds an export" in err[-1], err
    assert _old_or_new(dest, exports) == "old" and leftovers(dest) == []
    argv = ("export", corpora["a"], "--format", "nemo-tarred", "--out", dest, "--links", "--overwrite")
    assert shardify(capsys, *argv, "--no-progress")[0] == 0
    assert _old_or_new(dest, exports) == "new" and leftovers(dest) == []


def test_an_export_clears_the_temporary_files_earlier_ones_left(corpora, exports, tmp_path, capsys):
    dest = tmp_path / "ex"
    shutil.copytree(exports["old"], dest, symlinks=True)
    left = [
        "tarred_audio_manifest.json.tmp-0123abcd",
        "tarred_audio_filepaths.json.tmp-89abcdef",
        "sharded_manifests/manifest_3.json.tmp-deadbeef",
        ".shardify-export.tmp-01234567/sharded_manifests/manifest_0.json",
        "audio.tmp-fedcba98/audio_0.tar",
        "audio.old-00ff00ff/audio_1.tar",
    ]
    for rel in left:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text("{}\n")
    argv = ("export", corpora["a"], "--format", "nemo-tarred", "--out", dest, "--links", "--overwrite")
    code, _, err = shardify(capsys, *argv, "--no-progress")
    assert code == 0, err
    assert leftovers(dest) == [] and _old_or_new(dest, exports) == "new"


def test_export_overwrite_refuses_a_file_it_did_not_write_in_its_folders(corpora, exports, tmp_path, capsys):
    dest = tmp_path / "ex"
    shutil.copytree(exports["old"], dest, symlinks=True)
    (dest / "sharded_manifests" / "README.md").write_text("my notes")
    before = contents(dest)
    argv = ("export", corpora["a"], "--format", "nemo-tarred", "--out", dest, "--overwrite", "--no-progress")
    code, _, err = shardify(capsys, *argv)
    assert code == 2 and len(err) == 1 and "sharded_manifests/README.md: not written by shardify export" in err[0]
    assert contents(dest) == before


# ---- merge: errors.jsonl and index.json change together ---------------------------------------------------
@pytest.fixture
def merged_parts(corpora, tmp_path, capsys) -> Path:
    """Two parts of a corpus with a bad file (skipped), merged: ``index.json`` and ``errors.jsonl``."""
    audio = tmp_path / "audio"
    shutil.copytree(corpora["audio"], audio)
    (audio / "utt-000004.flac").write_bytes(b"not audio at all")
    out = tmp_path / "parts"
    for i in range(2):
        argv = ("write", audio, out, "--part", f"{i}/2", "--on-error", "skip", "--max-count", "5", "--no-progress")
        assert shardify(capsys, *argv)[0] == 0
    assert shardify(capsys, "merge", out, "--no-progress")[0] == 0
    assert (out / "errors.jsonl").exists()
    return out


def test_a_merge_that_cannot_save_its_index_leaves_the_errors_file_as_it_was(merged_parts, capsys, monkeypatch):
    out = merged_parts
    before = contents(out)
    part_errors = out / "errors.part-0000.jsonl"  # a part written again since, with another error
    part_errors.write_text(part_errors.read_text().replace("not readable audio", "unreadable audio"))
    before["errors.part-0000.jsonl"] = contents(out)["errors.part-0000.jsonl"]
    real = os.fsync

    def fsync(fd: int) -> None:
        if "index.json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code, _, err = shardify(capsys, "merge", out, "--no-progress")
    assert code == 2 and len(err) == 1, err
    assert f"{out / 'index.json'}: no space left on device" in err[0] and "already there is kept" in err[0], err
    assert contents(out) == before and leftovers(out) == []
    monkeypatch.undo()
    assert shardify(capsys, "merge", out, "--no-progress")[0] == 0
    assert "unreadable audio" in (out / "errors.jsonl").read_text()


def test_a_bad_part_index_is_named_once(merged_parts, capsys):
    bad = merged_parts / "index.part-0001.json"
    bad.write_text("{x")
    code, _, err = shardify(capsys, "merge", merged_parts, "--no-progress")
    assert code == 2 and len(err) == 1 and err[0].count(str(bad)) == 1 and "not valid JSON" in err[0], err


# ---- inspect --plot: a file replaced whole ------------------------------------------------------------------
def test_a_plot_that_does_not_fit_keeps_the_file_there_and_names_it(corpora, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    png = tmp_path / "lengths.png"
    assert shardify(capsys, "inspect", corpora["a"], "--plot", png)[0] == 0
    before = png.read_bytes()

    def full_disk(self, fname, **kw):  # writes part of the file, then the disk is full
        f = open(fname, "wb") if isinstance(fname, (str, os.PathLike)) else fname
        f.write(b"\x89PNG half")
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    code, _, err = shardify(capsys, "inspect", corpora["a"], "--plot", png)
    err = [line for line in err if line.startswith("shardify")]  # not the progress bar
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"shardify: error: {png}: no space left on device"), err
    assert png.read_bytes() == before and leftovers(tmp_path) == []
