"""A write's records and samples kept on local disk, not in memory, until their shard is written.

A manifest of millions of lines is a list a write needs whole (the shard plan, ``--shuffle``, the duplicate-key
check and the column choice look at every line) but reads one shard's worth at a time. `SpillList` is that list:
each item is pickled, as it is appended, to an unnamed temporary file (``tempfile.TemporaryFile``: on Linux and
macOS it has no name from the start, so a write that succeeds, fails or is killed leaves no file behind; the space
goes when the process lets go of it), and memory holds per item only where it lies (12 bytes) and, in a view, its
place (8 bytes). Items are read back when asked for: whole runs at once when iterated. The file is in Python's
temporary folder (``TMPDIR``), which must have room for the pickled records (a few hundred bytes a line); the
first MiB stays in memory.

A view (a slice, `SpillList.take()`) shares its parent's file. Pickling a `SpillList` (a shard's samples sent to
a worker process) pickles a plain list of its items.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

import numpy as np

from ..errors import output_fits

T = TypeVar("T")
#: bytes of pickled items gathered in memory before one write to the file
_WRITE_CHUNK = 1 << 20
#: the most items one read back brings in while iterating
_READ_RUN = 512


class _Store:
    """The file: items pickled one after another; ``starts``/``sizes`` say where item ``i`` lies."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(prefix="shardify-spill-")
        self.starts = array("q")
        self.sizes = array("I")
        self.pending = bytearray()
        self.flushed = 0  # bytes in the file; ``pending`` follows them

    def put(self, item: Any) -> int:
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        self.starts.append(self.flushed + len(self.pending))
        self.sizes.append(len(data))  # an item over 4 GiB (``array('I')``) raises OverflowError
        self.pending += data
        if len(self.pending) >= _WRITE_CHUNK:
            self.flush()
        return len(self.starts) - 1

    def flush(self) -> None:
        data, self.pending = bytes(self.pending), bytearray()
        with output_fits(tempfile.gettempdir(), "the records set aside until their shards are written (TMPDIR)"):
            while data:
                n = os.pwrite(self.file.fileno(), data, self.flushed)
                self.flushed += n
                data = data[n:]

    def get(self, ids: Sequence[int]) -> list[Any]:
        """The items ``ids`` (in that order), read in one go when they lie close together."""
        if not ids:
            return []
        starts = [self.starts[i] for i in ids]
        sizes = [self.sizes[i] for i in ids]
        lo, hi = min(starts), max(s + n for s, n in zip(starts, sizes))
        if lo >= self.flushed:  # not written yet (all of a small write's items stay here)
            at = self.flushed
            return [pickle.loads(self.pending[s - at : s - at + n]) for s, n in zip(starts, sizes)]
        if hi > self.flushed:
            self.flush()
        if len(ids) > 1 and hi - lo <= 2 * sum(sizes):
            block = os.pread(self.file.fileno(), hi - lo, lo)
            return [pickle.loads(block[s - lo : s - lo + n]) for s, n in zip(starts, sizes)]
        return [pickle.loads(os.pread(self.file.fileno(), n, s)) for s, n in zip(starts, sizes)]


class SpillList(Sequence[T], Generic[T]):
    """A list whose items wait in a temporary file (see the module): ``append``, ``len``, ``[i]``, ``[i] = x``,
    slices and iteration, as a list's. An item read back is a copy: change it, then assign it back."""

    def __init__(self, items: Iterable[T] = (), *, _store: _Store | None = None, _ids: array | None = None):
        self._store = _store or _Store()
        self._ids = array("q") if _ids is None else _ids
        for item in items:
            self.append(item)

    def append(self, item: T) -> None:
        self._ids.append(self._store.put(item))

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> SpillList[T]: ...
    def __getitem__(self, i: int | slice) -> T | SpillList[T]:
        if isinstance(i, slice):
            return SpillList(_store=self._store, _ids=self._ids[i])
        return self._store.get([self._ids[i]])[0]

    def __setitem__(self, i: int, item: T) -> None:
        self._ids[i] = self._store.put(item)

    def __iter__(self) -> Iterator[T]:
        for a in range(0, len(self._ids), _READ_RUN):
            yield from self._store.get(self._ids[a : a + _READ_RUN])

    def take(self, order: Sequence[int] | np.ndarray) -> SpillList[T]:
        """The items at ``order``'s positions, in its order (a view: nothing is copied but the positions)."""
        ids = array("q")
        ids.frombytes(np.frombuffer(self._ids, dtype=np.int64)[np.asarray(order, dtype=np.int64)].tobytes())
        return SpillList(_store=self._store, _ids=ids)

    def __reduce__(self) -> tuple[Any, tuple[list[T]]]:
        return list, (list(self),)

    def __repr__(self) -> str:
        return f"SpillList(<{len(self)} items in a temporary file>)"
