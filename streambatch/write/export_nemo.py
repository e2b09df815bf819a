"""``shardify export --format nemo-tarred``: the manifests NeMo's tarred audio loaders read, pointing at a dataset's
existing tars (no audio is rewritten, no tar renamed), so a team can switch loaders without re-sharding.

What NeMo reads (``nemo/collections/asr/data/audio_to_text.py``, ``.../common/data/lhotse/nemo_adapters.py``,
``scripts/speech_recognition/convert_to_tarred_audio_dataset.py``):

* a JSON-lines manifest, one line per sample: ``audio_filepath`` (the audio member's name inside its tar),
  ``duration`` (seconds), ``text``, ``shard_id`` (the tar's position in ``tarred_audio_filepaths``), and ``offset``
  (seconds) for a segment, a stretch of a longer member: every segment of one member carries the member's name;
* ``tarred_audio_filepaths``: a brace pattern or a list of the tars, in ``shard_id`` order;
* optionally ``sharded_manifests/manifest_N.json``, the lines of shard ``N`` only (``shard_manifests: true``, and
  the lhotse loader's way to match a manifest to its tar).

``TarredAudioToTextDataset`` reads the tars with webdataset: a member's key ends at its file name's first dot, the
member whose extension is an audio format becomes the sample's audio (our ``KEY.json`` is ignored), and the key is
looked up by the manifest's ``audio_filepath`` without its extension. So keys must hold no dot and be unique over the
dataset. The lhotse loader matches members by their exact name (other members need
``skip_missing_manifest_entries: true``) and takes each tar's ``shard_id`` from its file name (``audio*_N*.tar``),
which our ``shard-NNNNNN.tar`` names do not follow: `export_nemo()` can link ``audio/audio_N.tar`` to each tar
(``links=True``, local datasets) instead of renaming anything.

Into a local folder, the export is written into a staging folder there and replaces the one in place as one set
(`publish.Swap`): an error or interrupt at any point leaves the earlier export whole, and what a killed export left
(its staging folder, temporary files, the earlier export set aside) is cleared or put back by the next one. On
object storage each manifest appears whole when its upload completes, the whole manifest last.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import ShardifyError, output_fits
from ..format.index import ShardIndex
from ..io import storage
from ..io.lock import holds_lock, is_lock_file
from ..io.tempname import is_temporary
from .export_lines import read_shard
from .ordered import ordered
from .publish import Swap

MANIFEST_NAME = "tarred_audio_manifest.json"
SHARDED_DIR = "sharded_manifests"
SHARD_MANIFEST = "manifest_{}.json"
PATHS_NAME = "tarred_audio_filepaths.json"
LINKS_DIR = "audio"
LINK_NAME = "audio_{}.tar"
#: what an export writes into its folder, the whole manifest (which says the export is complete) last
ENTRIES = (LINKS_DIR, SHARDED_DIR, PATHS_NAME, MANIFEST_NAME)
#: the staging folder (a temporary name of it) and the aside folder of a local export (`publish.Swap`)
STAGE_NAME, ASIDE_NAME = ".shardify-export", ".shardify-export-replaced"
_SHARD_MANIFEST = re.compile(r"manifest_\d+\.json")
_LINK = re.compile(r"audio_\d+\.tar")
#: the folder an older export set its links aside in while replacing them
_OLD_LINKS = re.compile(r"audio\.old-[0-9a-f]{8}")
#: what NeMo turns into ``{`` and ``}`` in a tar pattern before brace expansion
_BRACES = ("{", "}", "(", ")", "[", "]", "<", ">", "_OP_", "_CL_")
log = logging.getLogger(__name__)
#: remote shards read at once (and shard manifests written): each read mostly waits for the store
READERS = 8


@dataclass
class NemoExport:
    """What `export_nemo()` wrote: the manifest, the tars in ``shard_id`` order (and their brace pattern when
    their names allow one), the links made, the sample count and the samples left out (length 0)."""

    out: str
    manifest: str
    tar_paths: list[str]
    pattern: str | None
    samples: int = 0
    left_out: int = 0
    dotted: int = 0
    links: str | None = None
    sharded: str = field(default="")


def _target(a: Any) -> tuple[str, None, dict | None]:
    return str(a.arguments["out"]), None, a.arguments["storage_options"]


@holds_lock(_target)
def export_nemo(
    index: ShardIndex,
    out: str,
    storage_options: dict | None = None,
    empty_text: bool = False,
    links: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> NemoExport:
    """Write NeMo's tarred manifests for ``index`` into the folder or URL ``out``: ``tarred_audio_manifest.json``,
    ``sharded_manifests/manifest_N.json`` and ``tarred_audio_filepaths.json`` (the tars, in ``shard_id`` order).

    Durations come from the index (the tars are read for member names, transcripts and a segment's rate).
    ``empty_text``: a sample without a transcript gets ``"text": ""`` (default: an error naming it). ``links``:
    also make ``audio/audio_N.tar`` links to the tars (local only) for NeMo's lhotse loader. Files appear whole
    and only when every shard was read; into a local folder the export replaces the one there as one set (see
    the module docstring). ``out`` already holding an export is refused unless ``overwrite``."""
    urls = index.shard_urls()  # every shard URL checked against the trust roots before any is opened
    local = storage.is_local(out)
    if local:
        _tidy(out)
    _check_out(out, storage_options, overwrite)
    tars, where = [_absolute(u) for u in urls], _absolute(out)  # what NeMo is given works from any folder
    result = NemoExport(where, storage.join_url(where, MANIFEST_NAME), tars, brace_pattern(tars))
    result.sharded = storage.join_url(where, SHARDED_DIR, SHARD_MANIFEST.format(f"_OP_0..{max(len(urls) - 1, 0)}_CL_"))
    if links and (not local or not all(storage.is_local(u) for u in urls)):
        raise ShardifyError("--links makes symbolic links: the dataset and --out must both be local folders")
    if local:
        _export_local(index, urls, out, result, empty_text, links, progress)
    else:
        _export_remote(index, urls, out, result, storage_options, empty_text, progress)
    return result


def _swap(out: str) -> Swap:
    """How a local export replaces the one in ``out`` (`publish.Swap`)."""
    return Swap(storage.local_path(out), ENTRIES, STAGE_NAME, ASIDE_NAME)


def _export_local(
    index: ShardIndex, urls: list[str], out: str, result: NemoExport, empty_text: bool, links: bool, progress: bool
) -> None:
    """Write the export into a staging folder in ``out`` (the manifests, the links), then swap it in for the one
    there as one set; on any error or interrupt ``out`` holds what it held before and no staging folder."""
    swap = _swap(out)
    staged = swap.staging()
    writers: list[storage.AtomicWriter] = []
    try:
        try:
            _write_manifests(index, urls, _Place(staged, out), result, writers, None, empty_text, progress)
            for w in writers:
                w.publish()  # under its name in the staging folder
            if links:
                result.links = _make_links(staged, result.out, result.tar_paths)
        except BaseException:
            _abort(writers)
            raise
        swap.publish(staged)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _export_remote(
    index: ShardIndex,
    urls: list[str],
    out: str,
    result: NemoExport,
    storage_options: dict | None,
    empty_text: bool,
    progress: bool,
) -> None:
    """Write the export into the object store ``out``: each manifest appears whole when its upload completes, the
    whole manifest last; then the shard manifests of a larger earlier export are removed."""
    writers: list[storage.AtomicWriter] = []
    try:
        _write_manifests(index, urls, _Place(out, out), result, writers, storage_options, empty_text, progress)
    except BaseException:
        _abort(writers)
        raise
    for w in writers[1:] + writers[:1]:  # the whole manifest last: it says the export is complete
        w.publish()
    _remove_stale(out, len(urls), storage_options)


@dataclass(frozen=True)
class _Place:
    """Where the manifests are written (``root``: a staging folder, or ``out`` itself) and the folder messages
    name them in (``out``: where they end up)."""

    root: str
    out: str


@dataclass
class _Manifest:
    """A manifest being written: its writer, and its name in messages (where it ends up)."""

    writer: storage.AtomicWriter
    shown: str


def _write_manifests(
    index: ShardIndex,
    urls: list[str],
    place: _Place,
    result: NemoExport,
    writers: list[storage.AtomicWriter],
    storage_options: dict | None,
    empty_text: bool,
    progress: bool,
) -> None:
    """Write every manifest under a temporary name in ``place``, reading each tar (``urls``) once: finished, not
    yet published (each writer is appended to ``writers`` as it is opened, so the caller can throw them all away).
    Remote tars are read `READERS` at once, the shard manifests written beside, the lines kept in tar order
    (local ones one after another: their reading is parsing, which threads would only share)."""
    whole = _opened(place, (MANIFEST_NAME,), storage_options, writers)
    readers = 1 if all(storage.is_local(u) for u in urls) else READERS  # local tars: parsing, not waiting
    pool = cf.ThreadPoolExecutor(readers, thread_name_prefix="shardify-export")
    parts: list[cf.Future[None]] = []
    stop = threading.Event()  # set when the export ends: the reads still running end at their next sample
    read = functools.partial(read_shard, index, storage_options, empty_text, stop)
    try:
        with _bar(len(urls), progress) as bar:
            for (shard, _), done in ordered(pool, read, enumerate(urls), readers):
                result.samples += done.samples
                result.left_out += done.left_out
                result.dotted += done.dotted
                _written(whole, done.lines)
                part = _opened(place, (SHARDED_DIR, SHARD_MANIFEST.format(shard)), storage_options, writers)
                parts.append(pool.submit(_written, part, done.lines, True))
                bar.update()
        for f in parts:
            f.result()
    finally:
        stop.set()
        cf.wait(parts)  # no shard manifest is still being written when the caller throws them away
        pool.shutdown(wait=False, cancel_futures=True)
    paths = _opened(place, (PATHS_NAME,), storage_options, writers)
    _written(paths, (json.dumps(result.tar_paths, indent=1) + "\n").encode("utf-8"), finish=True)
    _written(whole, b"", finish=True)


#: what an output that does not fit says it was writing (`output_fits()`)
_WRITING = "NeMo's manifests (none of them is kept)"


def _opened(
    place: _Place, rel: tuple[str, ...], storage_options: dict | None, writers: list[storage.AtomicWriter]
) -> _Manifest:
    """A new manifest writer for ``rel`` in ``place``, its writer appended to ``writers``; no space for it names
    the manifest where it ends up."""
    shown = storage.join_url(place.out, *rel)
    with output_fits(shown, _WRITING):
        w = storage.AtomicWriter(storage.join_url(place.root, *rel), storage_options)
    writers.append(w)
    return _Manifest(w, shown)


def _written(m: _Manifest, data: bytes, finish: bool = False) -> None:
    """Append ``data`` to the manifest ``m`` (then flush and sync it with ``finish``); no space names its file."""
    with output_fits(m.shown, _WRITING):
        if data:
            m.writer.file.write(data)
        if finish:
            m.writer.finish()


def _abort(writers: list[storage.AtomicWriter]) -> None:
    """After an error: throw every manifest not yet published away."""
    for w in writers:
        w.abort()


def _absolute(url: str) -> str:
    return os.path.abspath(storage.local_path(url)) if storage.is_local(url) else url


def _bar(total: int, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="exporting", unit="shard", file=sys.stderr, disable=not progress)


def brace_pattern(urls: list[str]) -> str | None:
    """``ROOT/shard-{000000..000041}.tar`` when the tars are one name with consecutive zero-padded numbers from 0
    (as ``shardify write`` names them), so NeMo's brace expansion gives them in ``shard_id`` order; else None
    (NeMo then takes the list)."""
    if len(urls) == 1:
        return None if any(b in urls[0] for b in _BRACES) else urls[0]
    parts = [re.fullmatch(r"(.*?)(\d+)(\.tar)", u) for u in urls]
    if not urls or any(p is None for p in parts):
        return None
    prefix, first, suffix = parts[0].groups()  # type: ignore[union-attr]
    width = len(first)
    for i, p in enumerate(parts):
        assert p is not None
        if p.group(1) != prefix or p.group(3) != suffix or p.group(2) != f"{i:0{width}d}":
            return None
    if any(b in prefix + suffix for b in _BRACES):
        return None
    return f"{prefix}{{{first}..{len(urls) - 1:0{width}d}}}{suffix}"


def _check_out(out: str, storage_options: dict | None, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, that holds an export already (unless ``overwrite``), or whose export
    folders hold a file no export writes (``overwrite`` replaces those folders whole: it would be lost)."""
    if storage.is_local(out) and os.path.isfile(storage.local_path(out)):
        raise ShardifyError(f"{out}: is a file, not a folder (--out names the folder to export into)")
    if not storage.exists(out, storage_options):
        return
    if overwrite:
        foreign = _foreign(out) if storage.is_local(out) else None
        if foreign is not None:
            raise ShardifyError(
                f"{foreign}: not written by shardify export; --overwrite replaces {os.path.dirname(foreign)} as a "
                "whole: move that file away first"
            )
        return
    names = [n for n in storage.listdir(out, storage_options) if not is_lock_file(n)]
    ours = [n for n in names if n in ENTRIES]
    if ours:
        raise ShardifyError(
            f"{out}: already holds an export ({', '.join(sorted(ours))}); pass --overwrite to replace it"
        )


def _foreign(out: str) -> str | None:
    """The first file in the local ``out``'s ``sharded_manifests/`` or ``audio/`` that an export does not write
    there (a shard manifest, a link to a tar, a temporary file of one); None when there is none."""
    for sub, ours in ((SHARDED_DIR, _SHARD_MANIFEST), (LINKS_DIR, _LINK)):
        folder = os.path.join(storage.local_path(out), sub)
        if not os.path.isdir(folder) or os.path.islink(folder):
            continue
        for name in sorted(os.listdir(folder)):
            final = name.split(".tmp-", 1)[0]
            kind = os.path.islink(os.path.join(folder, name)) or sub == SHARDED_DIR
            if not (ours.fullmatch(final) and (name == final or is_temporary(name, final)) and kind):
                return os.path.join(folder, name)
    return None


def _tidy(out: str) -> None:
    """Before an export into the local folder ``out`` (holding its lock): finish what an export killed there left
    (an earlier export set aside: kept or put back, `Swap.recover()`; staging folders) and remove the
    temporary files of earlier exports."""
    folder = storage.local_path(out)
    if not os.path.isdir(folder):
        return
    swap = _swap(out)
    said = swap.recover()
    if said:
        print(f"shardify: {said}", file=sys.stderr)
    swap.clear_staging()
    for name in os.listdir(folder):
        if _OLD_LINKS.fullmatch(name) or any(is_temporary(name, entry) for entry in ENTRIES):
            _remove_any(os.path.join(folder, name))
    manifests = os.path.join(folder, SHARDED_DIR)
    for name in os.listdir(manifests) if os.path.isdir(manifests) else []:
        final = name.split(".tmp-", 1)[0]
        if _SHARD_MANIFEST.fullmatch(final) and is_temporary(name, final):
            _remove_any(os.path.join(manifests, name))


def _remove_any(path: str) -> None:
    """Remove a file, link or folder (a folder of links: the links, not what they point to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _make_links(staged: str, out: str, urls: list[str]) -> str:
    """``audio/audio_N.tar`` -> tar ``N`` (symbolic links) in the staging folder ``staged``: the names NeMo's
    lhotse loader takes shard ids from. No space for them names ``out/audio`` (the staging folder goes, with
    every manifest). Returns their pattern in ``out``."""
    final = os.path.join(storage.local_path(out), LINKS_DIR)
    folder = os.path.join(staged, LINKS_DIR)
    with output_fits(final, "the links to the tars (no manifest and no link is kept)"):
        os.makedirs(folder)
        for i, u in enumerate(urls):
            os.symlink(os.path.abspath(storage.local_path(u)), os.path.join(folder, LINK_NAME.format(i)))
    return os.path.join(final, LINK_NAME.format(f"_OP_0..{len(urls) - 1}_CL_"))


def _remove_stale(out: str, n: int, storage_options: dict | None) -> None:
    """Drop the ``manifest_N.json`` files of a larger earlier export from the object store ``out`` (a local
    export replaces the whole folder instead)."""
    folder = storage.join_url(out, SHARDED_DIR)
    for name in storage.listdir(folder, storage_options):
        m = re.fullmatch(r"manifest_(\d+)\.json", name.rsplit("/", 1)[-1])
        if m is not None and int(m.group(1)) >= n:
            storage.remove(storage.join_url(folder, m.group(0)), storage_options)
