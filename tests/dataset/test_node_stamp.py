"""The node copy's stamp (format/shared_index.py) lives in a cache folder other jobs may share: a stamp that is
not one of ours (not JSON, nested too deep, too large) means "ask the store", never an error out of the loader."""

from __future__ import annotations

from streambatch.format.shared_index import NodeCopies


def test_a_forged_stamp_means_ask_the_store(tmp_path):
    copies = NodeCopies(str(tmp_path / "cache"))
    url = "s3://bucket/ds/index.json"
    stamp = copies._stamp_path(url)
    for text in ("{not json", "[" * 5000 + "]" * 5000, '{"url": "' + "x" * 200_000 + '"}', "[1, 2]"):
        with open(stamp, "w") as f:
            f.write(text)
        assert copies.checked(url, "job-1") is None
