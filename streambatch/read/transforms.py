"""What a worker does to each sample of a formed batch between decoding and padding: speed perturbation, the
user's ``transform`` with its own generator, and features.

Each sample's factor and generator come from ``(seed, epoch, global sample id)`` (`streambatch.plan.perturb`),
so the tensors are the same after a resume, on any world size and in any worker, and differ from epoch to epoch.
The plan promised each sample's length: a stage that makes a sample longer than that is an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import soxr
import torch

from ..errors import OptionError, shown
from ..plan.perturb import SpeedPerturb, perturbed_samples, sample_rng

Transform = Callable[[dict[str, Any], np.random.Generator], dict[str, Any]]


def resample(wav: np.ndarray, rate: float, target: int, n: int) -> np.ndarray:
    """``wav`` (float32 ``[T]`` or ``[T, C]``) sampled at ``rate`` Hz, as ``n`` samples at ``target`` Hz: soxr's
    high-quality resampler, band-limited (what lies above the lower rate's Nyquist frequency is filtered out
    rather than folded back as an alias), cut to ``n`` or padded with zeros up to it (the planner's count).
    The one resampler of the package: the loader's ``--sample-rate`` conversion and speed perturbation."""
    out = soxr.resample(np.ascontiguousarray(wav, dtype=np.float32), rate, target)[:n]
    if len(out) < n:
        out = np.pad(out, [(0, n - len(out))] + [(0, 0)] * (out.ndim - 1))
    return np.asarray(out, dtype=np.float32)


def speed_resample(wav: torch.Tensor, factor: float, sample_rate: int) -> torch.Tensor:
    """``wav`` played ``factor`` times as fast at the same rate: `resample()` from ``sample_rate × factor``
    to ``sample_rate``, to the planned ``floor(n / factor + 0.5)`` samples."""
    if factor == 1.0:
        return wav
    n = int(perturbed_samples(wav.shape[0], factor))
    return torch.from_numpy(resample(wav.numpy(), sample_rate * factor, sample_rate, n))


def as_payload(value: Any, option: str, fn: Any, key: Any) -> torch.Tensor:
    """What a user's ``option`` callable returned for sample ``key``, as a tensor: a clear ``TypeError`` naming the
    callable and the value when it is not an array of numbers (not torch's "can't convert np.ndarray")."""
    if isinstance(value, torch.Tensor):
        return value
    array = np.asarray(value)
    if array.dtype.kind not in "biufc":
        raise TypeError(
            f"{option} {name_of(fn)} returned {shown(value)} for sample {key!r}: an array or tensor of numbers "
            f"[T, ...] is needed"
        )
    return torch.as_tensor(array)


def name_of(fn: Any) -> str:
    """How an error names a user's callable: ``module.qualname``, else its repr."""
    qual = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", None)
    module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "")
    return f"{module}.{qual}" if qual and module else repr(fn)


def _too_long(stage: str, fn: Any, key: str, got: int, planned: int, unit: str) -> OptionError:
    return OptionError(
        f"{stage} {name_of(fn)} made sample {key!r} {got} {unit} long, longer than the {planned} {unit} planned: "
        "the budget is planned on each sample's length, so a per-sample stage may shorten a sample, never lengthen it"
    )


@dataclass(frozen=True)
class SampleOps:
    """The per-sample stages of one loader, for one epoch (`for_epoch()`): ``speed`` (factors drawn per
    sample), ``transform`` (``fn(sample, rng) -> sample``) and ``features`` (``fn(waveform, sample_rate)``)."""

    transform: Transform | None = None
    speed: SpeedPerturb | None = None
    features: Any = None
    seed: Any = 0
    epoch: int = 0
    sample_rate: int | None = None

    def for_epoch(self, epoch: int) -> SampleOps:
        return dataclasses.replace(self, epoch=int(epoch))

    def __call__(
        self, samples: Sequence[dict[str, Any]], payload: list[torch.Tensor], name: str
    ) -> tuple[list[torch.Tensor], dict[str, Any], str]:
        """The batch's payloads after the stages, the fields they add to the batch (``speed``), and the
        payload's name in the batch (``features`` once features are computed)."""
        if (self.speed is not None or self.features is not None) and name != "audio":
            raise OptionError(f"speed_perturb and features need audio samples; this batch decodes {name!r}")
        gids = np.array([_gid(s) for s in samples], dtype=np.int64)
        repeats = [int(s.get("__repeat__", 0)) for s in samples]  # set where a dataset mixture repeats a sample
        factors = self.speed.factors_of(self.seed, self.epoch, gids, repeats) if self.speed is not None else None
        rate = self.sample_rate
        if factors is not None and rate is None:
            raise OptionError("speed_perturb needs the dataset's sample rate (an index counting samples)")
        out = []
        for i, (s, p) in enumerate(zip(samples, payload)):
            if factors is not None and rate is not None:
                p = speed_resample(p, float(factors[i]), rate)
            if self.transform is not None:
                p = self._transform(self.transform, s, p, name, int(gids[i]))
            if self.features is not None:
                p = self._features(s, p)
            out.append(p)
        fields = {"speed": torch.tensor(factors, dtype=torch.float32)} if factors is not None else {}
        return out, fields, "features" if self.features is not None else name

    def _transform(
        self, fn: Transform, sample: dict[str, Any], payload: torch.Tensor, name: str, gid: int
    ) -> torch.Tensor:
        """The user's transform ``fn`` on a copy of the sample holding its decoded payload under ``name``."""
        rng = sample_rng(self.seed, self.epoch, gid, int(sample.get("__repeat__", 0)))
        got = fn({**sample, name: payload, "__id__": gid}, rng)
        if not isinstance(got, dict) or name not in got:
            raise TypeError(f"transform {name_of(fn)} must return the sample dict with its {name!r}")
        out = as_payload(got[name], "transform", fn, sample["__key__"])
        if out.shape[0] > payload.shape[0]:
            raise _too_long("transform", fn, sample["__key__"], out.shape[0], payload.shape[0], "steps")
        return out

    def _features(self, sample: dict[str, Any], wav: torch.Tensor) -> torch.Tensor:
        """Features of the waveform; no more frames than the plan counted, where it counts frames."""
        feats = as_payload(self.features(wav, self.sample_rate), "features", self.features, sample["__key__"])
        counter = getattr(self.features, "num_frames", None)
        if callable(counter):
            planned = int(counter(np.int64(wav.shape[0]), self.sample_rate))
            if feats.shape[0] > planned:
                raise _too_long("features", self.features, sample["__key__"], feats.shape[0], planned, "frames")
        return feats


def _gid(sample: dict[str, Any]) -> int:
    """The sample's global id, which the executor attaches when its planned batch is formed."""
    if "__id__" not in sample:
        raise OptionError(f"sample {sample.get('__key__')!r} carries no global id: per-sample stages need an index")
    return int(sample["__id__"])
