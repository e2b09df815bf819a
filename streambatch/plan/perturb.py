"""Per-sample randomness and the lengths the plan sees: speed factors and transform generators drawn from
``(seed, epoch, global sample id)``, and audio lengths turned into perturbed lengths or feature frames.

Everything here is a pure function of those numbers, so a worker, the planner of any rank and a job resumed on
another world size agree on every sample's factor and generator. The plan batches the lengths the emitted
tensors will have (`LengthTransform`), so the budget holds on them; shards are still dealt to slots by the
index's own lengths (`PlannedLengths`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OptionError
from .lengths import Lengths

#: stream tags, so that speed factors, transform generators and the planner's slot generators never share a seed
SPEED_TAG, TRANSFORM_TAG = 0x5350454544, 0x5452414E53


def seed_words(seed: Any) -> list[int]:
    """The batching ``seed`` (an int or a sequence of ints) as the non-negative words numpy seeds take."""
    items = seed if isinstance(seed, (list, tuple, np.ndarray)) else [seed]
    return [int(s) & 0xFFFFFFFF for s in items]


def sample_rng(seed: Any, epoch: int, gid: int, repeat: int = 0) -> np.random.Generator:
    """The generator a transform gets for one sample: from ``(seed, epoch, global id, repeat)``, where ``repeat``
    counts the times a dataset mixture repeats the sample within the epoch (0 for the first)."""
    return np.random.default_rng([*seed_words(seed), int(epoch), TRANSFORM_TAG, int(gid), int(repeat)])


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 (wrapping arithmetic): a counter-based hash, so a factor per sample
    costs a few vector operations instead of one generator per sample."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniform(seed: Any, epoch: int, gids: np.ndarray, tag: int = SPEED_TAG, repeats: Any = None) -> np.ndarray:
    """One uniform number in [0, 1) per global id, a pure function of ``(seed, epoch, tag, id)`` — and of the
    repeat number where a mixture repeats a sample within the epoch (``repeats``, 0 or None: the first)."""
    key = np.random.SeedSequence([*seed_words(seed), int(epoch), tag]).generate_state(1, np.uint64)[0]
    with np.errstate(over="ignore"):
        h = _mix(np.asarray(gids, dtype=np.uint64) ^ key)
        if repeats is not None:
            r = np.asarray(repeats, dtype=np.uint64)
            h = np.where(r > 0, _mix(h ^ r), h)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class SpeedPerturb:
    """Speed factors and their weights; a factor ``f`` plays a sample ``f`` times as fast (length ``n / f``)."""

    factors: tuple[float, ...]
    weights: tuple[float, ...]

    @classmethod
    def make(cls, spec: Any) -> SpeedPerturb | None:
        """From the loader's ``speed_perturb``: factors ``(0.9, 1.0, 1.1)``, ``(factors, weights)``, or a dict
        ``{factor: weight}``; None or empty means off."""
        shaped = isinstance(spec, (dict, list, tuple, np.ndarray))
        if spec is None or (shaped and not len(spec)):
            return None
        if not shaped:
            raise OptionError(f"speed_perturb must be {SPEED_FORMS}, got {spec!r}")
        if isinstance(spec, dict):
            factors, weights = list(spec), list(spec.values())
        elif len(spec) == 2 and all(isinstance(x, (list, tuple, np.ndarray)) for x in spec):
            factors, weights = list(spec[0]), list(spec[1])
        else:
            factors, weights = list(spec), [1.0] * len(spec)
        f, w = _numbers(factors, spec), _numbers(weights, spec)
        if f.ndim != 1 or f.size != w.size or not np.all(np.isfinite(f)) or np.any(f <= 0):
            raise OptionError(f"speed_perturb: factors must be positive numbers with one weight each, got {spec!r}")
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise OptionError(f"speed_perturb: weights must be non-negative with a positive sum, got {spec!r}")
        return cls(tuple(f.tolist()), tuple(w.tolist()))

    def factors_of(self, seed: Any, epoch: int, gids: np.ndarray, repeats: Any = None) -> np.ndarray:
        """Each sample's factor, drawn by weight from ``(seed, epoch, global id)`` (and its repeat number)."""
        cum = np.cumsum(self.weights) / float(np.sum(self.weights))
        pick = np.searchsorted(cum, sample_uniform(seed, epoch, gids, SPEED_TAG, repeats), side="right")
        return np.asarray(self.factors)[np.minimum(pick, len(self.factors) - 1)]


#: the forms ``speed_perturb`` takes, for its error messages
SPEED_FORMS = "factors like (0.9, 1.0, 1.1), (factors, weights) or {factor: weight}"


def _numbers(values: list[Any], spec: Any) -> np.ndarray:
    """Factors or weights as floats: real numbers only (not text, not True/False), else an `OptionError`."""
    if not all(isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) for x in values):
        raise OptionError(f"speed_perturb must be {SPEED_FORMS} with numbers, got {spec!r}")
    return np.asarray(values, dtype=np.float64)


def perturbed_samples(num_samples: Any, factor: Any) -> Any:
    """A length in samples played ``factor`` times as fast: ``floor(n / factor + 0.5)``, the length soxr's
    resampler gives (the worker trims to it, so the budget holds to the sample)."""
    return np.floor(np.asarray(num_samples, dtype=np.float64) / np.asarray(factor, dtype=np.float64) + 0.5).astype(
        np.int64
    )


def kaldi_num_frames(
    num_samples: Any, sample_rate: int, frame_length_ms: float = 25.0, frame_shift_ms: float = 10.0
) -> np.ndarray:
    """Frames Kaldi's feature extraction gives with ``snip_edges=True`` (its default, and torchaudio's and
    kaldi-native-fbank's): window ``int(sr × 0.001 × length_ms)`` and shift ``int(sr × 0.001 × shift_ms)`` samples,
    ``1 + (n − window) // shift`` frames, none for a sample shorter than one window."""
    window = int(sample_rate * 0.001 * frame_length_ms)
    shift = int(sample_rate * 0.001 * frame_shift_ms)
    n = np.asarray(num_samples, dtype=np.int64)
    return np.where(n >= window, 1 + (n - window) // shift, 0).astype(np.int64)


@dataclass(frozen=True)
class LengthTransform:
    """How the lengths the plan batches follow from the index's (in samples): speed perturbation, then the
    frame count of ``features`` (an object with ``num_frames(num_samples, sample_rate)``) when planning in frames."""

    sample_rate: int
    speed: SpeedPerturb | None = None
    features: Any = None

    @property
    def in_frames(self) -> bool:
        return self.features is not None

    def planned(self, lengths: np.ndarray, seed: Any, epoch: int, gids: np.ndarray) -> np.ndarray:
        """The planned length of each sample (index lengths ``lengths`` of the samples ``gids``)."""
        out = np.asarray(lengths)
        if self.speed is not None:
            out = perturbed_samples(out, self.speed.factors_of(seed, epoch, gids))
        return self.frames(out) if self.in_frames else out

    def frames(self, num_samples: Any) -> np.ndarray:
        return np.asarray(self.features.num_frames(np.asarray(num_samples, dtype=np.int64), self.sample_rate))

    def shortest(self, length: float) -> float:
        """The shortest a sample of index length ``length`` can be planned (its fastest factor)."""
        fastest = max(self.speed.factors) if self.speed is not None else 1.0
        n = perturbed_samples(length, fastest) if self.speed is not None else np.int64(length)
        return float(self.frames(n)) if self.in_frames else float(n)


class PlannedLengths(Lengths):
    """The lengths one epoch is planned on: by global id (``lengths[gids]``) and for a slot's stream
    (`plan_lengths()`, called by `stream_lengths()`) they are the planned ones;
    ``shard()`` and ``totals`` stay the index's, so shards are dealt to slots as without perturbation.
    ``base`` is the index's `Lengths` (sharing its loaded shards)."""

    def __init__(self, base: Lengths, plan: LengthTransform, seed: Any, epoch: int):
        super().__init__(base.counts, base.totals, base._load)
        self.scale = base.scale  # a mixture's deal scale (``totals`` are already scaled)
        self.load_outputs, self._outputs = base.load_outputs, base._outputs
        self.groups = base.groups  # a mixture's dataset per shard (batch_by)
        self._arrays = base._arrays  # one cache: a shard's lengths are read once
        self.base, self.plan, self.seed, self.epoch = base, plan, seed, int(epoch)

    def plan_lengths(self, lengths: np.ndarray, gids: np.ndarray) -> np.ndarray:
        """Planned lengths of the samples ``gids`` whose index lengths are ``lengths``."""
        return self.plan.planned(lengths, self.seed, self.epoch, gids)

    def __getitem__(self, gids: np.ndarray) -> np.ndarray:
        gids = np.asarray(gids, dtype=np.int64)
        return self.plan_lengths(super().__getitem__(gids), gids)


def planned_lengths(lengths: Lengths, plan: LengthTransform | None, seed: Any, epoch: int) -> Lengths:
    """``lengths`` as the epoch is planned on them: unchanged without a `LengthTransform`."""
    return lengths if plan is None else PlannedLengths(lengths, plan, seed, epoch)
