"""Synthetic length distributions and a synthetic speech-like audio dataset.

Used by ``shardify demo``, the benchmarks and the tests, so that every figure we print can be reproduced
without downloading a corpus.
"""

from __future__ import annotations

import numpy as np

from .units import Unit

SAMPLE_RATE = 16000


def librispeech_like(n: int, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Audio lengths in samples: most utterances 14–16 s, a tail from 1 to 25 s (LibriSpeech train-like)."""
    rng = np.random.default_rng(seed)
    kind = rng.random(n)
    sec = np.where(
        kind < 0.75,
        np.clip(rng.normal(15.0, 0.5, n), 14.0, 16.0),
        np.where(kind < 0.95, rng.uniform(1.0, 14.0, n), rng.uniform(16.0, 25.0, n)),
    )
    return np.round(sec * sample_rate).astype(np.int64)


def commonvoice_like(n: int, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Audio lengths in samples: log-normal around 5 s, clipped to 0.5–20 s (CommonVoice-like)."""
    rng = np.random.default_rng(seed)
    sec = np.clip(rng.lognormal(np.log(5.0), 0.4, n), 0.5, 20.0)
    return np.round(sec * sample_rate).astype(np.int64)


def text_like(n: int, seed: int = 0, cap: int = 1024) -> np.ndarray:
    """Token counts: log-normal around 60 tokens, capped at ``cap``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(60.0), 0.8, n)), 1, cap).astype(np.int64)


DISTRIBUTIONS = {
    # name: (generator, budget in the distribution's unit, unit)
    "librispeech": (librispeech_like, 200 * SAMPLE_RATE, Unit.SAMPLES),
    "commonvoice": (commonvoice_like, 60 * SAMPLE_RATE, Unit.SAMPLES),
    "text": (text_like, 16384, Unit.TOKENS),
}


def demo_lengths(n: int, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Lengths for the demo corpus: log-normal around 2.5 s with a long tail to 12 s (samples)."""
    rng = np.random.default_rng(seed)
    sec = np.clip(rng.lognormal(np.log(2.5), 0.55, n), 0.4, 12.0)
    return np.round(sec * sample_rate).astype(np.int64)


def speech_like(num_samples: int, rng: np.random.Generator, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A cheap speech-like waveform: a few harmonics of a wandering pitch under a syllable-rate envelope."""
    t = np.arange(num_samples) / sample_rate
    f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wav = sum(np.sin(k * phase) / k for k in (1, 2, 3))
    env = 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(3, 6) * t + rng.uniform(0, 6.28)))
    wav = 0.2 * wav * env + 0.002 * rng.standard_normal(num_samples)
    return wav.astype(np.float32)


WORDS = "the a of to and in speech model data batch stream shard length budget token audio train".split()


def write_audio_corpus(
    folder: str, n: int, seed: int = 0, sample_rate: int = SAMPLE_RATE, fmt: str = "flac"
) -> list[str]:
    """Write ``n`` synthetic utterances (``utt-000000.flac`` + ``.txt`` transcript) into ``folder``."""
    import os

    import soundfile as sf

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = demo_lengths(n, seed, sample_rate)
    # utterances are cut from a few long "speakers" (generating each from scratch would dominate the demo)
    voices = [speech_like(int(lengths.max()) * 4, rng, sample_rate) for _ in range(4)]
    paths = []
    for i, length in enumerate(lengths):
        voice = voices[i % len(voices)]
        start = int(rng.integers(0, len(voice) - length))
        wav = voice[start : start + length] * rng.uniform(0.5, 1.5)
        path = os.path.join(folder, f"utt-{i:06d}.{fmt}")
        sf.write(path, wav, sample_rate, format=fmt.upper(), subtype="PCM_16")
        words = rng.choice(WORDS, size=max(1, int(length / sample_rate * 2.5)))
        with open(os.path.join(folder, f"utt-{i:06d}.txt"), "w") as f:
            f.write(" ".join(words) + "\n")
        paths.append(path)
    return paths
