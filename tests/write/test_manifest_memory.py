"""What reading a manifest holds in memory per line until the write's index is written: a few numbers (where its
record lies in the temporary file the records wait in, streambatch/write/spill.py), not the record (its path,
key, transcript and fields, several hundred bytes); docs/benchmarks.md has the figures."""

from __future__ import annotations

import gc
import tracemalloc

from conftest import six_field_manifest

from streambatch.write.sources import read_source

LINES = 20000
#: bytes per line reading a six-field NeMo manifest may hold (its records held in memory took about 775)
MOST_PER_LINE = 64


def test_a_manifest_line_is_held_in_a_few_numbers(tmp_path):
    src = six_field_manifest(tmp_path, LINES, files=4, seconds=0.05)
    gc.collect()
    tracemalloc.start()
    try:
        records, problems = read_source(src)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert not problems and len(records) == LINES
    assert records[7].fields["speaker"] == "spk7" and records[7].fields["lang"] == "en"
    assert records[LINES - 1].key == f"utt{LINES - 1:07d}" and records[LINES - 1].text.endswith("of the corpus")
    assert held / LINES <= MOST_PER_LINE, f"{held / LINES:.0f} B per line"
