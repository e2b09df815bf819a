"""A sample whose payload decodes to values no model can take — audio holding NaN, a negative token id — is a bad
sample on the existing path: counted (``lost_samples``) and left out within ``max_bad_shards``, and with
``max_bad_shards=0`` an error naming the shard and the sample (both reached batches before)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from streambatch import DataError, StreamBatchLoader
from streambatch.write.writer import write_shards

BAD_KEY = "u3"


@pytest.fixture(scope="module")
def nan_audio(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    (root / "audio").mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        wav = (0.1 * rng.standard_normal(1600 + 100 * i)).astype("float32")
        if f"u{i}" == BAD_KEY:
            wav[100] = np.nan
        sf.write(str(root / "audio" / f"u{i}.wav"), wav, 16000, subtype="FLOAT")
    write_shards(str(root / "audio"), str(root / "ds"), progress=False, max_count=4)
    return str(root / "ds")


@pytest.fixture(scope="module")
def negative_ids(tmp_path_factory):
    root = tmp_path_factory.mktemp("neg")
    with open(root / "t.jsonl", "w") as f:
        for i in range(8):
            ids = list(range(1, 5 + i))
            if f"u{i}" == BAD_KEY:
                ids[2] = -7
            f.write(json.dumps({"id": f"u{i}", "input_ids": ids}) + "\n")
    write_shards(str(root / "t.jsonl"), str(root / "ds"), progress=False, max_count=4)
    return str(root / "ds")


def keys_and_values(loader):
    keys, finite, non_negative = [], True, True
    for b in loader:
        keys += list(b["keys"])
        if "audio" in b:
            finite &= bool(np.isfinite(b["audio"].numpy()).all())
        if "input_ids" in b:
            non_negative &= bool((b["input_ids"].numpy() >= 0).all())
    return keys, finite, non_negative


@pytest.mark.parametrize("which", ["nan_audio", "negative_ids"])
def test_a_bad_value_is_a_counted_bad_sample(request, which):
    ds = request.getfixturevalue(which)
    budget = "10s" if which == "nan_audio" else 1000
    loader = StreamBatchLoader(ds, budget, max_bad_shards=1)
    keys, finite, non_negative = keys_and_values(loader)
    assert BAD_KEY not in keys and finite and non_negative
    assert loader.fault_stats()["lost_samples"] >= 1
    with pytest.raises(DataError, match=f"'{BAD_KEY}'.*(NaN|negative token id -7)"):
        keys_and_values(StreamBatchLoader(ds, budget, max_bad_shards=0))
