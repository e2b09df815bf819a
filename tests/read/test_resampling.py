"""Resampling is band-limited or does not happen: a dataset written with ``--sample-rate`` streams its files at that
rate without folding what lies above the new Nyquist frequency back into the band as an alias, and a plain install
brings the resampler that does it (soxr), so no install resamples by interpolation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, popen

#: a 15 kHz tone at 44.1 kHz, written at 22.05 kHz: above the new Nyquist frequency (11.025 kHz), so all that may
#: remain of it is the resampler's stop-band residue; interpolation leaves it as a 7,050 Hz alias at full strength
TONE_HZ, FILE_RATE, DATASET_RATE = 15_000, 44_100, 22_050
#: the most of the tone's energy that may remain, in dB relative to the tone (the whole clip, its edges included)
MAX_RESIDUE_DB = -50.0

#: writes a one-second tone with `shardify write --sample-rate`, streams it back with the loader, and prints the rms
#: of what came out over the rms of the tone, in dB; argv: the folder to work in, the tone's frequency, the file's and
#: the dataset's rates, then "hide-soxr" to run as an install without soxr would
_RUN = """
import sys
if sys.argv[5:] == ["hide-soxr"]:
    sys.modules["soxr"] = None  # an import of soxr fails, as it would where it is not installed
from pathlib import Path
import numpy as np, soundfile as sf
from streambatch import StreamBatchLoader
from streambatch.cli import main
work, (hz, file_rate, rate) = Path(sys.argv[1]), map(int, sys.argv[2:5])
(work / "in").mkdir()
tone = (0.5 * np.sin(2 * np.pi * hz * np.arange(file_rate) / file_rate)).astype(np.float32)
sf.write(work / "in" / "tone.wav", tone, file_rate, subtype="FLOAT")
assert main(["write", str(work / "in"), str(work / "ds"), "--sample-rate", str(rate), "--no-progress"]) == 0
batch = next(iter(StreamBatchLoader(str(work / "ds"), budget="2s", decode="audio")))
out = batch["audio"][0, : int(batch["lengths"][0])].numpy()
assert len(out) == rate, len(out)
print("residue_db", 20 * np.log10(np.sqrt(np.mean(out**2)) / np.sqrt(np.mean(tone**2))))
"""


def _residue(tmp_path: Path, *args: str) -> tuple[int, float | None, str]:
    """Run :data:`_RUN` in a fresh process: (exit status, the residue in dB if it got that far, its stderr)."""
    rates = [str(v) for v in (TONE_HZ, FILE_RATE, DATASET_RATE)]
    proc = popen(
        [sys.executable, "-c", _RUN, str(tmp_path), *rates, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("residue_db ")]
    return proc.returncode, (float(lines[-1].split()[1]) if lines else None), err.decode()


def test_a_tone_above_the_new_nyquist_does_not_alias(tmp_path):
    rc, residue_db, err = _residue(tmp_path)
    assert rc == 0, err
    assert residue_db is not None and residue_db <= MAX_RESIDUE_DB, f"the tone remains at {residue_db:.1f} dB"


def test_without_soxr_nothing_is_resampled_by_interpolation(tmp_path):
    """Where soxr cannot be imported, resampling fails naming it; it never falls back to an aliasing method."""
    rc, residue_db, err = _residue(tmp_path, "hide-soxr")
    if rc == 0:
        assert residue_db is not None and residue_db <= MAX_RESIDUE_DB, (
            f"without soxr the 15 kHz tone came out at {residue_db:.1f} dB, with no word (aliased)"
        )
    else:
        assert "soxr" in err.strip().splitlines()[-1], err


def test_a_plain_install_brings_the_resampler():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group().lower() for d in project["dependencies"]}
    assert "soxr" in names
