"""Property-based fuzzing of the index reader (issue #25, acceptance): a real version 2 index (header fields,
Parquet table bytes, table contents) and a real version 1 index, mutated; every input either loads and reads
in full, as the loader reads it, or raises one of the project's errors (a :class:`StreamBatchError`) — no other
exception, no allocation above :data:`PEAK_BOUND` (tracemalloc: Python and numpy memory), no hang (an example
running past :data:`HANG_AFTER` seconds fails).

The suite runs a few hundred cases per test (a few seconds); a longer run:
``STREAMBATCH_FUZZ_EXAMPLES=20000 pytest tests/dataset/test_fuzz_index.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import text_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streambatch.errors import StreamBatchError
from streambatch.format.index import ShardIndex
from streambatch.format.index_check import check_tables

EXAMPLES = int(os.environ.get("STREAMBATCH_FUZZ_EXAMPLES", "150"))
#: the most Python/numpy memory one read of a mutated (tiny) index may take
PEAK_BOUND = 64 << 20
#: an example running this long is a hang
HANG_AFTER = 60
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """A version 2 and a version 1 index (without their shards: the reader never opens them)."""
    root = tmp_path_factory.mktemp("fuzz-index")
    out = {}
    for version in (2, 1):
        (root / f"v{version}").mkdir()
        ds = Path(text_dataset(root / f"v{version}", 40, seed=version, max_count=7, index_version=version))
        for tar in ds.glob("*.tar"):
            tar.unlink()
        out[f"v{version}"] = ds
    return out


def read_everything(folder: Path) -> None:
    """What the loader and ``shardify`` read of an index: header, every table in full, lengths, urls, offsets,
    metadata columns, the planning numbers."""
    index = ShardIndex.load(str(folder))
    check_tables(index)
    index.shard_urls()
    _ = (index.num_samples, index.total_length, index.total_bytes, index.has_output_lengths)
    index.shard_table()
    index.shard_lengths(range(index.num_shards))
    index.lengths  # noqa: B018
    index.length_stats()
    for i in range(index.num_shards):
        index.sample_offsets(i)
        index.shard_members(i)
        for name in index.columns:
            index.shard_values(i, name)


@contextlib.contextmanager
def _watched():
    """Fail an example that hangs or allocates past the bound."""

    def hang(*_: Any) -> None:
        raise AssertionError(f"reading the index ran past {HANG_AFTER} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_AFTER)
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak <= PEAK_BOUND, f"reading the index took {peak >> 20} MiB (bound {PEAK_BOUND >> 20} MiB)"
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def loads_or_refuses(folder: Path) -> None:
    """The property: a full read succeeds or raises a StreamBatchError, within the bounds."""
    with _watched():
        try:
            read_everything(folder)
        except StreamBatchError:
            pass


def _fresh(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _header(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "index.json").read_text())


def _set_header(folder: Path, header: Any) -> None:
    (folder / "index.json").write_text(json.dumps(header))


def _paths(d: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path of keys and list positions into a JSON value."""
    out = [prefix]
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d[:5]):
            out += _paths(v, (*prefix, i))
    return out


def _replace(d: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return d


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["../x", "/etc/passwd", "index.shards.parquet", "int64", "float64", "string", "samples"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@FUZZ
@given(data=st.data(), version=st.sampled_from(["v2", "v1"]), value=JSON_VALUES, delete=st.booleans())
def test_mutated_header_fields(datasets, tmp_path, data, version, value, delete):
    folder = _fresh(datasets[version], tmp_path / "ds")
    header = _header(folder)
    path = data.draw(st.sampled_from(_paths(header)))
    _set_header(folder, _replace(header, path, value, delete))
    loads_or_refuses(folder)


def _tables(folder: Path) -> list[str]:
    header = _header(folder)
    return [header["tables"]["shards"]["path"]] + [p["path"] for p in header["tables"]["samples"]]


def _fix_size(folder: Path, rel: str) -> None:
    """The header's byte count of table ``rel`` made to match the file, so the reader gets past the size check."""
    header = _header(folder)
    size = (folder / rel).stat().st_size
    for entry in [header["tables"]["shards"], *header["tables"]["samples"]]:
        if entry["path"] == rel:
            entry["bytes"] = size
    _set_header(folder, header)


@FUZZ
@given(
    data=st.data(), action=st.sampled_from(["flip", "truncate", "garbage", "append", "replace"]), fix_size=st.booleans()
)
def test_mutated_table_bytes(datasets, tmp_path, data, action, fix_size):
    folder = _fresh(datasets["v2"], tmp_path / "ds")
    rel = data.draw(st.sampled_from(_tables(folder)))
    raw = bytearray((folder / rel).read_bytes())
    if action == "flip":
        for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
            raw[at] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif action == "garbage":
        at = data.draw(st.integers(0, len(raw) - 1))
        junk = data.draw(st.binary(min_size=1, max_size=64))
        raw[at : at + len(junk)] = junk
    elif action == "append":
        raw += data.draw(st.binary(min_size=1, max_size=64))
    else:
        raw = bytearray(data.draw(st.binary(max_size=2048)))
    (folder / rel).write_bytes(bytes(raw))
    if fix_size:
        _fix_size(folder, rel)
    loads_or_refuses(folder)


COLUMN_VALUES = st.integers(min_value=-(2**40), max_value=2**40)


@FUZZ
@given(data=st.data(), value=COLUMN_VALUES)
def test_mutated_table_values(datasets, tmp_path, data, value):
    """A valid Parquet table of the same write (its id kept) whose numbers lie: counts, firsts, parts, row groups,
    shard ids, lengths, offsets. The reader's own consistency checks must catch what the checksums cannot."""
    folder = _fresh(datasets["v2"], tmp_path / "ds")
    rel = data.draw(st.sampled_from(_tables(folder)))
    table = pq.read_table(folder / rel)
    numeric = [f.name for f in table.schema if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)]
    name = data.draw(st.sampled_from(numeric))
    column = table.column(name).to_pylist()
    rows = data.draw(st.lists(st.integers(0, len(column) - 1), min_size=1, max_size=3, unique=True))
    for r in rows:
        column[r] = value
    typ = table.schema.field(name).type
    try:
        new = pa.array(column, type=typ)
    except (OverflowError, pa.ArrowInvalid):
        return  # the value does not fit the column's type: no such file can be written
    table = table.set_column(table.schema.get_field_index(name), name, new)
    md = pq.ParquetFile(folder / rel).metadata
    pq.write_table(
        table.replace_schema_metadata(table.schema.metadata),
        folder / rel,
        row_group_size=max(1, md.row_group(0).num_rows),
        write_page_checksum=True,
    )
    _fix_size(folder, rel)
    loads_or_refuses(folder)


@FUZZ
@given(data=st.data(), value=JSON_VALUES)
def test_mutated_v1_lengths(datasets, tmp_path, data, value):
    """Version 1 keeps lengths as base64 of a dtype: both mutated, and the shard entries' numbers."""
    folder = _fresh(datasets["v1"], tmp_path / "ds")
    header = _header(folder)
    shard = data.draw(st.integers(0, len(header["shards"]) - 1))
    entry = header["shards"][shard]
    field = data.draw(st.sampled_from(["count", "bytes", "url", "dtype", "b64", "b64-bytes"]))
    if field == "dtype":
        entry["lengths"]["dtype"] = data.draw(st.sampled_from(["<u4", "<i8", "<f8", "|b1", "<U3", "O", "V8", "<m8"]))
    elif field == "b64":
        entry["lengths"]["b64"] = data.draw(st.text(max_size=40))
    elif field == "b64-bytes":
        import base64

        entry["lengths"]["b64"] = base64.b64encode(data.draw(st.binary(max_size=64))).decode()
    else:
        entry[field] = value
    _set_header(folder, header)
    loads_or_refuses(folder)


def test_the_unmutated_indexes_read(datasets):
    for folder in datasets.values():
        read_everything(folder)
