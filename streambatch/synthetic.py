"""Synthetic length distributions and a synthetic speech-like audio dataset.

Used by ``shardify demo``, the benchmarks and the tests, so that every figure we print can be reproduced
without downloading a corpus.
"""

from __future__ import annotations

import numpy as np

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
    "librispeech": (librispeech_like, 200 * SAMPLE_RATE, "samples"),
    "commonvoice": (commonvoice_like, 60 * SAMPLE_RATE, "samples"),
    "text": (text_like, 16384, "tokens"),
}
