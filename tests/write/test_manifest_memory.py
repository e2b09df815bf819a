"""What reading a manifest holds per line until the write's index is written: the names of its fields and their
short values (language, speaker) once for the whole source, not once per line (a JSON parser makes new strings on
every line; docs/benchmarks.md has the figures)."""

from __future__ import annotations

import gc
import json
import tracemalloc

from conftest import make_audio

from streambatch.write.sources import read_source

LINES = 5000
#: bytes per record a six-field NeMo line may hold once read (its path, key, transcript and numbers are its own)
MOST_PER_LINE = 800


def test_a_manifest_line_is_held_in_bounded_bytes(tmp_path):
    for i in range(4):
        make_audio(tmp_path / "wavs" / f"w{i}.wav", 0.05, seed=i)
    with open(tmp_path / "m.json", "w") as f:
        for i in range(LINES):
            row = {
                "audio_filepath": f"wavs/w{i % 4}.wav",
                "duration": 0.05,
                "text": f"utterance number {i} of the corpus",
                "lang": "en",
                "speaker": f"spk{i % 30}",
                "id": f"utt{i:07d}",
            }
            f.write(json.dumps(row) + "\n")
    gc.collect()
    tracemalloc.start()
    try:
        records, problems = read_source(str(tmp_path / "m.json"))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert not problems and len(records) == LINES
    assert records[7].fields["speaker"] == "spk7" and records[7].fields["lang"] == "en"
    assert held / LINES <= MOST_PER_LINE, f"{held / LINES:.0f} B per line"
