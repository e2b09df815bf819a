"""Decode the samples of a formed batch and pad them into tensors.

Only emitted batches are decoded: buffers hold compressed bytes. A batch is a dict with the padded
payload (``audio`` float32 ``[B, T]``, ``input_ids`` int64 ``[B, T]``, or ``inputs`` for a custom decoder),
``lengths`` int64 ``[B]``, ``padding_mask`` bool ``[B, T]`` (True on padding), ``keys``, ``text`` (each
sample's ``.txt``, ``.json`` text, or the index's ``text`` column), for audio ``sample_rate`` (each sample's rate
in Hz as emitted: after resampling, and for tars adopted without a ``.json`` too), and every other ``.json`` field
as a list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import AudioError, OptionError, SampleError
from ..format.audio import AUDIO_EXTENSIONS, open_clips
from ..format.audio import decode as decode_audio
from ..format.members import SEGMENT_FIELD, TokenIdsError, token_ids
from ..units import resampled_count
from .ring import slot_tensor
from .transforms import as_payload, resample

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


def pad_stack(
    arrays: Sequence[torch.Tensor], pad_value: float = 0, pad_to_multiple_of: int | None = None
) -> torch.Tensor:
    """Stack 1-D (or ``[T, ...]``) tensors into ``[B, T_max, ...]``, padding the first dim."""
    t_max = max((a.shape[0] for a in arrays), default=0)
    if pad_to_multiple_of and t_max % pad_to_multiple_of:
        t_max += pad_to_multiple_of - t_max % pad_to_multiple_of
    first = arrays[0]
    out = batch_tensor((len(arrays), t_max, *first.shape[1:]), first.dtype).fill_(pad_value)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def decode_sample(sample: dict[str, Any], decode: Decode, sample_rate: int | None = None) -> torch.Tensor | None:
    """The payload tensor of one sample for the given decode mode (None for ``"none"``)."""
    if callable(decode):
        return as_payload(decode(sample), "decode", decode, sample.get("__key__"))
    if decode == "audio":
        return decode_audio_sample(sample, sample_rate)[0]
    if decode == "text":
        ids = sample.get("input_ids.npy")
        if ids is None:
            return None
        try:
            out = token_ids(ids).astype(np.int64)
        except TokenIdsError as e:  # which sample of which shard: the header check cannot say
            raise SampleError(f"{sample.get('__url__')}: sample {sample['__key__']!r}: input_ids.npy: {e}") from e
        if out.size and out.min() < 0:  # an embedding lookup would index from the end or fail on the device
            raise SampleError(
                f"{sample.get('__url__')}: sample {sample['__key__']!r}: negative token id {int(out.min())}"
            )
        return torch.from_numpy(out)
    if decode == "none":
        return None
    raise OptionError(f"unknown decode mode {decode!r}: use 'auto', 'audio', 'text', 'none' or a callable")


def decode_audio_sample(sample: dict[str, Any], sample_rate: int | None = None) -> tuple[torch.Tensor, int]:
    """A sample's audio decoded (resampled to ``sample_rate`` where given and its rate differs), and its rate."""
    ext = audio_ext(sample)
    if ext is None:
        raise SampleError(f"{sample.get('__url__')}: sample {sample['__key__']!r} has no audio member")
    try:
        wav, sr = decode_audio(sample[ext], segment=sample.get(SEGMENT_FIELD))
    except AudioError as e:  # which sample of which shard: the decoder cannot say
        raise AudioError(f"{sample.get('__url__')}: sample {sample['__key__']!r}: {e}") from e
    if wav.size and not math.isfinite(float(wav.sum(dtype=np.float64))):  # NaN or inf: would poison a loss
        raise AudioError(f"{sample.get('__url__')}: sample {sample['__key__']!r}: its audio holds NaN or inf")
    if sample_rate and sr != sample_rate:
        wav = resample(wav, sr, sample_rate, resampled_count(len(wav), sr, sample_rate))
        sr = sample_rate
    return torch.from_numpy(wav), int(sr)


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a batch; in a DataLoader worker, in shared memory from the start, so passing
    it to the main process copies nothing: in the worker's free ring buffer (read/ring.py), else in a fresh
    segment (as torch's own collate does)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    out = slot_tensor(shape, dtype)
    if out is not None:
        return out
    numel = math.prod(shape)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(numel, device="cpu")
    return torch.empty(0, dtype=dtype).new(storage).resize_(shape)


#: from this padded length on, a mask is filled row by row (two fills a row) rather than by one comparison per
#: element: far fewer operations for long audio rows, more for short text rows
ROW_FILL_FROM = 2048


def padding_mask(lengths: torch.Tensor, t: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B, t]``, True on padding (``out`` filled when given)."""
    if out is None:
        out = torch.empty((len(lengths), t), dtype=torch.bool)
    if t < ROW_FILL_FROM:
        return torch.ge(torch.arange(t)[None, :], lengths[:, None], out=out)
    rows = out.numpy()
    for row, n in zip(rows, lengths.tolist()):
        row[:n] = False
        row[n:] = True
    return out


def _padded_audio(
    samples: Sequence[dict[str, Any]], sample_rate: int | None, pad_to_multiple_of: int | None
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """(lengths, padded audio, rates) of mono clips decoded into their rows of the batch; None to decode one by
    one."""
    exts = [e for e in map(audio_ext, samples) if e is not None]
    if not exts or len(exts) < len(samples):
        return None
    clips = open_clips([s[e] for s, e in zip(samples, exts)], sample_rate, [s.get(SEGMENT_FIELD) for s in samples])
    if clips is None:
        return None
    try:
        t_max = _rounded(max(clips.frames), pad_to_multiple_of)
        out = batch_tensor((len(samples), t_max), torch.float32)
        lengths = clips.decode_into(out.numpy())
        if not math.isfinite(float(out.numpy().sum(dtype=np.float64))):  # NaN or inf: named one by one
            return None
    except Exception:  # noqa: BLE001 - decoded one by one, which raises the clear error
        return None
    finally:
        clips.close()
    t = _rounded(max(lengths), pad_to_multiple_of)
    return torch.tensor(lengths, dtype=torch.int64), (out if t == t_max else out[:, :t].contiguous()), clips.rates


def _rounded(n: int, multiple: int | None) -> int:
    return n + (multiple - n % multiple) % multiple if multiple else n


def _pad_payload(
    batch: dict[str, Any],
    name: str,
    payload: list[torch.Tensor],
    packed: bool,
    pad_value: float,
    pad_to_multiple_of: int | None,
) -> None:
    """Put decoded payloads in the batch: padded with a mask, or packed with ``cu_seqlens``."""
    lengths = torch.tensor([p.shape[0] for p in payload], dtype=torch.int64)
    batch["lengths"] = lengths
    if packed:
        batch[name] = torch.cat(list(payload))
        batch["cu_seqlens"] = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
        batch["max_seqlen"] = int(lengths.max())
    else:
        padded = pad_stack(payload, pad_value, pad_to_multiple_of)
        batch[name] = padded
        batch["padding_mask"] = padding_mask(lengths, padded.shape[1])


def collate(
    samples: Sequence[dict[str, Any]],
    decode: Decode = "auto",
    *,
    pad_to_multiple_of: int | None = None,
    pad_value: float = 0,
    sample_rate: int | None = None,
    packed: bool = False,
    per_sample: Any = None,
) -> dict[str, Any]:
    """Decode and pad one batch of samples (see the module docstring for the fields).

    ``packed=True``: no padding — the payloads concatenated (``[total, ...]``) with ``cu_seqlens`` (int32
    ``[B + 1]``, the offsets of each sample) and ``max_seqlen``, the form variable-length attention kernels
    (flash-attention's ``varlen`` functions) take. ``per_sample``: the stages run on each decoded payload before
    padding (`SampleOps`: speed perturbation, transform, features).
    """
    mode = resolve_decode(decode, samples[0])
    batch: dict[str, Any] = {"keys": [s["__key__"] for s in samples]}
    meta = [s.get("json") or {} for s in samples]
    direct = None
    if mode == "audio" and not packed and pad_value == 0 and per_sample is None:
        direct = _padded_audio(samples, sample_rate, pad_to_multiple_of)
    if direct is not None:  # decoded straight into the batch
        lengths, audio, batch["sample_rate"] = direct
        batch["lengths"], batch["audio"] = lengths, audio
        batch["padding_mask"] = padding_mask(lengths, audio.shape[1], batch_tensor(tuple(audio.shape), torch.bool))
    else:
        if mode == "audio":  # each sample's rate: the batch says it whatever the shards' .json hold
            decoded, batch["sample_rate"] = map(list, zip(*(decode_audio_sample(s, sample_rate) for s in samples)))
        else:
            decoded = [decode_sample(s, mode, sample_rate) for s in samples]
        payload = [p for p in decoded if p is not None]
        if len(payload) == len(decoded):
            name = "audio" if mode == "audio" else "input_ids" if mode == "text" else "inputs"
            if per_sample is not None:  # read/transforms.py: speed perturbation, transform, features
                payload, added, name = per_sample(samples, payload, name)
                batch.update(added)
            _pad_payload(batch, name, payload, packed, pad_value, pad_to_multiple_of)
        else:
            batch["lengths"] = torch.tensor([m.get("length", 0) for m in meta])
            if mode == "none":
                batch["samples"] = list(samples)
    if any("txt" in s or "__text__" in s for s in samples):  # a transcript member, or the index's text column
        batch["text"] = [sample_text(s, m) for s, m in zip(samples, meta)]
    fields = sorted({k for m in meta for k in m} - _RESERVED - set(batch))
    for k in fields:
        batch[k] = [m.get(k) for m in meta]
    return batch


def sample_text(sample: dict[str, Any], meta: dict[str, Any]) -> str | None:
    """A sample's text: its ``.txt``, else its ``.json`` ``text``, else the sample table's (``__text__``)."""
    if "txt" in sample:  # raw bytes, or a str where webdataset's ``.decode()`` ran first
        txt = sample["txt"]  # stripped, as every source's transcript is (a file's last newline is no word)
        return (txt.decode("utf-8") if isinstance(txt, bytes) else txt).strip()
    return meta["text"] if "text" in meta else sample.get("__text__")


def split_micro_batches(
    samples: Sequence[dict[str, Any]], k: int, by: str = "samples"
) -> tuple[list[list[dict[str, Any]]], list[float]]:
    """Deal a batch into ``min(k, n)`` micro-batches of near-equal cost, and each one's loss weight.

    Samples are dealt round robin in order of length (longest first), so every micro-batch gets samples of
    about the same lengths and count, hence about the same padded cost. The weight is the micro-batch's
    share of the batch's samples (``by="samples"``) or of its frames/tokens (``by="frames"``): summing
    ``weight × mean loss of the micro-batch`` over the micro-batches gives the mean loss of the whole batch,
    so accumulated gradients equal the whole batch's.
    """
    length = [float((s.get("json") or {}).get("length", 0)) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: (-length[i], i))
    m = max(1, min(k, len(samples)))
    idx = [order[j::m] for j in range(m)]
    groups = [[samples[i] for i in g] for g in idx]
    if by == "frames":
        total = sum(length) or 1.0
        weights = [sum(length[i] for i in g) / total for g in idx]
    else:
        weights = [len(g) / len(samples) for g in idx]
    return groups, weights


def to_packed_sequence(batch: dict[str, Any], key: str | None = None) -> torch.nn.utils.rnn.PackedSequence:
    """A padded batch as a ``torch.nn.utils.rnn.PackedSequence`` (for RNNs), using ``batch["lengths"]``."""
    if key is None:
        key = next(k for k in ("audio", "input_ids", "inputs") if k in batch)
    return torch.nn.utils.rnn.pack_padded_sequence(batch[key], batch["lengths"], batch_first=True, enforce_sorted=False)
