"""One Parquet table file read by row group and column, and numeric Arrow columns as numpy without pandas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa


def column_numpy(col: Any) -> np.ndarray:
    """A numeric Arrow column (chunked or not) as numpy, read from its buffers where it has no nulls. Arrow's own
    ``to_numpy`` imports pandas when pandas is installed: pandas' import time and memory in every reading process."""
    import pyarrow.types as pt

    chunks = col.chunks if hasattr(col, "chunks") else [col]
    parts = []
    for ch in chunks:
        if ch.null_count or not (pt.is_integer(ch.type) or pt.is_floating(ch.type)):
            return col.to_numpy()
        dt = np.dtype(ch.type.to_pandas_dtype())
        parts.append(np.frombuffer(ch.buffers()[1], dtype=dt, count=len(ch), offset=ch.offset * dt.itemsize))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.dtype(col.type.to_pandas_dtype()))


class ParquetTable:
    """One Parquet table file open for reading row groups by column name, checksums verified.

    pyarrow.parquet.ParquetFile wraps the same reader but imports pyarrow's filesystem modules (the S3, GCS,
    Azure and HDFS bindings, resident in every training process) and allocates from Arrow's default pool
    (mimalloc: an arena that stays). The index is read once per process in small row groups, where
    neither pays off, so this opens pyarrow's reader directly on the system allocator."""

    def __init__(self, source: Any):
        import pyarrow as pa
        from pyarrow._parquet import ParquetReader

        self._reader = ParquetReader(memory_pool=pa.system_memory_pool())
        self._reader.open(source, page_checksum_verification=True, pre_buffer=False)
        self.metadata = self._reader.metadata

    def read_row_group(self, rg: int, columns: Sequence[str]) -> pa.Table:
        """Row group ``rg``, the ``columns`` named (a name the table lacks is a KeyError), one thread."""
        indices = [self._reader.column_name_idx(c) for c in columns]
        return self._reader.read_row_group(rg, column_indices=indices, use_threads=False)
