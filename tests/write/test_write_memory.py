"""What ``shardify write`` holds per manifest line: a longer manifest costs the write's peak memory only what a
line's record and its index entry take, not its ``.json`` bytes, dicts and tar members (made per shard as it is
written). Measured as the peak RSS of the command in a child process of its own, at N and 4N lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import make_audio

LINES = 2000
#: bytes of peak RSS one more line of a six-field NeMo manifest may cost (its record and index entry take about
#: half; holding every sample's ``.json`` bytes and members at once took twice this)
MOST_PER_LINE = 1800
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _manifest(folder, lines: int) -> str:
    path = folder / f"m{lines}.json"
    with open(path, "w") as f:
        for i in range(lines):
            row = {
                "audio_filepath": f"wavs/w{i % 8}.wav",
                "duration": 0.02,
                "text": f"utterance number {i} of the corpus",
                "lang": "en",
                "speaker": f"spk{i % 30}",
                "id": f"utt{i:07d}",
            }
            f.write(json.dumps(row) + "\n")
    return str(path)


def _peak_rss(src: str, out: str) -> int:
    """Peak RSS in bytes of ``shardify write SRC OUT`` (one worker) run in a child process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    code = "import sys; from streambatch_shardify import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "write", src, out, "--no-progress", "--workers", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode() if proc.stderr else ""
    return usage.ru_maxrss * 1024  # KiB on Linux


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and os.wait4: Linux")
def test_a_longer_manifest_costs_the_write_bounded_bytes_per_line(tmp_path):
    for i in range(8):
        make_audio(tmp_path / "wavs" / f"w{i}.wav", 0.02, seed=i)
    small = _peak_rss(_manifest(tmp_path, LINES), str(tmp_path / "small"))
    large = _peak_rss(_manifest(tmp_path, 4 * LINES), str(tmp_path / "large"))
    per_line = (large - small) / (3 * LINES)
    assert per_line <= MOST_PER_LINE, f"{per_line:.0f} B of peak RSS per manifest line"
    assert sum(1 for n in os.listdir(tmp_path / "large") if n.endswith(".tar")) == 8  # 1,000 a shard: all written
