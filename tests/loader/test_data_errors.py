"""What data the loader cannot use is one of the package's errors, naming the file, sample or option: a shard
whose ``.json`` length is not one (without an index batches are cut by it), an index the shards no longer match,
a layout with a rank the data cannot reach, a shard the node cache cannot hold."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from streambatch import EmptyEpochError, OptionError, SampleError, StreamBatchLoader, index_tars
from streambatch.io.cache import ShardCache


def _tar(path: Path, lengths: list) -> None:
    """A shard of text-like samples whose ``.json`` carries each given ``length`` as it is."""
    with tarfile.open(path, "w") as tf:
        for i, length in enumerate(lengths):
            for ext, data in (("json", json.dumps({"length": length}).encode()), ("txt", b"x")):
                info = tarfile.TarInfo(f"k{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("length", ["7", -1, None])
def test_a_shard_length_that_is_not_one_names_the_sample_without_an_index(tmp_path, length):
    _tar(tmp_path / "a.tar", [3, 4, length, 5])
    loader = StreamBatchLoader(str(tmp_path / "a.tar"), budget=64, decode="none")
    with pytest.raises(SampleError, match=r"a\.tar: sample 'k0002'"):
        list(loader)


def test_a_rank_the_data_cannot_reach_is_an_empty_epoch(tmp_path):
    (tmp_path / "ds").mkdir()
    _tar(tmp_path / "ds" / "a.tar", [3, 4])
    index_tars(str(tmp_path / "ds"))
    loader = StreamBatchLoader(str(tmp_path / "ds"), budget=64, decode="none", rank=3, world_size=4, even_batches="pad")
    with pytest.raises(EmptyEpochError, match=r"rank \d gets no data this epoch \(2 samples"):
        len(loader)


def test_a_shard_larger_than_the_cache_names_cache_size(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), 100)
    with pytest.raises(OptionError, match=r"s3://b/big\.tar: 600 bytes do not fit .*raise cache_size"):
        cache.get("s3://b/big.tar", 600, lambda tmp: open(tmp, "wb").write(b"o" * 600))
    assert not list((tmp_path / "c" / "objects").iterdir())  # nothing half-written left


def test_audio_that_cannot_be_decoded_names_its_shard_and_sample(tmp_path):
    """The decoder's own message ("cannot decode audio (Internal psf_fseek() failed.)") names neither; a batch
    that fails as a whole (the first one, or with max_bad_shards=0) must say which sample of which shard."""
    from streambatch import AudioError
    from streambatch.read.collate import decode_sample

    sample = {"__key__": "utt-7", "__url__": "/data/shard-000003.tar", "flac": b"fLaC" + bytes(200)}
    with pytest.raises(AudioError, match=r"^/data/shard-000003\.tar: sample 'utt-7': cannot decode audio"):
        decode_sample(sample, "audio")
