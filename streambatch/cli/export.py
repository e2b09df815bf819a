"""``shardify export``: a dataset's manifests for another loader, pointing at its existing tars
(`streambatch.write.export_nemo`: NeMo's tarred audio manifests)."""

from __future__ import annotations

import argparse

from .args import add_shared, add_storage, load_index, storage_options

FORMATS = ("nemo-tarred",)
HELP = "write another loader's manifests for a dataset's existing tars (NeMo tarred audio)"
DESCRIPTION = (
    "Write the manifests NeMo's tarred audio loaders (TarredAudioToTextDataset, and its lhotse-based loading) read "
    "for the dataset OUT, pointing at its existing tars: no audio is rewritten and no tar renamed. Into --out DIR: "
    "tarred_audio_manifest.json (one line per sample: audio_filepath, the member's name in its tar; duration in "
    "seconds, from the index; text, from the index's text column or the member's .json; shard_id, the tar's "
    "position in tarred_audio_filepaths; offset for a segment of a longer member), sharded_manifests/"
    "manifest_N.json (shard N's lines) and tarred_audio_filepaths.json (the tars in shard_id order). Each tar is "
    "read once (member names, transcripts). Files appear whole, only once every shard was read; into a local DIR "
    "the export is staged there and replaces an earlier one (--overwrite) as one set: an error or interrupt leaves "
    "the earlier export whole. Exit 2 on a sample NeMo cannot load (no text without --empty-text, no or several "
    "audio members)."
)
EPILOG = "NeMo config keys to set: see the guide 'Using NeMo's loader on our shards' (docs/guide/nemo.md)."


def add_arguments(e: argparse.ArgumentParser) -> None:
    """The arguments of ``shardify export`` (read back by `run()`)."""
    add_shared(e, "out", "the dataset to export: its folder or URL (or its index.json)")
    e.add_argument("--format", choices=FORMATS, required=True, help="what to write: nemo-tarred (NeMo's manifests)")
    e.add_argument("--out", dest="dest", metavar="DIR", required=True, help="folder or URL to write the manifests into")
    e.add_argument(
        "--empty-text",
        action="store_true",
        help='write "text": "" for a sample without a transcript (default: an error naming the first one)',
    )
    e.add_argument(
        "--links",
        action="store_true",
        help="also make DIR/audio/audio_N.tar symbolic links to the tars (local only): NeMo's lhotse loader "
        "takes each tar's shard_id from such a name",
    )
    add_shared(
        e,
        "overwrite",
        "replace an export already in DIR, as one set (its sharded_manifests/ and audio/ folders whole: a file there "
        "no export writes is refused)",
    )
    add_shared(e, "no_progress")
    add_shared(e, "shard_root")
    add_storage(e)


def run(args: argparse.Namespace) -> int:
    """Export the dataset and print the NeMo config keys that read it."""
    from ..write.export_nemo import export_nemo

    index = load_index(args)
    done = export_nemo(
        index,
        args.dest,
        storage_options(args),
        empty_text=args.empty_text,
        links=args.links,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    left = f" ({done.left_out} samples left out of the index's epochs not listed)" if done.left_out else ""
    print(f"exported {done.samples} samples of {len(done.tar_paths)} tars to {done.manifest}{left}")
    tars = done.pattern or f"the list in {args.dest}/tarred_audio_filepaths.json"
    print("NeMo (TarredAudioToTextDataset):")
    print(f"  is_tarred: true\n  manifest_filepath: {done.manifest}\n  tarred_audio_filepaths: {tars}")
    print(f"  shard_manifests: true -> manifest_filepath: {done.sharded}")
    if done.links is not None:
        print("NeMo with lhotse (use_lhotse: true):")
        print(f"  manifest_filepath: {done.sharded}\n  tarred_audio_filepaths: {done.links}")
        print("  skip_missing_manifest_entries: true")
    if done.dotted:
        print(
            f"warning: {done.dotted} keys hold a dot: TarredAudioToTextDataset (webdataset) cuts member names at "
            "the first dot and will not find them; the lhotse loader matches whole names"
        )
    return 0
