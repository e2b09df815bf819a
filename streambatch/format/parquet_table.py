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
    """One Parquet table file open for reading row groups by column name, checksums verified, one thread.

    Through pyarrow's public ``ParquetFile``: importing it loads pyarrow's filesystem bindings too, and it
    allocates from Arrow's default memory pool, a price each reading process pays once (figures in
    docs/benchmarks.md)."""

    def __init__(self, source: Any):
        import pyarrow.parquet as pq

        self._file = pq.ParquetFile(source, pre_buffer=False, page_checksum_verification=True)
        self.metadata = self._file.metadata
        self._names = frozenset(self._file.schema_arrow.names)

    def read_row_group(self, rg: int, columns: Sequence[str]) -> pa.Table:
        """Row group ``rg``, the ``columns`` named (a name the table lacks is a KeyError), one thread."""
        for c in columns:
            if c not in self._names:
                raise KeyError(c)
        return self._file.read_row_group(rg, columns=list(columns), use_threads=False)
