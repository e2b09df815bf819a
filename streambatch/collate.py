"""Decode the samples of a formed batch and pad them into tensors.

Only emitted batches are decoded: buffers hold compressed bytes. A batch is a dict with the padded
payload (``audio`` float32 ``[B, T]``, ``input_ids`` int64 ``[B, T]``, or ``inputs`` for a custom decoder),
``lengths`` int64 ``[B]``, ``padding_mask`` bool ``[B, T]`` (True on padding), ``keys``, and every other
``.json`` field as a list.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .audio import AUDIO_EXTENSIONS, decode as decode_audio

Decode = str | Callable[[dict[str, Any]], Any]
_RESERVED = {"length"}


def audio_ext(sample: dict[str, Any]) -> str | None:
    for ext in AUDIO_EXTENSIONS:
        if ext in sample:
            return ext
    return None


def resolve_decode(decode: Decode, sample: dict[str, Any]) -> Decode:
    """``"auto"`` becomes ``"audio"`` for samples with an audio member, else ``"text"``."""
    if decode == "auto":
        return "audio" if audio_ext(sample) else "text"
    return decode


def pad_stack(arrays: Sequence[torch.Tensor], pad_value: float = 0, pad_to_multiple_of: int | None = None) -> torch.Tensor:
    """Stack 1-D (or ``[T, ...]``) tensors into ``[B, T_max, ...]``, padding the first dim."""
    t_max = max((a.shape[0] for a in arrays), default=0)
    if pad_to_multiple_of and t_max % pad_to_multiple_of:
        t_max += pad_to_multiple_of - t_max % pad_to_multiple_of
    first = arrays[0]
    out = torch.full((len(arrays), t_max, *first.shape[1:]), pad_value, dtype=first.dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def _resample(wav: np.ndarray, sr: int, target: int) -> np.ndarray:
    """Resample to the dataset's rate (only for datasets written with ``--sample-rate`` from mixed rates)."""
    try:
        import torchaudio.functional as F  # optional

        return F.resample(torch.from_numpy(wav), sr, target).numpy()
    except Exception:
        n = int(round(len(wav) * target / sr))
        return np.interp(np.linspace(0, len(wav) - 1, n), np.arange(len(wav)), wav).astype(np.float32)


def decode_sample(sample: dict[str, Any], decode: Decode, sample_rate: int | None = None) -> torch.Tensor | None:
    """The payload tensor of one sample for the given decode mode (None for ``"none"``)."""
    if callable(decode):
        out = decode(sample)
        return out if isinstance(out, torch.Tensor) else torch.as_tensor(np.asarray(out))
    if decode == "audio":
        ext = audio_ext(sample)
        if ext is None:
            raise ValueError(f"{sample.get('__url__')}: sample {sample['__key__']!r} has no audio member")
        wav, sr = decode_audio(sample[ext])
        if sample_rate and sr != sample_rate:
            wav = _resample(wav, sr, sample_rate)
        return torch.from_numpy(wav)
    if decode == "text":
        ids = sample.get("input_ids.npy")
        if ids is None:
            return None
        return torch.from_numpy(np.load(io.BytesIO(ids)).astype(np.int64))
    if decode == "none":
        return None
    raise ValueError(f"unknown decode mode {decode!r}: use 'auto', 'audio', 'text', 'none' or a callable")


def collate(
    samples: Sequence[dict[str, Any]],
    decode: Decode = "auto",
    *,
    pad_to_multiple_of: int | None = None,
    pad_value: float = 0,
    sample_rate: int | None = None,
) -> dict[str, Any]:
    """Decode and pad one batch of samples (see the module docstring for the fields)."""
    mode = resolve_decode(decode, samples[0])
    payload = [decode_sample(s, mode, sample_rate) for s in samples]
    batch: dict[str, Any] = {"keys": [s["__key__"] for s in samples]}
    meta = [s.get("json") or {} for s in samples]
    if all(p is not None for p in payload):
        name = "audio" if mode == "audio" else "input_ids" if mode == "text" else "inputs"
        lengths = torch.tensor([p.shape[0] for p in payload], dtype=torch.int64)
        padded = pad_stack(payload, pad_value, pad_to_multiple_of)
        batch[name] = padded
        batch["lengths"] = lengths
        batch["padding_mask"] = torch.arange(padded.shape[1])[None, :] >= lengths[:, None]
    else:
        batch["lengths"] = torch.tensor([m.get("length", 0) for m in meta])
        if mode == "none":
            batch["samples"] = list(samples)
    if mode == "text" and any("txt" in s for s in samples):
        batch["text"] = [s["txt"].decode("utf-8") if "txt" in s else m.get("text") for s, m in zip(samples, meta)]
    fields = sorted({k for m in meta for k in m} - _RESERVED - set(batch))
    for k in fields:
        batch[k] = [m.get(k) for m in meta]
    return batch
