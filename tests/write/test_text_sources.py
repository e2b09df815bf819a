"""Text on the write side: ``--tokenizer`` (Hugging Face tokenizers and sentencepiece, both trained here), Hugging
Face ``datasets`` sources (built here with ``save_to_disk``: audio as arrays, audio as stored bytes, text) and
``--output-length`` (a second length per sample in each ``.json`` and the sample table, kept by merge and
re-saves); the errors a user sees for each are one line, exit 2."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import webdataset as wds
from conftest import SR, write_jsonl

from streambatch.cli import main
from streambatch.errors import InputErrors
from streambatch.format.index import IndexFormatError, ShardIndex, upgrade
from streambatch.write.parts import merge_parts
from streambatch.write.stage import stage_dataset
from streambatch.write.verify import verify_dataset
from streambatch.write.writer import write_shards

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")

SENTENCES = [
    "the quick brown fox",
    "jumps over the lazy dog",
    "hello world",
    "a dog and a fox",
    "over and over again",
    "the world is quick",
]


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory) -> str:
    """A tiny BPE tokenizer with [CLS] ... [SEP] added around every text (so true lengths count them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(vocab_size=80, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in specials[1:]]
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("spm")
    (d / "corpus.txt").write_text("\n".join(SENTENCES * 10) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"),
        model_prefix=str(d / "sp"),
        vocab_size=30,
        hard_vocab_limit=False,
        model_type="unigram",
        minloglevel=2,
    )
    return str(d / "sp.model")


def encoder(path: str):
    """The test's own view of a tokenizer: text → ids, straight from the library."""
    if path.endswith(".model"):
        sp = spm.SentencePieceProcessor(model_file=path)
        return lambda text: list(sp.encode(text))
    tok = tokenizers.Tokenizer.from_file(path)
    return lambda text: tok.encode(text).ids


def tone(n: int, seed: int) -> np.ndarray:
    return (0.3 * np.sin(np.arange(n) / (5 + seed)) + 0.01 * np.random.default_rng(seed).standard_normal(n)).astype(
        np.float32
    )


@pytest.fixture(scope="module")
def hf_arrays(tmp_path_factory) -> tuple[str, dict]:
    """A saved Dataset whose audio is arrays + sampling_rate, with ids, transcripts and a speaker column."""
    rows = {f"utt{i}": (tone(800 * (i + 1), i), SENTENCES[i], f"spk{i % 2}") for i in range(5)}
    ds = datasets.Dataset.from_dict(
        {
            "id": list(rows),
            "audio": [{"array": a, "sampling_rate": SR} for a, _, _ in rows.values()],
            "text": [t for _, t, _ in rows.values()],
            "speaker": [s for _, _, s in rows.values()],
        }
    )
    path = tmp_path_factory.mktemp("hf") / "arrays"
    ds.save_to_disk(str(path))
    return str(path), rows


@pytest.fixture(scope="module")
def hf_flac_splits(tmp_path_factory) -> tuple[str, dict]:
    """A saved DatasetDict (train, test) with an Audio column of FLAC bytes and a 'sentence' column."""

    def flac(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        sf.write(buf, a, SR, format="FLAC")
        return buf.getvalue()

    splits, expected = {}, {}
    for split, offset in (("train", 0), ("test", 3)):
        names = [f"{split}-{i}" for i in range(3)]
        blobs = [flac(tone(1000 + 300 * i, offset + i)) for i in range(3)]
        texts = SENTENCES[offset : offset + 3]
        ds = datasets.Dataset.from_dict(
            {"audio": [{"bytes": b, "path": f"{n}.flac"} for n, b in zip(names, blobs)], "sentence": texts}
        )
        splits[split] = ds.cast_column("audio", datasets.Audio())
        expected[split] = {n: (b, t) for n, b, t in zip(names, blobs, texts)}
    path = tmp_path_factory.mktemp("hf") / "flac_splits"
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return str(path), expected


def read_back(out) -> list[dict]:
    return list(wds.WebDataset(ShardIndex.load(str(out)).shard_urls(), shardshuffle=False, empty_check=False))


def meta(sample: dict) -> dict:
    return json.loads(sample["json"])


def ids_of(sample: dict) -> list[int]:
    return np.load(io.BytesIO(sample["input_ids.npy"])).tolist()


def run_cli(*argv, env: dict | None = None) -> subprocess.CompletedProcess:
    """``shardify`` in its own process (so environment variables such as HF_HUB_OFFLINE are read fresh)."""
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "streambatch.cli", *map(str, argv), "--no-progress"],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


# ---- --tokenizer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tokenizers", "sentencepiece"])
def test_tokenizer_stores_input_ids_and_true_token_lengths(tmp_path, tok_json, sp_model, which):
    path = tok_json if which == "tokenizers" else sp_model
    encode = encoder(path)
    src = write_jsonl(tmp_path / "t.jsonl", [{"id": f"s{i}", "text": t} for i, t in enumerate(SENTENCES)])
    index = write_shards(str(src), str(tmp_path / "ds"), tokenizer=path, max_count=4, progress=False)
    assert index.unit == "tokens" and verify_dataset(index, progress=False) == []
    samples = read_back(tmp_path / "ds")
    assert [ids_of(s) for s in samples] == [encode(t) for t in SENTENCES]
    assert index.lengths.tolist() == [len(encode(t)) for t in SENTENCES] == [meta(s)["length"] for s in samples]
    if which == "tokenizers":  # the post-processor's [CLS] ... [SEP] are tokens of the sample too
        assert all(len(ids_of(s)) == len(s["txt"].decode().split()) + 2 for s in samples)
    described = ShardIndex.load(str(tmp_path / "ds")).meta["tokenizer"]
    assert described["name"] == path and described["kind"] == which and len(described["sha256"]) == 64


def test_tokenizer_hash_tells_tokenizers_apart_and_the_loader_reads_the_ids(tmp_path, tok_json, sp_model):
    copy = tmp_path / "elsewhere" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(tok_json, copy)
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in SENTENCES])
    hashes = {}
    for name, tok in (("a", tok_json), ("b", str(copy.parent)), ("c", sp_model)):
        hashes[name] = write_shards(str(src), str(tmp_path / name), tokenizer=tok, progress=False).meta["tokenizer"][
            "sha256"
        ]
    assert hashes["a"] == hashes["b"] != hashes["c"]  # the same tokenizer (a folder holding it), and another one

    from streambatch.loader import StreamBatchLoader

    encode, seen = encoder(tok_json), 0
    for b in StreamBatchLoader(str(tmp_path / "a"), budget=64, seed=0):
        for row, n, text in zip(b["input_ids"], b["lengths"].tolist(), b["text"]):
            assert row[:n].tolist() == encode(text)
            seen += 1
    assert seen == len(SENTENCES)


def test_input_ids_another_tokenizer_made_are_bad_input(tmp_path, tok_json):
    good = encoder(tok_json)("hello world")
    rows = [
        {"id": "ok", "text": "hello world", "input_ids": good},
        {"id": "bad", "text": "hello world", "input_ids": [1, 2]},
        {"id": "ids_only", "input_ids": [5, 6, 7]},
    ]
    src = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(InputErrors, match=r"t.jsonl:2.*not what --tokenizer .* makes of its text"):
        write_shards(str(src), str(tmp_path / "ds"), tokenizer=tok_json, progress=False)
    index = write_shards(str(src), str(tmp_path / "ds"), tokenizer=tok_json, on_error="skip", progress=False)
    assert [s["__key__"] for s in read_back(tmp_path / "ds")] == ["ok", "ids_only"]
    assert index.lengths.tolist() == [len(good), 3] and index.meta["skipped"] == 1


# ---- Hugging Face datasets --------------------------------------------------------------------------------
def test_hf_audio_arrays_with_output_length_chars(tmp_path, hf_arrays, capsys):
    path, rows = hf_arrays
    assert (
        main(["write", path, str(tmp_path / "ds"), "--output-length", "chars", "--max-count", "2", "--no-progress"])
        == 0
    )
    index = ShardIndex.load(str(tmp_path / "ds"))
    assert index.meta["kind"] == "hf" and index.unit == "samples" and index.sample_rate == SR
    assert verify_dataset(index, progress=False, decode=True) == []
    samples = read_back(tmp_path / "ds")
    assert [s["__key__"] for s in samples] == list(rows)
    for s in samples:
        audio, text, speaker = rows[s["__key__"]]
        decoded, sr = sf.read(io.BytesIO(s["wav"]), dtype="float32")
        assert sr == SR and np.array_equal(decoded, audio)  # the arrays exactly, as float WAV
        m = meta(s)
        assert (m["length"], m["output_length"], m["text"], m["speaker"]) == (len(audio), len(text), text, speaker)
    assert index.has_output_lengths
    got = index.shard_output_lengths(range(index.num_shards))
    assert np.concatenate(got).tolist() == [len(t) for _, t, _ in rows.values()]
    assert [len(x) for x in got] == [2, 2, 1] and all(x.dtype == np.int64 for x in got)
    assert index.shard_output_lengths([2, 0])[0].tolist() == [len(rows["utt4"][1])]


def test_hf_arrays_give_the_same_shards_for_any_workers_and_keep_int16(tmp_path):
    pcm = [(tone(600 + 100 * i, i) * 32767).astype(np.int16) for i in range(4)]
    ds = datasets.Dataset.from_dict({"audio": [{"array": a, "sampling_rate": 8000} for a in pcm]})
    ds.save_to_disk(str(tmp_path / "hf"))
    shards = []
    for workers in (1, 2):
        write_shards(str(tmp_path / "hf"), str(tmp_path / f"w{workers}"), workers=workers, max_count=2, progress=False)
        shards.append([(tmp_path / f"w{workers}" / f"shard-00000{j}.tar").read_bytes() for j in range(2)])
    assert shards[0] == shards[1]
    for s, a in zip(read_back(tmp_path / "w2"), pcm):
        decoded, sr = sf.read(io.BytesIO(s["wav"]), dtype="int16")
        assert sr == 8000 and sf.info(io.BytesIO(s["wav"])).subtype == "PCM_16" and np.array_equal(decoded, a)


def test_hf_audio_feature_bytes_kept_and_splits(tmp_path, hf_flac_splits, sp_model):
    path, expected = hf_flac_splits
    encode = encoder(sp_model)
    index = write_shards(f"hf:{path}:test", str(tmp_path / "test"), output_length=f"tokens:{sp_model}", progress=False)
    samples = read_back(tmp_path / "test")
    assert [s["__key__"] for s in samples] == list(expected["test"])
    for s in samples:
        blob, text = expected["test"][s["__key__"]]
        assert s["flac"] == blob  # the stored bytes as they are, not decoded and re-encoded
        assert meta(s)["length"] == sf.info(io.BytesIO(blob)).frames and meta(s)["text"] == text
        assert meta(s)["output_length"] == len(encode(text))
    assert index.meta["output_length"]["unit"] == "tokens"
    assert index.meta["output_length"]["tokenizer"]["kind"] == "sentencepiece"
    train = write_shards(path, str(tmp_path / "train"), progress=False)  # a DatasetDict: train by default
    assert [s["__key__"] for s in read_back(tmp_path / "train")] == list(expected["train"])
    assert (
        not train.has_output_lengths
        and "output_length" not in json.loads((tmp_path / "train" / "index.json").read_text())["columns"]
    )
    with pytest.raises(IndexFormatError, match="no output lengths"):
        train.shard_output_lengths([0])


def test_hf_text_dataset_with_tokenizer(tmp_path, tok_json):
    texts = SENTENCES[:4]
    path = tmp_path / "hf_text"
    datasets.Dataset.from_dict({"text": texts, "lang": ["en"] * 4}).save_to_disk(str(path))
    index = write_shards(f"hf:{path}", str(tmp_path / "ds"), tokenizer=tok_json, progress=False)
    samples = read_back(tmp_path / "ds")
    encode = encoder(tok_json)
    assert [s["txt"].decode() for s in samples] == texts
    assert [ids_of(s) for s in samples] == [encode(t) for t in texts]
    assert index.lengths.tolist() == [len(encode(t)) for t in texts]
    assert [meta(s) for s in samples] == [{"length": len(encode(t)), "lang": "en"} for t in texts]
    assert [s["__key__"] for s in samples] == [f"hf_text_{i:09d}" for i in range(4)]


# ---- output lengths through merge, version 1 and re-saves --------------------------------------------------
def test_output_lengths_survive_parts_merge_stage_version_1_and_upgrade(tmp_path, hf_arrays):
    path, rows = hf_arrays
    want = [len(t) for _, t, _ in rows.values()]
    out = tmp_path / "parts"
    for i in range(2):
        write_shards(path, str(out), output_length="chars", part=(i, 2), max_count=2, progress=False)
    merged = merge_parts(str(out), progress=False)
    assert merged.meta["output_length"] == {"unit": "chars"}
    again = ShardIndex.load(str(out))
    assert again.has_output_lengths
    assert np.concatenate(again.shard_output_lengths(range(again.num_shards))).tolist() == want
    stage_dataset(str(out), str(tmp_path / "staged"), progress=False)
    staged = ShardIndex.load(str(tmp_path / "staged"))
    assert np.concatenate(staged.shard_output_lengths(range(staged.num_shards))).tolist() == want

    v1 = write_shards(path, str(tmp_path / "v1"), output_length="chars", index_version=1, progress=False)
    loaded = ShardIndex.load(str(tmp_path / "v1"))
    assert loaded.version == 1 and np.concatenate(loaded.shard_output_lengths(range(v1.num_shards))).tolist() == want
    upgrade(str(tmp_path / "v1"), progress=False)
    up = ShardIndex.load(str(tmp_path / "v1"))
    assert up.version == 2 and np.concatenate(up.shard_output_lengths(range(up.num_shards))).tolist() == want

    copy = up.save(str(tmp_path / "v1" / "copy.json"))  # a re-save of a version 2 index streams the column
    assert np.concatenate(ShardIndex.load(copy).shard_output_lengths(range(up.num_shards))).tolist() == want


def test_parts_with_another_output_length_do_not_merge(tmp_path, hf_arrays):
    path, _ = hf_arrays
    write_shards(path, str(tmp_path / "p"), output_length="chars", part=(0, 2), progress=False)
    write_shards(path, str(tmp_path / "p"), part=(1, 2), progress=False)
    with pytest.raises(Exception, match="output_length"):
        merge_parts(str(tmp_path / "p"), progress=False)


# ---- what a user sees when something is wrong -------------------------------------------------------------
def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardify: error: "), res.stderr
    return lines[0]


def test_hub_unreachable_is_one_line_exit_2(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}  # no network here: offline says so at once
    line = one_line_error(run_cli("write", "hf:someone/some_dataset:train", tmp_path / "ds", env=env))
    assert "hf:someone/some_dataset:train" in line and "save_to_disk" in line
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    line = one_line_error(run_cli("write", text, tmp_path / "ds2", "--tokenizer", "someone/tok", env=env))
    assert "someone/tok" in line and "local tokenizer file" in line
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds2").exists()


def test_hub_really_unreachable_is_one_line_exit_2(tmp_path):
    """As it is here, without a network (the hub client retries for ~25 s first, silently)."""
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    line = one_line_error(run_cli("write", "hf:someone/some_dataset", tmp_path / "ds", env=env))
    assert "cannot load the Hugging Face dataset" in line and "save_to_disk" in line


def test_option_mistakes_are_one_line_exit_2(tmp_path, hf_arrays, hf_flac_splits, tok_json, capsys):
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    cases = [
        (("write", hf_arrays[0], tmp_path / "o1", "--tokenizer", tok_json), "--output-length tokens"),
        (("write", text, tmp_path / "o2", "--output-length", "chars"), "--tokenizer"),
        (("write", hf_arrays[0], tmp_path / "o3", "--output-length", "words"), "'chars' or 'tokens:TOKENIZER'"),
        (("write", text, tmp_path / "o4", "--tokenizer", tmp_path / "nope.json"), "no such tokenizer file"),
        (("write", text, tmp_path / "o5", "--tokenizer", tmp_path / "broken.json"), "not a Hugging Face tokenizers"),
        (("write", f"hf:{hf_flac_splits[0]}:dev", tmp_path / "o6"), "no split 'dev'; the dataset has"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        code = main([*map(str, argv), "--no-progress"])
        err = capsys.readouterr().err
        assert expected in one_line_error(subprocess.CompletedProcess(argv, code, "", err)), argv


def test_a_sample_without_transcript_is_bad_input(tmp_path):
    ds = datasets.Dataset.from_dict(
        {"audio": [{"array": tone(400, i), "sampling_rate": SR} for i in range(2)], "text": ["has words", None]}
    )
    ds.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(InputErrors, match="no transcript"):
        write_shards(str(tmp_path / "hf"), str(tmp_path / "ds"), output_length="chars", progress=False)
    index = write_shards(
        str(tmp_path / "hf"), str(tmp_path / "ds"), output_length="chars", on_error="skip", progress=False
    )
    assert index.num_samples == 1 and index.shard_output_lengths([0])[0].tolist() == [len("has words")]
