"""Fuzzing the one tar parser (issue 25): tars written here from real audio (ustar, GNU long names, pax paths),
mutated (headers' size, checksum and type fields included) or replaced by random bytes, read by every way the
package reads a tar (streamed, from a buffer, grouped into samples, scanned as ``shardify index`` scans them).
Every input gives samples or one of the project's errors, never another exception, and the memory held stays
under a bound stated here: a header claiming more bytes than the input holds is never allocated."""

from __future__ import annotations

import io
import tarfile

import soundfile as sf
from conftest import TESTS
from fuzz_inputs import FUZZ, inputs, parse_within
from hypothesis import given

from streambatch.dataset.tar import buffer_members, group_samples, iter_members
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


def stream_all(data: bytes) -> list:
    return list(group_samples(iter_members(io.BytesIO(data), "fuzz.tar"), "fuzz.tar"))


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
