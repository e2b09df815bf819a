"""The model tools/bench_gpu_train.py trains: a transformer CTC encoder over log-mel features, and its step.

Log-mel features (fp32, 10 ms frames), two strided convolutions (4x subsampling), sinusoidal positions, a pre-norm
``nn.TransformerEncoder`` with a key padding mask and a linear CTC head; ``FULL`` has 26.1 M parameters (d_model
512, 8 layers, 8 heads, ff 2048), ``TINY`` 0.1 M for the CPU smoke test. bf16 autocast when ``amp``. The
targets are synthetic tokens, about 12 per second of audio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from streambatch.synthetic import SAMPLE_RATE

HOP, N_FFT, N_MELS = 160, 400, 80  # 10 ms frames, 25 ms windows at 16 kHz
VOCAB = 32  # CTC blank 0 and 31 synthetic tokens
TOKENS_PER_SECOND = 12.0  # synthetic target length: about a character rate


@dataclass(frozen=True)
class ModelConfig:
    """The encoder's size."""

    d_model: int = 512
    layers: int = 8
    heads: int = 8
    ff: int = 2048


FULL = ModelConfig()
TINY = ModelConfig(d_model=64, layers=2, heads=4, ff=128)


# ---- the model ---------------------------------------------------------------------------------------
def mel_filterbank(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Triangular mel filters ``[n_mels, n_fft // 2 + 1]`` (HTK mel scale, no normalisation)."""

    def to_mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def to_hz(m):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    pts = to_hz(np.linspace(0.0, to_mel(sample_rate / 2), n_mels + 2))
    lo, mid, hi = pts[:-2, None], pts[1:-1, None], pts[2:, None]
    fb = np.maximum(0.0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)))
    return torch.tensor(fb, dtype=torch.float32)


def _conv_out(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after one Conv1d(kernel 3, stride 2, padding 1)."""
    return torch.div(lengths - 1, 2, rounding_mode="floor") + 1


class CTCEncoder(nn.Module):
    """Waveform ``[B, T]`` → CTC log-probabilities ``[T', B, VOCAB]``: log-mel, 4x conv subsampling,
    sinusoidal positions, a pre-norm transformer encoder with a key padding mask, a linear head."""

    def __init__(self, cfg: ModelConfig = FULL, amp: bool = False):
        super().__init__()
        self.cfg, self.amp = cfg, amp
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.register_buffer("mel", mel_filterbank(), persistent=False)
        d = cfg.d_model
        self.subsample = nn.Sequential(nn.Conv1d(N_MELS, d, 3, 2, 1), nn.GELU(), nn.Conv1d(d, d, 3, 2, 1), nn.GELU())
        layer = nn.TransformerEncoderLayer(
            d, cfg.heads, cfg.ff, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    @staticmethod
    def output_lengths(lengths: torch.Tensor) -> torch.Tensor:
        """Encoder frames per utterance of ``lengths`` samples (``stft`` centred, then two stride-2 convs)."""
        return _conv_out(_conv_out(torch.div(lengths, HOP, rounding_mode="floor") + 1))

    def _positions(self, n: int, device: torch.device) -> torch.Tensor:
        d = self.cfg.d_model
        pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d))
        return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)

    def forward(self, audio: torch.Tensor, out_lengths: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(audio.float(), N_FFT, HOP, window=self.window, return_complex=True)  # [B, F, frames]
        feats = torch.log(self.mel @ spec.abs().pow(2) + 1e-6)  # [B, 80, frames], fp32
        with torch.autocast(audio.device.type, dtype=torch.bfloat16, enabled=self.amp):
            x = self.subsample(feats).transpose(1, 2)  # [B, T', d]
            x = x + self._positions(x.shape[1], x.device).to(x.dtype)
            pad = torch.arange(x.shape[1], device=x.device)[None, :] >= out_lengths[:, None]
            x = self.encoder(x, src_key_padding_mask=pad)
            logits = self.head(x)
        return logits.float().log_softmax(-1).transpose(0, 1)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class Trainer:
    """A model, its optimizer and ``forward_backward(batch) -> loss`` (the loss scaled by the batch's
    ``loss_weight`` before ``backward()``, so the OOM guard's pieces add up to the whole batch's gradient)."""

    model: CTCEncoder
    opt: torch.optim.Optimizer
    forward_backward: Callable[[dict[str, Any]], float]

    def step(self, batch: dict[str, Any]) -> float:
        """Forward, backward and the optimizer step on one batch: what calibration measures."""
        loss = self.forward_backward(batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def make_trainer(cfg: ModelConfig, device: torch.device, seed: int = 0) -> Trainer:
    """A fresh model (the same weights for the same seed) and AdamW."""
    torch.manual_seed(seed)
    model = CTCEncoder(cfg, amp=device.type == "cuda").to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(seed)

    def forward_backward(batch: dict[str, Any]) -> float:
        lengths = batch["lengths"]
        out_len = CTCEncoder.output_lengths(lengths)
        tgt_len = torch.minimum((lengths / SAMPLE_RATE * TOKENS_PER_SECOND).ceil().long().clamp(min=1), out_len)
        targets = torch.randint(1, VOCAB, (int(tgt_len.sum()),), generator=gen)
        logp = model(batch["audio"].to(device, non_blocking=True), out_len.to(device))
        loss = nn.functional.ctc_loss(
            logp, targets.to(device), out_len.to(device), tgt_len.to(device), zero_infinity=True
        )
        (loss * float(batch.get("loss_weight", 1.0))).backward()
        return float(loss.detach())

    return Trainer(model, opt, forward_backward)
