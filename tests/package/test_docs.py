"""The manual: the docs site builds with warnings as errors (broken links and anchors, pages outside the nav, API
reference names that do not resolve), and the README's set-up commands are the ones CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_build_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    api = (tmp_path / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("StreamBatchLoader", "BatchingConfig", "plan_batches", "write_shards", "calibrate"):
        assert f'id="streambatch.{name}"' in api, f"{name} is missing from the API reference"
    text = re.sub(r"<[^>]+>", "", api)
    roles = re.findall(r":(?:class|func|meth|mod|attr|data|exc):`[^`]*`", text)
    assert not roles, f"the API reference shows {len(roles)} Sphinx roles as text, e.g. {roles[:3]}"
    # the loader's signature apart, one parameter a line
    sig = re.search(r'id="streambatch.StreamBatchLoader".*?doc-signature[^>]*>(.*?)</div>', api, re.S)
    lines = re.sub(r"<[^>]+>", "", sig.group(1)).strip().splitlines() if sig else []
    assert len(lines) > 12 and max(map(len, lines)) <= 100, "StreamBatchLoader's signature is not one option a line"
    assert (tmp_path / "img" / "padding.png").exists() and (tmp_path / "img" / "dataflow.png").exists()
    # the reference shows the public API: no internal helper of a public class or of the errors module
    errors = (tmp_path / "reference" / "errors" / "index.html").read_text(encoding="utf-8")
    for internal in ("LoaderState.resume_on", "LoaderState.equalised_on", "errors.int_option", "errors.os_problem"):
        assert f'id="streambatch.{internal}"' not in api + errors, f"{internal} is internal but in the API reference"
    for error in ("StreamBatchError", "OptionError", "ShardReadError", "StateError", "RetriesExhausted"):
        assert re.search(rf'id="streambatch\.(errors\.)?{error}"', errors), f"{error} is missing from the errors page"
    # the errors page says what the hierarchy is once
    words = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", errors))
    assert words.count("keeps the builtin base") == 1, "the errors page repeats its opening"


def test_the_readme_stays_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the manual lives in docs/"


def test_ci_runs_the_readme_test_command():
    """.ci/run's last command is the README's second set-up command, character for character."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    commands = re.findall(r"^(\. \.venv/bin/activate && pip install .*)$", readme, re.M)
    assert commands == [ci]


def test_the_manual_home_page_shows_the_readme_set_up_commands():
    """The docs' home page repeats the README's set-up block as it is (commands and stated timings)."""
    block = re.compile(r"## Set up and try it \(a fresh machine\)\n\n```bash\n.*?```\n", re.S)
    readme = block.search((ROOT / "README.md").read_text(encoding="utf-8"))
    home = block.search((ROOT / "docs" / "index.md").read_text(encoding="utf-8"))
    assert readme and home and readme.group(0) == home.group(0)
