"""The ``shardify`` command: write (whole, as parts, resumed), index (existing tars), merge, stage, inspect,
verify, demo.

Exit codes: 0 success; 1 ``verify`` found mismatches, or an unexpected error (one line; the traceback
with ``STREAMBATCH_DEBUG=1``); 2 a usage or input error (bad arguments, bad input records, a non-empty
output folder, no index, a path denied or of the wrong kind, missing storage credentials).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .dataset.index import IndexFormatError, ShardIndex
from .errors import InputErrors, ShardifyError
from .summary import total_text

PROG = "shardify"


# ---- argument helpers --------------------------------------------------------------------------
def _positive_int(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {s!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {s!r}")
    return n


def _size(s: str) -> int:
    from .write.writer import parse_size

    try:
        return parse_size(s)
    except ShardifyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _storage_option(s: str) -> tuple[str, Any]:
    key, sep, value = s.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key, parsed


def storage_options_from(pairs: Sequence[tuple[str, Any]] | None) -> dict | None:
    """``[("client_kwargs.endpoint_url", "http://...")]`` → ``{"client_kwargs": {"endpoint_url": ...}}``."""
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for key, value in pairs:
        d = out
        *parents, last = key.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return out


def _add_storage(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option",
        dest="storage_option",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        help="fsspec storage option for URLs (repeatable; dotted keys nest, values are JSON when they parse), "
        "e.g. --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write, inspect and verify length-annotated WebDataset shards for streambatch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (
        _add_write,
        _add_index,
        _add_merge,
        _add_stage,
        _add_inspect,
        _add_verify,
        _add_upgrade,
        _add_demo,
        _add_calibrate,
    ):
        add(sub)
    return parser


def _add_write(sub: Any) -> None:
    from .write.sources import KINDS
    from .write.text_cli import SOURCE_HELP
    from .write.text_cli import add_arguments as add_text_arguments

    w = sub.add_parser(
        "write",
        help="turn an audio folder, manifest or text JSONL into shards + index.json",
        description="Write SRC as length-annotated WebDataset shards (shard-000000.tar, ...) and index.json "
        "(written last) in OUT. SRC is a folder of audio files (wav/flac/ogg, recursive; NAME.txt beside an "
        "audio file is its transcript), a JSONL manifest (NeMo style: audio_filepath or path, duration, text, "
        "...), a SpeechBrain JSON or CSV manifest, a text JSONL (text and/or input_ids), or a Hugging Face "
        "dataset (hf:NAME[:SPLIT] or a save_to_disk folder). Audio lengths "
        "are read from file headers, never by decoding; the original audio bytes are stored as they are. Each "
        'sample is KEY.json ({"length": N, "sample_rate", "duration", "text", other fields}) then '
        "KEY.<ext> (audio) or KEY.txt / KEY.input_ids.npy (text). Exit 2 on bad input (nothing written).",
    )
    w.add_argument(
        "src",
        metavar="SRC",
        help="audio folder, .jsonl/.json manifest, SpeechBrain .json/.csv, text .jsonl, or " + SOURCE_HELP,
    )
    w.add_argument("out", metavar="OUT", help="output folder or fsspec URL (s3://bucket/prefix, ...)")
    w.add_argument(
        "--kind",
        choices=KINDS,
        help="what SRC is (default: detected: a folder; .csv or a JSON "
        "object of objects = speechbrain; JSON lines with an audio path field = manifest, else text; hf:... or a "
        "save_to_disk folder = hf)",
    )
    w.add_argument(
        "--unit",
        choices=("samples", "seconds", "tokens"),
        help="length unit of the dataset (default: samples for audio, tokens for text). tokens are "
        "--tokenizer's tokens; without one, whitespace tokens of text, unless a record has input_ids or "
        "a precomputed length",
    )
    w.add_argument(
        "--sample-rate",
        type=_positive_int,
        metavar="R",
        help="count audio lengths in samples at R Hz (round(frames*R/rate)) and record R in the "
        "index; needed when files have different sample rates (each .json keeps its file's rate)",
    )
    w.add_argument("--data-root", metavar="DIR", help="fills {data_root} / $data_root in SpeechBrain paths")
    w.add_argument(
        "--max-count", type=_positive_int, default=1000, metavar="N", help="at most N samples per shard (default 1000)"
    )
    w.add_argument(
        "--max-size",
        type=_size,
        default="1G",
        metavar="SIZE",
        help="at most SIZE bytes per shard: a number of bytes or 500M, 2G, ... (powers of 1024; "
        "default 1G). A single bigger sample gets a shard of its own",
    )
    w.add_argument("--shuffle", action="store_true", help="shuffle the sample order before sharding")
    w.add_argument("--seed", type=int, default=0, help="seed of --shuffle (default 0)")
    w.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="processes probing headers and writing shards (default 1); the output is identical for any N",
    )
    w.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="bad input (missing/unreadable audio, bad lines, duplicate keys): fail = write "
        "nothing and exit 2 (default); skip = write the rest and list them in OUT/errors.jsonl",
    )
    w.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset already in OUT (removes only shard-*.tar, index.json, "
        "errors.jsonl, index.part-*.json, errors.part-*.jsonl, their index.*.shards.parquet and "
        "index.*.samples/ tables, and *.tmp* files; with --part: "
        "only that part's files, the merged index and parts numbered N or more)",
    )
    w.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted write of the same command: shards already in OUT whose bytes "
        "are exactly what this run would write (size, then byte for byte) are kept, the others "
        "written, then the index. Safe to use on every run (an empty OUT is written in full)",
    )
    w.add_argument(
        "--part",
        metavar="I/N",
        type=_part,
        help="write only part I of N (I = 0 .. N-1, e.g. $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT): "
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
    add_text_arguments(w)
    w.add_argument(
        "--columns",
        metavar="NAMES",
        help="comma-separated .json fields stored as columns of the sample table, for filters "
        '(where=, inspect --where); "" for none. Default: every field whose values are scalars '
        "(numbers, booleans or strings: speaker, language, duration, scores, ...) but the transcript",
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_storage(w)
    w.set_defaults(func=cmd_write)


def _add_index(sub: Any) -> None:
    from .write.adopt_cli import DESCRIPTION, HELP, add_arguments

    p = sub.add_parser("index", help=HELP, description=DESCRIPTION)
    add_arguments(p, _positive_int, _part)
    _add_storage(p)
    p.set_defaults(func=cmd_index)


def _add_merge(sub: Any) -> None:
    mg = sub.add_parser(
        "merge",
        help="merge the part indexes of `write --part I/N` runs into index.json",
        description="Merge the part indexes (index.part-*.json) that `shardify write SRC OUT --part I/N` wrote "
        "into OUT/index.json (and OUT/errors.jsonl from the parts' errors.part-*.jsonl). Checks that all N parts "
        "are there once each, written from the same source with the same options, and that the shards they "
        "list exist; a missing part is an error that names it (exit 2, nothing written). The merged dataset "
        "has the same samples, order, lengths and totals as a single `shardify write` of SRC.",
    )
    mg.add_argument("out", metavar="OUT", help="the folder or URL the parts were written to")
    mg.add_argument(
        "parts",
        metavar="PART_INDEX",
        nargs="*",
        help="part index files to merge (default: every index.part-*.json in OUT)",
    )
    mg.add_argument(
        "--verify",
        action="store_true",
        help="also re-read every shard and check it against its part index (as `shardify verify`) "
        "before writing index.json",
    )
    mg.add_argument("--no-progress", action="store_true", help="no progress bar (with --verify)")
    _add_storage(mg)
    mg.set_defaults(func=cmd_merge)


def _add_stage(sub: Any) -> None:
    st = sub.add_parser(
        "stage",
        help="copy a dataset (shards + index) to node-local disk, resumably",
        description="Copy the dataset at SRC (a folder, fsspec URL or index.json) to DEST, typically node-local "
        "disk ($TMPDIR, /local/scratch/...). Each shard goes to a temporary name, is checked against the "
        "index (byte size, and sha256 computed while copying) and renamed; shards already in DEST with the "
        "index's size are kept (re-hashed with --verify); index.json is written last, so DEST has an index only "
        "once every shard it lists is complete. Nothing else in DEST is touched. Run it again to finish an "
        "interrupted copy. Train from DEST afterwards.",
    )
    st.add_argument("src", metavar="SRC", help="dataset folder or URL (s3://bucket/ds, ...) or its index.json")
    st.add_argument("dest", metavar="DEST", help="destination folder (node-local disk)")
    st.add_argument(
        "--verify",
        action="store_true",
        help="re-hash shards already in DEST against the index's sha256 (default: their size)",
    )
    st.add_argument(
        "--workers", type=_positive_int, default=4, metavar="N", help="shards copied at a time (threads; default 4)"
    )
    st.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_storage(st)
    st.set_defaults(func=cmd_stage)


def _add_inspect(sub: Any) -> None:
    i = sub.add_parser(
        "inspect",
        help="counts, hours/tokens, length percentiles, a suggested budget and bucket boundaries",
        description="Summarise a dataset from its index.json: sample and shard counts, total hours (audio) or "
        "tokens, length percentiles (in the dataset's unit and, for audio, seconds), a suggested batch "
        "budget and bucket boundaries.",
    )
    i.add_argument(
        "out",
        metavar="OUT",
        help="dataset folder or URL (or its index.json), or a mixture file (.yaml/.json naming datasets and weights)",
    )
    i.add_argument(
        "--budget",
        metavar="B",
        help="batch budget (max padded length per batch) in the dataset's unit, or seconds with "
        "an 's' suffix for audio (e.g. 60s); default: suggested from the lengths",
    )
    i.add_argument(
        "--num-buckets",
        type=_positive_int,
        metavar="K",
        help="number of buckets for the boundaries (default: chosen from the lengths)",
    )
    i.add_argument(
        "--where",
        metavar="EXPR",
        help="summarise only the samples this SQL expression over the sample table's columns keeps, "
        "e.g. \"language = 'de' AND snr > 10\" (needs duckdb: pip install 'streambatch[filters]')",
    )
    i.add_argument("--plot", metavar="FILE.png", help="save a length histogram (needs matplotlib)")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.add_argument(
        "--plan",
        action="store_true",
        help="plan epoch 0 with --budget on --world-size ranks x --num-workers workers and show its steps "
        "per rank, batch-size histogram, padding and budget use (--plot draws them)",
    )
    i.add_argument("--world-size", type=_positive_int, default=1, metavar="W", help="ranks for --plan (default 1)")
    i.add_argument(
        "--num-workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="DataLoader workers per rank for --plan (default 1)",
    )
    _add_storage(i)
    i.set_defaults(func=cmd_inspect)


def _add_verify(sub: Any) -> None:
    v = sub.add_parser(
        "verify",
        help="re-read every shard and check it against index.json",
        description="Re-read every shard and check it against index.json: it exists, byte size, sha256, "
        "sample count, keys and their order, a .json and a payload per sample, and each .json length equal "
        "to the index's. With --decode, also decode every audio member as the loader does and check its "
        "length (catches a member damaged after writing whose checksum was recomputed). Exit 0 if all match, "
        "1 with the list of mismatches otherwise (SHARD: KEY.EXT: problem for a member that does not decode).",
    )
    v.add_argument("out", metavar="OUT", help="dataset folder or URL (or its index.json)")
    v.add_argument(
        "--decode",
        action="store_true",
        help="also decode every audio member and compare its decoded length with the index's",
    )
    v.add_argument(
        "--workers",
        type=_positive_int,
        metavar="N",
        help="check N shards at a time, in processes (default: 1, or every CPU with --decode)",
    )
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_storage(v)
    v.set_defaults(func=cmd_verify)


def _add_upgrade(sub: Any) -> None:
    u = sub.add_parser(
        "upgrade",
        help="rewrite a version 1 index.json as the columnar version 2, in place",
        description="Rewrite the dataset's version 1 index.json (one JSON file with every length) as version 2: "
        "index.json holds the header and points to Parquet tables beside it (index.shards.parquet, "
        "index.samples/part-*.parquet), so a DDP rank reads only the lengths of its own shards. The tables are "
        "written first and index.json last (atomically): a killed upgrade leaves the version 1 index in place. "
        "Shards are not touched. A version 2 index is left as it is.",
    )
    u.add_argument("out", metavar="OUT", help="dataset folder or URL (or its index.json)")
    u.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_storage(u)
    u.set_defaults(func=cmd_upgrade)


def _add_demo(sub: Any) -> None:
    d = sub.add_parser(
        "demo",
        help="write a small synthetic dataset and show streambatch on it",
        description="Write a small synthetic speech dataset to OUT and run streambatch on it.",
    )
    d.add_argument("out", metavar="OUT", help="folder for the demo dataset")
    d.add_argument(
        "--num-utterances", type=_positive_int, default=2400, metavar="N", help="synthetic utterances (default 2400)"
    )
    d.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    d.set_defaults(func=cmd_demo)


def _add_calibrate(sub: Any) -> None:
    from .fit.calibrate import CLI_DESCRIPTION, CLI_EPILOG, add_arguments

    c = sub.add_parser(
        "calibrate",
        help="measure the largest batch per length your training step fits, write a cost model",
        description=CLI_DESCRIPTION,
        epilog=CLI_EPILOG,
    )
    add_arguments(c)
    c.set_defaults(func=cmd_calibrate)


# ---- commands ----------------------------------------------------------------------------------
def _part(s: str) -> tuple[int, int]:
    from .write.parts import parse_part

    try:
        return parse_part(s)
    except ShardifyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_write(args: argparse.Namespace) -> int:
    from .dataset.format import ERRORS_NAME, PART_ERRORS_NAME, PART_INDEX_NAME
    from .dataset.storage import join_url
    from .write.writer import write_shards

    stats: dict[str, int] = {}
    index = write_shards(
        args.src,
        args.out,
        kind=args.kind,
        unit=args.unit,
        sample_rate=args.sample_rate,
        data_root=args.data_root,
        max_count=args.max_count,
        max_size=args.max_size,
        shuffle=args.shuffle,
        seed=args.seed,
        workers=args.workers,
        on_error=args.on_error,
        overwrite=args.overwrite,
        resume=args.resume,
        part=args.part,
        storage_options=storage_options_from(args.storage_option),
        progress=not args.no_progress,
        stats=stats,
        index_version=args.index_version,
        tokenizer=args.tokenizer,
        output_length=args.output_length,
        columns=args.columns,
    )
    skipped = index.meta.get("skipped", 0)
    if skipped:
        errors = ERRORS_NAME if args.part is None else PART_ERRORS_NAME.format(args.part[0])
        print(
            f"{PROG}: skipped {skipped} bad input{'s' if skipped != 1 else ''}, listed in {join_url(args.out, errors)}",
            file=sys.stderr,
        )
    if args.resume:
        print(
            f"resumed: kept {stats.get('kept', 0)} complete shard{'s' if stats.get('kept', 0) != 1 else ''}, "
            f"wrote {stats.get('written', 0)}"
        )
    what = f"{index.num_samples} samples in {index.num_shards} shards to {args.out}"
    if args.part is not None:
        i, n = args.part
        print(
            f"wrote part {i}/{n}: {what}, index {PART_INDEX_NAME.format(i)}; when all {n} parts are written: "
            f"shardify merge {args.out}"
        )
        return 0
    print(
        f"wrote {what} ({total_text(index)}); index: {index.unit}"
        + (f" @ {index.sample_rate} Hz" if index.sample_rate else "")
    )
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .write.adopt_cli import run_cli

    return run_cli(args, storage_options_from(args.storage_option))


def cmd_merge(args: argparse.Namespace) -> int:
    from .write.parts import merge_parts

    index = merge_parts(
        args.out,
        args.parts or None,
        storage_options_from(args.storage_option),
        verify=args.verify,
        progress=not args.no_progress,
    )
    skipped = index.meta.get("skipped", 0)
    print(
        f"merged {index.meta['parts']} parts: {index.num_samples} samples in {index.num_shards} shards "
        f"({total_text(index)})"
        + (f", {skipped} bad inputs skipped (errors.jsonl)" if skipped else "")
        + f"; index: {index.unit}"
        + (f" @ {index.sample_rate} Hz" if index.sample_rate else "")
    )
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from .write.stage import stage_dataset

    so = storage_options_from(args.storage_option)
    res = stage_dataset(
        args.src, args.dest, verify=args.verify, workers=args.workers, storage_options=so, progress=not args.no_progress
    )
    print(
        f"staged {res.index.num_shards} shards to {res.dest}: copied {len(res.copied)} "
        f"({res.bytes_copied / 2**20:,.1f} MiB), kept {len(res.kept)} already complete"
    )
    return 0


def _load(args: argparse.Namespace) -> ShardIndex:
    try:
        return ShardIndex.load(args.out, storage_options_from(args.storage_option))
    except (FileNotFoundError, IndexFormatError) as e:
        raise ShardifyError(str(e)) from None


def cmd_inspect(args: argparse.Namespace) -> int:
    from .dataset.mixture import open_index
    from .summary import inspect_dataset

    try:
        index = open_index(args.out, storage_options_from(args.storage_option))
    except (FileNotFoundError, IndexFormatError) as e:
        raise ShardifyError(str(e)) from None
    if args.plan:
        return _inspect_plan(index, args)
    return inspect_dataset(index, args.out, args.budget, args.num_buckets, args.plot, args.json, args.where)


def _inspect_plan(index: Any, args: argparse.Namespace) -> int:
    from .plan_report import planned_epoch, plot_planned, print_planned
    from .summary import parse_budget

    if not args.budget:
        raise ShardifyError("--plan needs --budget (`shardify inspect DS` suggests one)")
    options = {"num_buckets": args.num_buckets} if args.num_buckets else {}
    p = planned_epoch(index, parse_budget(args.budget, index), args.world_size, args.num_workers, **options)
    if args.plot:
        p["plot"] = plot_planned(p, args.plot)
    print_planned(p, args.json)
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from .dataset.index import upgrade

    before = _load(args)
    if before.version >= 2:
        print(f"{args.out}: already a version {before.version} index; nothing to do")
        return 0
    url = upgrade(args.out, storage_options_from(args.storage_option), progress=not args.no_progress)
    print(f"upgraded {url} to version 2 ({before.num_shards:,} shards, {before.num_samples:,} samples)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .write.verify import verify_dataset

    index = _load(args)
    problems = verify_dataset(
        index,
        storage_options_from(args.storage_option),
        progress=not args.no_progress,
        decode=args.decode,
        workers=args.workers,
    )
    if problems:
        print(f"{len(problems)} mismatch{'es' if len(problems) != 1 else ''} between the shards and the index:")
        for p in problems:
            print(f"  {p}")
        return 1
    decoded = " (every audio member decodes to its length)" if args.decode else ""
    print(f"ok: {index.num_shards} shards, {index.num_samples} samples match {args.out}{decoded}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return int(run_demo(args.out, num_utterances=args.num_utterances, seed=args.seed))


# ---- entry point -------------------------------------------------------------------------------
#: OS errors about the paths a user gave (permissions, a file where a folder belongs, ...): exit 2, one line
INPUT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EROFS, errno.ENOENT}


def os_error_text(e: OSError) -> str:
    """``PATH: problem`` for an OS error (both paths for a rename), without the exception's class."""
    if e.filename is None:
        return str(e)
    names = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{names}: {(e.strerror or type(e).__name__).lower()}"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .fit.calibrate import run_cli

    return int(run_cli(args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    if args.func is cmd_calibrate:  # runs the user's step: its errors keep their full traceback
        return cmd_calibrate(args)
    try:
        return args.func(args)
    except InputErrors as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        print(f"{PROG}: fix them, or pass --on-error skip to write the rest", file=sys.stderr)
        return 2
    except ShardifyError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into head & co.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if isinstance(e, OSError) and e.errno in INPUT_ERRNOS and os.environ.get("STREAMBATCH_DEBUG") != "1":
            print(f"{PROG}: error: {os_error_text(e)}", file=sys.stderr)  # the user's paths, not our bug
            return 2
        if os.environ.get("STREAMBATCH_DEBUG") == "1":
            raise
        msg = (str(e).strip().splitlines() or [""])[0]
        print(
            f"{PROG}: unexpected error: {type(e).__name__}: {msg} (STREAMBATCH_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
