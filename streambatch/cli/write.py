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

SOURCE_HELP = (
    "Hugging Face datasets: hf:NAME[:SPLIT] or hf:NAME:CONFIG:SPLIT (from the hub, needs a network), or "
    "a folder written by Dataset.save_to_disk (hf:DIR:SPLIT picks a split of a DatasetDict; default "
    "train, or the only one)"
)

HELP = "turn an audio folder, manifest or text JSONL into shards + index.json"
DESCRIPTION = (
    "Write SRC as length-annotated WebDataset shards (shard-000000.tar, ...) and index.json "
    "(written last) in OUT. SRC is a folder of audio files (any format libsndfile reads: wav, flac, ogg, opus, "
    "mp3, sph, aiff, au, w64, ...; recursive; NAME.txt beside an audio file is its transcript), a JSONL "
    "manifest (NeMo style: audio_filepath or path, duration, text, ...), a SpeechBrain JSON or CSV manifest, a "
    "text JSONL (text and/or input_ids), or a Hugging Face dataset (hf:NAME[:SPLIT] or a save_to_disk folder). "
    "Audio lengths are read from file headers (an MP3 is decoded to count its frames); the original audio "
    'bytes are stored as they are. Each sample is KEY.json ({"length": N, "sample_rate", "duration", "text", '
    "other fields}) then KEY.<ext> (audio) or KEY.txt / KEY.input_ids.npy (text). Exit 2 on bad input (nothing "
    "written). An output that does not fit (disk or quota full) is exit 2 naming the file; the whole shards "
    "written before it stay, listed by no index: make room and run the same command with --resume to finish. "
    "An s3:// OUT that stops answering fails the write in a few minutes, naming the object (each request waits "
    "10 s to connect, 60 s for data, and is tried 3 times; --storage-option config_kwargs.read_timeout=S, "
    "config_kwargs.connect_timeout=S set other waits); Ctrl-C's cleanup waits 5 s per call, then says what it left."
)

OVERWRITE_HELP = (
    "replace a dataset already in OUT (replaces only shard-*.tar, index.json, errors.jsonl, index.part-*.json, "
    "errors.part-*.jsonl, their index.*.shards.parquet and index.*.samples/ tables, and *.tmp* files; with "
    "--part: only that part's files, the merged index and parts numbered N or more). In a local OUT those files "
    "are first moved (renamed) into OUT/.shardify-replaced and removed once the new dataset is complete; a write "
    "that fails or is interrupted puts them back (the disk holds both meanwhile). After a kill -9 the next write "
    "into OUT puts them back (another --overwrite keeps them aside and writes again). With --part only the "
    "part's own files are kept aside (the merged index is removed). On object storage (s3://, ...) the old "
    "files are removed first: a write that fails there leaves neither dataset"
)
RESUME_HELP = (
    "finish an interrupted write of the same command: shards already in OUT whose bytes "
    "are exactly what this run would write (size, then byte for byte) are kept, the others "
    "written, then the index. A complete dataset in OUT is compared with this command by what its "
    "index records (source, --max-count, --max-size, --shuffle, --seed, unit, sample rate, tokenizers; with "
    "--part, the part's index and I/N): this command's is left as it is (nothing to do; a changed source is not "
    "noticed: --overwrite writes it again), another's is refused (exit 2; --overwrite replaces it). An empty OUT "
    "is written in full"
)


def add_arguments(w: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify write`` (read back by `run()`)."""
    _add_source(w)
    _add_sharding(w)
    _add_run(w)
    _add_text(w)
    add_shared(
        w,
        "columns",
        "comma-separated .json fields stored as columns of the sample table, for filters "
        '(where=, inspect --where); "" for none. Default: every field whose values are scalars '
        "(numbers, booleans or strings: speaker, language, duration, scores, ...) but the transcript, the first "
        f"{DEFAULT_MAX_COLUMNS} of them (name more to store them)",
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
        help="audio folder, .jsonl/.json manifest, SpeechBrain .json/.csv, text .jsonl, or " + SOURCE_HELP,
    )
    w.add_argument("out", metavar="OUT", help="output folder or fsspec URL (s3://bucket/prefix, ...)")
    w.add_argument(
        "--kind",
        choices=KINDS,
        help="what SRC is (default: detected: a folder holding wav.scp = kaldi, another folder = folder; .csv or "
        "a JSON object of objects = speechbrain; JSON lines (also .gz) with lhotse's cut, recording or supervision "
        "fields = lhotse, with an audio path field = manifest, else text; hf:... or a save_to_disk folder = hf)",
    )
    add_shared(
        w,
        "unit",
        "length unit of the dataset (default: samples for audio, tokens for text). tokens are "
        "--tokenizer's tokens; without one, whitespace tokens of text, unless a record has input_ids or "
        "a precomputed length",
    )
    add_shared(
        w,
        "sample_rate",
        "count audio lengths in samples at R Hz (round(frames*R/rate)) and record R in the "
        "index; needed when files have different sample rates. The loader resamples to R: each .json's sample_rate is "
        "R, and original_sample_rate the file's rate where it differs",
    )
    w.add_argument("--data-root", metavar="DIR", help="fills {data_root} / $data_root in SpeechBrain paths")


def _add_sharding(w: argparse.ArgumentParser) -> None:
    """How samples go into shards: count and size per shard, order."""
    w.add_argument(
        "--max-count", type=count, default=1000, metavar="N", help="at most N samples per shard: 1000 (default), 10k, ..."
    )
    w.add_argument(
        "--max-size",
        type=size,
        default="1G",
        metavar="SIZE",
        help="at most SIZE bytes per shard: a number of bytes or 500M, 2G, ... (powers of 1024; "
        "default 1G). A single bigger sample gets a shard of its own",
    )
    w.add_argument("--shuffle", action="store_true", help="shuffle the sample order before sharding")
    w.add_argument("--seed", type=non_negative, default=0, help="seed of --shuffle (default 0)")


def _add_run(w: argparse.ArgumentParser) -> None:
    """How the write runs: workers, bad input, what OUT may hold (overwrite, resume, part), index version."""
    add_shared(
        w, "workers", "processes probing headers and writing shards (default 1); the output is identical for any N"
    )
    add_shared(
        w,
        "on_error",
        "bad input (missing/unreadable audio, bad lines, duplicate keys): fail = write "
        "nothing and exit 2 (default); skip = write the rest and list them in OUT/errors.jsonl",
    )
    add_shared(w, "overwrite", OVERWRITE_HELP)
    w.add_argument("--resume", action="store_true", help=RESUME_HELP)
    add_shared(
        w,
        "part",
        "write only part I of N (I = 0 .. N-1, e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT): "
        "the I-th contiguous slice of the (shuffled) record list, as shard-pIIII-JJJJJJ.tar and "
        "index.part-IIII.json; all parts share OUT. Then `shardify merge OUT` writes index.json: the "
        "same samples in the same order as one `shardify write` (shard boundaries differ)",
    )
    w.add_argument(
        "--index-version",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): index.json plus Parquet tables (the shard table; each sample's key, "
        "length and byte range in its tar), read per rank; 1: one JSON file with every length, for "
        "streambatch releases before the columnar index",
    )


def _add_text(w: argparse.ArgumentParser) -> None:
    """``--tokenizer`` (text lengths in a tokenizer's tokens) and ``--output-length`` (audio's second length)."""
    w.add_argument(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="text sources: store each text's input_ids from this tokenizer and count lengths in its "
        "tokens (the true count of the stored ids). A Hugging Face tokenizers file (tokenizer.json, or "
        "a folder holding one), a sentencepiece .model file, or a hub name (needs a network). Its "
        "name and sha256 go into the index's meta. Needs pip install 'streambatch[text]'",
    )
    add_shared(
        w,
        "output_length",
        "audio sources: give each sample a second length, its transcript's characters (chars) "
        "or tokens of a tokenizer (tokens:NAME_OR_PATH, as --tokenizer); stored as output_length in "
        "each .json and in the index's sample table. A sample without a transcript is bad input",
    )


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
