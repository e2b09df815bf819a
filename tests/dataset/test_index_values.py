"""The values an index holds are data, checked where they are first read (streambatch/format/index_values.py), and
``shardify index`` refuses a sample whose members say something the loader could not use (write/adopt/scan.py).

Each index here is a real one (``shardify write`` of real audio files) whose Parquet tables were rewritten with
one value forged, their write id kept and the header's byte counts fixed, so every size and id check passes and only
the value check can refuse it; each tar is a real tar of a real audio file. Every refusal is the right error class,
names the file and the problem, and through the CLI is one line, exit 2, no traceback.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from conftest import REPO

from streambatch.cli import main
from streambatch.errors import IndexFormatError, ShardifyError
from streambatch.format.index import ShardIndex
from streambatch.format.index_check import check_tables
from streambatch.write.adopt.index import index_tars

AUDIO = REPO / "tests" / "data" / "real" / "audio"
WAV = AUDIO / "LJ002-0020.wav"
SAMPLES = "index.samples/part-00000.parquet"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[int, Path]:
    """The real audio files written as shards of 5, with a version 2 and a version 1 index."""
    root = tmp_path_factory.mktemp("values")
    out = {}
    for version in (2, 1):
        ds = root / f"v{version}"
        args = ["--sample-rate", "16000", "--max-count", "5", "--no-progress", "--index-version", str(version)]
        assert main(["write", str(AUDIO), str(ds), *args]) == 0
        out[version] = ds
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _header(ds: Path) -> dict[str, Any]:
    return json.loads((ds / "index.json").read_text())


def forge(ds: Path, column: str, row: int, value: Any, rel: str = SAMPLES, as_binary: bool = False) -> None:
    """Rewrite table ``rel`` of ``ds`` with ``column[row] = value``: same schema, write id and row groups; the
    header's byte count of the table fixed so the size check passes. ``as_binary``: the value is bytes stored in a
    string column (Parquet does not check UTF-8)."""
    path = ds / rel
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    typ = table.schema.field(column).type
    values[row] = value
    if as_binary:
        new = pa.array([v.encode() if isinstance(v, str) else v for v in values], pa.binary()).view(typ)
    else:
        new = pa.array(values, typ)
    table = table.set_column(table.schema.get_field_index(column), column, new)
    rows = pq.ParquetFile(path).metadata.row_group(0).num_rows
    pq.write_table(table, path, row_group_size=rows, write_page_checksum=True)
    header = _header(ds)
    for entry in [header["tables"]["shards"], *header["tables"]["samples"]]:
        if entry["path"] == rel:
            entry["bytes"] = path.stat().st_size
    (ds / "index.json").write_text(json.dumps(header))


def _cli(capsys, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, (out.out + out.err).strip().splitlines()


def assert_one_line(capsys, args: list[str], *words: str) -> None:
    """The command exits 2 with one line on stderr that holds every one of ``words``, and no traceback."""
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, out.out + out.err
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    assert all(w in lines[0] for w in words), (words, lines[0])


def _refused(ds: Path, *words: str) -> str:
    """Reading every table as the loader does raises IndexFormatError naming the sample file and ``words``."""
    with pytest.raises(IndexFormatError) as e:
        check_tables(ShardIndex.load(str(ds)))
    text = str(e.value)
    assert SAMPLES in text and all(w in text for w in words), text
    return text


# ---- lengths --------------------------------------------------------------------------------------------------
def test_a_negative_length_is_refused_by_the_loader_inspect_and_verify(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "length", 3, -5)
    with pytest.raises(IndexFormatError, match=r"row 3 \(shard 0\): length -5 is negative"):
        ShardIndex.load(str(ds)).shard_lengths([0])
    _refused(ds, "length -5 is negative")
    assert_one_line(capsys, ["inspect", str(ds)], SAMPLES, "length -5 is negative")
    code, lines = _cli(capsys, "verify", str(ds), "--no-progress")
    assert code != 0 and any("length -5 is negative" in line for line in lines), lines


def test_a_length_past_the_bound_is_refused(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "length", 0, 2**62)
    _refused(ds, f"length {2**62}", "over")
    assert_one_line(capsys, ["inspect", str(ds)], SAMPLES, "STREAMBATCH_MAX_LENGTH")


def test_lengths_that_do_not_add_up_to_the_shard_table_are_refused(written, tmp_path, capsys):
    """Every length plausible, one changed: the shard table's total (what the plan balances ranks by) disagrees."""
    ds = _copy(written[2], tmp_path / "ds")
    lengths = pq.read_table(ds / SAMPLES).column("length").to_pylist()
    forge(ds, "length", 6, lengths[6] + 1000)
    _refused(ds, "shard 1", "add up to")
    assert_one_line(capsys, ["inspect", str(ds)], SAMPLES, "add up to")


def test_a_header_total_that_is_not_the_shard_tables_is_refused(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    header = _header(ds)
    header["total_length"] += 12345
    (ds / "index.json").write_text(json.dumps(header))
    with pytest.raises(IndexFormatError, match=r"index\.shards\.parquet: .*add up to .*index header says"):
        ShardIndex.load(str(ds))
    assert_one_line(capsys, ["inspect", str(ds)], "index.shards.parquet", "add up to")


def test_a_null_length_is_refused(written, tmp_path):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "length", 2, None)
    with pytest.raises(IndexFormatError, match="row 2 .*column 'length' is null"):
        ShardIndex.load(str(ds)).shard_lengths([0])


def _v1_lengths(ds: Path, shard: int, row: int, value: float, dtype: str) -> None:
    header = _header(ds)
    packed = header["shards"][shard]["lengths"]
    arr = np.frombuffer(base64.b64decode(packed["b64"]), dtype=packed["dtype"]).astype(dtype)
    arr[row] = value
    header["shards"][shard]["lengths"] = {"dtype": dtype, "b64": base64.b64encode(arr.tobytes()).decode()}
    (ds / "index.json").write_text(json.dumps(header))


@pytest.mark.parametrize(("value", "dtype", "why"), [(-5, "<i8", "negative"), (float("nan"), "<f8", "not a finite")])
def test_a_version_1_index_with_a_bad_length_is_neither_inspected_nor_upgraded(
    written, tmp_path, capsys, value, dtype, why
):
    ds = _copy(written[1], tmp_path / "ds")
    _v1_lengths(ds, 1, 2, value, dtype)
    before = (ds / "index.json").read_bytes()
    with pytest.raises(IndexFormatError, match=rf"index\.json: shards\[1\]\.lengths\[2\]: length .* is {why}"):
        ShardIndex.load(str(ds))
    assert_one_line(capsys, ["inspect", str(ds)], "index.json", "shards[1].lengths[2]", why)
    assert_one_line(capsys, ["upgrade", str(ds)], "index.json", "shards[1].lengths[2]", why)
    assert (ds / "index.json").read_bytes() == before and not (ds / "index.samples").exists()


# ---- keys, offsets, sizes -------------------------------------------------------------------------------------
def test_a_null_key_is_refused_where_keys_are_read_and_only_there(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "key", 0, None)
    index = ShardIndex.load(str(ds))
    assert index.shard_lengths([0])[0].size == 5  # a rank that reads lengths never reads keys
    with pytest.raises(IndexFormatError, match=r"row 0 \(shard 0\): column .key. is null among"):
        index.shards.reader.shard_values(0, "key")
    _refused(ds, "column 'key' is null")
    code, lines = _cli(capsys, "verify", str(ds), "--no-progress")
    assert code != 0 and any("column 'key' is null" in line for line in lines), lines
    assert_one_line(capsys, ["inspect", str(ds), "--step", "0", "--budget", "60s"], SAMPLES, "'key' is null")


@pytest.mark.parametrize(("key", "why"), [("../../etc/passwd", "climbs out"), ("/abs/path", "absolute path")])
def test_a_key_the_tar_reader_would_refuse_is_refused(written, tmp_path, capsys, key, why):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "key", 4, key)
    _refused(ds, "row 4", why)
    code, lines = _cli(capsys, "verify", str(ds), "--no-progress")
    assert code != 0 and any(why in line for line in lines), lines


def test_a_key_that_is_not_utf8_is_refused(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "key", 1, b"\xff\xfe", as_binary=True)
    _refused(ds, "column 'key' is not UTF-8")
    assert_one_line(capsys, ["inspect", str(ds), "--step", "0", "--budget", "60s"], SAMPLES, "not UTF-8")


def test_a_negative_offset_is_refused(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    forge(ds, "offset", 2, -3)
    with pytest.raises(IndexFormatError, match=r"row 2 \(shard 0\): offset -3 is negative"):
        ShardIndex.load(str(ds)).sample_offsets(0)
    code, lines = _cli(capsys, "verify", str(ds), "--no-progress")
    assert code != 0 and any("offset -3 is negative" in line for line in lines), lines


def test_a_byte_range_past_the_end_of_its_shard_is_refused(written, tmp_path, capsys):
    ds = _copy(written[2], tmp_path / "ds")
    shard_bytes = pq.read_table(ds / "index.shards.parquet").column("bytes").to_pylist()
    forge(ds, "size", 7, shard_bytes[1])  # row 7 is in shard 1, and does not start at its byte 0
    with pytest.raises(IndexFormatError, match=r"row 7 \(shard 1\): offset \d+ and size \d+ reach past the end"):
        ShardIndex.load(str(ds)).sample_offsets(1)
    code, lines = _cli(capsys, "verify", str(ds), "--no-progress")
    assert code != 0 and any("reach past the end" in line for line in lines), lines


# ---- shardify index: what a sample's members say --------------------------------------------------------------
def make_tar(folder: Path, members: dict[str, bytes], name: str = "t-0.tar") -> Path:
    """A real tar of ``members`` (name → bytes) in order, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / name, "w") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder / name


def assert_index_refused(capsys, src: Path, *words: str) -> None:
    """``index_tars`` raises ShardifyError naming ``words``; ``shardify index`` exits 2 with one line; no index."""
    with pytest.raises(ShardifyError) as e:
        index_tars(str(src), progress=False)
    assert all(w in str(e.value) for w in words) and "unknown layout" not in str(e.value), str(e.value)
    assert_one_line(capsys, ["index", str(src), "--no-progress"], *words)
    assert not (src / "index.json").exists()


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (b'{"length": "abc"}', "length 'abc' is not a finite number"),
        (b'{"length": true}', "length True is not a finite number"),
        (b'{"length": NaN}', "length nan is not a finite number"),
        (b'{"duration": "x"}', "duration 'x' is not a finite number"),
    ],
)
def test_a_json_length_or_duration_that_is_not_a_number_is_refused(tmp_path, capsys, meta, why):
    tar = make_tar(tmp_path / "jl", {"k1.wav": WAV.read_bytes(), "k1.json": meta})
    assert_index_refused(capsys, tar.parent, "t-0.tar", "k1.json", why)


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ({"k1.wav": WAV.read_bytes(), "k1.json": b"{not json"}, "k1.json: invalid JSON"),
        ({"k1.wav": WAV.read_bytes(), "k1.json": b"[1, 2]"}, "k1.json: not a JSON object"),
        ({"k1.json": b"{not json"}, "k1.json: invalid JSON"),
        ({"k1.txt": b"\xff\xfe not text"}, "k1.txt: not UTF-8 text"),
        ({"k1.wav": WAV.read_bytes(), "k1.txt": b"\xff\xfe not text"}, "k1.txt: not UTF-8 text"),
    ],
)
def test_a_bad_member_is_named_not_taken_for_an_unknown_layout(tmp_path, capsys, members, why):
    tar = make_tar(tmp_path / "bad", members)
    assert_index_refused(capsys, tar.parent, "t-0.tar", why)


def test_a_nemo_duration_that_is_not_a_number_is_refused_as_write_refuses_it(tmp_path, capsys):
    src = tmp_path / "nemo"
    make_tar(src, {"k1.wav": WAV.read_bytes(), "k2.wav": WAV.read_bytes()}, "audio_0.tar")
    duration = sf.info(str(WAV)).duration
    lines = [
        {"audio_filepath": "k1.wav", "duration": "x", "shard_id": 0, "text": "a"},
        {"audio_filepath": "k2.wav", "duration": duration, "shard_id": 0, "text": "b"},
    ]
    (src / "tarred_audio_manifest.json").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert_index_refused(capsys, src, "audio_0.tar", "tarred_audio_manifest.json:1", "'duration' is not a number: 'x'")
    assert main(["index", str(src), "--no-progress", "--on-error", "skip"]) == 0
    index = ShardIndex.load(str(src))
    assert index.lengths.tolist()[0] == 0 and index.lengths.tolist()[1] > 0  # left out, never planned
