"""Fuzzing the one tar parser (issue 25): tars written here from real audio (ustar, GNU long names, pax paths),
mutated (headers' size, checksum and type fields included) or replaced by random bytes, read by every way the
package reads a tar (streamed, from a buffer, grouped into samples, scanned as ``shardify index`` scans them).
Every input gives samples or one of the project's errors, never another exception, and the memory held stays
under a bound stated here: a header claiming more bytes than the input holds is never allocated."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile

import pytest
import soundfile as sf
from conftest import TESTS
from fuzz_inputs import FUZZ, inputs, parse_within
from hypothesis import given
from hypothesis import strategies as st

from streambatch.errors import ShardReadError
from streambatch.format.tar import buffer_members, group_samples, iter_members
from streambatch.write.adopt.scan import scan_sample

AUDIO = TESTS / "data" / "real" / "audio"
#: what parsing one input may allocate at its peak: the 16 MiB read piece, plus a few copies of the input
BOUND = (16 << 20) + (1 << 20)


def short_wav() -> bytes:
    x, sr = sf.read(AUDIO / "LJ002-0020.wav", frames=1500, dtype="int16")
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def real_tar(fmt: int) -> bytes:
    """A tar of three samples in format ``fmt``: real audio (wav, opus, mp3), .json and .txt members, one
    key long enough to need a GNU long name or a pax path record."""
    members = [
        ("LJ002-0020.wav", short_wav()),
        ("LJ002-0020.json", b'{"length": 1500, "speaker": "LJ", "nested": {"a": [1, 2]}}'),
        ("LJ002-0020.txt", b"the real words"),
        ("d/" + "long" * 30 + ".opus", (AUDIO / "mono_c0.opus").read_bytes()),
        ("d/" + "long" * 30 + ".json", b'{"length": 3}'),
        ("stereo.mp3", (AUDIO / "stereo_mp3.mp3").read_bytes()),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


GNU, PAX = real_tar(tarfile.GNU_FORMAT), real_tar(tarfile.PAX_FORMAT)


def header_offsets(data: bytes) -> list[int]:
    """Where each header block of a tar starts (the members', and their long-name / pax records')."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return sorted({off for m in tar.getmembers() for off in (m.offset, m.offset_data - 512)})


@st.composite
def size_claims(draw, base: bytes) -> bytes:
    """``base`` with one header's size field claiming any size up to 2**62 bytes (octal where it fits, else GNU
    base-256), its checksum made right again so the claim is believed: what a hostile tar does."""
    data = bytearray(base)
    at = draw(st.sampled_from(header_offsets(base)))
    size = draw(st.one_of(st.integers(0, 1 << 16), st.integers(0, 1 << 62), st.just(100 << 30)))
    field = b"%011o\0" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
    data[at + 124 : at + 136] = field
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])
    return bytes(data)


_FILE = os.path.join(tempfile.mkdtemp(prefix="fuzz-tar-"), "fuzz.tar")


@pytest.fixture(scope="module", autouse=True)
def _remove_the_fuzz_file():
    """The one file every streamed case goes through (hypothesis runs many cases per test) goes with the module."""
    yield
    shutil.rmtree(os.path.dirname(_FILE), ignore_errors=True)


def stream_all(data: bytes) -> list:
    """Through a real file, as the loader reads a local shard: a file's ``read(n)`` allocates ``n`` up front, so a
    size a header claims would be allocated if the parser trusted it."""
    with open(_FILE, "wb") as f:
        f.write(data)
    with open(_FILE, "rb") as f:
        return list(group_samples(iter_members(f, _FILE), _FILE))


def buffer_all(data: bytes) -> list:
    return list(group_samples(buffer_members(data, "fuzz.tar"), "fuzz.tar"))


def scan_all(data: bytes) -> list:
    """As ``shardify index`` reads a tar: members grouped by key, each group scanned (audio probed, .json read)."""
    groups: dict[str, dict[str, bytes]] = {}
    for name, member in iter_members(io.BytesIO(data), "fuzz.tar"):
        key, _, ext = name.partition(".")
        groups.setdefault(key, {})[ext] = member
    return [scan_sample(k, g) for k, g in groups.items()]


def test_the_unmutated_tars_read_whole():
    for data in (GNU, PAX):
        assert [s["__key__"] for s in stream_all(data)] == ["LJ002-0020", "d/" + "long" * 30, "stereo"]
        records = data.rstrip(b"\0")  # the members' records without the end-of-archive blocks
        records += b"\0" * (-len(records) % 512)
        assert [s["__key__"] for s in buffer_all(records)] == [s["__key__"] for s in stream_all(data)]
        assert all(s.problem is None for s in scan_all(data))


def pax_tar(record: bytes) -> bytes:
    """A tar whose one member has a pax header holding ``record``."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(record)
    member = tarfile.TarInfo("a.txt")
    member.size = 2
    data = record + b"\0" * (-len(record) % 512)
    return info.tobuf(tarfile.USTAR_FORMAT) + data + member.tobuf(tarfile.USTAR_FORMAT) + b"hi".ljust(512, b"\0")


@pytest.mark.parametrize("record", [b"0 path=x\n", b"x1 path=a\n", b"99 path=a\n", b"-3 path=a\n"])
def test_a_broken_pax_record_is_an_unreadable_tar(record):
    """A record length of 0 looped forever; a length that is not a number raised ValueError."""
    with pytest.raises(ShardReadError, match="invalid pax header record"):
        stream_all(pax_tar(record))


def test_a_pax_path_is_the_member_name():
    assert [s["__key__"] for s in stream_all(pax_tar(b"17 path=dir/k.txt\n"))] == ["dir/k"]


@FUZZ
@given(st.one_of(size_claims(GNU), size_claims(PAX)))
def test_sizes_claimed_by_headers(data):
    """Read through a file: a size is never allocated on a header's word, only as the bytes arrive."""
    parse_within(lambda: stream_all(data), BOUND)
    parse_within(lambda: buffer_all(data), BOUND)


@FUZZ
@given(inputs(GNU, aligned=512))
def test_streamed_gnu_tars(data):
    parse_within(lambda: stream_all(data), BOUND)


@FUZZ
@given(inputs(PAX, aligned=512))
def test_streamed_pax_tars(data):
    parse_within(lambda: stream_all(data), BOUND)


@FUZZ
@given(inputs(GNU, aligned=512))
def test_tars_read_from_a_buffer(data):
    parse_within(lambda: buffer_all(data), BOUND)


@FUZZ
@given(inputs(PAX, aligned=512))
def test_tars_scanned_for_shardify_index(data):
    parse_within(lambda: scan_all(data), BOUND)
