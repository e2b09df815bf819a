"""What the tests of hostile inputs share: mutations of real inputs, the fuzz run settings, the check that parsing an
input stays within a stated memory bound and raises nothing but the project's own errors, and a tar writer.

Each fuzz test runs ``STREAMBATCH_FUZZ_EXAMPLES`` examples (default 200, a few seconds a test); a longer run:
``STREAMBATCH_FUZZ_EXAMPLES=20000 pytest tests/dataset/test_fuzz_tar.py tests/write/test_fuzz_manifests.py``.
The deadline is a guard against hangs (an example that takes seconds), not a timing assertion.
"""

from __future__ import annotations

import io
import os
import tarfile
import tracemalloc
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from streambatch.errors import StreamBatchError

EXAMPLES = int(os.environ.get("STREAMBATCH_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    derandomize=EXAMPLES <= 1000,  # the suite's short run is the same every time; a long run explores
)

#: byte strings a mutation writes: nesting, huge numbers, separators, NULs, non-UTF-8, quotes
TOKENS = [
    b"[" * 3000,
    b"{" * 200 + b'"a":' * 10,
    b"99999999999",
    b"\x80\x00\x00\x00\x00\x00\x00\x17\x48\x76\xe8\x00",  # a GNU base-256 size of 100 GB
    b"77777777777\0",
    b"-1",
    b"1e999",
    b"NaN",
    b"\0" * 16,
    b"\xff\xfe\xc3\x28",
    b'"',
    b"\\",
    b"\n",
    b"\r\n",
    b",",
    b"\t",
    b"|",
    b"../../../etc/passwd",
    b"/dev/zero",
    b"\x1b[2J",
    b"null",
    b"[]",
    b"{}",
    b"0 1 path=",
    b"30 path=" + b"a" * 21 + b"\n",
]


@st.composite
def mutated(draw: Callable[..., Any], base: bytes, aligned: int = 0) -> bytes:
    """``base`` with a few edits: bytes flipped, cut, inserted (random or :data:`TOKENS`), ranges deleted or
    repeated; with ``aligned`` (512 for a tar) some edits land on the fields of a block (a header's size, checksum,
    type)."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        n = len(data)
        pos = draw(st.integers(0, max(n - 1, 0)))
        if aligned and n >= aligned and draw(st.booleans()):
            pos = draw(st.integers(0, n // aligned - 1)) * aligned + draw(st.sampled_from([0, 100, 124, 148, 156, 345]))
        kind = draw(st.sampled_from(["flip", "cut", "insert", "token", "delete", "repeat"]))
        if kind == "flip" and n:
            data[pos] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "token":
            token = draw(st.sampled_from(TOKENS))
            data[pos : pos + (len(token) if draw(st.booleans()) else 0)] = token
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 1024))]
        elif kind == "repeat":
            data[pos:pos] = bytes(data[pos : pos + draw(st.integers(1, 2048))]) * draw(st.integers(1, 8))
    return bytes(data)


def inputs(base: bytes, aligned: int = 0) -> st.SearchStrategy[bytes]:
    """Mutations of ``base`` most of the time, random bytes otherwise."""
    return st.one_of(mutated(base, aligned), mutated(base, aligned), st.binary(max_size=4096))


def parse_within(parse: Callable[[], Any], bound: int) -> Any:
    """``parse()``'s result, or None where it raised one of the project's errors (any other exception fails the
    test); the memory it allocated at its peak (tracemalloc) must stay under ``bound`` bytes."""
    tracemalloc.start()
    try:
        try:
            result = parse()
        except StreamBatchError:
            result = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < bound, f"parsing allocated {peak} bytes at its peak, more than the bound {bound}"
    return result


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A plain tar (Python's tarfile, GNU format) of ``members`` in order."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
