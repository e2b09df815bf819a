"""Bombs in adopted tars and manifests (issue 25, items 4 and 7): a .json member nested 200,000 deep, a header
claiming 100 GB, a member over the size limit, a .json with 300,000 keys, keys that climb out of their folder or
hold control characters, a manifest line nested 100,000 deep. Each is a clear one-line error (exit 2), or a
sample skipped and listed under ``--on-error skip``; never a RecursionError, a MemoryError or 300,000 columns."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from fuzz_inputs import write_tar

from streambatch import ShardIndex, limits
from streambatch.cli import main
from streambatch.errors import ShardReadError
from streambatch.format.tar import iter_members
from streambatch.write.sources import read_source

DEEP = 200_000
REAL = Path(__file__).parent.parent / "data" / "real"


def cli(*args: str) -> int:
    return main([*args, "--no-progress"])


def text_sample(key: str, words: int, meta: dict | None = None) -> list[tuple[str, bytes]]:
    """A text sample: ``KEY.txt`` of ``words`` words, and ``KEY.json`` when ``meta`` is given."""
    out = [(f"{key}.txt", " ".join(["w"] * words).encode())]
    if meta is not None:
        out.append((f"{key}.json", json.dumps(meta).encode()))
    return out


def text_tars(src: Path, bad: dict[str, list[tuple[str, bytes]]], per_tar: int = 4) -> list[str]:
    """Two text tars of ``2 * per_tar`` samples ``doc00``...; a key in ``bad`` has those members instead.
    Returns the good keys."""
    src.mkdir(parents=True, exist_ok=True)
    good = []
    for t in range(2):
        members = []
        for i in range(per_tar):
            key = f"doc{t * per_tar + i:02d}"
            members += bad.get(key) or text_sample(key, 1 + i, {"lang": "de"})
            if key not in bad:
                good.append(key)
        write_tar(src / f"text-{t}.tar", members)
    return good


def errors_listed(src: Path) -> list[dict]:
    return [json.loads(line) for line in (src / "errors.jsonl").read_text().splitlines()]


def one_line_exit_2(capsys, *args: str) -> str:
    capsys.readouterr()
    assert cli(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def index_keys(src: Path) -> dict[str, int]:
    ix = ShardIndex.load(str(src))
    out: dict[str, int] = {}
    for s in range(ix.num_shards):
        stored = ix.shards.reader.shard_samples(s)
        out.update(zip(stored["keys"], stored["lengths"].tolist()))
    return out


# ---- a .json nested 200,000 deep -------------------------------------------------------------------------------
def test_deep_json_member_is_one_line_or_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "deep"
    deep = b"[" * DEEP + b"]" * DEEP
    good = text_tars(src, {"doc02": [("doc02.txt", b"a b"), ("doc02.json", deep)]})
    line = one_line_exit_2(capsys, "index", str(src))
    assert "doc02.json" in line and "nested more than" in line and "--on-error skip" in line
    assert not (src / "index.json").exists()

    assert cli("index", str(src), "--on-error", "skip") == 0
    listed = errors_listed(src)
    assert [r["key"] for r in listed] == ["doc02"] and "STREAMBATCH_MAX_JSON_DEPTH" in listed[0]["error"]
    lengths = index_keys(src)
    assert lengths["doc02"] == 0  # kept in place (the tar is not rewritten), never planned
    assert {k for k, n in lengths.items() if n} == set(good)


def test_deep_json_within_a_raised_limit_is_read(tmp_path, monkeypatch):
    """The limit is a setting: raised by the environment variable, a 150-deep .json is an ordinary sample."""
    src = tmp_path / "deepish"
    meta = {"lang": "de", "nested": json.loads("[" * 149 + "]" * 149)}
    text_tars(src, {"doc01": text_sample("doc01", 3, meta)})
    monkeypatch.setenv("STREAMBATCH_MAX_JSON_DEPTH", "200")
    assert cli("index", str(src)) == 0
    assert index_keys(src)["doc01"] == 3


# ---- sizes: a header claiming 100 GB, a member over the limit --------------------------------------------------
def huge_claim_tar(path: Path, claim: int = 100 << 30) -> None:
    """A tar whose second member's header claims ``claim`` bytes (GNU base-256 size) and holds a few KB."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in text_sample("doc00", 2, {"lang": "de"}):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue().rstrip(b"\0")
    body += b"\0" * (-len(body) % 512)
    info = tarfile.TarInfo("doc01.txt")
    info.size = claim
    path.write_bytes(body + info.tobuf(format=tarfile.GNU_FORMAT) + b"x" * 5000)


def test_header_claiming_100_gb_reads_what_is_there(tmp_path):
    """The parser never allocates what a header claims: it reads what arrives and finds the tar truncated."""
    path = tmp_path / "claim.tar"
    huge_claim_tar(path)
    tracemalloc.start()
    try:
        with open(path, "rb") as f, pytest.raises(ShardReadError, match="truncated"):
            list(iter_members(f, str(path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # the read piece (16 MiB) bounds it, not the 100 GB claimed


def test_header_claiming_100_gb_in_shardify_index(tmp_path, capsys):
    src = tmp_path / "claim"
    text_tars(src, {})
    huge_claim_tar(src / "text-9.tar")
    line = one_line_exit_2(capsys, "index", str(src))
    assert "text-9.tar" in line and "truncated" in line and "MemoryError" not in line
    assert cli("index", str(src), "--on-error", "skip") == 0
    assert [r["source"].rsplit("/", 1)[-1] for r in errors_listed(src)] == ["text-9.tar"]


def test_member_over_the_size_limit_is_a_bad_sample(tmp_path, capsys, monkeypatch):
    src = tmp_path / "big"
    good = text_tars(src, {"doc05": text_sample("doc05", 3000, {"lang": "en"})})
    monkeypatch.setenv("STREAMBATCH_MAX_MEMBER_BYTES", "4K")
    line = one_line_exit_2(capsys, "index", str(src))
    assert "doc05.txt" in line and "STREAMBATCH_MAX_MEMBER_BYTES" in line
    assert cli("index", str(src), "--on-error", "skip") == 0
    assert [r["key"] for r in errors_listed(src)] == ["doc05"]
    assert {k for k, n in index_keys(src).items() if n} == set(good)


# ---- 300,000 keys in one .json: a bounded set of columns ------------------------------------------------------
def test_300000_keys_give_a_bounded_set_of_columns(tmp_path, capsys):
    src = tmp_path / "wide"
    wide = {"lang": "de", **{f"k{i}": i for i in range(300_000)}}
    text_tars(src, {"doc03": text_sample("doc03", 2, wide)})
    capsys.readouterr()
    assert cli("index", str(src)) == 0
    assert "--columns" in capsys.readouterr().err
    ix = ShardIndex.load(str(src))
    assert len(ix.columns) == limits.DEFAULT_MAX_COLUMNS and "lang" in ix.columns
    assert ix.meta["columns_left_out"] > 0
    # --columns names the ones wanted (any number of them), and nothing else is stored
    assert cli("index", str(src), "--overwrite", "--columns", "lang,k299") == 0
    assert set(ShardIndex.load(str(src)).columns) == {"lang", "k299"}


def test_a_manifest_with_thousands_of_fields_gives_a_bounded_set_of_columns(tmp_path, capsys):
    """`shardify write` from a manifest whose lines carry 5,000 scalar fields stores the bounded default (and
    says so); --columns names exactly the ones wanted."""
    manifest = tmp_path / "docs.jsonl"
    with open(manifest, "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"d{i}", "text": "a b c", "lang": "de", **{f"k{j}": j for j in range(5000)}}))
            f.write("\n")
    out = tmp_path / "ds"
    capsys.readouterr()
    assert cli("write", str(manifest), str(out)) == 0
    assert "--columns" in capsys.readouterr().err
    ix = ShardIndex.load(str(out))
    assert len(ix.columns) == limits.DEFAULT_MAX_COLUMNS and "lang" in ix.columns
    assert ix.meta["columns_left_out"] == 5002 - limits.DEFAULT_MAX_COLUMNS  # id, lang and k0..k4999
    assert cli("write", str(manifest), str(out), "--overwrite", "--columns", "lang,k4999") == 0
    assert set(ShardIndex.load(str(out)).columns) == {"lang", "k4999"}


# ---- keys: refused, not renamed -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,why",
    [
        ("../../escape", "climbs out"),
        ("a/../../b", "climbs out"),
        ("/etc/passwd", "absolute path"),
        ("bell\x07key", "control characters"),
        ("new\nline", "control characters"),
    ],
)
def test_unsafe_keys_are_refused(tmp_path, capsys, key, why):
    """A key is the name a sample's members are written out under, and the index's key must be the tar's: an
    unsafe one is refused (one line; listed and left out under --on-error skip), never cleaned up."""
    src = tmp_path / "keys"
    good = text_tars(src, {"doc06": text_sample(key, 2, {"lang": "de"})})
    line = one_line_exit_2(capsys, "index", str(src))
    assert why in line
    assert cli("index", str(src), "--on-error", "skip") == 0
    listed = errors_listed(src)
    assert len(listed) == 1 and why in listed[0]["error"]
    assert {k for k, n in index_keys(src).items() if n} == set(good)


# ---- item 7: a manifest field nested 100,000 deep --------------------------------------------------------------
def deep_field(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


def exit_2_naming(capsys, where: str, *args: str) -> None:
    """``shardify ARGS`` exits 2 with a problem line ``WHERE: JSON nested more than ...`` (no traceback)."""
    capsys.readouterr()
    assert cli(*args) == 2
    err = capsys.readouterr().err
    assert f"{where}: " in err and "JSON nested more than" in err and "unexpected" not in err and "Traceback" not in err


def first_cut() -> dict:
    with gzip.open(REAL / "manifests" / "lhotse" / "cuts.jsonl.gz", "rt") as f:
        return json.loads(f.readline())


@pytest.mark.parametrize("kind", ["manifest", "text", "lhotse"])
def test_deep_manifest_line_is_exit_2_naming_the_line(tmp_path, capsys, kind):
    good = {
        "manifest": {"audio_filepath": str(REAL / "audio" / "LJ002-0020.wav"), "duration": 1.0, "text": "hi"},
        "text": {"text": "a b c"},
    }
    first = good[kind] if kind in good else first_cut()
    src = tmp_path / ("cuts.jsonl" if kind == "lhotse" else "m.jsonl")
    src.write_text(json.dumps(first) + "\n" + '{"id": "x", "deep": ' + deep_field() + "}\n")
    exit_2_naming(capsys, f"{src}:2", "write", str(src), str(tmp_path / "out"), "--kind", kind)


def test_deep_speechbrain_json_is_exit_2_naming_the_line(tmp_path, capsys):
    src = tmp_path / "sb.json"
    src.write_text('{\n"a": {"wav": "x.wav", "length": 1.0},\n"b": {"wav": "y.wav", "deep": ' + deep_field() + "}\n}\n")
    exit_2_naming(capsys, f"{src}:3", "write", str(src), str(tmp_path / "out"), "--kind", "speechbrain")


def test_deep_nemo_manifest_beside_adopted_tars(tmp_path, capsys):
    src = tmp_path / "nemo"
    src.mkdir()
    write_tar(src / "audio_0.tar", [("a.wav", b"RIFF")])
    (src / "tarred_audio_manifest.json").write_text('{"audio_filepath": "a.wav", "x": ' + deep_field() + "}\n")
    line = one_line_exit_2(capsys, "index", str(src))
    assert "tarred_audio_manifest.json:1" in line and "nested more than" in line


def test_deep_first_line_does_not_crash_kind_detection(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text('{"deep": ' + deep_field() + "}\n")
    records, problems = read_source(str(src), kind="text")
    assert not records and problems and "nested more than" in problems[0].error


def test_brackets_inside_strings_do_not_count(tmp_path):
    """Depth is nesting, not bracket characters: a transcript of 200,000 brackets is an ordinary sample."""
    src = tmp_path / "brackets"
    meta = {"lang": "de", "note": "[{" * DEEP, "quoted": '\\"[' * 50}
    text_tars(src, {"doc04": text_sample("doc04", 2, meta)})
    assert cli("index", str(src)) == 0
    assert index_keys(src)["doc04"] == 2
    assert limits.loads(json.dumps([[["[" * 500]]])) == [[["[" * 500]]]


def test_a_limit_set_to_nonsense_is_one_line(tmp_path, capsys, monkeypatch):
    src = tmp_path / "nonsense"
    text_tars(src, {})
    monkeypatch.setenv("STREAMBATCH_MAX_MEMBER_BYTES", "lots")
    line = one_line_exit_2(capsys, "index", str(src))
    assert "STREAMBATCH_MAX_MEMBER_BYTES" in line
