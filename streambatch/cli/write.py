"""``shardify write``: an audio folder, manifest, text JSONL or Hugging Face dataset as shards plus index.json
(whole, as one part of N, or resumed)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..format.columns import left_out_note
from ..format.describe import total_text, unit_text
from ..limits import DEFAULT_MAX_COLUMNS
from .args import PROG, add_engine, add_shared, add_storage, count, engine, non_negative, shared_keywords, size

HELP = "turn audio (folder, NeMo/Kaldi/lhotse/SpeechBrain manifests), text JSONL or HF data into shards"
DESCRIPTION = (
    "Write SRC as length-annotated WebDataset shards (shard-000000.tar, ...) plus index.json (written last) in "
    "OUT. Audio bytes are stored as they are, lengths read from their headers. Bad input: exit 2, nothing written "
    "(or --on-error skip). Details of every option: docs/guide/writing.md."
)
#: what SRC may be (``--kind`` names each; detected when left out), and examples: the help's epilog
EPILOG = """\
SRC is one of (--kind, detected when left out):
  folder       a folder of audio files, recursive (wav, flac, ogg, opus, mp3, ...); NAME.txt is the transcript
  manifest     NeMo-style JSON lines: audio_filepath (or path), duration, text, offset, other fields
  kaldi        a Kaldi data folder: wav.scp, text, segments, utt2spk (relative paths: --data-root)
  lhotse       lhotse cuts, recordings or supervisions (JSON lines, also .gz)
  speechbrain  a SpeechBrain .json or .csv manifest ({data_root}: --data-root)
  text         JSON lines with text and/or input_ids (--tokenizer counts tokens)
  hf           hf:NAME[:SPLIT], hf:NAME:CONFIG:SPLIT (the hub) or a Dataset.save_to_disk folder

examples:
  shardify write audio/ ds                             # a folder of audio files -> ds/
  shardify write train_manifest.json ds --workers 8    # NeMo manifest, 8 processes
  shardify write data/train ds --data-root /corpora    # Kaldi folder with relative wav.scp paths
  shardify write cuts.jsonl.gz ds --sample-rate 16000  # lhotse cuts, lengths at 16 kHz
  shardify write corpus.jsonl ds --tokenizer tokenizer.json --max-count 10k
  shardify write audio/ s3://bucket/ds --part $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT
  shardify inspect ds                                  # then: counts, hours, a budget
"""

OVERWRITE_HELP = (
    "replace a dataset already in OUT (only streambatch's own files; a local one comes back if the write fails)"
)
RESUME_HELP = "finish an interrupted write of the same command (complete shards are kept)"


def add_arguments(w: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify write`` (read back by `run()`)."""
    _add_source(w)
    _add_sharding(w)
    _add_run(w)
    _add_text(w)
    add_shared(
        w,
        "columns",
        f'.json fields stored as filter columns, comma-separated ("" none; default: scalar fields, at most '
        f"{DEFAULT_MAX_COLUMNS})",
    )
    add_shared(w, "no_progress", "no progress bars")
    add_storage(w)
    add_engine(w, "probing the records and writing the planned shards")


def _add_source(w: argparse.ArgumentParser) -> None:
    """SRC, OUT and how to read SRC: its kind, unit, sample rate and data root."""
    from ..write.sources import KINDS

    w.add_argument(
        "src",
        metavar="SRC",
        help="what to write: a folder, manifest, Kaldi folder, lhotse cuts, text JSONL or hf:NAME (below)",
    )
    w.add_argument("out", metavar="OUT", help="output folder or fsspec URL (s3://bucket/prefix, ...)")
    w.add_argument("--kind", choices=KINDS, help="what SRC is (default: detected from its files and fields)")
    add_shared(w, "unit", "length unit (default: samples for audio, tokens for text)")
    add_shared(w, "sample_rate", "count lengths at R Hz, the loader resampling to it (needed for mixed rates)")
    w.add_argument(
        "--data-root", metavar="DIR", help="folder relative audio paths are read from ({data_root} in SpeechBrain)"
    )


def _add_sharding(w: argparse.ArgumentParser) -> None:
    """How samples go into shards: count and size per shard, order."""
    w.add_argument(
        "--max-count",
        type=count,
        default=1000,
        metavar="N",
        help="at most N samples per shard: 1000 (default), 10k, ...",
    )
    w.add_argument(
        "--max-size",
        type=size,
        default="1G",
        metavar="SIZE",
        help="at most SIZE bytes per shard: 500M, 2G, ... (default 1G)",
    )
    w.add_argument("--shuffle", action="store_true", help="shuffle the sample order before sharding")
    w.add_argument("--seed", type=non_negative, default=0, help="seed of --shuffle (default 0)")


def _add_run(w: argparse.ArgumentParser) -> None:
    """How the write runs: workers, bad input, what OUT may hold (overwrite, resume, part), index version."""
    add_shared(w, "workers", "processes probing and writing (default 1; the output is the same for any N)")
    add_shared(
        w, "on_error", "bad input: fail = write nothing (default); skip = write the rest, list them in OUT/errors.jsonl"
    )
    add_shared(w, "overwrite", OVERWRITE_HELP)
    w.add_argument("--resume", action="store_true", help=RESUME_HELP)
    add_shared(w, "part", "write only part I of N (I = 0 .. N-1) into OUT; then `shardify merge OUT`")
    w.add_argument(
        "--index-version",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): JSON + Parquet tables; 1: one JSON file, for releases before the columnar index",
    )


def _add_text(w: argparse.ArgumentParser) -> None:
    """``--tokenizer`` (text lengths in a tokenizer's tokens) and ``--output-length`` (audio's second length)."""
    w.add_argument(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="text: store input_ids of this tokenizer (tokenizer.json, sentencepiece .model, hub name)",
    )
    add_shared(w, "output_length", "audio: a second length per sample, its transcript's chars or tokens:TOKENIZER")


def run(args: argparse.Namespace) -> int:
    """Write the dataset and say what was written (and skipped, kept, left to merge)."""
    from ..write.writer import write_shards

    stats: dict[str, int] = {}
    with engine(args) as chosen:
        index = write_shards(
            args.src,
            args.out,
            kind=args.kind,
            data_root=args.data_root,
            max_count=args.max_count,
            max_size=args.max_size,
            shuffle=args.shuffle,
            seed=args.seed,
            resume=args.resume,
            stats=stats,
            index_version=args.index_version,
            tokenizer=args.tokenizer,
            **shared_keywords(args),
            engine=chosen,
        )
    _report(args, index, stats)
    return 0


def _report(args: argparse.Namespace, index: Any, stats: dict[str, int]) -> None:
    """What the write did: skipped inputs (stderr), kept and written shards, the dataset or part written."""
    from ..io.storage import join_url
    from ..write.parts import Scope

    scope = Scope(args.part)
    skipped = index.meta.get("skipped", 0)
    if skipped:
        errors = join_url(args.out, scope.errors_name)
        print(f"{PROG}: skipped {skipped} bad input{'s' if skipped != 1 else ''}, listed in {errors}", file=sys.stderr)
    if index.meta.get("columns_left_out"):
        print(f"{PROG}: {left_out_note(len(index.columns), index.meta['columns_left_out'])}", file=sys.stderr)
    if args.resume and stats.get("complete"):
        how = f", merged from {index.meta['parts']} parts" if index.meta.get("parts") else ""
        what = "this dataset" if args.part is None else "part {}/{} of this dataset".format(*args.part)
        print(
            f"{args.out} already holds {what}{how}: {index.num_samples} samples in {index.num_shards} "
            f"shards ({total_text(index)}); already complete, nothing to do (--overwrite writes it again)"
        )
        return
    if args.resume:
        print(
            f"resumed: kept {stats.get('kept', 0)} complete shard{'s' if stats.get('kept', 0) != 1 else ''}, "
            f"wrote {stats.get('written', 0)}"
        )
    what = f"{index.num_samples} samples in {index.num_shards} shards to {args.out}"
    if args.part is not None:
        i, n = args.part
        print(
            f"wrote part {i}/{n}: {what}, index {scope.index_name}; when all {n} parts are written: "
            f"shardify merge {args.out}"
        )
        return
    print(f"wrote {what} ({total_text(index)}); index: {unit_text(index)}")
