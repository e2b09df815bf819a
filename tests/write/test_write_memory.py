"""What ``shardify write`` holds per manifest line: a longer manifest costs the write's peak memory a few numbers
per line (where its record waits in the temporary file, its tar size) and its index entry, not its record (set
aside on disk until its shard is written: streambatch/write/spill.py). Measured as the peak RSS of the command in
a child process of its own, at N and 4N lines, with the version 1 index: the Parquet writer of the version 2 index
holds buffers that grow with a row group's rows (up to 65,536, then no more), which at these sizes would hide what
the write holds per line (docs/benchmarks.md has both)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import six_field_manifest

LINES = 2000
#: bytes of peak RSS one more line of a six-field NeMo manifest may cost (holding every line's record in memory
#: until the shards were written cost about 850)
MOST_PER_LINE = 300
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _peak_rss(src: str, out: str) -> int:
    """Peak RSS in bytes of ``shardify write SRC OUT`` (one worker) run in a child process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    code = "import sys; from streambatch_shardify import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "write", src, out, "--no-progress", "--workers", "1", "--index-version", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode() if proc.stderr else ""
    return usage.ru_maxrss * 1024  # KiB on Linux


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and os.wait4: Linux")
def test_a_longer_manifest_costs_the_write_a_few_numbers_per_line(tmp_path):
    small = _peak_rss(six_field_manifest(tmp_path, LINES), str(tmp_path / "small"))
    large = _peak_rss(six_field_manifest(tmp_path, 4 * LINES), str(tmp_path / "large"))
    per_line = (large - small) / (3 * LINES)
    assert per_line <= MOST_PER_LINE, f"{per_line:.0f} B of peak RSS per manifest line"
    assert sum(1 for n in os.listdir(tmp_path / "large") if n.endswith(".tar")) == 8  # 1,000 a shard: all written
