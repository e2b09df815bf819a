"""Features computed in the workers: Kaldi-compatible log-mel filterbanks (`Fbank`) from kaldi-native-fbank.

kaldi-native-fbank (the k2-fsa project's C++ port of Kaldi's feature code, a small wheel with numpy as its only
dependency) is the one implementation, whatever else is installed: torchaudio's ``compliance.kaldi.fbank`` gives
the same features with the same options, but it does not import beside every torch build (not beside this
project's CPU torch), and computing them one way everywhere keeps a resumed job's features bit-identical on
a node where torchaudio happens to import.

A features object is a callable ``(waveform [T] float32, sample_rate) → tensor [frames, dim]``; with a
``num_frames(num_samples, sample_rate)`` method as well, the loader plans in its frames (the budget counts frames).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import OptionError
from ..plan.perturb import kaldi_num_frames


class Fbank:
    """``num_mel_bins``-dim log-mel filterbank energies, Kaldi's defaults as speech recipes use them: 25 ms frames
    every 10 ms, povey window, pre-emphasis 0.97, DC offset removed, power spectrum, ``snip_edges`` and no dither
    (deterministic). The waveform is taken as decoded (float in [-1, 1])."""

    def __init__(self, num_mel_bins: int = 80, frame_length_ms: float = 25.0, frame_shift_ms: float = 10.0):
        self.num_mel_bins, self.frame_length_ms, self.frame_shift_ms = (
            int(num_mel_bins),
            frame_length_ms,
            frame_shift_ms,
        )
        self._options: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_options": {}}  # the native options object stays in its process

    def __repr__(self) -> str:
        return (
            f"Fbank(num_mel_bins={self.num_mel_bins}, frame_length_ms={self.frame_length_ms}, "
            f"frame_shift_ms={self.frame_shift_ms})"
        )

    def num_frames(self, num_samples: Any, sample_rate: int) -> np.ndarray:
        """The frames `__call__()` gives for waveforms of ``num_samples`` (see
        `kaldi_num_frames()`)."""
        return kaldi_num_frames(num_samples, sample_rate, self.frame_length_ms, self.frame_shift_ms)

    def _opts(self, sample_rate: int) -> Any:
        if sample_rate not in self._options:
            knf = require_knf()
            o = knf.FbankOptions()
            o.frame_opts.samp_freq = float(sample_rate)
            o.frame_opts.frame_length_ms = float(self.frame_length_ms)
            o.frame_opts.frame_shift_ms = float(self.frame_shift_ms)
            o.frame_opts.dither = 0.0
            o.mel_opts.num_bins = self.num_mel_bins
            self._options[sample_rate] = o
        return self._options[sample_rate]

    def __call__(self, waveform: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """Features ``[frames, num_mel_bins]`` (float32) of a 1-D waveform."""
        import kaldi_native_fbank as knf

        wav = np.ascontiguousarray(np.asarray(waveform, dtype=np.float32).reshape(-1))
        extractor = knf.OnlineFbank(self._opts(sample_rate))
        if wav.size:
            extractor.accept_waveform(float(sample_rate), wav)
        extractor.input_finished()
        n = extractor.num_frames_ready
        if not n:
            return torch.zeros((0, self.num_mel_bins), dtype=torch.float32)
        return torch.from_numpy(np.stack([extractor.get_frame(i) for i in range(n)]))


def require_knf() -> Any:
    """kaldi-native-fbank, or an error saying how to install it."""
    try:
        import kaldi_native_fbank
    except ImportError:
        raise ImportError("features='fbank' needs kaldi-native-fbank: pip install 'streambatch[audio]'") from None
    return kaldi_native_fbank


def resolve_features(features: Any) -> Any:
    """The loader's ``features``: None, ``"fbank"`` (80-dim `Fbank`), or a callable as it is."""
    if features is None:
        return None
    if isinstance(features, str) and features == "fbank":
        require_knf()
        return Fbank()
    if callable(features):
        return features
    raise OptionError(
        f"features must be 'fbank' or a callable (waveform, sample_rate) -> [frames, dim], got {features!r}"
    )


def plans_in_frames(features: Any) -> bool:
    """Whether the plan counts this features object's frames (it says how many it makes)."""
    return features is not None and callable(getattr(features, "num_frames", None))
