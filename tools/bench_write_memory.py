#!/usr/bin/env python
"""How much memory ``shardify write`` holds per manifest line: peak RSS of the command at several sizes.

For each size N, a NeMo manifest of N lines (six fields: ``audio_filepath``, ``duration``, ``text``, ``lang``,
``speaker``, ``id``) over a few distinct 10 ms WAV files is written with ``shardify write --no-progress
--workers 1`` in a child process of its own, and that child's peak resident set (``ru_maxrss`` from
``os.wait4``) is read. The slope between sizes (bytes per line) is what a longer manifest costs: what the write
holds per line until its index is written. Wall seconds move with the machine's load; CPU seconds (user and
system, of the child) far less. ``--kind text`` measures a text JSON-lines source instead.

Usage: ``python tools/bench_write_memory.py [--sizes 5000,20000] [--kind manifest|text] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import soundfile as sf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import machine, table  # noqa: E402

#: distinct audio files the manifest lines point at (probing and copying stay cheap; the lines are what grows)
FILES = 50
SAMPLE_RATE = 16000
_WRITE = "import sys; from streambatch_shardify import main; sys.exit(main())"


def make_source(folder: str, lines: int, kind: str) -> str:
    """A manifest (or text JSON lines) of ``lines`` lines in ``folder``; its path."""
    if kind == "manifest":
        os.makedirs(os.path.join(folder, "wavs"), exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(FILES):
            wav = os.path.join(folder, "wavs", f"w{i:03d}.wav")
            if not os.path.exists(wav):
                sf.write(wav, (0.1 * rng.standard_normal(SAMPLE_RATE // 100)).astype("float32"), SAMPLE_RATE)
    path = os.path.join(folder, f"{kind}-{lines}.jsonl")
    with open(path, "w") as f:
        for i in range(lines):
            row: dict[str, object] = {"text": f"utterance number {i} of the corpus", "lang": "en"}
            if kind == "manifest":
                row = {"audio_filepath": f"wavs/w{i % FILES:03d}.wav", "duration": 0.01, **row}
            row.update(speaker=f"spk{i % 30}", id=f"utt{i:07d}")
            f.write(json.dumps(row) + "\n")
    return path


def peak_rss(src: str, out: str, kind: str, index_version: int = 2) -> tuple[int, float, float]:
    """(peak RSS in bytes, wall seconds, CPU seconds: user and system) of ``shardify write SRC OUT``, run in a
    child process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-c", _WRITE, "write", src, out, "--kind", kind, "--no-progress", "--workers", "1"]
    cmd += ["--index-version", str(index_version)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"shardify write failed (exit {proc.returncode}): {err.strip()[-500:]}")
    return usage.ru_maxrss * 1024, wall, usage.ru_utime + usage.ru_stime  # ru_maxrss is in KiB on Linux


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="5000,20000", help="manifest lines, comma-separated (default 5000,20000)")
    ap.add_argument("--kind", choices=("manifest", "text"), default="manifest")
    ap.add_argument(
        "--index-version",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): Parquet tables, whose writer's buffers grow with a row group's rows (up to 65,536); "
        "1: one JSON file, so the slope is what the write itself holds per line",
    )
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    sizes = sorted({int(s) for s in a.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] <= 0:
        ap.error("--sizes needs two or more positive sizes")
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            src = make_source(tmp, n, a.kind)
            rss, wall, cpu = peak_rss(src, os.path.join(tmp, f"out-{n}"), a.kind, a.index_version)
            results.append({"lines": n, "peak_rss": rss, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
    base = results[0]
    for r in results:
        dn = r["lines"] - base["lines"]
        slope = (r["peak_rss"] - base["peak_rss"]) / dn if dn else None
        r["bytes_per_line"] = None if slope is None else round(slope)
        rows.append(
            [
                f"{r['lines']:,}",
                f"{r['peak_rss'] // 1024:,}",
                "-" if slope is None else f"{slope:,.0f}",
                f"{r['wall_s']:.1f}",
                f"{r['cpu_s']:.1f}",
            ]
        )
    print(f"shardify write of a {a.kind} source, one worker, index version {a.index_version}; {machine()}")
    print(table(rows, ["lines", "peak RSS KiB", f"B/line over {base['lines']:,}", "wall s", "CPU s"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"kind": a.kind, "index_version": a.index_version, "machine": machine(), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
