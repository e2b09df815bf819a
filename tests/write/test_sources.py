"""sources.py: every input kind → records with the right keys, paths, text and fields; bad lines → problems
with FILE:LINE; source-level mistakes → ShardifyError."""

from __future__ import annotations

import json

import pytest
from conftest import make_audio, write_jsonl

from streambatch.errors import ShardifyError
from streambatch.write.sources import Record, detect_kind, read_source, sanitize_key, token_length


def test_sanitize_key_makes_webdataset_safe_keys():
    assert sanitize_key("spk1/utt.a b") == "spk1__utt_a_b"
    assert sanitize_key("1089-134686-0000") == "1089-134686-0000"
    assert "." not in sanitize_key("a.b.c") and "/" not in sanitize_key("a/b")


def test_detect_kind(tmp_path, audio_folder, nemo_manifest):
    folder, _ = audio_folder
    manifest, _ = nemo_manifest
    assert detect_kind(str(folder)) == "folder"
    assert detect_kind(str(manifest)) == "manifest"  # NeMo JSONL named .json
    sb = tmp_path / "sb.json"
    sb.write_text(json.dumps({"u1": {"wav": "a.wav", "length": 1.0}}, indent=2))
    assert detect_kind(str(sb)) == "speechbrain"
    sb1 = tmp_path / "sb1.json"
    sb1.write_text(json.dumps({"u1": {"wav": "a.wav", "length": 1.0}}))  # one line
    assert detect_kind(str(sb1)) == "speechbrain"
    csv = tmp_path / "x.csv"
    csv.write_text("ID,duration,wav\n")
    assert detect_kind(str(csv)) == "speechbrain"
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    assert detect_kind(str(text)) == "text"
    with pytest.raises(ShardifyError, match="no such file"):
        detect_kind(str(tmp_path / "nope.jsonl"))


def test_folder_keys_transcripts_and_extensions(audio_folder):
    folder, expected = audio_folder
    records, problems = read_source(str(folder))
    assert problems == []
    assert sorted(r.key for r in records) == sorted(expected)
    by_key = {r.key: r for r in records}
    for key, e in expected.items():
        assert by_key[key].path == str(e["path"])
        assert by_key[key].text == e["text"]
    assert by_key["spk2__utt_c"].ext == "ogg"


def test_folder_same_stem_two_formats_is_a_duplicate_naming_both(tmp_path):
    make_audio(tmp_path / "d" / "a.wav", 0.1)
    make_audio(tmp_path / "d" / "a.flac", 0.1)
    records, problems = read_source(str(tmp_path / "d"))
    assert len(records) == 1 and len(problems) == 1
    msg = str(problems[0])
    assert "duplicate key 'a'" in msg and "a.wav" in msg and "a.flac" in msg


def test_empty_folder_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardifyError, match="no audio files"):
        read_source(str(tmp_path / "empty"))


def test_nemo_manifest_relative_paths_and_fields(nemo_manifest):
    manifest, expected = nemo_manifest
    records, problems = read_source(str(manifest))
    assert problems == []
    assert [r.key for r in records] == list(expected)
    r = records[0]
    assert r.path == str(expected[r.key]["path"])  # resolved against the manifest's folder
    assert r.text == "utterance 0"
    assert r.fields == {"duration": pytest.approx(expected[r.key]["frames"] / 16000), "lang": "en"}
    assert r.line == 1 and r.source == str(manifest)


def test_manifest_id_field_wins_and_paths_outside_use_common_folder(tmp_path):
    make_audio(tmp_path / "elsewhere" / "x" / "a.wav", 0.1)
    make_audio(tmp_path / "elsewhere" / "y" / "b.wav", 0.1)
    m = write_jsonl(
        tmp_path / "m" / "m.jsonl",
        [
            {"path": str(tmp_path / "elsewhere" / "x" / "a.wav"), "duration": 0.1},
            {"path": str(tmp_path / "elsewhere" / "y" / "b.wav"), "duration": 0.1, "utt_id": "my.id"},
        ],
    )
    records, problems = read_source(str(m))
    assert problems == []
    assert [r.key for r in records] == ["x__a", "my_id"]


def test_manifest_bad_lines_are_reported_with_file_and_line(tmp_path):
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"audio_filepath": "a.wav", "duration": 1.0},  # line 1
            {"duration": 1.0},  # line 3: no path
            {"audio_filepath": "c.wav"},  # line 4: no length
            {"audio_filepath": "d.wav", "duration": "long"},
        ],  # line 5: not a number
        raw_lines={1: "{not json"},  # line 2
    )
    records, problems = read_source(str(m), kind="manifest")
    assert [r.key for r in records] == ["a"]
    got = [str(p) for p in problems]
    assert got[0].startswith(f"{m}:2: not valid JSON")
    assert got[1].startswith(f"{m}:3: missing audio path field")
    assert got[2].startswith(f"{m}:4: missing length field")
    assert got[3].startswith(f"{m}:5: 'duration' is not a number")


def test_speechbrain_json_with_data_root_and_line_numbers(tmp_path):
    data = tmp_path / "corpus"
    make_audio(data / "a.flac", 0.1)
    make_audio(data / "b.wav", 0.1)
    entries = {
        "spk1-utt.1": {"wav": "{data_root}/a.flac", "length": 0.1, "wrd": "HELLO", "spk_id": "spk1"},
        "spk2-utt2": {"file_path": "$data_root/b.wav", "duration": 0.1},
        "bad": {"wav": "{data_root}/c.wav"},
    }
    sb = tmp_path / "train.json"
    sb.write_text(json.dumps(entries, indent=2))
    records, problems = read_source(str(sb), data_root=str(data))
    assert [r.key for r in records] == ["spk1-utt_1", "spk2-utt2"]
    assert records[0].path == str(data / "a.flac") and records[1].path == str(data / "b.wav")
    assert records[0].fields["id"] == "spk1-utt.1" and records[0].fields["wrd"] == "HELLO"
    assert records[0].line == 2 and records[1].line == 8
    assert len(problems) == 1 and str(problems[0]).startswith(f"{sb}:12: missing length field")


def test_data_root_placeholder_without_data_root_is_a_clear_error(tmp_path):
    sb = tmp_path / "x.json"
    sb.write_text(json.dumps({"u": {"wav": "{data_root}/a.wav", "length": 1}}, indent=2))
    with pytest.raises(ShardifyError, match=r"\{data_root\}.*--data-root"):
        read_source(str(sb))


def test_broken_speechbrain_json_names_the_line(tmp_path):
    sb = tmp_path / "x.json"
    sb.write_text('{\n  "u1": {"wav": "a.wav", "length": 1},\n  "u2": {"wav": "b.wav" "length": 1}\n}\n')
    with pytest.raises(ShardifyError, match=r"x\.json:3: not a valid SpeechBrain JSON"):
        read_source(str(sb), kind="speechbrain")


def test_speechbrain_csv_columns_and_wrong_column_count(tmp_path):
    data = tmp_path / "corpus"
    make_audio(data / "a.wav", 0.1)
    csv = tmp_path / "train.csv"
    csv.write_text(
        "ID,duration,wav,wav_format,spk_id,wrd\n"
        'utt1,0.1,$data_root/a.wav,wav,spk1,"HELLO, WORLD"\n'
        "utt2,0.1,$data_root/b.wav,wav\n"
        "utt3,abc,$data_root/c.wav,wav,spk1,X\n"
    )
    records, problems = read_source(str(csv), data_root=str(data))
    assert [r.key for r in records] == ["utt1"]
    r = records[0]
    assert r.path == str(data / "a.wav")
    assert r.fields == {"ID": "utt1", "duration": 0.1, "wav_format": "wav", "spk_id": "spk1", "wrd": "HELLO, WORLD"}
    assert [str(p) for p in problems] == [
        f"{csv}:3: 4 columns, but the header has 6",
        f"{csv}:4: 'duration' is not a number: 'abc'",
    ]


def test_csv_without_id_or_path_column(tmp_path):
    csv = tmp_path / "x.csv"
    csv.write_text("name,duration\nx,1\n")
    with pytest.raises(ShardifyError, match="ID"):
        read_source(str(csv))


def test_text_jsonl_keys_lengths_and_problems(tmp_path):
    t = write_jsonl(
        tmp_path / "corpus.jsonl",
        [
            {"text": "one two three", "lang": "en"},  # 1: 3 whitespace tokens
            {"input_ids": [5, 6, 7, 8], "id": "doc.2"},  # 2: 4 ids
            {"text": "a b", "input_ids": [1], "length": 9},  # 3: precomputed length wins
            {"lang": "fr"},  # 4: nothing to measure
            {"input_ids": [1, "x"]},  # 5: bad ids
            {"text": "x", "length": 1.5},  # 6: bad length
        ],
    )
    records, problems = read_source(str(t))
    assert [r.key for r in records] == ["corpus_000000001", "doc_2", "corpus_000000003"]
    assert [token_length(r) for r in records] == [3, 4, 9]
    assert records[0].fields == {"lang": "en"}
    assert [p.line for p in problems] == [4, 5, 6]
    assert "missing 'text' or 'input_ids'" in str(problems[0])


def test_record_where_and_ext():
    r = Record(key="k", path="/x/Y.FLAC", source="/m.jsonl", line=7)
    assert r.where == "/m.jsonl:7" and r.ext == "flac"
    assert str(r.problem("boom")) == "/m.jsonl:7: boom"


def test_kind_can_be_forced(tmp_path):
    t = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a b c", "path": "crawl/1.html"}])
    assert detect_kind(str(t)) == "manifest"  # it has a "path" field
    records, problems = read_source(str(t), kind="text")
    assert problems == [] and records[0].text == "a b c" and records[0].fields == {"path": "crawl/1.html"}
    with pytest.raises(ShardifyError, match="unknown kind"):
        read_source(str(t), kind="video")
