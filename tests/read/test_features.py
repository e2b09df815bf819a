"""Features in the workers: Kaldi-compatible fbank (kaldi-native-fbank) planned in frames — the budget, lengths
and padding mask count frames — and any other features callable."""

from __future__ import annotations

import kaldi_native_fbank as knf
import numpy as np
import pytest
import torch
from conftest import audio_dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from streambatch import StreamBatchLoader
from streambatch.plan.perturb import kaldi_num_frames, perturbed_samples
from streambatch.read.features import Fbank

SR = 16000
FRAMES = 1500  # 15 s of 10 ms frames per batch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return audio_dataset(root, 40, 9, SR, max_count=10, shuffle=True, seed=0)


def index_samples(b: dict) -> np.ndarray:
    return np.round(np.array(b["duration"]) * SR).astype(np.int64)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5000), st.sampled_from([8000, 16000, 22050, 44100]))
def test_frame_count_is_the_extractors(n, sr):
    """The plan's frame formula is exactly the number of frames kaldi-native-fbank computes."""
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq, opts.frame_opts.dither, opts.mel_opts.num_bins = sr, 0.0, 23
    fb = knf.OnlineFbank(opts)
    if n:
        fb.accept_waveform(sr, np.full(n, 0.01, dtype=np.float32))
    fb.input_finished()
    assert int(kaldi_num_frames(n, sr)) == fb.num_frames_ready == int(Fbank().num_frames(n, sr))


def test_fbank_is_80_dim_log_mel_power():
    """Twice the amplitude is four times the power: every log-mel energy goes up by log 4 (no dither)."""
    wav = torch.from_numpy(np.random.default_rng(0).normal(0, 0.1, SR).astype(np.float32))
    a, b = Fbank()(wav, SR), Fbank()(2 * wav, SR)
    assert a.shape == (98, 80) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.allclose(b - a, torch.full_like(a, float(np.log(4.0))), atol=1e-3)
    assert torch.equal(a, Fbank()(wav, SR))


def test_batches_of_fbank_frames_keep_a_budget_in_frames(data):
    loader = StreamBatchLoader(data, budget=FRAMES, features="fbank", num_workers=2, seed=1)
    seen = 0
    for b in loader:
        x = b["features"]
        assert x.ndim == 3 and x.shape[2] == 80 and "audio" not in b
        assert x.shape[0] * x.shape[1] <= FRAMES
        assert b["lengths"].tolist() == kaldi_num_frames(index_samples(b), SR).tolist()
        assert torch.equal(b["padding_mask"], torch.arange(x.shape[1])[None] >= b["lengths"][:, None])
        assert torch.all(x[b["padding_mask"]] == 0)
        seen += len(b["keys"])
    assert seen == 40


def test_a_duration_budget_counts_the_frames_of_that_much_audio(data):
    assert StreamBatchLoader(data, budget="15s", features="fbank").config.budget == kaldi_num_frames(15 * SR, SR)


def test_features_with_speed_perturbation_keep_the_budget(data):
    loader = StreamBatchLoader(data, budget=FRAMES, features="fbank", speed_perturb=(0.9, 1.0, 1.1), seed=2)
    for b in loader:
        assert b["features"].shape[0] * b["features"].shape[1] <= FRAMES
        planned = kaldi_num_frames(perturbed_samples(index_samples(b), b["speed"].double().numpy()), SR)
        assert np.all(np.abs(b["lengths"].numpy() - planned) <= 1)


def test_a_features_callable_without_a_frame_count_plans_in_samples(data):
    def energy(wav, sr):  # one value per 10 ms: the plan cannot know, so the budget stays in samples
        return wav[: len(wav) // 160 * 160].reshape(-1, 160).pow(2).mean(1, keepdim=True)

    budget = 15 * SR
    for b in StreamBatchLoader(data, budget=budget, features=energy):
        assert b["features"].shape[2] == 1 and b["lengths"].tolist() == (index_samples(b) // 160).tolist()
        assert b["features"].shape[0] * int(index_samples(b).max()) <= budget


class Framed:
    """A features object that says how many frames it makes: the plan counts them."""

    def __init__(self, extra: int = 0):
        self.extra = extra

    def num_frames(self, num_samples, sample_rate):
        return np.asarray(num_samples) // 400

    def __call__(self, wav, sr):
        n = len(wav) // 400 + self.extra
        return torch.ones(n, 3)


def test_a_features_object_with_a_frame_count_plans_in_its_frames(data):
    for b in StreamBatchLoader(data, budget=100, features=Framed()):
        assert b["features"].shape[0] * b["features"].shape[1] <= 100
        assert b["lengths"].tolist() == (index_samples(b) // 400).tolist()


def test_more_frames_than_counted_is_an_error_naming_the_features(data):
    with pytest.raises(ValueError, match=r"features .*Framed made sample .* longer than the \d+ frames planned"):
        next(iter(StreamBatchLoader(data, budget=100, features=Framed(extra=1))))


def test_unknown_features_is_an_error(data):
    with pytest.raises(ValueError, match="features must be 'fbank' or a callable"):
        StreamBatchLoader(data, budget=FRAMES, features="mfcc")
