"""shardify write --part I/N + merge (= a single-process write), write --resume (also after a real kill), and
shardify stage (a resumable, verified copy to local disk)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_same_dataset, make_audio, popen, samples_of, write_jsonl

from streambatch.cli import main
from streambatch.errors import ShardifyError, UntrustedURL
from streambatch.format.index import ShardIndex
from streambatch.write.parts import merge_parts
from streambatch.write.stage import stage_dataset
from streambatch.write.verify import verify_dataset
from streambatch.write.writer import write_shards


def index_json(out) -> dict:
    """What an index says, whichever write made it: its header without the time and the write's id (the
    tables' file sizes too, which hold that id) and, for version 2, every row of its tables."""
    d = json.loads((Path(out) / "index.json").read_text())
    d["meta"].pop("created")
    d["meta"].pop("parts", None)
    if d.pop("id", None) is not None:
        d.pop("tables")
        ix = ShardIndex.load(str(out))
        d["rows"] = [(s.url, s.count, s.bytes, s.sha256, s.keys_sha1) for s in ix.shards]
        d["samples"] = [
            {k: v.tolist() if hasattr(v, "tolist") else v for k, v in ix.shards.reader.shard_samples(i).items()}
            for i in range(ix.num_shards)
        ]
    return d


def files_under(root) -> list[str]:
    """Every file under ``root``, as paths relative to it."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("parts") / "audio"
    for i in range(23):
        make_audio(d / f"spk{i % 3}" / f"u{i:03d}.{['wav', 'flac'][i % 2]}", 0.05 + 0.01 * (i % 7), seed=i)
        if i % 4 == 0:
            (d / f"spk{i % 3}" / f"u{i:03d}.txt").write_text(f"words {i}\n")
    return d


KW = dict(max_count=3, shuffle=True, seed=5, progress=False)


@pytest.mark.parametrize("n", [1, 3, 7, 30])
def test_parts_merged_equal_a_single_process_write(tmp_path, folder, n):
    single = tmp_path / "single"
    write_shards(str(folder), str(single), **KW)
    out = tmp_path / "parts"
    for i in reversed(range(n)):  # any order, as array tasks run
        ix = write_shards(str(folder), str(out), part=f"{i}/{n}", workers=2 if i == 1 else 1, **KW)
        assert ix.meta["part"]["index"] == i
        assert (out / f"index.part-{i:04d}.json").exists()
    assert not (out / "index.json").exists()
    merged = merge_parts(str(out))
    assert merged.meta["parts"] == n
    assert all(s.url.startswith("shard-p") for s in merged.shards)
    assert_same_dataset(out, single)
    assert merge_parts(str(out)).lengths.tolist() == merged.lengths.tolist()  # merging again is harmless


def test_parts_with_bad_inputs_skipped_give_the_same_errors_jsonl(tmp_path):
    d = tmp_path / "m"
    rows = []
    for i in range(10):
        make_audio(d / f"a{i}.wav", 0.05, seed=i)
        rows.append({"audio_filepath": f"a{i}.wav", "duration": 0.05, "text": f"t{i}"})
    rows.insert(3, {"audio_filepath": "gone.wav", "duration": 1})
    rows.insert(8, {"audio_filepath": "gone2.wav", "duration": 1})
    m = write_jsonl(d / "m.jsonl", rows, raw_lines={5: "{not json"})
    kw = dict(max_count=2, shuffle=True, seed=1, on_error="skip", progress=False)
    write_shards(str(m), str(tmp_path / "single"), **kw)
    for i in range(3):
        write_shards(str(m), str(tmp_path / "parts"), part=(i, 3), **kw)
    merged = merge_parts(str(tmp_path / "parts"))
    assert merged.meta["skipped"] == 3
    assert_same_dataset(tmp_path / "parts", tmp_path / "single")
    assert (tmp_path / "parts" / "errors.jsonl").read_text() == (tmp_path / "single" / "errors.jsonl").read_text()


def test_a_missing_part_is_a_clear_error(tmp_path, folder, capsys):
    out = tmp_path / "out"
    for i in (0, 2):
        write_shards(str(folder), str(out), part=(i, 4), **KW)
    with pytest.raises(ShardifyError, match=r"2 of 4 parts missing \(part 1, 3: no index.part-0001.json"):
        merge_parts(str(out))
    assert main(["merge", str(out)]) == 2
    assert "--part I/4 --resume" in capsys.readouterr().err
    assert not (out / "index.json").exists()
    with pytest.raises(ShardifyError, match="no part indexes"):
        merge_parts(str(tmp_path / "empty"))


def test_parts_of_different_runs_or_options_do_not_merge(tmp_path, folder):
    out = tmp_path / "out"
    write_shards(str(folder), str(out), part=(0, 2), **KW)
    write_shards(str(folder), str(out), part=(1, 2), **dict(KW, seed=6))
    with pytest.raises(ShardifyError, match="seed=6.*not from the same run"):
        merge_parts(str(out))
    write_shards(str(folder), str(out), part=(2, 3), **KW)
    with pytest.raises(ShardifyError, match="different runs"):
        merge_parts(str(out))
    # --overwrite of a part of a 2-part run removes parts numbered 2 or more, left by the 3-part run
    write_shards(str(folder), str(out), part=(1, 2), overwrite=True, **KW)
    assert not list(out.glob("*p0002*"))
    merge_parts(str(out))


def test_parts_of_mixed_sample_rates_need_sample_rate(tmp_path):
    d = tmp_path / "a"
    for i in range(4):
        make_audio(d / f"u{i}.wav", 0.05, sr=16000 if i < 2 else 8000, seed=i)
    out = tmp_path / "out"
    for i in range(2):  # each part alone sees one rate
        write_shards(str(d), str(out), part=(i, 2), progress=False)
    with pytest.raises(ShardifyError, match="different sample rates.*--sample-rate"):
        merge_parts(str(out))
    for i in range(2):
        write_shards(str(d), str(out), part=(i, 2), sample_rate=16000, overwrite=True, progress=False)
    assert merge_parts(str(out)).sample_rate == 16000


def test_part_folder_rules(tmp_path, folder):
    out = tmp_path / "out"
    write_shards(str(folder), str(out), part=(0, 2), **KW)
    with pytest.raises(ShardifyError, match="--resume to finish an interrupted part"):
        write_shards(str(folder), str(out), part=(0, 2), **KW)
    write_shards(str(folder), str(out), part=(0, 2), resume=True, **KW)
    (out / "notes.txt").write_text("x")
    with pytest.raises(ShardifyError, match="other than the other parts'"):
        write_shards(str(folder), str(out), part=(1, 2), **KW)
    for bad in ("2/2", "1", "a/b", "-1/3"):
        with pytest.raises(ShardifyError, match="I/N|between 0 and N-1"):
            write_shards(str(folder), str(tmp_path / "x"), part=bad, **KW)
    with pytest.raises(ShardifyError, match="pass one of them"):
        write_shards(str(folder), str(out), resume=True, overwrite=True, **KW)


def test_cli_parts_merge_and_stage(tmp_path, folder, capsys):
    out = tmp_path / "out"
    for i in range(2):
        assert main(["write", str(folder), str(out), "--part", f"{i}/2", "--max-count", "4", "--no-progress"]) == 0
        assert f"wrote part {i}/2" in capsys.readouterr().out
    assert main(["merge", str(out), "--verify", "--no-progress"]) == 0
    assert "merged 2 parts: 23 samples" in capsys.readouterr().out
    assert main(["write", str(folder), str(tmp_path / "o2"), "--part", "2/2"]) == 2
    assert "between 0 and N-1" in capsys.readouterr().err
    assert main(["stage", str(out), str(tmp_path / "local"), "--no-progress"]) == 0
    assert "copied 6" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "local"), "--no-progress"]) == 0


@pytest.mark.parametrize(
    "command,options",
    [
        ("write", ["--part", "--resume"]),
        ("merge", ["PART_INDEX", "--verify", "--storage-option"]),
        ("stage", ["--verify", "--workers", "--storage-option"]),
    ],
)
def test_help_documents_the_options(capsys, command, options):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    for o in options:
        assert o in text


# ---- resume --------------------------------------------------------------------------------------
def test_resume_keeps_complete_shards_and_rewrites_the_rest(tmp_path, folder):
    clean, out = tmp_path / "clean", tmp_path / "out"
    write_shards(str(folder), str(clean), **KW)
    write_shards(str(folder), str(out), **KW)
    (out / "index.json").unlink()  # as if killed before the index
    (out / "shard-000002.tar").unlink()  # never written
    bad = out / "shard-000004.tar"  # same size, other bytes
    data = bytearray(bad.read_bytes())
    data[700] ^= 0xFF
    bad.write_bytes(bytes(data))
    (out / "shard-000005.tar.tmp-deadbeef").write_bytes(b"partial")  # a killed write's temporary file
    (out / "shard-000099.tar").write_bytes(b"a stale shard of another plan")
    kept_inode = (out / "shard-000000.tar").stat().st_ino
    stats: dict = {}
    write_shards(str(folder), str(out), resume=True, stats=stats, **KW)
    assert stats == {"kept": 6, "written": 2}
    assert (out / "shard-000000.tar").stat().st_ino == kept_inode  # kept, not rewritten
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        if not name.startswith("index."):
            assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert index_json(out) == index_json(clean)
    # resuming a finished write touches nothing: not even its index
    index_inode, stats = (out / "index.json").stat().st_ino, {}
    write_shards(str(folder), str(out), resume=True, stats=stats, workers=2, **KW)
    assert stats == {"kept": 8, "written": 0, "complete": 1}
    assert (out / "index.json").stat().st_ino == index_inode


def _many_small_files(d: Path, n: int) -> Path:
    for i in range(n):
        make_audio(d / f"u{i:04d}.wav", 0.02, seed=i)
    return d


def test_a_killed_shardify_write_resumes_to_the_clean_result(tmp_path):
    """A real `shardify write` process, SIGKILLed after its first shards appear."""
    src = _many_small_files(tmp_path / "src", 400)
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ["write", str(src), "--max-count", "1", "--workers", "1", "--shuffle", "--no-progress"]
    proc = popen(
        [sys.executable, "-m", "streambatch.cli", *args[:2], str(out), *args[2:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 60
    while len(list(out.glob("shard-*.tar"))) < 5:
        assert proc.poll() is None and time.time() < deadline, "the write ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(list(out.glob("shard-*.tar")))
    assert 5 <= written < 400, written
    assert not (out / "index.json").exists()
    assert main(["verify", str(out), "--no-progress"]) == 2  # no index: not a dataset yet

    r = subprocess.run(
        [sys.executable, "-m", "streambatch.cli", *args[:2], str(out), *args[2:], "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"kept {written} complete shards" in r.stdout or f"kept {written - 1} complete" in r.stdout
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert main([*args[:2], str(clean), *args[2:]]) == 0
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        if not name.startswith("index."):
            assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert index_json(out) == index_json(clean)


def test_resume_of_a_part(tmp_path, folder):
    single, out = tmp_path / "single", tmp_path / "out"
    write_shards(str(folder), str(single), **KW)
    for i in range(3):
        write_shards(str(folder), str(out), part=(i, 3), **KW)
    (out / "index.part-0001.json").unlink()
    next(out.glob("shard-p0001-*.tar")).unlink()
    with pytest.raises(ShardifyError, match="part 1: no index.part-0001.json"):
        merge_parts(str(out))
    stats: dict = {}
    write_shards(str(folder), str(out), part=(1, 3), resume=True, stats=stats, **KW)
    assert stats["written"] == 1 and stats["kept"] >= 1
    merge_parts(str(out))
    assert_same_dataset(out, single)
    with pytest.raises(ShardifyError, match="already holds the merged dataset"):
        write_shards(str(folder), str(out), part=(1, 3), resume=True, **KW)


def test_resume_of_a_complete_part_touches_nothing(tmp_path, folder, capsys):
    """`--part I/N --resume` of a part that is complete leaves its files as they are (an interrupt there could
    otherwise leave the part without its index); a resume with other options, or of another part count, is
    refused and leaves the part as it was."""
    out = tmp_path / "out"
    write = ["write", str(folder), str(out), "--max-count", "3", "--seed", "5", "--shuffle", "--no-progress"]
    assert main([*write, "--part", "1/3"]) == 0
    before = {name: (out / name).stat().st_mtime_ns for name in files_under(out)}
    capsys.readouterr()
    assert main([*write, "--part", "1/3", "--resume"]) == 0
    assert "already holds part 1/3 of this dataset" in capsys.readouterr().out
    assert {name: (out / name).stat().st_mtime_ns for name in files_under(out)} == before
    assert main([*write[:-3], "6", "--shuffle", "--no-progress", "--part", "1/3", "--resume"]) == 2
    assert "of another command (seed=5, this command: 6)" in capsys.readouterr().err
    assert main([*write, "--part", "1/4", "--resume"]) == 2
    assert "part 1/3 of another command (part='1/3', this command: '1/4')" in capsys.readouterr().err
    assert {name: (out / name).stat().st_mtime_ns for name in files_under(out)} == before
    next(out.glob("shard-p0001-*.tar")).unlink()  # a part with a shard missing is finished, as before
    assert main([*write, "--part", "1/3", "--resume"]) == 0
    assert "resumed: kept" in capsys.readouterr().out


def test_resume_after_merge_recognises_the_merged_dataset(tmp_path, folder, capsys):
    """`shardify write SRC OUT --resume` (the documented safe-on-every-run command) after the parts were merged:
    the dataset is complete, so nothing is written or removed (exit 0, a message). A resume with other options, or
    before the merge, refuses (exit 2) and leaves OUT as it was, instead of writing a whole copy beside the parts."""
    out = tmp_path / "out"
    write = ["write", str(folder), str(out), "--max-count", "3", "--shuffle", "--seed", "5", "--no-progress"]
    for i in range(3):
        assert main([*write, "--part", f"{i}/3"]) == 0
    before = files_under(out)
    assert main([*write, "--resume"]) == 2
    assert "not yet merged" in capsys.readouterr().err and files_under(out) == before
    assert main(["merge", str(out)]) == 0
    merged = {name: (out / name).stat().st_mtime_ns for name in files_under(out)}
    expected = index_json(out)

    capsys.readouterr()
    assert main([*write, "--resume"]) == 0
    assert "already holds this dataset, merged from 3 parts" in capsys.readouterr().out
    assert {name: (out / name).stat().st_mtime_ns for name in files_under(out)} == merged  # not a file touched
    assert index_json(out) == expected and not list(out.glob("shard-0*.tar"))
    stats: dict = {}
    ix = write_shards(str(folder), str(out), resume=True, stats=stats, **KW)
    assert stats == {"kept": ix.num_shards, "written": 0, "complete": 1} and ix.meta["parts"] == 3

    assert main([*write[:-2], "6", "--no-progress", "--resume"]) == 2  # --seed 6
    assert "another command (seed=5, this command: 6)" in capsys.readouterr().err
    assert files_under(out) == sorted(merged)


# ---- stage ---------------------------------------------------------------------------------------
@pytest.fixture
def dataset(tmp_path, folder) -> Path:
    out = tmp_path / "ds"
    write_shards(str(folder), str(out), **KW)
    return out


def test_stage_copies_verifies_and_resumes(tmp_path, dataset):
    dest = tmp_path / "local" / "ds"
    (dest).mkdir(parents=True)
    (dest / "other.txt").write_text("not ours")
    res = stage_dataset(str(dataset), str(dest), progress=False)
    assert len(res.copied) == 8 and not res.kept
    assert (dest / "index.json").read_bytes() == (dataset / "index.json").read_bytes()
    for name in files_under(dataset):
        assert (dest / name).read_bytes() == (dataset / name).read_bytes()
    assert (dest / "other.txt").read_text() == "not ours"
    assert verify_dataset(ShardIndex.load(str(dest)), progress=False) == []
    mtime = (dest / "shard-000000.tar").stat().st_mtime_ns
    res = stage_dataset(str(dataset), str(dest), progress=False)
    assert not res.copied and len(res.kept) == 8
    assert (dest / "shard-000000.tar").stat().st_mtime_ns == mtime
    # an interrupted stage: a truncated shard (size differs), a temporary file
    (dest / "shard-000003.tar").write_bytes(b"x" * 10)
    (dest / "shard-000004.tar").unlink()
    res = stage_dataset(str(dataset), str(dest), progress=False)
    assert res.copied == ["shard-000003.tar", "shard-000004.tar"]
    # same size, other bytes: only --verify notices
    p = dest / "shard-000001.tar"
    b = bytearray(p.read_bytes())
    b[600] ^= 1
    p.write_bytes(bytes(b))
    assert stage_dataset(str(dataset), str(dest), progress=False).copied == []
    assert stage_dataset(str(dataset), str(dest), verify=True, progress=False).copied == ["shard-000001.tar"]
    assert verify_dataset(ShardIndex.load(str(dest)), progress=False) == []
    assert not [n for n in os.listdir(dest) if ".tmp" in n]


def test_stage_refuses_a_damaged_source_shard_and_writes_no_index(tmp_path, dataset):
    p = dataset / "shard-000002.tar"
    b = bytearray(p.read_bytes())
    b[900] ^= 1
    p.write_bytes(bytes(b))
    dest = tmp_path / "local"
    with pytest.raises(ShardifyError, match="shard-000002.tar: sha256"):
        stage_dataset(str(dataset), str(dest), progress=False, workers=1)
    assert not (dest / "index.json").exists()
    assert not [n for n in os.listdir(dest) if ".tmp" in n]


def test_stage_from_an_fsspec_url(tmp_path, dataset):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = "memory://streambatch-stage/ds"
    if fs.exists(url):
        fs.rm(url, recursive=True)
    for name in files_under(dataset):
        fs.pipe(f"{url}/{name}", (dataset / name).read_bytes())
    dest = tmp_path / "local"
    res = stage_dataset(url, str(dest), progress=False, workers=3)
    assert len(res.copied) == 8
    assert samples_of(dest) == samples_of(dataset)
    fs.rm(url, recursive=True)


def test_stage_of_an_index_with_absolute_urls_rewrites_them(tmp_path, folder):
    out = tmp_path / "parts"
    for i in range(2):
        write_shards(str(folder), str(out), part=(i, 2), **KW)
    merged_elsewhere = tmp_path / "merged"
    merge_parts(str(merged_elsewhere), [str(p) for p in sorted(out.glob("index.part-*.json"))])
    assert all(os.path.isabs(s.url) for s in ShardIndex.load(str(merged_elsewhere)).shards)
    dest = tmp_path / "local"
    with pytest.raises(UntrustedURL, match="shard_roots="):  # its shards are outside its folder: read if allowed
        stage_dataset(str(merged_elsewhere), str(dest), progress=False)
    assert not dest.exists()
    stage_dataset(str(merged_elsewhere), str(dest), progress=False, shard_roots=[str(out)])
    staged = ShardIndex.load(str(dest))
    assert all(not os.path.isabs(s.url) for s in staged.shards)  # the staged copy holds them all
    assert verify_dataset(staged, progress=False) == []
    assert samples_of(dest) == samples_of(merged_elsewhere, shard_roots=[str(out)])
