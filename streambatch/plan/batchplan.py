"""BatchPlan: the batches of one stream, held flat (positions and batch bounds), plus what was left out; their
ordering by length (``batch_order``), and the sorted oracle the benchmarks compare with."""

from __future__ import annotations

from collections import abc
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import OptionError, shown
from ..stats import stream_array
from .config import BatchingConfig
from .select import run_positions


class BatchPlan(abc.Sequence):
    """The batches of one stream, as arrays of positions in that stream, plus what was left out.

    Held flat (one position array and the batch bounds, like a CSR matrix): a slot of a million samples costs
    its positions, not a Python object per batch. ``plan[i]`` is batch ``i`` (a view); ``sizes`` are the
    batch sizes. ``skipped`` holds the positions of samples outside ``[min_length, max_length]`` or longer
    than the budget (never emitted); ``dropped`` those left in the buffers at the end under ``drop_last``.
    """

    def __init__(
        self,
        batches: Iterable[np.ndarray] = (),
        skipped: Sequence[int] = (),
        dropped: Sequence[int] = (),
        *,
        flat: np.ndarray | None = None,
        bounds: np.ndarray | None = None,
        rounds: np.ndarray | None = None,
    ):
        if flat is None:
            arrays = [np.asarray(b) for b in batches]
            sizes = np.fromiter((len(b) for b in arrays), dtype=np.int64, count=len(arrays))
            flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
            bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        elif bounds is None:
            raise OptionError("a BatchPlan given flat positions needs their batch bounds")
        self.flat, self.bounds = flat, bounds
        self.skipped = np.asarray(skipped, dtype=np.int64)
        self.dropped = np.asarray(dropped, dtype=np.int64)
        #: batches each round of the batcher emitted, in order (None: not known, as for sorted batches); batches
        #: of one round were formed from one window together (`balance`)
        self.rounds = rounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("batch index out of range")
        return self.flat[self.bounds[i] : self.bounds[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        flat, bounds = self.flat, self.bounds.tolist()
        return (flat[a:b] for a, b in zip(bounds, bounds[1:]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, abc.Sequence) or len(self) != len(other):
            return False
        return all(np.array_equal(a, b) for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.bounds)

    @property
    def num_samples(self) -> int:
        return int(self.bounds[-1])


def sort_batches(
    flat: np.ndarray, sizes: np.ndarray, lengths: np.ndarray, descending: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Batches (positions ``flat``, ``sizes``) reordered by their longest sample's length, shortest first
    (``descending``: longest first); batches with equally long longest samples keep their planned order."""
    first = np.cumsum(sizes) - sizes
    longest = np.maximum.reduceat(lengths[flat], first)
    order = np.argsort(-longest if descending else longest, kind="stable")
    return flat[run_positions(first[order], first[order] + sizes[order])], sizes[order]


def sorted_oracle(lengths: np.ndarray, budget: float, max_batch_size: int | None = None) -> list[np.ndarray]:
    """Reference: the whole dataset sorted by length and packed greedily (needs all lengths in memory)."""
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] <= budget]
    out, start = [], 0
    cap = max_batch_size or 1 << 62
    n = len(order)
    while start < n:
        m = lengths[order[start]]
        k = int(min(budget // m, cap, n - start))
        out.append(order[start : start + k])
        start += k
    return out


def plan_inputs(
    lengths: Any, budget: Any, config: Any, options: dict[str, Any], output_lengths: Any, groups: Any
) -> tuple[BatchingConfig, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """`plan_batches()`' arguments checked where they come in: the config (given, or
    made from ``budget`` and the options), ``lengths`` and ``output_lengths`` as 1-D arrays of finite numbers from
    0, ``groups`` as 1-D whole numbers, one per sample. Anything else is an `OptionError` naming the
    argument, rather than a numpy error from deep inside the batcher."""
    lens = stream_array("lengths", lengths)
    outs = None if output_lengths is None else stream_array("output_lengths", output_lengths, len(lens))
    keys = None if groups is None else stream_array("groups", groups, len(lens), whole=True)
    if config is None:
        config = BatchingConfig.make(budget, lens, **options)
    elif not isinstance(config, BatchingConfig):
        raise OptionError(f"config must be a BatchingConfig (BatchingConfig.make(...)), got {shown(config)}")
    elif budget is not None or options:
        said = ", ".join(["budget"] * (budget is not None) + sorted(options))
        raise OptionError(f"plan_batches: pass either config= or the batching options, not both (also gave {said})")
    if config.output_budget is not None and outs is None:
        raise OptionError(f"output_budget={config.output_budget:g} needs output_lengths (each sample's second length)")
    if config.batch_by is not None and keys is None:
        raise OptionError(f"batch_by={config.batch_by!r} needs groups (each sample's group key, a whole number)")
    return config, lens, outs, keys
