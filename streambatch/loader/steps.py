"""What `StreamBatchLoader.step_samples()` answers (which samples were in step k) and what a checkpoint records of
the steps a resume skips after a loss spike.

The plan knows every step before a byte is read: ``loader.step_samples()`` names the samples of any step of an epoch,
past or future, on every rank (their keys from the index's sample table, their datasets in a mixture), and a resume
can skip a range of steps (``loader.load_state_dict(state, skip_steps=range(a, b))``): every rank skips the same
steps, their samples are not read, and every other step comes as it would have. Step numbers count from the
epoch's start, as ``len()`` and ``consumed`` do (a skipped step still counts: ``consumed`` jumps over it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..format.members import shard_keys
from ..plan.skips import SkippedSteps
from ..select.mixture import AnyIndex, MixedIndex


@dataclass(frozen=True)
class StepSample:
    """One sample of a planned batch: its key (None where the index stores no keys: a version 1 index), its
    dataset's name in a mixture (else None), and where it lies: its shard's number in its dataset's index and
    its place in that shard (tar order)."""

    key: str | None
    dataset: str | None
    shard: int
    sample: int


@dataclass(frozen=True)
class StepBatch:
    """One rank's batch at one step: its samples in the order the batch holds them, and whether it repeats the
    batch before it (``even_batches="pad"``)."""

    rank: int
    samples: tuple[StepSample, ...]
    repeat: bool = False

    @property
    def keys(self) -> list[str | None]:
        """The samples' keys, as ``batch["keys"]`` lists them."""
        return [s.key for s in self.samples]

    def line(self) -> str:
        """One line: the rank, its sample count and each sample (``dataset/key`` in a mixture)."""
        names = [f"{s.dataset}/{s.key}" if s.dataset else str(s.key) for s in self.samples]
        return f"rank {self.rank}: {len(names)} samples{' (a repeat)' if self.repeat else ''}: " + " ".join(names)


@dataclass(frozen=True)
class StepSamples:
    """The samples of step ``step`` of epoch ``epoch``: each rank's batch (``batches[rank]``)."""

    epoch: int
    step: int
    batches: dict[int, StepBatch]

    def keys(self) -> dict[int, list[str | None]]:
        """Each rank's keys."""
        return {r: b.keys for r, b in self.batches.items()}

    def lines(self) -> list[str]:
        """One line per rank (what ``shardify inspect --step`` prints)."""
        return [b.line() for _, b in sorted(self.batches.items())]


def samples_of(index: AnyIndex, offsets: np.ndarray, gids: np.ndarray) -> Iterator[StepSample]:
    """Each global id as its key, dataset, shard and place in the shard (keys read once per shard)."""
    shards = np.searchsorted(offsets, gids, side="right") - 1
    keys: dict[int, list[str] | None] = {}
    for v, gid in zip(shards.tolist(), gids.tolist()):
        ix, s, name = index, v, None
        if isinstance(index, MixedIndex):
            d, s = index.real_shard(v)
            ix, name = index.indexes[d], index.names[d]
        if v not in keys:
            keys[v] = shard_keys(ix, s)
        pos = gid - int(offsets[v])
        got = keys[v]
        yield StepSample(got[pos] if got is not None else None, name, s, pos)


# ---- skipping steps on resume ----------------------------------------------------------------------
def skip_state(skips: SkippedSteps | None, epoch: int) -> list[list[int]]:
    """What a checkpoint of ``epoch`` records of the skipped steps (``LoaderState.skip_steps``)."""
    return skips.state() if skips is not None and skips.epoch == epoch else []
