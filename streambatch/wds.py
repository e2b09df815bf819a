"""Budget batching as a webdataset pipeline stage: ``wds.WebDataset(urls).decode().compose(BudgetBatches(budget))``.

A stage in webdataset is a function from an iterator of samples to an iterator; `BudgetBatches` is one, over
the very `BucketBatcher` the loader runs without an index (the same window, the
same budget guarantee, the same rule for a sample that cannot fit), fed online with each sample's length: from a
function you give, else the ``length`` our shards carry in their ``.json`` member. It holds no index and reads
nothing itself, so it runs after webdataset's own shard splitting (``nodesplitter=wds.split_by_node``,
``workersplitter=wds.split_by_worker``), decoding and maps. The package does not import webdataset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .dist import process_info, worker_info
from .errors import OptionError, SampleError, callable_option, int_option
from .limits import LimitExceeded, loads
from .plan.batcher import BucketBatcher, iter_batches
from .plan.config import BatchingConfig, slot_seed
from .read.collate import collate
from .read.worker import json_length, json_output_length

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
