"""Budget batching as a webdataset pipeline stage: ``wds.WebDataset(urls).decode().compose(BudgetBatches(budget))``.

A stage in webdataset is a function from an iterator of samples to an iterator; `BudgetBatches` is one, over
the very `BucketBatcher` the loader runs without an index (the same window, the
same budget guarantee, the same rule for a sample that cannot fit), fed online with each sample's length: from a
function you give, else the ``length`` our shards carry in their ``.json`` member. It holds no index and reads
nothing itself, so it runs after webdataset's own shard splitting (``nodesplitter=wds.split_by_node``,
``workersplitter=wds.split_by_worker``), decoding and maps. The package does not import webdataset.
`collate` pads a batch of the stage, whether its audio members are still the shard's bytes or were decoded by
the pipeline itself (numpy arrays, torch tensors, webdataset's ``torch_audio`` pairs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .dist import process_info, worker_info
from .errors import OptionError, SampleError, callable_option, int_option
from .limits import LimitExceeded, loads
from .plan.batcher import BucketBatcher, iter_batches
from .plan.config import BatchingConfig, slot_seed
from .read.collate import Decode, audio_ext, decode_sample
from .read.collate import collate as collate_samples
from .read.transforms import resample
from .read.worker import json_length, json_output_length
from .units import resampled_count

__all__ = ["BudgetBatches", "annotated_length", "collate"]

Sample = dict[str, Any]
#: the largest ``.json`` member the stage parses for a length (a shard is untrusted input)
MAX_JSON_BYTES = 1 << 20


class BudgetBatches:
    """A webdataset stage that turns a stream of samples into budget-bounded batches (lists of samples).

    ``budget`` and ``options`` are `BatchingConfig.make()`'s (``buffer_size``, ``refill``, ``max_batch_size``,
    ``cost``, ``max_length``, ``strict``, ``drop_last``, ``seed``, ``output_budget`` …): every batch holds
    ``cost(n, max_len) ≤ budget`` (``n × max_len`` by default) for the lengths ``length(sample)`` gives, and a
    sample that cannot fit even alone is never emitted — counted in `skipped`, or with ``strict=True`` a
    `SampleTooLongError`. Each pass emits every other sample exactly once
    (``drop_last``: but the pass's one incomplete batch). ``length``: ``sample → number``; None reads the
    ``length`` of the sample's ``.json`` (raw bytes or decoded by ``.decode()``). ``output_length``: the same
    for the second length under ``output_budget`` (None: the ``.json``'s ``output_length``).

    The batch order is seeded by ``(seed, epoch, rank, worker, pass)``: call `set_epoch()` before each epoch
    (as with the loader) for another order; a pipeline that repeats (``.repeat()``, ``with_epoch``) counts passes.
    """

    def __init__(
        self,
        budget: float | str | None,
        *,
        length: Callable[[Sample], float] | None = None,
        output_length: Callable[[Sample], float] | None = None,
        epoch: int = 0,
        **options: Any,
    ):
        for name in ("batch_by", "num_buckets"):
            if options.get(name) is not None:
                raise OptionError(f"{name} needs an index (the loader's); the webdataset stage has none")
        if options.get("batch_order", "random") != "random":
            raise OptionError("batch_order sorts a planned epoch's batches; the webdataset stage emits them as formed")
        self.config = BatchingConfig.make(budget, **options)
        for name, fn in (("length", length), ("output_length", output_length)):
            if fn is not None:
                callable_option(name, fn, f"{name}(sample) -> number", 1)
        self.length = length if length is not None else annotated_length
        self.output_length = output_length if output_length is not None else _annotated_output
        self.epoch = int_option("epoch", epoch, 0)
        self.skipped = 0
        """Samples this process's passes left out because they can never fit (a DataLoader worker counts its own)."""
        self.dropped = 0
        """Samples dropped with an incomplete last batch (``drop_last``), in this process's passes."""
        self._passes = 0

    def set_epoch(self, epoch: int) -> None:
        """Seed the next passes' batch order with ``epoch`` (call it on the pipeline's stage before each epoch)."""
        self.epoch = int_option("epoch", epoch, 0)
        self._passes = 0

    def __call__(self, samples: Iterable[Sample]) -> Iterator[list[Sample]]:
        """One pass: the samples as budget-bounded batches, formed in a window of ``buffer_size`` samples."""
        seed = [*slot_seed(self.config.epoch_seed, self.epoch, _slot()), self._passes]
        batcher = BucketBatcher(self.config, seed=seed)
        self._passes += 1
        outputs = self.output_length if self.config.output_budget is not None else None
        yield from iter_batches(samples, batcher, self.length, outputs)
        self.skipped += len(batcher.skipped)
        self.dropped += len(batcher.dropped)


def _slot() -> int:
    """This process's (rank, DataLoader worker) slot, as the loader numbers them."""
    worker, workers = worker_info()
    return process_info().rank * workers + worker


def annotated_length(sample: Sample) -> float:
    """A sample's length from its ``.json`` member, as ``shardify write`` annotates it (raw or decoded)."""
    return json_length(_with_meta(sample))


def _annotated_output(sample: Sample) -> float:
    """A sample's output length from its ``.json`` member (``shardify write --output-length``)."""
    return json_output_length(_with_meta(sample))


def _with_meta(sample: Sample) -> Sample:
    """The sample with its ``.json`` member parsed where webdataset left it as bytes (no ``.decode()`` yet)."""
    meta = sample.get("json")
    if not isinstance(meta, (bytes, bytearray, str)):
        return sample
    where = f"{sample.get('__url__')}: sample {sample.get('__key__')!r}"
    if len(meta) > MAX_JSON_BYTES:
        raise LimitExceeded(f"{where}: its .json member is {len(meta):,} bytes, more than {MAX_JSON_BYTES:,}")
    try:
        parsed = loads(
            bytes(meta) if isinstance(meta, bytearray) else meta
        )  # the one parser for untrusted JSON: its depth is bounded
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, LimitExceeded):
            raise
        raise SampleError(f"{where}: its .json member is not JSON ({e})") from None
    return {**sample, "json": parsed}


def collate(samples: Sequence[Sample], decode: Decode = "auto", *, sample_rate: int | None = None, **options: Any):
    """Decode and pad one batch of the stage: the loader's batch (``audio`` float32 ``[B, T]``, ``lengths``,
    ``padding_mask``, ``keys``, ``text``, the ``.json`` fields; see `streambatch.read.collate`).

    An audio member (``.flac``, ``.wav``, …) may be the shard's bytes, or audio the pipeline decoded itself:
    a numpy array or torch tensor ``[T]`` (or ``[T, C]``), or a ``(tensor [C, T], rate)`` pair as webdataset's
    ``torch_audio`` decoder gives; one channel becomes ``[T]``, floats become float32. ``sample_rate``: resample
    each clip to this rate (Hz); decoded audio then needs its rate, from the pair or the ``.json``'s
    ``sample_rate``. ``options``: `collate_samples`'s (``pad_to_multiple_of``, ``pad_value``, ``packed``).
    """
    if decode in ("auto", "audio") and samples:
        ext = audio_ext(samples[0])
        if ext is not None and any(not isinstance(s.get(ext), (bytes, bytearray, memoryview)) for s in samples):
            batch = collate_samples(samples, functools.partial(_decoded_audio, sample_rate=sample_rate), **options)
            batch["audio"] = batch.pop("inputs")
            return batch
    return collate_samples(samples, decode, sample_rate=sample_rate, **options)


def _decoded_audio(sample: Sample, sample_rate: int | None) -> torch.Tensor:
    """One sample's audio ``[T]`` (or ``[T, C]``) from its audio member, decoded by the pipeline or not."""
    ext = audio_ext(sample)
    value = sample.get(ext) if ext is not None else None
    if isinstance(value, (bytes, bytearray, memoryview)) or value is None:
        out = decode_sample(sample, "audio", sample_rate)  # names the sample where it has no audio
        assert out is not None  # audio decoding gives a tensor or raises
        return out
    where = f"{sample.get('__url__')}: sample {sample.get('__key__')!r}"
    rate = None
    if isinstance(value, (tuple, list)) and len(value) == 2 and np.ndim(value[1]) == 0:
        value, rate = value  # webdataset's torch_audio: (tensor [C, T], rate), channels first
        value = value.T if np.ndim(value) == 2 else value
    wav = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if wav.ndim == 2 and wav.shape[1] == 1:
        wav = wav[:, 0]
    if wav.ndim not in (1, 2) or not (wav.is_floating_point() or wav.dtype in (torch.int16, torch.int32)):
        raise SampleError(
            f"{where}: its decoded .{ext} is {wav.dtype} {tuple(wav.shape)}; collate takes audio [T] or [T, C] "
            "(an array or tensor of numbers, or a (tensor [C, T], rate) pair)"
        )
    if wav.is_floating_point():
        wav = wav.to(torch.float32)
    if sample_rate:
        meta = sample.get("json")
        rate = rate or (meta.get("sample_rate") if isinstance(meta, dict) else None)
        if not rate:
            raise SampleError(
                f"{where}: its .{ext} was decoded without its sample rate, so it cannot be resampled to "
                f"{sample_rate} Hz: decode to a (tensor, rate) pair, or call collate without sample_rate"
            )
        if int(rate) != int(sample_rate):
            n = resampled_count(wav.shape[0], int(rate), int(sample_rate))
            wav = torch.from_numpy(resample(wav.numpy().astype(np.float32), int(rate), int(sample_rate), n))
    return wav.contiguous()
