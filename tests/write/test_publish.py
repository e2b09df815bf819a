"""Stage then swap (`streambatch.write.publish`): a process killed at any step of a replacement leaves the old set or
the new one, never a mix, and the next run (under the folder's lock) finishes or undoes what it left.

A driver process replays the replacement once per step: it forks a child that dies (``os._exit``, no cleanup, as
``kill -9``) at its k-th change to the filesystem (a rename, removal, link, new folder or new file), then reads
the folder as a reader would, runs the recovery the next run runs, and reads it again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent(
    r'''
    import builtins, json, os, shutil, sys, tempfile

    from streambatch.write import aside
    from streambatch.write.publish import Swap

    OLD = {"links/a": "old a", "links/b": "old b", "paths.txt": "old paths", "manifest.json": "old manifest"}
    NEW = {"links/a": "new a", "links/c": "new c", "paths.txt": "new paths", "manifest.json": "new manifest"}
    DS_OLD = {"shard-000000.tar": "old 0", "shard-000001.tar": "old 1", "errors.jsonl": "old e", "index.json": "old i"}
    DS_NEW = {"shard-000000.tar": "new 0", "errors.jsonl": "new e", "index.json": "new i"}


    def put(root, files):
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)


    def read(root):
        """What a reader finds: every file but hidden ones (asides, staging folders), by relative path."""
        found = {}
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if not name.startswith("."):
                    path = os.path.join(dirpath, name)
                    found[os.path.relpath(path, root)] = open(path).read()
        return found


    def hidden(root):
        return sorted(n for n in os.listdir(root) if n.startswith("."))


    def die_at(k):
        """Make the k-th change to the filesystem end the process on the spot."""
        count = [0]

        def wrap(real):
            def changed(*a, **kw):
                count[0] += 1
                if count[0] == k:
                    os._exit(9)
                return real(*a, **kw)
            return changed

        for name in ("rename", "replace", "remove", "unlink", "rmdir", "mkdir", "link", "symlink"):
            setattr(os, name, wrap(getattr(os, name)))
        real_open = builtins.open

        def opened(file, mode="r", *a, **kw):
            return (wrap(real_open) if any(c in mode for c in "wax") else real_open)(file, mode, *a, **kw)

        builtins.open = opened


    def export_swap(root):
        swap = Swap(root, ("links", "paths.txt", "manifest.json"), ".stage", ".replaced")
        staged = swap.staging()
        put(staged, NEW)
        swap.publish(staged)
        shutil.rmtree(staged, ignore_errors=True)


    def export_recover(root):
        swap = Swap(root, ("links", "paths.txt", "manifest.json"), ".stage", ".replaced")
        swap.recover()
        swap.clear_staging()


    def overwrite(root):
        with aside.replacing(root, None, True, None):
            put(root, DS_NEW)  # the index last, as the writer does


    def overwrite_recover(root):
        aside.recover_replaced(root, None, False)


    CASES = {
        "export": (OLD, NEW, export_swap, export_recover, "manifest.json"),
        "overwrite": (DS_OLD, DS_NEW, overwrite, overwrite_recover, "index.json"),
    }
    old, new, run, recover, last = CASES[sys.argv[1]]
    results = []
    for k in range(1, 200):
        root = tempfile.mkdtemp(dir=sys.argv[2])
        put(root, old)
        pid = os.fork()
        if pid == 0:
            die_at(k)
            run(root)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        seen = read(root)
        recover(root)
        results.append({"k": k, "code": code, "seen": seen, "after": read(root), "hidden": hidden(root)})
        shutil.rmtree(root)
        if code == 0:
            break
    print(json.dumps(results))
    '''
)


@pytest.mark.parametrize("case", ["export", "overwrite"])
def test_a_kill_at_any_step_leaves_the_old_set_or_the_new(case, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, case, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results[-1]["code"] == 0 and len(results) > 5, results  # it ran to its end once, after dying at each step
    old, new = results[0]["after"], results[-1]["seen"]
    assert old != new and all(v.startswith("old") for v in old.values()), (old, new)
    assert all(v.startswith("new") for v in new.values()), new
    index = "manifest.json" if case == "export" else "index.json"
    for r in results:
        # what a reader finds while the set is replaced: never an index beside files of the other set
        if index in r["seen"]:
            assert r["seen"] in (old, new), r
        # what the next run leaves: the old set or the new one, whole, and nothing hidden left over
        assert r["after"] in (old, new), r
        assert r["hidden"] == [], r


NO_HARD_LINKS = textwrap.dedent(
    """
    import errno, os, resource, signal, sys

    def no_link(*a, **kw):  # a filesystem without hard links: the file to keep is copied
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    os.link = no_link
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
    from streambatch.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_a_merge_with_no_room_to_keep_the_errors_file_leaves_it_as_it_was(tmp_path):
    """``merge`` keeps ``errors.jsonl`` to put it back should the index fail; on a filesystem without hard links
    that is a copy, and a copy that does not fit ends the merge in one line naming the file, leaving the file
    there as it was (never a partial copy put back over it) and nothing hidden beside it."""
    src, out = tmp_path / "src.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps({"id": f"s{i}", "text": "word " * (1 + i % 17)}) + "\n" for i in range(40)))
    shardify = [sys.executable, "-m", "streambatch.cli"]
    for i in range(2):
        done = subprocess.run([*shardify, "write", str(src), str(out), "--part", f"{i}/2", "--no-progress"])
        assert done.returncode == 0
    errors = out / "errors.jsonl"
    errors.write_text(
        "".join(json.dumps({"source": f"x{i}", "error": "not readable audio"}) + "\n" for i in range(900))
    )
    before = errors.read_bytes()
    assert len(before) > 16384
    done = subprocess.run(
        [sys.executable, "-c", NO_HARD_LINKS, "merge", str(out)], capture_output=True, text=True, timeout=300
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and str(errors) in lines[0], done.stderr
    assert errors.read_bytes() == before
    assert not (out / "index.json").exists()
    assert [n for n in os.listdir(out) if n.startswith(".shardify-replaced")] == []


STAGE_DRIVER = textwrap.dedent(
    r'''
    import builtins, json, os, shutil, sys, tempfile

    from streambatch.format.index import ShardIndex
    from streambatch.io.lock import is_lock_file
    from streambatch.write.stage import stage_dataset
    from streambatch.write.verify import verify_dataset

    exec(sys.argv[5])  # die_at(), as the driver above defines it
    old, new, template, work = sys.argv[1:5]


    def seen(root):
        """What a reader finds in ``root``: "old" or "new" (that dataset's index, every shard verified), "none"
        (no index), or what else it finds."""
        if not os.path.exists(os.path.join(root, "index.json")):
            return "none"
        raw = open(os.path.join(root, "index.json"), "rb").read()
        which = {open(os.path.join(d, "index.json"), "rb").read(): n for n, d in (("old", old), ("new", new))}
        try:
            problems = verify_dataset(ShardIndex.load(root), progress=False)
        except Exception as e:
            problems = [repr(e)]
        return which.get(raw, "another index") + (f" broken: {problems[:1]}" if problems else "")


    def stage(root):
        stage_dataset(new, root, overwrite=True, workers=1, progress=False)


    results = []
    for k in range(1, 400):
        root = os.path.join(tempfile.mkdtemp(dir=work), "dest")
        shutil.copytree(template, root)
        pid = os.fork()
        if pid == 0:
            die_at(k)
            stage(root)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        found = seen(root)
        stage(root)  # the next run: it finishes the replacement
        hidden = sorted(n for n in os.listdir(root) if n.startswith(".") and not is_lock_file(n))
        results.append({"k": k, "code": code, "seen": found, "after": seen(root), "hidden": hidden})
        shutil.rmtree(os.path.dirname(root))
        if code == 0:
            break
    print(json.dumps(results))
    '''
)


def test_a_stage_overwrite_killed_at_any_step_leaves_the_old_dataset_or_the_new(tmp_path):
    """``shardify stage --overwrite``: while the new shards are copied the old dataset stays readable (its index
    in place, every shard it lists intact); the swap at the end leaves the old dataset or the new one, never a mix,
    and the next stage finishes the replacement, leaving nothing hidden behind."""
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.stage import stage_dataset
    from streambatch.write.writer import write_shards

    write_audio_corpus(str(tmp_path / "audio"), 12, seed=5)
    shutil.copytree(tmp_path / "audio", tmp_path / "audio2")
    for txt in sorted((tmp_path / "audio2").glob("*.txt")):  # the same audio, other transcripts: other bytes
        txt.write_text("Z" + txt.read_text()[1:])
    write_shards(str(tmp_path / "audio"), str(tmp_path / "old"), max_count=2, progress=False)
    write_shards(str(tmp_path / "audio2"), str(tmp_path / "new"), max_count=2, progress=False)
    stage_dataset(str(tmp_path / "old"), str(tmp_path / "template"), progress=False)
    die_at = DRIVER[DRIVER.index("def die_at") : DRIVER.index("def export_swap")]
    work = tmp_path / "work"
    work.mkdir()
    argv = [str(tmp_path / n) for n in ("old", "new", "template")] + [str(work), die_at]
    done = subprocess.run([sys.executable, "-c", STAGE_DRIVER, *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results[-1]["code"] == 0 and results[-1]["seen"] == "new", results[-1]
    seen = [r["seen"] for r in results]
    assert set(seen) <= {"old", "none", "new"}, seen  # never a broken dataset or a mix of the two
    # in that order: the old dataset, a short swap with no index at all, then the new one
    assert seen == sorted(seen, key=["old", "none", "new"].index), seen
    shards = len(os.listdir(tmp_path / "new")) - 3  # index.json and its two tables aside
    assert seen.count("old") >= 2 * shards, seen  # each shard copied (a write, a rename) with the old index there
    for r in results:
        assert r["after"] == "new" and r["hidden"] == [], r
