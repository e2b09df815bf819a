"""The tar member reader: the same members as Python's tarfile, and clear errors for broken shards."""

from __future__ import annotations

import io
import tarfile

import pytest

from streambatch.errors import ShardReadError
from streambatch.format.tar import buffer_members, iter_members


def make_tar(fmt: int, names: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        d = tarfile.TarInfo("a-directory")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)  # not a file: skipped
        for i, name in enumerate(names):
            data = (name * (i + 1)).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


NAMES = ["k1.json", "k1.flac", "d" * 120 + "/long.json", "grüße/straße.flac", "empty.txt", "x" * 300 + ".npy"]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_same_members_as_tarfile(fmt):
    raw = make_tar(fmt, NAMES)
    expected = []
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for m in tar:
            if m.isfile():
                expected.append((m.name, tar.extractfile(m).read()))
    assert list(iter_members(io.BytesIO(raw), "mem")) == expected
    assert [n for n, _ in expected] == NAMES


def test_broken_shards_are_clear_errors():
    raw = make_tar(tarfile.PAX_FORMAT, NAMES)
    with pytest.raises(ShardReadError, match="mem.tar: not a readable tar shard"):
        list(iter_members(io.BytesIO(b"garbage" * 200), "mem.tar"))
    with pytest.raises(ShardReadError, match="truncated"):
        list(iter_members(io.BytesIO(raw[: len(raw) // 2 + 100]), "mem.tar"))
    flipped = bytearray(raw)
    flipped[10] ^= 0xFF  # a damaged header
    with pytest.raises(ShardReadError, match="checksum"):
        list(iter_members(io.BytesIO(bytes(flipped)), "mem.tar"))


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_members_of_a_byte_span_as_the_stream_gives_them(fmt):
    raw = make_tar(fmt, NAMES)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:  # the records, without the closing zero blocks
        last = tar.getmembers()[-1]
    end = last.offset_data + last.size + (-last.size % 512)
    assert list(buffer_members(raw[:end], "mem")) == list(iter_members(io.BytesIO(raw), "mem"))
    flipped = bytearray(raw[:end])
    flipped[10] ^= 0xFF
    with pytest.raises(ShardReadError, match="checksum"):
        list(buffer_members(bytes(flipped), "mem.tar"))
    with pytest.raises(ShardReadError, match="truncated"):
        list(buffer_members(raw[: end - 600], "mem.tar"))
