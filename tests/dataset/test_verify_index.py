"""``verify`` checks what the loader checks (issue #25, item 6): a flipped byte in any column of any index table,
or a truncated table, fails ``shardify verify`` (and ``--decode``) with a line naming the table, and ``inspect``
refuses the index instead of summarising it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import audio_dataset

from streambatch.cli import main
from streambatch.format.index import ShardIndex


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify-index")
    return Path(audio_dataset(root, 12, corpus_seed=3, max_count=4))


def _tables(ds: Path) -> list[str]:
    """Every table file the index names, relative to its folder."""
    return [rel for rel, _ in ShardIndex.load(str(ds)).shards.reader.table_files()]


def _column_chunks(path: Path) -> list[tuple[str, int, int]]:
    """(column, first byte, bytes) of every column chunk of every row group of a Parquet file."""
    md = pq.ParquetFile(path).metadata
    out = []
    for rg in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(rg).column(c)
            start = col.dictionary_page_offset or col.data_page_offset
            out.append((col.path_in_schema, start, col.total_compressed_size))
    return out


def _damaged_copy(ds: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ds, copy)
    return copy


def _run(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_undamaged_dataset_verifies(dataset, capsys):
    code, text = _run(capsys, "verify", str(dataset), "--no-progress")
    assert code == 0, text


def test_a_flipped_byte_in_any_table_fails_verify(dataset, tmp_path, capsys):
    """One byte flipped in the data pages of each column chunk of each table, one at a time."""
    tried = 0
    for rel in _tables(dataset):
        for column, start, size in _column_chunks(dataset / rel):
            copy = _damaged_copy(dataset, tmp_path)
            data = bytearray((copy / rel).read_bytes())
            data[start + size - 1] ^= 0xFF  # the last byte of the chunk's last page: page data, under its checksum
            (copy / rel).write_bytes(bytes(data))
            for extra in ([], ["--decode"]):
                code, text = _run(capsys, "verify", str(copy), "--no-progress", *extra)
                assert code != 0, f"{rel} column {column}: verify said\n{text}"
                assert str(copy / rel) in text, text
            code, text = _run(capsys, "inspect", str(copy))
            assert code == 2 and str(copy / rel) in text, f"{rel} column {column}: inspect said\n{text}"
            tried += 1
    assert tried >= 10  # the shard table's and the sample table's columns


def test_a_truncated_table_is_named(dataset, tmp_path, capsys):
    for rel in _tables(dataset):
        copy = _damaged_copy(dataset, tmp_path)
        data = (copy / rel).read_bytes()
        (copy / rel).write_bytes(data[: len(data) // 2])
        code, text = _run(capsys, "verify", str(copy), "--no-progress")
        assert code != 0
        assert str(copy / rel) in text and "truncated" in text, text
        assert "unreadable tar" not in text


def test_a_table_with_another_writes_rows_is_named(dataset, tmp_path, capsys):
    """A sample table replaced by one of the same size from another write: the write id differs."""
    other = audio_dataset(tmp_path / "other", 12, corpus_seed=4, max_count=4)
    copy = _damaged_copy(dataset, tmp_path)
    rel = _tables(dataset)[1]
    shutil.copyfile(Path(other) / rel, copy / rel)
    code, text = _run(capsys, "verify", str(copy), "--no-progress")
    assert code != 0 and str(copy / rel) in text, text
