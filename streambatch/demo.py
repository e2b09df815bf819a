"""``shardify demo OUT``: a synthetic speech dataset, shardified and streamed three ways, side by side.

1. ``OUT/audio``: synthetic FLAC utterances with long-tailed lengths (`synthetic.write_audio_corpus()`);
2. ``OUT/shards``: length-annotated shards plus ``index.json`` (`writer.write_shards()`);
3. one epoch each of (a) fixed-size random batches, (b) fixed-size batches of the globally sorted data
   (batches shuffled) and (c) `StreamBatchLoader` with a budget of 60 s of audio per batch.

All three stream the same shards with the same tar reader (`reader.read_shard()`), decode and pad
with the same `collate.collate()`, in one DataLoader worker, so samples/s compares batching, not I/O
code. Padding and cost figures are measured on the tensors each method actually yields.

If ``OUT/shards/index.json`` already exists the data is reused (only read), so a second run takes seconds. The
demo writes only into a folder that is missing or empty, and marks it (`DEMO_MARK`): it rewrites the data
only there, never in a folder of the user's own (refused in one line).
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import IterableDataset

from .errors import ShardifyError

if TYPE_CHECKING:
    from .format.index import ShardIndex


BUDGET_SECONDS = 60
#: the file marking a folder the demo made: the only non-empty folder it writes into
DEMO_MARK = ".shardify-demo"
SHARD_COUNT = 100  # utterances per shard: ~24 shards for the default 2,400
NUM_WORKERS = 1


@dataclass
class Result:
    """What one method yielded over one epoch."""

    name: str
    batches: int = 0
    samples: int = 0
    real: int = 0  # audio samples that are data
    padded: int = 0  # audio samples in the padded tensors
    over_budget: int = 0  # batches with n × max_len > budget
    max_cost: int = 0  # largest n × max_len of a batch
    seconds: float = 0.0

    @property
    def padding(self) -> float:
        return 1.0 - self.real / self.padded if self.padded else 0.0

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def add(self, batch: dict[str, Any], budget: float) -> None:
        audio = batch["audio"]
        n, t = int(audio.shape[0]), int(audio.shape[1])
        self.batches += 1
        self.samples += n
        self.real += int(batch["lengths"].sum())
        self.padded += n * t
        self.max_cost = max(self.max_cost, n * t)
        self.over_budget += int(n * t > budget)


# ---- fixed-size baselines, executed by plain tar streaming -------------------------------------------
def fixed_random_batches(n: int, batch_size: int, seed: int) -> list[np.ndarray]:
    """(a) A random permutation of all samples cut into batches of ``batch_size``."""
    perm = np.random.default_rng([seed, 1]).permutation(n)
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


def fixed_sorted_batches(lengths: np.ndarray, batch_size: int, seed: int) -> list[np.ndarray]:
    """(b) All samples sorted by length, cut into batches of ``batch_size``, the batches shuffled."""
    order = np.argsort(lengths, kind="stable")
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i] for i in np.random.default_rng([seed, 2]).permutation(len(batches))]


def batch_mates_kept(first: Sequence[np.ndarray], second: Sequence[np.ndarray], n: int) -> float:
    """Share of the sample pairs batched together in one epoch that are batched together again in the next:
    what fixed sorted batches give up for their low padding (the same batches every epoch, only reordered)."""
    label = np.full(n, -1, dtype=np.int64)
    for i, b in enumerate(second):
        label[b] = i
    together = again = 0
    for b in first:
        together += len(b) * (len(b) - 1) // 2
        _, c = np.unique(label[b], return_counts=True)
        again += int((c * (c - 1) // 2).sum())
    return again / together if together else 0.0


def streambatch_batches(shards: str, budget: float, seed: int, epoch: int) -> list[np.ndarray]:
    """The samples (ids in index order) of each batch streambatch plans for ``epoch`` on this demo's layout."""
    from .loader import StreamBatchLoader
    from .plan.epoch import make_epoch_plan
    from .plan.layout import Layout
    from .plan.lengths import index_lengths

    loader = StreamBatchLoader(shards, budget=budget, num_workers=NUM_WORKERS, seed=seed)
    assert loader.index is not None  # the demo's dataset has one
    plan = make_epoch_plan(index_lengths(loader.index), loader.config, epoch, Layout(1, NUM_WORKERS))
    return [s.gids[b] for s in plan.slots for b in s.batches]


class InOrderBatches(IterableDataset):
    """Stream every shard once, in order, with the plain tar reader; hold each sample's raw bytes until
    the last sample of its batch has been read, then decode and pad the batch with ``collate``.

    An iterable dataset for a torch DataLoader: worker ``w`` of ``W`` executes batches ``w, w + W, ...``.
    """

    def __init__(
        self, urls: Sequence[str], counts: Sequence[int], batches: Sequence[np.ndarray], sample_rate: int | None
    ):
        self.urls, self.counts, self.batches, self.sample_rate = list(urls), list(counts), list(batches), sample_rate

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from torch.utils.data import get_worker_info

        from .read.collate import collate
        from .read.reader import read_shard

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        batch_of = np.full(int(offsets[-1]), -1, dtype=np.int64)
        mine = range(worker, len(self.batches), workers)
        for b in mine:
            batch_of[self.batches[b]] = b
        missing = {b: len(self.batches[b]) for b in mine}
        held: dict[int, dict[str, Any]] = {}
        for s, url in enumerate(self.urls):
            for sample in read_shard(url, s):
                gid = int(offsets[s]) + sample["__index__"]
                b = int(batch_of[gid])
                if b < 0:
                    continue
                held[gid] = sample
                missing[b] -= 1
                if missing[b] == 0:
                    yield collate([held.pop(int(i)) for i in self.batches[b]], "audio", sample_rate=self.sample_rate)


def _identity(x: Any) -> Any:
    return x


def _run(name: str, batches_iter, budget: float) -> Result:
    res = Result(name)
    t0 = time.perf_counter()
    for batch in batches_iter:
        res.add(batch, budget)
    res.seconds = time.perf_counter() - t0
    return res


def run_fixed(name: str, index, batches: Sequence[np.ndarray], budget: float, num_workers: int = NUM_WORKERS) -> Result:
    from torch.utils.data import DataLoader

    ds = InOrderBatches(index.shard_urls(), [s.count for s in index.shards], batches, index.sample_rate)
    dl = DataLoader(ds, batch_size=None, num_workers=num_workers, collate_fn=_identity)
    return _run(name, dl, budget)


def run_streambatch(
    name: str, shards: str, budget: float, seed: int, num_workers: int = NUM_WORKERS
) -> tuple[Result, Any]:
    from .loader import StreamBatchLoader

    loader = StreamBatchLoader(shards, budget=budget, num_workers=num_workers, seed=seed)
    planned = len(loader)
    return _run(name, loader, budget), planned


# ---- data -----------------------------------------------------------------------------------------
def prepare_data(out: str, num_utterances: int, seed: int) -> tuple[Any, bool]:
    """(index, reused): the dataset in ``OUT/shards`` when its ``index.json`` is there (reused: only read), else
    ``OUT/audio`` and ``OUT/shards`` written — into a folder the demo may write (`claim_folder()`)."""
    from .format.index import INDEX_NAME, ShardIndex

    audio, shards = os.path.join(out, "audio"), os.path.join(out, "shards")
    if os.path.exists(os.path.join(shards, INDEX_NAME)):
        return ShardIndex.load(shards), True
    claim_folder(out)
    from .synthetic import write_audio_corpus
    from .write.writer import write_shards

    # a run interrupted before the index was written: start its audio over (only our own file names)
    for path in glob.glob(os.path.join(audio, "utt-*.flac")) + glob.glob(os.path.join(audio, "utt-*.txt")):
        os.remove(path)
    t0 = time.perf_counter()
    say(f"writing {num_utterances:,} synthetic utterances to {audio} ...")
    write_audio_corpus(audio, num_utterances, seed)
    say(f"writing them as shards to {shards} ({time.perf_counter() - t0:.1f} s so far) ...")
    # the bars `shardify write` shows, on a terminal only (never \r redraws in a log)
    index = write_shards(audio, shards, max_count=SHARD_COUNT, overwrite=True, progress=sys.stderr.isatty())
    return index, False


def say(line: str) -> None:
    """Print one line of the demo's progress at once (stdout is block-buffered into a pipe or a log)."""
    print(line, flush=True)


def claim_folder(out: str) -> None:
    """Make ``out`` the demo's folder: one it made (holding `DEMO_MARK`) is kept, a missing or empty one is
    made and marked; anything else (a file, a folder of the user's own) is a `ShardifyError` naming it,
    before a file is touched: the demo rewrites ``OUT/audio/utt-*`` and ``OUT/shards``."""
    mark = os.path.join(out, DEMO_MARK)
    if os.path.isfile(mark):
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise ShardifyError(f"{out}: a file, not a folder; give the demo a new or empty folder")
    if os.path.isdir(out) and os.listdir(out):
        raise ShardifyError(
            f"{out}: not empty, and not a folder shardify demo made (no {DEMO_MARK} in it): nothing was written; give "
            "the demo a new or empty folder"
        )
    os.makedirs(out, exist_ok=True)
    with open(mark, "w") as f:
        f.write("made by `shardify demo`, which writes and rewrites audio/ and shards/ here\n")


# ---- the command ----------------------------------------------------------------------------------
def _table(rows: list[list[str]], align: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def run_demo(out: str, num_utterances: int = 2400, seed: int = 0) -> int:
    """Write (or reuse) the demo dataset under ``out``, stream it three ways and print the comparison."""
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    out = str(out)
    index, reused = prepare_data(out, num_utterances, seed)
    shards = os.path.join(out, "shards")
    sr = index.sample_rate or 16000
    budget = BUDGET_SECONDS * sr
    _describe(index, out, shards, reused, num_utterances, time.perf_counter() - t_start)
    results, kept, batch_size, planned = _compare(index, shards, budget, seed)
    _report(results, kept, batch_size, budget)
    if results[-1].batches != planned:
        print(f"WARNING: streambatch yielded {results[-1].batches} batches but planned {planned}")
    print()
    print(f"data: {shards} (index.json + {index.num_shards} shards); total time {time.perf_counter() - t_start:.1f} s")
    print(
        f'use it: StreamBatchLoader("{shards}", budget="{BUDGET_SECONDS}s")  '
        f"# from streambatch import StreamBatchLoader"
    )
    return 0


def _describe(index: ShardIndex, out: str, shards: str, reused: bool, asked: int, t_data: float) -> None:
    """Print what the demo dataset holds and how it will be streamed."""
    sr = index.sample_rate or 16000
    lengths = index.lengths
    n = len(lengths)
    if reused:
        again = f"delete {out} to make a new one" if os.path.isfile(os.path.join(out, DEMO_MARK)) else "only read"
        print(f"reusing the dataset in {shards} ({n:,} utterances; {again})")
        if n != asked:
            print(f"  note: it holds {n:,} utterances, not the {asked:,} asked for")
    else:
        print(
            f"wrote {n:,} synthetic utterances to {os.path.join(out, 'audio')} and "
            f"{index.num_shards} shards to {shards} in {t_data:.1f} s"
        )
    print(
        f"dataset: {n:,} FLAC utterances, {lengths.sum() / sr / 3600:.2f} h, {lengths.min() / sr:.1f}-"
        f"{lengths.max() / sr:.1f} s (median {np.median(lengths) / sr:.1f} s), {index.num_shards} shards"
    )
    budget = BUDGET_SECONDS * sr
    print(f"budget: {BUDGET_SECONDS} s of audio per batch ({budget:,} samples @ {sr} Hz) = max padded size n x max_len")
    say(f"streaming: {NUM_WORKERS} DataLoader worker, torch.set_num_threads(1), one epoch per method ...")
    print()


def _compare(index: ShardIndex, shards: str, budget: int, seed: int) -> tuple[list[Any], list[float], int, int]:
    """Stream the three ways (streambatch first, to learn its mean batch size for the fixed baselines) and
    measure how many batch-mates each keeps from one epoch to the next."""
    lengths = index.lengths
    n = len(lengths)
    sb, planned = run_streambatch("(c) streambatch", shards, budget, seed)
    batch_size = max(1, int(round(sb.samples / max(1, sb.batches))))
    fr = run_fixed(f"(a) fixed random, B={batch_size}", index, fixed_random_batches(n, batch_size, seed), budget)
    fs = run_fixed(f"(b) fixed sorted, B={batch_size}", index, fixed_sorted_batches(lengths, batch_size, seed), budget)
    sb.name = f"(c) streambatch, budget {BUDGET_SECONDS} s"
    kept = [
        batch_mates_kept(fixed_random_batches(n, batch_size, seed), fixed_random_batches(n, batch_size, seed + 1), n),
        batch_mates_kept(
            fixed_sorted_batches(lengths, batch_size, seed), fixed_sorted_batches(lengths, batch_size, seed + 1), n
        ),
        batch_mates_kept(streambatch_batches(shards, budget, seed, 0), streambatch_batches(shards, budget, seed, 1), n),
    ]
    return [fr, fs, sb], kept, batch_size, planned


def _report(results: list[Any], kept: list[float], batch_size: int, budget: int) -> None:
    """Print the comparison table and what its columns mean."""
    header = ["method", "batches", "samples/batch", "padding %", "over budget", "max cost/budget", "samples/s"]
    rows = [[*header, "same batch-mates next epoch %"]]
    for r, k in zip(results, kept):
        rows.append(
            [
                r.name,
                f"{r.batches:,}",
                f"{r.samples / max(1, r.batches):.1f}",
                f"{100 * r.padding:.1f}",
                f"{r.over_budget}/{r.batches}",
                f"{r.max_cost / budget:.2f}",
                f"{r.samples_per_second:,.0f}",
                f"{100 * k:.1f}",
            ]
        )
    for line in _table(rows, "lrrrrrrr"):
        print(line)
    print()
    sb = results[-1]
    print(
        f"B = {batch_size}: the fixed batch size with the same mean samples per batch as streambatch "
        f"({sb.samples:,} samples / {sb.batches} batches)."
    )
    print(DEMO_NOTES)


DEMO_NOTES = """\
padding % = 1 - real / padded audio samples; cost = n x max_len of a batch (what the budget bounds).
all three read the same shards with the same tar reader and decode+pad with streambatch.collate.collate;
samples/s: one epoch each, one after the other in this run (noisy on a shared machine); padding costs
throughput too: bigger padded tensors to fill and to pass from the worker process.
fixed batches of the same mean size exceed the budget whenever they catch a long utterance;
to stay under it they would need B = budget / longest utterance, i.e. many more, smaller batches.
same batch-mates next epoch % = of the sample pairs batched together in epoch 0, those together again in
epoch 1: sorted fixed batches come close on padding but repeat the very same batches every epoch (only
their order changes); streambatch sorts within a window (buffer_size samples) of a reshuffled shard
stream, so its batches change more the larger the dataset is beside the window (this demo's dataset is
about one window)."""
