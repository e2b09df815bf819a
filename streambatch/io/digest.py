"""Bytes and their checks: the sha256 and byte count of what was read, and how a size or a checksum that differs
from the expected one is said.

One place for the size and checksum checks (and their messages) that the reader, ``shardify verify``,
``shardify stage`` and the writer's ``--resume`` apply, so every caller accepts and rejects the same shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable


def size_problem(actual: int, expected: int | None) -> str | None:
    """``"size is N bytes, the index says M"`` when the sizes differ (None when they agree or none is known)."""
    if expected is None or int(actual) == int(expected):
        return None
    return f"size is {int(actual)} bytes, the index says {int(expected)}"


def sha256_problem(actual: str, expected: str | None) -> str | None:
    """``"sha256 is …, the index says …"`` when the digests differ (None when they agree or none is known)."""
    if not expected or actual == expected:
        return None
    return f"sha256 is {actual[:12]}..., the index says {expected[:12]}..."


class Digest:
    """sha256 and byte count of everything passed through `update()` (or read through `reader()`)."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.bytes = 0

    def update(self, data: bytes) -> bytes:
        self.hash.update(data)
        self.bytes += len(data)
        return data

    def hexdigest(self) -> str:
        return self.hash.hexdigest()

    def reader(self, read: Callable[[int], bytes]) -> HashingReader:
        return HashingReader(read, self)


class HashingReader:
    """A ``read(n)`` that feeds a `Digest` on the way: checksums a stream while it is parsed."""

    def __init__(self, read: Callable[[int], bytes], digest: Digest | None = None):
        self._read = read
        self.digest = digest if digest is not None else Digest()

    def read(self, n: int = -1) -> bytes:
        return self.digest.update(self._read(n))

    def drain(self, chunk: int = 1 << 20) -> Digest:
        """Read to the end (a tar's trailing padding counts in its checksum) and return the digest."""
        while self.read(chunk):
            pass
        return self.digest
