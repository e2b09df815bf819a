"""Metadata columns and filters: `shardify write` stores the samples' scalar fields as columns of the sample
table, `where=` keeps exactly the samples an SQL expression over them selects (DuckDB), the plan, len() and
a resume agree with what is streamed, and the bytes of long filtered runs are not fetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import SR, make_audio, popen, write_jsonl

from streambatch import EmptyEpochError, OptionError, StreamBatchLoader
from streambatch.cli import main
from streambatch.errors import ShardifyError
from streambatch.format.index import ShardIndex
from streambatch.write.parts import merge_parts
from streambatch.write.writer import write_shards

pytest.importorskip("duckdb")
pytest_plugins = ["conftest_s3"]

N = 60
LANGS = ("de", "en", "fr")
BUDGET = 2 * SR


def row(i: int) -> dict:
    """Manifest fields of sample i: languages in runs of 6, speakers round robin, a score, a transcript and a
    list field (never a column)."""
    return {
        "audio_filepath": f"wavs/u{i:02d}.wav",
        "text": f"words of utterance {i}",
        "speaker": f"spk{i % 4}",
        "language": LANGS[(i // 6) % 3],
        "snr": float(i % 17),
        "tags": ["x", str(i)],
    }


def key(i: int) -> str:
    return f"wavs__u{i:02d}"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    d = tmp_path_factory.mktemp("filters")
    rows = []
    for i in range(N):
        r = row(i)
        frames = make_audio(d / r["audio_filepath"], 0.1 + 0.02 * (i % 9), seed=i)
        rows.append({**r, "duration": frames / SR})
    return write_jsonl(d / "manifest.jsonl", rows), rows


@pytest.fixture(scope="module")
def dataset(manifest, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("filters_ds") / "ds")
    write_shards(str(manifest[0]), out, max_count=12, progress=False)
    return out


def expected(rows, pred) -> set[str]:
    return {key(i) for i, r in enumerate(rows) if pred(r)}


def epoch_keys(loader) -> list[str]:
    return [k for b in loader for k in b["keys"]]


DE_LOUD = "language = 'de' AND snr > 5"


def de_loud(r):
    return r["language"] == "de" and r["snr"] > 5


# ---- writing the columns ------------------------------------------------------------------------
def test_sample_table_holds_the_scalar_fields_but_not_the_text(dataset, manifest):
    ix = ShardIndex.load(dataset)
    assert ix.columns == {
        "sample_rate": "int64",
        "duration": "double",
        "speaker": "string",
        "language": "string",
        "snr": "double",
    }
    t = pq.read_table(os.path.join(dataset, "index.samples", "part-00000.parquet"))
    assert "text" not in t.column_names and "tags" not in t.column_names
    rows = manifest[1]
    for k, lang, spk, snr in zip(*(t.column(c).to_pylist() for c in ("key", "language", "speaker", "snr"))):
        r = rows[int(k[-2:])]
        assert (lang, spk, snr) == (r["language"], r["speaker"], r["snr"])


def test_columns_option_chooses(manifest, tmp_path):
    src = str(manifest[0])
    ix = write_shards(src, str(tmp_path / "a"), max_count=12, progress=False, columns="speaker, snr")
    assert ShardIndex.load(str(tmp_path / "a")).columns == ix.columns == {"speaker": "string", "snr": "double"}
    write_shards(src, str(tmp_path / "b"), max_count=30, progress=False, columns="")
    assert ShardIndex.load(str(tmp_path / "b")).columns == {}
    write_shards(src, str(tmp_path / "c"), max_count=30, progress=False, columns=["text"])  # asked for: stored
    assert ShardIndex.load(str(tmp_path / "c")).columns == {"text": "string"}
    with pytest.raises(ShardifyError, match=r"'tags' is not a scalar.*can be columns: .*language"):
        write_shards(src, str(tmp_path / "d"), progress=False, columns="tags")


def test_columns_cli_unknown_field_lists_the_fields(manifest, tmp_path, capsys):
    rc = main(["write", str(manifest[0]), str(tmp_path / "o"), "--columns", "speaker,lang", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "'lang' is in no sample's .json" in err and "language" in err and "speaker" in err
    assert not (tmp_path / "o" / "index.json").exists()


def test_merged_parts_keep_their_columns(manifest, dataset, tmp_path):
    out = str(tmp_path / "parts")
    for i in range(2):
        write_shards(str(manifest[0]), out, max_count=12, progress=False, part=(i, 2))
    merge_parts(out, progress=False)
    merged = ShardIndex.load(out)
    assert merged.columns == ShardIndex.load(dataset).columns
    got = epoch_keys(StreamBatchLoader(out, BUDGET, where=DE_LOUD, decode="none"))
    assert sorted(got) == sorted(expected(manifest[1], de_loud))


def test_resaved_index_keeps_columns(dataset, tmp_path):
    from streambatch.write.stage import stage_dataset

    ix = ShardIndex.load(dataset)
    ix.save(str(tmp_path / "copy" / "index.json"))  # the tables re-written from the loaded index
    assert ShardIndex.load(str(tmp_path / "copy" / "index.json")).columns == ix.columns
    copy = ShardIndex.load(str(tmp_path / "copy"))
    assert copy.shards.reader.read_columns(0, ["language"]).equals(ix.shards.reader.read_columns(0, ["language"]))
    staged = stage_dataset(dataset, str(tmp_path / "staged"), progress=False)
    assert staged.index.columns == ix.columns


# ---- filtering ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_where_keeps_exactly_the_matching_samples(dataset, manifest, num_workers):
    loader = StreamBatchLoader(dataset, BUDGET, where=DE_LOUD, num_workers=num_workers, decode="none", buffer_size=8)
    want = expected(manifest[1], de_loud)
    assert 0 < len(want) < N
    epochs = []
    for _ in range(2):
        steps = len(loader)
        batches = list(loader)
        assert len(batches) == steps
        keys = [k for b in batches for k in b["keys"]]
        assert Counter(keys) == Counter(want)  # every kept sample once, nothing else
        epochs.append(keys)
    assert epochs[0] != epochs[1]  # another epoch, another order
    plan = loader.plan(0)
    assert sum(len(b) for s in plan.slots for b in s.batches) == len(want)


def test_where_on_key_and_length(dataset, manifest):
    loader = StreamBatchLoader(dataset, BUDGET, where="key LIKE '%u1_' OR length < 2000", decode="none")
    want = {key(i) for i in range(10, 20)} | {
        key(i) for i, r in enumerate(manifest[1]) if round(r["duration"] * SR) < 2000
    }
    assert Counter(epoch_keys(loader)) == Counter(want)


def test_resume_with_a_filter_is_exact(dataset, manifest):
    kw = dict(budget=BUDGET, where="language <> 'fr'", decode="none", buffer_size=4, seed=5)
    whole = [b["keys"] for b in StreamBatchLoader(dataset, **kw)]
    assert len(whole) >= 4
    first = StreamBatchLoader(dataset, **kw)
    it = iter(first)
    done = [next(it)["keys"] for _ in range(3)]
    state = first.state_dict()
    again = StreamBatchLoader(dataset, **kw)
    again.load_state_dict(state)
    assert len(again) == len(whole)
    assert done + [b["keys"] for b in again] == whole
    with pytest.raises(ValueError, match="saved with where="):
        StreamBatchLoader(dataset, **{**kw, "where": "language = 'fr'"}).load_state_dict(state)


def test_resume_on_another_world_size_with_a_filter(dataset, manifest):
    kw = dict(budget=BUDGET, where="snr >= 3", decode="none", buffer_size=4, seed=1)
    want = expected(manifest[1], lambda r: r["snr"] >= 3)
    ranks = [StreamBatchLoader(dataset, rank=r, world_size=2, **kw) for r in range(2)]
    its = [iter(x) for x in ranks]
    seen = [k for it in its for _ in range(2) for k in next(it)["keys"]]
    states = [x.state_dict() for x in ranks]
    single = StreamBatchLoader(dataset, rank=0, world_size=1, **kw)
    single.load_state_dict(states[0])
    rest = epoch_keys(single)
    assert Counter(seen + rest) == Counter(want)  # the rest re-planned on one rank: each kept sample once


# ---- the workers of a filtered loader read the parent's answers: they never load DuckDB -----------------------
_PROBE = """
import os, sys


def transform(sample, rng):
    with open(os.path.join(os.environ["PROBE_DIR"], str(os.getpid())), "w") as f:
        f.write("duckdb" if "duckdb" in sys.modules else "none")
    return sample
"""
_PROBE_RUN = """
import json, os, sys
from collections import Counter
from probe import transform
from streambatch import StreamBatchLoader
loader = StreamBatchLoader(sys.argv[1], budget=int(sys.argv[2]), where=sys.argv[3], num_workers=2,
                           transform=transform, seed=2)
keys = [k for b in loader for k in b["keys"]]
print(json.dumps({"keys": keys, "parent_duckdb": "duckdb" in sys.modules, "pid": os.getpid()}))
"""


def test_workers_of_a_filtered_loader_never_load_duckdb(dataset, manifest, tmp_path):
    """The filter is evaluated once, in the engine's child process; the training process and its DataLoader
    workers only read the answers, so none of them loads DuckDB (which is not safe to fork)."""
    (tmp_path / "probe.py").write_text(_PROBE)
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {**os.environ, "PROBE_DIR": str(seen), "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    cmd = [sys.executable, "-c", _PROBE_RUN, dataset, str(BUDGET), DE_LOUD]
    proc = popen(cmd, env=env, stdout=subprocess.PIPE, cwd=tmp_path)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"the filtered loader exited with {proc.returncode}"
    got = json.loads(out)
    assert Counter(got["keys"]) == Counter(expected(manifest[1], de_loud))
    workers = {p.name: p.read_text() for p in seen.iterdir() if p.name != str(got["pid"])}
    assert len(workers) == 2 and set(workers.values()) == {"none"}, workers
    assert not got["parent_duckdb"]


# ---- a filter's answer does not depend on the process's time zone ---------------------------------------
#: the hour of the day (UTC) each sample was recorded at, as a time-zone-aware string; under Asia/Tokyo (UTC+9) a
#: session that follows TZ reads hours 9..23 and 0..8, and dates a day later from 15:00 UTC on
RECORDED = [f"2024-03-01 {h:02d}:30:00+00:00" for h in range(24)]
MORNING = "hour(CAST(recorded AS TIMESTAMPTZ)) < 12 AND CAST(CAST(recorded AS TIMESTAMPTZ) AS DATE) = DATE '2024-03-01'"
_TZ_RUN = """
import json, sys, torch
from streambatch import StreamBatchLoader
ds, where, mode, state = sys.argv[1:5]
loader = StreamBatchLoader(ds, budget=6400, where=where, decode="none", buffer_size=4, seed=3)
if mode == "resume":
    loader.load_state_dict(torch.load(state))
it, keys = iter(loader), []
for batch in it:
    keys += batch["keys"]
    if mode == "first":
        torch.save(loader.state_dict(), state)
        break
print(json.dumps(keys))
"""


@pytest.fixture(scope="module")
def recorded_dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("recorded")
    rows = []
    for h, when in enumerate(RECORDED):
        frames = make_audio(d / f"wavs/r{h:02d}.wav", 0.1, seed=h)
        rows.append({"audio_filepath": f"wavs/r{h:02d}.wav", "duration": frames / SR, "recorded": when})
    out = str(d / "ds")
    write_shards(str(write_jsonl(d / "manifest.jsonl", rows)), out, max_count=6, progress=False)
    return out


def _keys_under(tz: str, ds: str, mode: str = "epoch", state: str = "") -> list[str]:
    """The keys a loader with the :data:`MORNING` filter streams in a process whose TZ is ``tz``."""
    env = {**os.environ, "TZ": tz}
    proc = popen([sys.executable, "-c", _TZ_RUN, ds, MORNING, mode, state], env=env, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"the loader under TZ={tz} exited with {proc.returncode}"
    return json.loads(out)


def test_a_filter_keeps_the_same_samples_in_every_time_zone(recorded_dataset, tmp_path):
    want = {f"wavs__r{h:02d}" for h in range(12)}  # the hours before noon, UTC
    for tz in ("UTC", "Asia/Tokyo"):
        assert Counter(_keys_under(tz, recorded_dataset)) == Counter(want), tz
    state = str(tmp_path / "state.pt")  # begun under one time zone, resumed under another: still each kept once
    first = _keys_under("UTC", recorded_dataset, "first", state)
    rest = _keys_under("Asia/Tokyo", recorded_dataset, "resume", state)
    assert first and Counter(first + rest) == Counter(want)


@pytest.mark.parametrize(
    "where, message",
    [
        ("lang = 'de'", "no column 'lang'"),
        ("language = ", "syntax error"),
        ("snr > 1; DROP TABLE t", "only an expression"),
        ("(SELECT 1) = 1", "only an expression"),
        ("snr + 1", "not true/false"),
        ("language = 'xx'", "keeps none of the 60 samples"),
    ],
)
def test_bad_filters_are_one_clear_line(dataset, where, message):
    """A filter's mistakes are the package's errors (an OptionError; an EmptyEpochError when it keeps nothing),
    both still ValueErrors."""
    with pytest.raises(EmptyEpochError if "keeps none" in message else OptionError) as e:
        StreamBatchLoader(dataset, BUDGET, where=where)
    text = str(e.value)
    assert message in text and "\n" not in text
    if "keeps none" not in message:
        assert "language (string)" in text and "snr (double)" in text and "speaker (string)" in text


def test_a_filter_needs_a_columnar_index(manifest, tmp_path):
    out = str(tmp_path / "v1")
    write_shards(str(manifest[0]), out, max_count=30, progress=False, index_version=1)
    with pytest.raises(OptionError, match="version 2 index"):
        StreamBatchLoader(out, BUDGET, where="snr > 1")
    with pytest.raises(OptionError, match="needs a dataset index"):  # shard URLs alone: no columns at all
        StreamBatchLoader(sorted(str(p) for p in Path(out).glob("*.tar")), BUDGET, where="snr > 1")


def test_mixture_filters_each_dataset(dataset, manifest, tmp_path):
    other = str(tmp_path / "other")
    write_shards(str(manifest[0]), other, max_count=20, progress=False, columns="language")
    loader = StreamBatchLoader({"a": dataset, "b": other}, BUDGET, where="language = 'en'", decode="none")
    got = Counter(epoch_keys(loader))
    want = expected(manifest[1], lambda r: r["language"] == "en")
    assert got == Counter({k: 2 for k in want})  # each dataset's own kept samples, once each
    with pytest.raises(ValueError, match=r"dataset 'b'.*no column 'snr'"):
        StreamBatchLoader({"a": dataset, "b": other}, BUDGET, where="snr > 3")


# ---- inspect -------------------------------------------------------------------------------------
def test_inspect_where(dataset, manifest, capsys):
    assert main(["inspect", dataset, "--where", DE_LOUD, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    want = expected(manifest[1], de_loud)
    assert s["num_samples"] == len(want)
    assert s["where"]["kept"] == len(want) and s["where"]["of"] == N
    assert s["where"]["fraction"] == pytest.approx(len(want) / N)
    hours = sum(r["duration"] for r in manifest[1] if de_loud(r)) / 3600
    assert s["total_hours"] == pytest.approx(hours, rel=1e-3)
    assert main(["inspect", dataset, "--where", DE_LOUD]) == 0
    assert f"keeps {len(want)} of {N} samples" in capsys.readouterr().out
    assert main(["inspect", dataset, "--where", "speakr = 'spk1'"]) == 2
    err = capsys.readouterr().err
    assert "no column 'speakr'" in err and "speaker (string)" in err


# ---- not fetching what is filtered out --------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_local_byte_ranges_give_the_same_batches(dataset, num_workers):
    """Small chunks: pieces split around the filtered runs (three samples, 10-25 KB, between kept ones) are
    read as byte ranges of the local files, and give the very batches a whole read gives."""
    kw = dict(budget=BUDGET, where="snr IN (0, 4, 8, 12, 16)", decode="audio", num_workers=num_workers, seed=4)
    whole = list(StreamBatchLoader(dataset, **kw))
    ranged = list(StreamBatchLoader(dataset, chunk_size="4K", **kw))
    assert [b["keys"] for b in ranged] == [b["keys"] for b in whole]
    assert all((a["audio"] == b["audio"]).all() for a, b in zip(ranged, whole))


@pytest.mark.parametrize("read_ahead", [0, "64K"])
def test_filtered_runs_are_not_fetched_from_s3(manifest, moto_endpoint, proxy, read_ahead):
    from conftest_s3 import BUCKET, s3_options
    from faultproxy import byte_range

    url = f"s3://{BUCKET}/filters-{uuid.uuid4().hex[:8]}"
    write_shards(str(manifest[0]), url, max_count=30, progress=False, storage_options=s3_options(moto_endpoint))
    ix = ShardIndex.load(url, s3_options(moto_endpoint))
    chunk = 4096
    proxy.reset()
    loader = StreamBatchLoader(
        url,
        BUDGET,
        where="language = 'de'",
        decode="none",
        chunk_size=chunk,
        read_ahead=read_ahead,
        storage_options=s3_options(proxy.url),
    )
    keys = epoch_keys(loader)
    assert Counter(keys) == Counter(expected(manifest[1], lambda r: r["language"] == "de"))
    fetched = total = skipped = 0
    for s, info in enumerate(ix.shards):
        offsets, sizes = ix.sample_offsets(s)
        langs = [manifest[1][int(k[-2:])]["language"] for k in ix.shards.reader.shard_samples(s)["keys"]]
        gets = proxy.gets(f"{url.rsplit('/', 1)[-1]}/{info.url}")
        ranges = [byte_range(rng, info.bytes) for _, _, rng, status in gets if status == 206]
        fetched += sum(hi - lo + 1 for lo, hi in ranges)
        total += info.bytes
        i = 0
        while i < len(langs):  # each run of filtered samples spanning at least a chunk: no byte of it fetched
            j = i
            while j < len(langs) and langs[j] != "de":
                j += 1
            lo, hi = (int(offsets[i]), int(offsets[j - 1] + sizes[j - 1])) if j > i else (0, 0)
            if hi - lo >= chunk:
                skipped += hi - lo
                assert not any(a < hi and b >= lo for a, b in ranges), f"{info.url}: bytes {lo}..{hi} fetched"
            i = j + 1
    assert skipped > total / 2  # the runs of 'en' and 'fr' (two thirds of the data) were there to skip
    assert fetched < total - skipped + len(ix.shards) * chunk
