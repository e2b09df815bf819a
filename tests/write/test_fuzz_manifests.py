"""Fuzzing every manifest parser (issue 25): NeMo JSONL (for ``shardify write`` and beside adopted tars),
SpeechBrain JSON and CSV, text JSONL, lhotse cuts, recordings and supervisions (plain and gzipped), and a Kaldi data
folder (wav.scp, segments, text, utt2spk). The real manifests of tests/data/real, mutated or replaced by random
bytes, each give records and problems or one of the project's errors (a :class:`~streambatch.errors.StreamBatchError`
subclass: one line, exit 2), never another exception, within a stated memory bound."""

from __future__ import annotations

import gzip
import shutil

import pytest
from conftest import TESTS
from fuzz_inputs import FUZZ, inputs, parse_within
from hypothesis import given
from hypothesis import strategies as st

from streambatch.write.adopt.nemo import read_manifests
from streambatch.write.sources import read_source

MANIFESTS = TESTS / "data" / "real" / "manifests"
SPEECHBRAIN = MANIFESTS / "speechbrain" / "tests" / "samples" / "annotation"
LHOTSE = MANIFESTS / "lhotse"
KALDI_FILES = ("wav.scp", "segments", "text", "utt2spk")


def bound(data: bytes) -> int:
    """What parsing a manifest of ``data`` may allocate at its peak: parsed JSON takes a few dozen times its text."""
    return (16 << 20) + 64 * len(data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder the examples write their manifests into (one file name per parser, overwritten each example)."""
    path = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(LHOTSE / "kaldi", path / "kaldi")
    return path


def parse(folder, name: str, data: bytes, kind: str):
    path = folder / name
    path.write_bytes(data)
    return parse_within(lambda: read_source(str(path), kind=kind, data_root=str(folder)), bound(data))


NEMO = (MANIFESTS / "nemo" / "long_segments.json").read_bytes()
TEXT = (
    b'{"text": "a first document", "lang": "en"}\n{"text": "two", "score": 0.5}\n{"text": "", "n": [1, {"a": null}]}\n'
)
CUTS = gzip.decompress((LHOTSE / "cuts.jsonl.gz").read_bytes())
SUPERVISIONS = gzip.decompress((LHOTSE / "supervisions.jsonl.gz").read_bytes())


@FUZZ
@given(inputs(NEMO))
def test_nemo_manifest(folder, data):
    parse(folder, "nemo.json", data, "manifest")


@FUZZ
@given(inputs(NEMO))
def test_nemo_manifest_beside_adopted_tars(folder, data):
    path = folder / "tarred_audio_manifest.json"
    path.write_bytes(data)
    parse_within(lambda: read_manifests([str(path)]), bound(data))


@FUZZ
@given(inputs((SPEECHBRAIN / "ASR_train.json").read_bytes()))
def test_speechbrain_json(folder, data):
    parse(folder, "sb.json", data, "speechbrain")


@FUZZ
@given(inputs((SPEECHBRAIN / "ASR_train.csv").read_bytes()))
def test_speechbrain_csv(folder, data):
    parse(folder, "sb.csv", data, "speechbrain")


@FUZZ
@given(inputs(TEXT))
def test_text_jsonl(folder, data):
    parse(folder, "text.jsonl", data, "text")


@FUZZ
@given(inputs(CUTS))
def test_lhotse_cuts(folder, data):
    parse(folder, "cuts.jsonl", data, "lhotse")


@FUZZ
@given(st.one_of(inputs(SUPERVISIONS), inputs(gzip.compress(SUPERVISIONS))))
def test_lhotse_supervisions_plain_and_gzipped(folder, data):
    """A supervisions manifest beside the real recordings (gzipped: the bytes mutated are the compressed ones)."""
    shutil.copy(LHOTSE / "recordings.jsonl.gz", folder / "recordings.jsonl.gz")
    gz = data[:2] == b"\x1f\x8b"
    parse(folder, "supervisions.jsonl" + (".gz" if gz else ""), data, "lhotse")
    (folder / ("supervisions.jsonl" + (".gz" if gz else ""))).unlink()


@FUZZ
@given(st.sampled_from(KALDI_FILES), st.data())
def test_kaldi_folder(folder, name, data):
    """One of the Kaldi folder's files mutated, the others real."""
    real = (LHOTSE / "kaldi" / name).read_bytes()
    raw = data.draw(inputs(real))
    (folder / "kaldi" / name).write_bytes(raw)
    try:
        parse_within(lambda: read_source(str(folder / "kaldi"), kind="kaldi", data_root=str(LHOTSE)), bound(raw))
    finally:
        (folder / "kaldi" / name).write_bytes(real)
