"""`shardify index`: tars that exist already (webdataset.ShardWriter's, a NeMo tarred dataset, text tars) indexed in
place: not a byte of them changes, `verify` passes, the loader streams every key once with the audio's lengths."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import webdataset as wds

from streambatch import ShardIndex, StreamBatchLoader
from streambatch.cli import main
from streambatch.format.tar import iter_members

SR = 8000


def audio_bytes(fmt: str, frames: int, seed: int, sr: int = SR) -> bytes:
    x = (0.2 * np.random.default_rng(seed).standard_normal(frames)).astype("float32")
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt.upper(), subtype="PCM_16")
    return buf.getvalue()


def frames_of(data: bytes) -> int:
    return sf.info(io.BytesIO(data)).frames


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.tar"))}


def cli(*args: str) -> int:
    return main([*args, "--no-progress"]) if args[0] in ("index", "verify", "merge") else main(list(args))


def write_wds(folder: Path, n: int = 23, bad: dict[int, bytes] | None = None, maxcount: int = 6) -> dict[str, dict]:
    """Tars by webdataset.ShardWriter: flac and wav members with a .txt each, no .json. ``bad``: sample number
    → bytes stored as its flac member instead. Returns {key: {"frames", "text"}} of the good samples."""
    folder.mkdir(parents=True, exist_ok=True)
    want = {}
    with wds.ShardWriter(str(folder / "train-%04d.tar"), maxcount=maxcount, verbose=0) as w:
        for i in range(n):
            key, ext = f"utt{i:04d}", ("flac" if i % 3 else "wav")
            data = audio_bytes(ext, 400 + 97 * ((i * 7) % 23), seed=i)
            text = f"sample {i} says {'ha ' * (i % 4)}".strip()
            if bad and i in bad:
                ext, data = "flac", bad[i]
            else:
                want[key] = {"frames": frames_of(data), "text": text}
            w.write({"__key__": key, ext: data, "txt": text})
    return want


def stream(source: str, budget: float = 4 * SR, **kw) -> tuple[collections.Counter, dict[str, int], dict[str, str]]:
    """Every key the loader yields in one epoch (counted), each one's decoded length and text."""
    loader = StreamBatchLoader(source, budget=budget, seed=3, buffer_size=16, **kw)
    seen: collections.Counter = collections.Counter()
    lengths, texts = {}, {}
    steps = 0
    for batch in loader:
        steps += 1
        seen.update(batch["keys"])
        for i, k in enumerate(batch["keys"]):
            lengths[k] = int(batch["lengths"][i])
            if "text" in batch:
                texts[k] = batch["text"][i]
    assert steps == len(loader)
    return seen, lengths, texts


def index_lengths(folder: str) -> dict[str, int]:
    """{key: length} from the sample table (keys, as the loader groups them, in the index)."""
    ix = ShardIndex.load(folder)
    out = {}
    for s in range(ix.num_shards):
        stored = ix.shards.reader.shard_samples(s)
        out.update(zip(stored["keys"], stored["lengths"].tolist()))
    return out


def test_webdataset_tars_indexed_in_place(tmp_path):
    """flac/wav + txt written by webdataset.ShardWriter: bytes unchanged, lengths = soundfile frames, verify (with
    --decode) passes, the loader (2 workers) streams every key exactly once with its text."""
    src = tmp_path / "wds"
    want = write_wds(src)
    before = digests(src)
    assert cli("index", str(src), "--workers", "2") == 0
    assert digests(src) == before
    assert index_lengths(str(src)) == {k: v["frames"] for k, v in want.items()}
    ix = ShardIndex.load(str(src))
    assert ix.unit == "samples" and ix.sample_rate == SR and ix.num_shards == len(before)
    offsets, sizes = ix.sample_offsets(1)  # each sample's byte range holds its members, parsed on their own
    raw = (src / ix.shards[1].url).read_bytes()
    keys = ix.shards.reader.shard_samples(1)["keys"]
    for key, o, n in zip(keys, offsets.tolist(), sizes.tolist()):
        names = [name for name, _ in iter_members(io.BytesIO(raw[o : o + n]), "range")]
        assert names and all(name.startswith(key + ".") for name in names)
    assert cli("verify", str(src), "--decode") == 0
    seen, lengths, texts = stream(str(src), num_workers=2)
    assert seen == collections.Counter(list(want)) and set(seen.values()) == {1}
    assert lengths == {k: v["frames"] for k, v in want.items()}
    assert texts == {k: v["text"] for k, v in want.items()}
    assert digests(src) == before


def test_damaged_members_skip_lists_them_and_fail_exits_2_with_one_line(tmp_path, capsys):
    good = audio_bytes("flac", 3000, seed=99)
    src = tmp_path / "wds"
    want = write_wds(src, n=14, bad={4: b"definitely not audio" * 20, 9: good[: len(good) // 3]})
    before = digests(src)
    capsys.readouterr()
    assert cli("index", str(src)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "utt0004.flac" in err[0] and "(and 1 more)" in err[0] and "--on-error skip" in err[0]
    assert not (src / "index.json").exists()

    assert cli("index", str(src), "--on-error", "skip") == 0
    listed = [json.loads(line) for line in (src / "errors.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in listed) == ["utt0004", "utt0009"]
    assert any("ends early" in r["error"] or "cut short" in r["error"] for r in listed if r["key"] == "utt0009")
    assert cli("verify", str(src)) == 0
    seen, lengths, _ = stream(str(src))
    assert seen == collections.Counter(list(want))  # every good key once, the damaged ones never
    assert digests(src) == before


def write_nemo(root: Path, per_tar: tuple[int, int] = (7, 6), extra: bool = True) -> dict[str, dict]:
    """A NeMo-style tarred dataset: audio_0.tar, audio_1.tar (one wav member per utterance, as NeMo's converter
    writes them with tarfile) and tarred_audio_manifest.json. ``extra``: audio_1.tar also holds a member the
    manifest does not name. Each entry also has a ``lang`` and a ``num_tokens``. Returns {key: {"frames", "text",
    "lang", "num_tokens"}}."""
    root.mkdir(parents=True, exist_ok=True)
    want, lines, n = {}, [], 0
    for shard, count in enumerate(per_tar):
        with tarfile.open(root / f"audio_{shard}.tar", "w") as tar:
            members = [(f"common_voice_{n + i:05d}", 500 + 131 * ((n + i) * 5 % 17)) for i in range(count)]
            if extra and shard == 1:
                members.append(("not_in_manifest", 900))
            for key, frames in members:
                data = audio_bytes("wav", frames, seed=frames)
                info = tarfile.TarInfo(f"{key}.wav")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                if key != "not_in_manifest":
                    k = int(key[-5:])
                    text = f"words of {key}" + " more" * (k % 5)
                    fields = {"lang": "de" if k % 3 else "en", "num_tokens": len(text.split())}
                    want[key] = {"frames": frames, "text": text, **fields}
                    lines.append(
                        {
                            "audio_filepath": f"{key}.wav",
                            "duration": round(frames / SR, 3),
                            "text": text,
                            "shard_id": shard,
                            **fields,
                        }
                    )
            n += count
    (root / "tarred_audio_manifest.json").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return want


def test_nemo_tarred_dataset(tmp_path, capsys):
    """Lengths are the members' frames (the manifest's durations agree), a member the manifest does not name is
    left out of every epoch, every named key streamed once; a manifest naming a missing member is exit 2."""
    src = tmp_path / "nemo"
    want = write_nemo(src)
    before = digests(src)
    assert cli("index", str(src), "--workers", "2") == 0
    assert "1 member(s) the manifest does not name" in capsys.readouterr().err
    assert digests(src) == before
    ix = ShardIndex.load(str(src))
    assert ix.meta["adopted"]["layout"] == "nemo" and ix.num_samples == len(want) + 1
    assert {k: v for k, v in index_lengths(str(src)).items() if v} == {k: v["frames"] for k, v in want.items()}
    assert cli("verify", str(src), "--decode") == 0
    for workers in (0, 2):  # the manifest's text, stored in the sample table, is each sample's batch["text"]
        seen, lengths, texts = stream(str(src), num_workers=workers)
        assert seen == collections.Counter(list(want))
        assert lengths == {k: v["frames"] for k, v in want.items()}
        assert texts == {k: v["text"] for k, v in want.items()}

    manifest = src / "tarred_audio_manifest.json"
    manifest.write_text(
        manifest.read_text()
        + json.dumps({"audio_filepath": "gone.wav", "duration": 1.0, "text": "x", "shard_id": 1})
        + "\n"
    )
    capsys.readouterr()
    assert cli("index", str(src), "--overwrite") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "gone.wav" in err[0] and "audio_1.tar" in err[0] and f"{manifest}:{len(want) + 1}" in err[0]
    )


def output_lengths_by_key(folder: str) -> dict[str, int]:
    """{key: output_length} from the sample table, of the samples the loader plans (length > 0)."""
    ix = ShardIndex.load(folder)
    out = {}
    for s in range(ix.num_shards):
        stored = ix.shards.reader.shard_samples(s)
        out.update(
            (k, o)
            for k, n, o in zip(stored["keys"], stored["lengths"].tolist(), stored["output_lengths"].tolist())
            if n
        )
    return out


def test_output_lengths_and_filters_on_an_adopted_nemo_dataset(tmp_path):
    """--output-length chars / column:FIELD: the sample table holds each sample's transcript characters / the
    manifest's integer field, and the loader keeps budget and output_budget on every batch, each key once with
    its manifest text; the manifest's scalar fields are columns, so where= filters an adopted dataset."""
    src = tmp_path / "nemo"
    want = write_nemo(src, per_tar=(12, 10, 9))
    budget, out_budget = 4 * SR, 120
    for spec, expect, workers in (
        ("chars", lambda v: len(v["text"]), 0),
        ("column:num_tokens", lambda v: v["num_tokens"], 2),
    ):
        assert cli("index", str(src), "--output-length", spec, "--overwrite") == 0
        expected = {k: expect(v) for k, v in want.items()}
        assert output_lengths_by_key(str(src)) == expected
        assert ShardIndex.load(str(src)).meta["output_length"]["unit"] == spec.split(":")[0]
        assert cli("verify", str(src)) == 0
        for where in (None, "lang = 'de'"):
            loader = StreamBatchLoader(
                str(src),
                budget=budget,
                output_budget=out_budget,
                num_workers=workers,
                buffer_size=16,
                seed=1,
                where=where,
            )
            steps = len(loader)
            batches = list(loader)
            assert len(batches) == steps
            keys = [k for b in batches for k in b["keys"]]
            kept = {k for k, v in want.items() if where is None or v["lang"] == "de"}
            assert sorted(keys) == sorted(kept)
            for b in batches:
                n = len(b["keys"])
                assert n * int(b["lengths"].max()) <= budget
                assert n * max(expected[k] for k in b["keys"]) <= out_budget
                assert b["text"] == [want[k]["text"] for k in b["keys"]]
        assert max(len({k for k in b["keys"]}) for b in batches) > 1  # the output budget is not one per batch


def write_wds_json(folder: Path, fields: list[dict]) -> None:
    """webdataset tars of flac + txt + a .json of ``fields[i]`` per sample (a .json text is the transcript)."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "part-%04d.tar"), maxcount=4, verbose=0) as w:
        for i, f in enumerate(fields):
            w.write(
                {
                    "__key__": f"utt{i:04d}",
                    "flac": audio_bytes("flac", 600 + 50 * i, seed=i),
                    "txt": f"the words {i}",
                    "json": f,
                }
            )


def test_output_length_column_errors_name_the_field_and_where(tmp_path, capsys):
    """column:FIELD missing or not a whole number: exit 2, one line naming the field and the manifest line or the
    sample's .json member, nothing written; on webdataset tars, chars counts the .txt, column: reads the .json."""
    src = tmp_path / "nemo"
    write_nemo(src)
    manifest = src / "tarred_audio_manifest.json"
    cases = [("column:n_words", "'n_words'", f"{manifest}:1:")]
    lines = manifest.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["num_tokens"] = "many"
    (src / "edited.json").write_text("\n".join(lines[:2] + [json.dumps(bad)] + lines[3:]) + "\n")
    for spec, field, where in cases + [("column:num_tokens", "'num_tokens'", f"{src / 'edited.json'}:3:")]:
        capsys.readouterr()
        extra = ["--manifest", str(src / "edited.json")] if "edited" in where else []
        assert cli("index", str(src), "--output-length", spec, *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0] and where in err[0], err
        assert not (src / "index.json").exists()

    wsrc = tmp_path / "wds"
    write_wds_json(wsrc, [{"n": i} for i in range(6)] + [{"n": 2.5}, {"speaker": "x"}])
    capsys.readouterr()
    assert cli("index", str(wsrc), "--output-length", "column:n") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'n'" in err[0] and "utt0006.json" in err[0] and "(and 1 more)" in err[0], err
    assert cli("index", str(wsrc), "--output-length", "column:n", "--on-error", "skip") == 0
    assert output_lengths_by_key(str(wsrc)) == {f"utt{i:04d}": i for i in range(6)}
    assert cli("index", str(wsrc), "--output-length", "chars", "--overwrite") == 0
    assert output_lengths_by_key(str(wsrc)) == {f"utt{i:04d}": len(f"the words {i}") for i in range(8)}
    assert "n" in ShardIndex.load(str(wsrc)).columns  # a .json field is a metadata column, as `write` stores it


def test_output_length_tokens_counts_the_manifest_text(tmp_path):
    """--output-length tokens:TOKENIZER on a NeMo dataset: each sample's output_length is the tokenizer's count
    of its manifest text (the library's own count, special tokens included)."""
    tokenizers = pytest.importorskip("tokenizers")
    src = tmp_path / "nemo"
    want = write_nemo(src)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [v["text"] for v in want.values()],
        tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "[CLS]"]),
    )
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", tok.token_to_id("[CLS]"))]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    assert cli("index", str(src), "--output-length", f"tokens:{tmp_path / 'tokenizer.json'}") == 0
    counts = {k: len(tok.encode(v["text"]).ids) for k, v in want.items()}
    assert output_lengths_by_key(str(src)) == counts and len(set(counts.values())) > 1
    assert ShardIndex.load(str(src)).meta["output_length"]["tokenizer"]["kind"] == "tokenizers"


@pytest.mark.cluster
def test_two_ranks_stream_the_manifest_text(tmp_path):
    """torchrun, 2 ranks x 2 workers, planned rank-locally, over an adopted NeMo dataset: every key once, each
    with its manifest text."""
    from torchrun_jobs import check_epoch, read_logs, run_job

    src = tmp_path / "nemo"
    want = write_nemo(src, per_tar=(9, 8, 9, 8), extra=False)
    assert cli("index", str(src)) == 0
    logs = run_job(str(src), tmp_path / "job", 2)
    check_epoch(logs, 0, len(want))
    texts = {
        k: t
        for log in read_logs(tmp_path / "job").values()
        for e in log
        if e["event"] == "batch"
        for k, t in zip(e["keys"], e["text"])
    }
    assert texts == {k: v["text"] for k, v in want.items()}


def test_text_tars(tmp_path):
    """Text tars (.txt, and a .json text): lengths in whitespace tokens, every key streamed once with its text."""
    src = tmp_path / "text"
    src.mkdir()
    want = {}
    with wds.ShardWriter(str(src / "text-%02d.tar"), maxcount=5, verbose=0) as w:
        for i in range(12):
            text = " ".join(f"w{j}" for j in range(1 + (i * 5) % 9))
            want[f"doc{i:02d}"] = text
            sample = {"__key__": f"doc{i:02d}"}
            sample.update({"txt": text} if i % 4 else {"json": {"text": text, "source": "web"}})
            w.write(sample)
    before = digests(src)
    assert cli("index", str(src)) == 0
    ix = ShardIndex.load(str(src))
    assert ix.unit == "tokens" and ix.meta["adopted"]["layout"] == "text"
    assert index_lengths(str(src)) == {k: len(t.split()) for k, t in want.items()}
    assert cli("verify", str(src)) == 0
    seen, _, texts = stream(str(src), budget=40)
    assert seen == collections.Counter(list(want))
    assert texts == want
    assert digests(src) == before


def test_index_elsewhere_and_as_parts(tmp_path, capsys):
    """--out for read-only storage: nothing new beside the tars, the index points back at them (the command says
    which root to allow, and the dataset loads with it); --part I/N + merge gives the same samples, lengths and
    order as one run."""
    src = tmp_path / "ro" / "wds"
    want = write_wds(src, n=17)
    listing = sorted(p.name for p in src.iterdir())
    out = tmp_path / "elsewhere" / "idx"
    capsys.readouterr()
    assert cli("index", str(src), "--out", str(out)) == 0
    told = capsys.readouterr().out.strip().splitlines()[-1]
    assert told == f"shards live outside {out}: load with shard_roots=[{str(src)!r}] (shardify: --shard-root {src})"
    assert sorted(p.name for p in src.iterdir()) == listing
    ix = ShardIndex.load(str(out), shard_roots=[str(src)])
    assert all(s.url.startswith("../../ro/wds/") for s in ix.shards)
    assert cli("verify", str(out)) == 2  # the tars are outside the dataset's folder: not read unless allowed
    assert cli("verify", str(out), "--shard-root", str(src)) == 0
    seen, _, _ = stream(str(out), shard_roots=[str(src)])
    assert seen == collections.Counter(list(want))

    parts = tmp_path / "parts"
    for i in range(3):
        assert cli("index", str(src), "--out", str(parts), "--part", f"{i}/3") == 0
    assert cli("merge", str(parts), "--shard-root", str(src)) == 0
    merged = ShardIndex.load(str(parts), shard_roots=[str(src)])
    assert [os.path.realpath(u) for u in merged.shard_urls()] == [str(p) for p in sorted(src.glob("*.tar"))]
    assert np.array_equal(merged.lengths, ix.lengths) and merged.meta["kind"] == "adopted"
    assert index_lengths(str(parts)) == index_lengths(str(out))
    assert cli("verify", str(parts), "--shard-root", str(src)) == 0


def test_clear_errors(tmp_path, capsys):
    """No tars, an unknown layout, an index already there: one line each, exit 2, nothing written."""
    empty = tmp_path / "empty"
    empty.mkdir()
    odd = tmp_path / "odd"
    odd.mkdir()
    with wds.TarWriter(str(odd / "x.tar")) as w:
        w.write({"__key__": "a", "bin": b"\x00\x01"})
    cases = [
        (str(empty), "no .tar files found"),
        (str(odd), "unknown layout"),
        (str(tmp_path / "missing"), "does not exist"),
    ]
    for src, words in cases:
        capsys.readouterr()
        assert cli("index", src) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (odd / "index.json").exists()
    src = tmp_path / "wds"
    write_wds(src, n=4)
    assert cli("index", str(src)) == 0
    capsys.readouterr()
    assert cli("index", str(src)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli("index", str(src), "--overwrite") == 0


@pytest.mark.cluster
def test_two_ranks_over_adopted_tars(tmp_path):
    """torchrun, 2 ranks (gloo) x 2 workers over adopted tars: equal steps = len(loader), every key once."""
    from torchrun_jobs import check_epoch, run_job

    src = tmp_path / "wds"
    want = write_wds(src, n=60, maxcount=8)
    assert cli("index", str(src)) == 0
    logs = run_job(str(src), tmp_path / "job", 2)
    assert len(logs) == 2
    check_epoch(logs, 0, len(want))


def test_a_json_length_rounded_by_another_tool_streams_as_indexed(tmp_path):
    """A .json length in seconds that another tool rounded (within the tolerance ``shardify index`` adopts it
    by) verifies and streams without a mismatch: `verify` and the loader check it by the same rule, and every
    key comes once."""
    src = tmp_path / "tars"
    src.mkdir()
    frames = [600 + 50 * i for i in range(9)]
    with wds.ShardWriter(str(src / "part-%04d.tar"), maxcount=4, verbose=0) as w:
        for i, n in enumerate(frames):
            flac = audio_bytes("flac", n, seed=i)
            w.write({"__key__": f"utt{i:04d}", "flac": flac, "json": {"length": n / SR + 4e-7}})
    assert cli("index", str(src), "--unit", "seconds") == 0
    assert cli("verify", str(src)) == 0  # by the same rule
    seen, _, _ = stream(str(src), budget=0.5)
    assert seen == {f"utt{i:04d}": 1 for i in range(len(frames))}
