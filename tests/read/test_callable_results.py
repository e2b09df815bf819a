"""What a user's per-sample callable returns is checked where it comes back: a value that is no array of numbers is
one clear error naming the option, the callable and the sample (was torch's "can't convert np.ndarray ...")."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import audio_dataset, text_dataset

from streambatch import StreamBatchLoader


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("text"), 12, seed=4)


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("audio"), 6, corpus_seed=2)


def first_batch(source, budget, **options):
    return next(iter(StreamBatchLoader(source, budget, **options)))


def test_a_decode_returning_text_is_named(text):
    with pytest.raises(TypeError, match=r"decode .*<lambda> returned 'no array' for sample '.*': an array"):
        first_batch(text, 2000, decode=lambda sample: "no array")
    assert first_batch(text, 2000, decode=lambda sample: np.zeros(3))["inputs"].shape[1] == 3


def test_a_transform_returning_text_is_named(audio):
    def bad(sample, rng):
        return {**sample, "audio": "quiet"}

    with pytest.raises(TypeError, match=r"transform .*bad returned 'quiet' for sample"):
        first_batch(audio, "20s", transform=bad)


def test_features_returning_text_are_named(audio):
    with pytest.raises(TypeError, match=r"features .*<lambda> returned 'x' for sample"):
        first_batch(audio, "20s", features=lambda wav, rate: "x")
