"""``shardify index``: existing tar shards indexed in place (`streambatch.write.adopt`), not a byte of them
rewritten."""

from __future__ import annotations

import argparse
import sys

from ..format.audio import AUDIO_EXTENSIONS
from ..format.columns import left_out_note
from ..format.describe import total_text, unit_text
from ..format.trust import allow_line, roots_for
from ..limits import DEFAULT_MAX_COLUMNS
from ..write.adopt import LAYOUTS, index_tars
from ..write.parts import Scope
from .args import add_engine, add_shared, add_storage, engine, not_empty, shared_keywords

HELP = "index existing tar shards in place (webdataset, NeMo tarred, text), not rewriting a byte"
DESCRIPTION = (
    "Adopt the tar shards in SRC as they are: read each tar once and write a streambatch index (index.json, "
    "version 2) beside them, or in --out for read-only storage (it then points back at the tars). SRC holds "
    "plain webdataset tars (an audio member per sample, optional .txt/.json; lengths from the audio headers, "
    "or a .json length), a NeMo tarred audio dataset (audio_0.tar ... and tarred_audio_manifest.json: each "
    "entry names its member, text and duration from the manifest; offset + duration entries and NeMo's -subN "
    "names are segments of one member, each a sample of its own), a lhotse Shar folder (with --out; cut ids "
    "may contain dots), or text tars (.txt, .input_ids.npy or a .json text; lengths in tokens). Audio members: "
    f"{', '.join('.' + e for e in AUDIO_EXTENSIONS)}. No tar is modified. Exit 2 on bad input."
)


#: the help of the options ``index`` shares with ``write`` (declared once in `args.SHARED`)
UNIT_HELP = "length unit (default: samples for audio, tokens for text)"
SAMPLE_RATE_HELP = "count audio lengths in samples at R Hz; needed when the members have mixed rates"
WORKERS_HELP = "tars read at a time, in processes (default 1); the index is identical for any N"
ON_ERROR_HELP = (
    "members the loader could not use (unreadable or cut-short audio, no audio or text, a "
    ".json length the header contradicts): fail = write nothing, exit 2 (default); skip = leave "
    "those samples out of every epoch (length 0 in the index) and list them in errors.jsonl"
)
PART_HELP = (
    "index only the I-th of N slices of the tars (I = 0 .. N-1, e.g. "
    "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT) as index.part-IIII.json; then `shardify merge "
    "DIR` (DIR: --out, else SRC) writes index.json"
)
OUTPUT_LENGTH_HELP = (
    "give each audio sample a second length (output_length in the sample table, for the "
    "loader's output_budget): its transcript's characters (chars) or tokens of a tokenizer "
    "(tokens:NAME_OR_PATH, as `shardify write --tokenizer`), the transcript being the NeMo manifest's "
    "text, else the .txt or the .json text; or column:FIELD, an integer field of the manifest entry "
    "or the .json, as it is. A sample without one is bad input (--on-error)"
)
COLUMNS_HELP = (
    "comma-separated scalar fields of the NeMo manifest entries or the samples' .json stored as "
    "columns of the sample table, for filters (where=); default: every scalar field but the "
    f'transcript, the first {DEFAULT_MAX_COLUMNS} of them (name more to store them); "" for none. A NeMo '
    "dataset's transcripts are always stored (column text: the loader's batch[\"text\"])"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify index`` (read back by `run()`)."""
    _add_where(p)
    add_shared(p, "unit", UNIT_HELP)
    add_shared(p, "sample_rate", SAMPLE_RATE_HELP)
    add_shared(p, "workers", WORKERS_HELP)
    add_shared(p, "on_error", ON_ERROR_HELP)
    add_shared(p, "overwrite", "replace an index already there (never a tar)")
    add_shared(p, "part", PART_HELP)
    add_shared(p, "output_length", OUTPUT_LENGTH_HELP, metavar="chars|tokens:NAME_OR_PATH|column:FIELD")
    add_shared(p, "columns", COLUMNS_HELP)
    add_shared(p, "no_progress")
    add_storage(p)
    add_engine(p, "scanning the tars")


def _add_where(p: argparse.ArgumentParser) -> None:
    """SRC, where the index goes and what the tars hold."""
    p.add_argument("src", metavar="SRC", help="folder or fsspec URL holding the .tar shards")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write the index here instead of beside the tars (read-only "
        "storage); shard paths are relative to DIR when both are local, else full URLs",
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="what the tars hold (default auto: nemo when a tarred manifest is beside them, audio when "
        "samples have an audio member, else text)",
    )
    p.add_argument(
        "--manifest",
        type=not_empty,
        metavar="FILE",
        help="the NeMo tarred manifest (default: "
        "SRC/tarred_audio_manifest.json, else SRC/sharded_manifests/manifest_*.json)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``shardify index`` and print what it wrote (exit 0)."""
    out = args.out or args.src
    with engine(args) as chosen:
        keywords = dict(layout=args.layout, manifest=args.manifest, **shared_keywords(args), engine=chosen)
        index = index_tars(args.src, args.out, **keywords)
    adopted = index.meta["adopted"]
    if index.meta.get("skipped"):
        print(
            f"shardify: left out {index.meta['skipped']} sample(s) or tar(s) the loader could not use, listed in "
            f"{out.rstrip('/')}/{Scope(args.part).errors_name}",
            file=sys.stderr,
        )
    if index.meta.get("columns_left_out"):
        print(f"shardify: {left_out_note(len(index.columns), index.meta['columns_left_out'])}", file=sys.stderr)
    if adopted["unnamed"]:
        print(
            f"shardify: {adopted['unnamed']} member(s) the manifest does not name are left out of every epoch",
            file=sys.stderr,
        )
    what = f"{index.num_samples} samples in {index.num_shards} tars ({adopted['layout']})"
    if args.part is not None:
        i, n = args.part
        print(f"indexed part {i}/{n}: {what}; when all {n} parts are done: shardify merge {out}")
    else:
        where = f"{out.rstrip('/')}/index.json"
        print(f"indexed {what} in place ({total_text(index)}); index: {where}, {unit_text(index)}")
    outside = roots_for(index.shard_urls(), out)
    if outside:  # the index points back at tars elsewhere: loading it needs them allowed
        print(allow_line(outside, out))
    return 0
