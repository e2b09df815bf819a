"""Every example in README.md and docs/ runs as written.

The convention (stated in docs/index.md): a ``python`` or ``bash`` block runs as written unless its first line is
a comment starting with ``# needs`` (``# needs your data: …``, ``# needs a GPU``, …), which marks it as needing the
reader's data, model or cluster. A block whose first line is ``# torchrun … FILE.py`` is saved as FILE.py and run
with that command. Each runnable block runs in a subprocess in an empty folder, with TMPDIR inside it so that its
``tempfile.mkdtemp()`` data stays there. A Python example runs twice (it must not refuse a second run); a shell
example (each starts in a fresh ``mktemp -d`` folder) and a torchrun one run once, to keep the test short.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
RUNS = ("python", "bash")
TIMEOUT = 180
# what the runnable examples must cover between them (a word each must contain, in its code)
COVERAGE = {
    "write": "write_shards",
    "stream": "StreamBatchLoader(",
    "DDP": "# torchrun",
    "mixing": "weights=",
    "filters": "where=",
    "transforms": "transform=",
    "speed perturbation": "speed_perturb=",
    "features": 'features="fbank"',
    "resume": "load_state_dict",
    "metrics": ".metrics(",
    "shardify CLI": "shardify write",
}


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.lstrip().split("\n", 1)[0].strip()

    @property
    def runnable(self) -> bool:
        return not self.first_line.startswith("# needs")


def examples() -> list[Example]:
    """Every python and bash block of the README and the docs pages, in page order; a block that appears on two
    pages (the README's and the docs home page's) once."""
    found: dict[str, Example] = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) in RUNS and m.group(2) not in found:
                line = text.count("\n", 0, m.start()) + 1
                found[m.group(2)] = Example(page, line, m.group(1), m.group(2))
    return list(found.values())


RUNNABLE = [e for e in examples() if e.runnable]


def command(example: Example, folder: Path) -> list[str]:
    """The command that runs ``example`` (its code saved in ``folder``)."""
    if example.lang == "bash":
        script = folder / "example.sh"
        script.write_text(example.code)
        return ["bash", "-euo", "pipefail", str(script)]
    if example.first_line.startswith("# torchrun "):
        args = shlex.split(example.first_line[2:])
        (folder / args[-1]).write_text(example.code)
        return [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    (folder / "example.py").write_text(example.code)
    return [sys.executable, "example.py"]


def run_example(example: Example, folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "tmp"
    tmp.mkdir(exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # shardify and python of this environment first
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p),
        "OMP_NUM_THREADS": "1",
    }
    cmd = command(example, folder)
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _by_kind(example: Example) -> object:
    """``example`` as a test parameter, marked ``cluster`` when it runs under torchrun."""
    return pytest.param(example, marks=pytest.mark.cluster if example.first_line.startswith("# torchrun ") else ())


@pytest.mark.parametrize("example", [_by_kind(e) for e in RUNNABLE], ids=lambda e: e.name)
def test_example_runs_as_written(example, tmp_path):
    twice = example.lang == "python" and not example.first_line.startswith("# torchrun ")
    for attempt in ("first", "second")[: 2 if twice else 1]:
        result = run_example(example, tmp_path)
        assert result.returncode == 0, (
            f"{example.name}: the {attempt} run exited {result.returncode}\n"
            f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        )


def test_enough_runnable_examples_cover_the_features():
    assert len(RUNNABLE) >= 10, [e.name for e in RUNNABLE]
    code = "\n".join(e.code for e in RUNNABLE)
    missing = [what for what, word in COVERAGE.items() if word not in code]
    assert not missing, f"no runnable example covers {missing}"


def test_every_marked_example_says_what_it_needs():
    """A marked block names what it needs (``# needs your data: …``), not a bare ``# needs``."""
    bare = [e.name for e in examples() if not e.runnable and len(e.first_line) < len("# needs a GPU")]
    assert not bare, f"examples marked without saying what they need: {bare}"


def test_the_examples_are_found():
    """The extraction itself: a page with a marked and an unmarked block of each kind."""
    page = "text\n```python\nprint(1)\n```\n\n```bash\n# needs your data\nls /data\n```\n```json\n{}\n```\n"
    found = [(m.group(1), m.group(2)) for m in FENCE.finditer(page)]
    assert found == [("python", "print(1)\n"), ("bash", "# needs your data\nls /data\n"), ("json", "{}\n")]
