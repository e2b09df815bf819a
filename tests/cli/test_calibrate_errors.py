"""``shardify calibrate`` on bad input: one line naming the value or file, exit 2, no traceback, nothing left
behind, and all of it found before the model is loaded; errors of the user's own code keep their traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from streambatch.cli import main
from streambatch.format.index import ShardIndex, ShardInfo

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU calibration measures through /proc")


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A dataset ``ds`` and a model ``model.py`` whose import leaves a ``loaded`` file (so a test sees whether
    the model was loaded), in the current folder."""
    monkeypatch.chdir(tmp_path)
    lengths = np.arange(1_000, 2_000, 100)
    ShardIndex([ShardInfo("shard-000000.tar", len(lengths), 0, lengths)], unit="samples", sample_rate=16000).save("ds")
    (tmp_path / "model.py").write_text(
        textwrap.dedent("""
        import os
        open(os.path.join(os.path.dirname(__file__), "loaded"), "w").close()

        def make(device):
            return (lambda batch: None), (lambda n, L: (n, L))
    """)
    )
    return tmp_path


def files_under(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs}


def calibrate(capsys, *argv: str, model: str = "model.py:make") -> tuple[int, str]:
    """``shardify calibrate ds --model MODEL ARGV...``: (exit code, stderr)."""
    capsys.readouterr()
    code = main(["calibrate", "ds", "--model", model, *argv])
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("shardify: error: "), err
    for name in names:
        assert name in err, (name, err)


BAD_OPTIONS = [
    (["--device", "tpu7"], ["--device", "'tpu7'"]),
    (["--device", "gpu"], ["--device", "'gpu'"]),
    (["--device", "meta"], ["--device", "'meta'"]),
    (["--memory-limit", "lots"], ["--memory-limit", "'lots'"]),
    (["--memory-limit=-5"], ["--memory-limit", "'-5'"]),
    (["--memory-limit", "0"], ["--memory-limit", "'0'"]),
    (["--memory-fraction", "nan"], ["--memory-fraction", "nan"]),
    (["--memory-fraction", "2"], ["--memory-fraction", "2"]),
    (["--memory-fraction", "0"], ["--memory-fraction", "0"]),
    (["--margin", "nan"], ["--margin", "nan"]),
    (["--margin", "1"], ["--margin", "1"]),
    (["--margin=-0.1"], ["--margin", "-0.1"]),
    (["--rel-tol=-1"], ["--rel-tol", "-1"]),
    (["--rel-tol", "0.5"], ["--rel-tol", "0.5"]),
    (["--rel-tol", "inf"], ["--rel-tol", "inf"]),
    (["--lengths", "1,abc"], ["--lengths", "'abc'"]),
    (["--lengths=-3,0"], ["--lengths", "-3"]),
    (["--lengths", "nan"], ["--lengths", "nan"]),
    (["--lengths", "100,,200"], ["--lengths", "''"]),
    (["--max-batch-size", "99999999999999999999"], ["--max-batch-size", "99999999999999999999"]),
]


@pytest.mark.parametrize("argv, names", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_one_line_before_the_model_loads(work, capsys, argv, names):
    before = files_under(work)
    code, err = calibrate(capsys, *argv, "--out", "calib.json")
    assert_one_line(code, err, *names)
    assert files_under(work) == before  # no model loaded (no "loaded"), no calibration written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_one_line(work, capsys, device):
    code, err = calibrate(capsys, "--device", device)
    assert_one_line(code, err, "--device", repr(device), "CUDA")
    assert not (work / "loaded").exists()


def test_a_cuda_device_this_machine_lacks_is_one_line(work, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, err = calibrate(capsys, "--device", "cuda:7")
    assert_one_line(code, err, "--device", "'cuda:7'", "2 CUDA devices")
    assert not (work / "loaded").exists()


@pytest.mark.parametrize("source", ["nonexist", "garbage", "file"])
def test_a_missing_or_bad_source_is_one_line(work, capsys, source):
    (work / "garbage").mkdir()
    (work / "garbage" / "index.json").write_text("{not json")
    (work / "file").write_text("not a dataset")
    before = files_under(work)
    capsys.readouterr()
    code = main(["calibrate", source, "--model", "model.py:make", "--out", "calib.json"])
    assert_one_line(code, capsys.readouterr().err, source)
    assert files_under(work) == before


def test_the_library_keeps_its_exceptions_for_a_missing_source(work):
    from streambatch.fit.calibrate import calibrate as calibrate_fn

    with pytest.raises(FileNotFoundError, match="nonexist"):
        calibrate_fn(lambda batch: None, "nonexist")


BAD_MODELS = [
    ("nonexist.py:make", ["--model", "nonexist.py"]),
    ("model.py:nope", ["--model", "model.py", "'nope'"]),
    ("model.py", ["--model", "MODULE:FACTORY", "'model.py'"]),
    ("model.py:", ["--model", "MODULE:FACTORY"]),
    ("no_such_module_xyz:make", ["--model", "no_such_module_xyz"]),
    ("model.py:os", ["--model", "'os'", "not callable"]),
    (".", ["--model", "MODULE:FACTORY"]),
    (".model:make", ["--model", "'.model'", "relative"]),
    ("afolder.py:make", ["--model", "afolder.py", "is a directory"]),
]


@pytest.mark.parametrize("model, names", BAD_MODELS, ids=[m for m, _ in BAD_MODELS])
def test_a_bad_model_spec_is_one_line(work, capsys, model, names):
    (work / "afolder.py").mkdir()
    code, err = calibrate(capsys, "--memory-limit", "8M", model=model)
    assert_one_line(code, err, *names)


def test_a_model_path_may_start_with_a_dot(work):
    from streambatch.cli.calibrate import load_factory

    assert callable(load_factory("./model.py:make")) and (work / "loaded").exists()


def test_a_model_file_with_a_syntax_error_is_one_line_naming_file_and_line(work, capsys):
    (work / "broken.py").write_text("import os\ndef make(device:\n    pass\n")
    code, err = calibrate(capsys, "--memory-limit", "8M", model="broken.py:make")
    assert_one_line(code, err, "broken.py:2", "--model")


def test_a_factory_returning_no_step_function_is_one_line(work, capsys):
    (work / "nostep.py").write_text("def make(device):\n    return 42\n")
    code, err = calibrate(capsys, "--memory-limit", "8M", model="nostep.py:make")
    assert_one_line(code, err, "--model", "nostep.py:make", "42")


@pytest.mark.parametrize("out", ["afile/calib.json", "afolder", "afolder/"])
def test_an_unwritable_out_is_one_line_before_anything_runs(work, capsys, out):
    (work / "afile").write_text("a regular file")
    (work / "afolder").mkdir()
    before = files_under(work)
    code, err = calibrate(capsys, "--memory-limit", "8M", "--out", out)
    assert_one_line(code, err, "--out", out.rstrip("/"))
    assert files_under(work) == before  # no model loaded, no temporary file left


def test_an_out_that_fails_at_the_end_leaves_nothing_behind(work, capsys):
    """The folder appears where the file goes while the calibration runs: one line, no temporary file."""
    (work / "late.py").write_text(
        textwrap.dedent("""
        import os
        import numpy as np

        def make(device):
            os.mkdir("calib.json")
            return (lambda batch: np.ones(batch[0] * batch[1] * 64, dtype=np.uint8)), (lambda n, L: (n, int(L)))
    """)
    )
    argv = ["--memory-limit", "16M", "--lengths", "10000", "--max-batch-size", "4", "--out", "calib.json"]
    code, err = calibrate(capsys, *argv, model="late.py:make")
    assert_one_line(code, err, "calib.json")
    assert not [f for f in files_under(work) if ".tmp-" in f]
    assert os.listdir(work / "calib.json") == []


def test_the_users_own_errors_keep_their_traceback(work, capsys):
    """The exception: the model's import and its step fail in the user's code, so they propagate."""
    from streambatch.errors import CalibrationError

    (work / "raises.py").write_text("raise RuntimeError('my model is broken')\n")
    with pytest.raises(RuntimeError, match="my model is broken"):
        main(["calibrate", "ds", "--model", "raises.py:make", "--memory-limit", "8M"])
    (work / "fails.py").write_text(
        "def make(device):\n    def step(batch):\n        raise ValueError('shape mismatch')\n"
        "    return step, (lambda n, L: (n, L))\n"
    )
    argv = ["--memory-limit", "8M", "--lengths", "100", "--out", "calib.json"]
    with pytest.raises(CalibrationError, match="shape mismatch"):
        main(["calibrate", "ds", "--model", "fails.py:make", *argv])
    assert not [f for f in files_under(work) if f.startswith("calib.json")]


def test_the_command_prints_one_line_and_exits_2(work):
    """The installed command, end to end: stderr is the one line, the exit status 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "streambatch.cli", "calibrate", "ds", "--model", "model.py:make", "--device", "tpu7"],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert_one_line(proc.returncode, proc.stderr, "--device", "'tpu7'")
    assert not (work / "loaded").exists()
