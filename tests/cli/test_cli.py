"""The shardify command: exit codes, the messages a user sees, and verify catching damaged datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from conftest import make_audio, write_jsonl

from streambatch import cli
from streambatch.cli import main
from streambatch.format.index import ShardIndex
from streambatch.write import writer


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def dataset(tmp_path, audio_folder):
    folder, expected = audio_folder
    out = tmp_path / "ds"
    assert main(["write", str(folder), str(out), "--max-count", "2", "--no-progress"]) == 0
    return out, expected


def test_write_verify_inspect(capsys, tmp_path, audio_folder):
    folder, expected = audio_folder
    out = tmp_path / "ds"
    code, stdout, _ = run(
        capsys, "write", folder, out, "--max-count", "2", "--shuffle", "--seed", "3", "--workers", "2", "--no-progress"
    )
    assert code == 0 and f"wrote 5 samples in 3 shards to {out}" in stdout
    code, stdout, _ = run(capsys, "verify", out, "--no-progress")
    assert code == 0 and stdout.strip() == f"ok: 3 shards, 5 samples match {out}"
    code, stdout, err = run(capsys, "inspect", out)
    assert code == 0, err
    assert "samples @ 16000 Hz" in stdout and "p50" in stdout and "(0.10 s)" in stdout  # shortest is 0.1 s
    assert "budget" in stdout and "buckets" in stdout


def test_inspect_json_budget_and_plot(capsys, dataset, tmp_path):
    out, expected = dataset
    png = tmp_path / "hist.png"
    code, stdout, err = run(capsys, "inspect", out, "--json", "--budget", "2s", "--num-buckets", "3", "--plot", png)
    assert code == 0, err
    s = json.loads(stdout)
    assert s["num_samples"] == 5 and s["num_shards"] == 3 and s["unit"] == "samples"
    assert s["total_length"] == sum(e["frames"] for e in expected.values())
    assert s["total_hours"] == pytest.approx(s["total_length"] / 16000 / 3600)
    assert s["seconds"]["min"] == pytest.approx(min(e["frames"] for e in expected.values()) / 16000)
    assert s["budget"] == 32000 and s["budget_source"] == "given"
    assert len(s["bucket_boundaries"]) <= 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_text_dataset_in_tokens(capsys, tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": " ".join(["w"] * n)} for n in (3, 5, 8)])
    assert main(["write", str(src), str(tmp_path / "ds"), "--no-progress"]) == 0
    code, stdout, _ = run(capsys, "inspect", tmp_path / "ds", "--json")
    s = json.loads(stdout)
    assert code == 0 and s["unit"] == "tokens" and s["total_length"] == 16 and "seconds" not in s
    code, _, err = run(capsys, "inspect", tmp_path / "ds", "--budget", "10s")
    assert code == 2 and "seconds only make sense for audio" in err


def test_bad_input_fail_exits_2_with_file_line_and_writes_nothing(capsys, tmp_path):
    d = tmp_path / "src"
    make_audio(d / "a.wav", 0.1)
    m = write_jsonl(
        d / "m.jsonl",
        [{"audio_filepath": "a.wav", "duration": 0.1}, {"audio_filepath": "gone.wav", "duration": 0.1}],
        raw_lines={1: "not json"},
    )
    out = tmp_path / "ds"
    code, stdout, err = run(capsys, "write", m, out, "--no-progress")
    assert code == 2
    assert f"{m}:2: not valid JSON" in err and f"{m}:3: audio file not found" in err
    assert "nothing was written" in err and "--on-error skip" in err and "Traceback" not in err
    assert not out.exists()
    code, stdout, err = run(capsys, "write", m, out, "--on-error", "skip", "--no-progress")
    assert code == 0 and "skipped 2 bad inputs" in err and "errors.jsonl" in err
    assert len((out / "errors.jsonl").read_text().splitlines()) == 2
    assert "wrote 1 samples in 1 shards" in stdout


def test_many_problems_are_listed_up_to_20(capsys, tmp_path):
    m = write_jsonl(tmp_path / "m.jsonl", [{"audio_filepath": f"x{i}.wav", "duration": 1} for i in range(25)])
    code, _, err = run(capsys, "write", m, tmp_path / "ds", "--no-progress")
    assert code == 2 and "25 problems" in err and "... and 5 more" in err
    assert f"{m}:20:" in err and f"{m}:21:" not in err


def test_mixed_rates_exit_2_then_sample_rate(capsys, tmp_path):
    d = tmp_path / "src"
    make_audio(d / "a.wav", 0.1, sr=16000)
    make_audio(d / "b.wav", 0.1, sr=22050)
    code, _, err = run(capsys, "write", d, tmp_path / "ds", "--no-progress")
    assert code == 2 and "mixed sample rates" in err and "a.wav" in err and "b.wav" in err
    code, _, err = run(capsys, "write", d, tmp_path / "ds", "--sample-rate", "16000", "--no-progress")
    assert code == 0, err
    assert ShardIndex.load(str(tmp_path / "ds")).lengths.tolist() == [1600, 1600]


def test_data_root_missing_is_a_clear_error(capsys, tmp_path):
    sb = tmp_path / "train.json"
    sb.write_text(json.dumps({"u1": {"wav": "{data_root}/a.wav", "duration": 1.0}}, indent=2))
    code, _, err = run(capsys, "write", sb, tmp_path / "ds")
    assert code == 2 and "--data-root" in err


def test_refuses_non_empty_out_unless_overwrite(capsys, dataset, audio_folder):
    out, _ = dataset
    folder, _ = audio_folder
    code, _, err = run(capsys, "write", folder, out, "--no-progress")
    assert code == 2 and "not empty" in err and "--overwrite" in err
    code, _, _ = run(capsys, "write", folder, out, "--overwrite", "--no-progress")
    assert code == 0 and sorted(os.listdir(out)) == [
        "index.json",
        "index.samples",
        "index.shards.parquet",
        "shard-000000.tar",
    ]


def _first_shard(out) -> str:
    return str(out / "shard-000000.tar")


def test_verify_detects_a_truncated_shard(capsys, dataset):
    out, _ = dataset
    path = _first_shard(out)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    code, stdout, _ = run(capsys, "verify", out, "--no-progress")
    assert code == 1 and f"{path}: size is" in stdout and "shard-000001" not in stdout


def test_verify_detects_a_tampered_length_in_the_index(capsys, dataset):
    out, _ = dataset
    index = ShardIndex.load(str(out))
    index.shards[1].lengths[0] += 1
    index.save(str(out))
    code, stdout, _ = run(capsys, "verify", out, "--no-progress")
    assert code == 1 and str(out / "shard-000001.tar") in stdout and "length" in stdout
    assert "the index says" in stdout and "shard-000000" not in stdout


def test_verify_detects_a_tampered_length_in_a_shard(capsys, dataset):
    out, _ = dataset
    path = _first_shard(out)
    data = open(path, "rb").read()
    first_len = ShardIndex.load(str(out)).shards[0].lengths[0]
    old = f'"length":{first_len},'.encode()
    new = f'"length":{first_len + 1},'.encode()  # same size: the tar stays readable
    assert data.count(old) == 1
    open(path, "wb").write(data.replace(old, new))
    code, stdout, _ = run(capsys, "verify", out, "--no-progress")
    assert code == 1 and "sha256" in stdout and f".json length {first_len + 1}" in stdout


def test_verify_detects_a_missing_shard_and_missing_index(capsys, dataset, tmp_path):
    out, _ = dataset
    os.remove(out / "shard-000002.tar")
    code, stdout, _ = run(capsys, "verify", out, "--no-progress")
    assert code == 1 and f"{out / 'shard-000002.tar'}: missing" in stdout
    code, _, err = run(capsys, "verify", tmp_path / "nowhere")
    assert code == 2 and "no dataset index" in err


def test_unexpected_errors_are_one_line_unless_debug(capsys, monkeypatch, audio_folder, tmp_path):
    folder, _ = audio_folder

    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(writer, "write_shards", boom)
    code, _, err = run(capsys, "write", folder, tmp_path / "ds")
    assert code == 1 and err.strip().count("\n") == 0 and "RuntimeError: boom" in err and "Traceback" not in err
    monkeypatch.setenv("STREAMBATCH_DEBUG", "1")
    with pytest.raises(RuntimeError):
        main(["write", str(folder), str(tmp_path / "ds")])


@pytest.mark.parametrize(
    "command,options",
    [
        (
            "write",
            [
                "--kind",
                "--unit",
                "--sample-rate",
                "--data-root",
                "--max-count",
                "--max-size",
                "--shuffle",
                "--seed",
                "--workers",
                "--on-error",
                "--overwrite",
                "--storage-option",
            ],
        ),
        ("inspect", ["--budget", "--num-buckets", "--plot", "--json"]),
        ("verify", ["--no-progress"]),
        ("demo", ["--num-utterances", "--seed"]),
    ],
)
def test_help_documents_every_option(capsys, command, options):
    code, stdout, _ = run(capsys, command, "--help")
    assert code == 0
    for opt in options:
        assert opt in stdout


def test_usage_errors_exit_2(capsys, tmp_path):
    assert run(capsys)[0] == 2
    assert run(capsys, "write", tmp_path, tmp_path / "o", "--max-size", "lots")[0] == 2
    assert run(capsys, "write", tmp_path, tmp_path / "o", "--workers", "0")[0] == 2


def test_demo_is_wired_to_run_demo(capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("streambatch.demo")
    fake.run_demo = lambda out, num_utterances=2400, seed=0: calls.append((out, num_utterances, seed)) or 0
    monkeypatch.setitem(sys.modules, "streambatch.demo", fake)
    assert run(capsys, "demo", "/tmp/x", "--num-utterances", "50", "--seed", "4")[0] == 0
    assert calls == [("/tmp/x", 50, 4)]


def test_storage_options_nest():
    pairs = [
        cli.args.storage_option("key=x"),
        cli.args.storage_option("client_kwargs.endpoint_url=http://h:1"),
        cli.args.storage_option("anon=true"),
    ]
    assert cli.args.storage_options_from(pairs) == {
        "key": "x",
        "client_kwargs": {"endpoint_url": "http://h:1"},
        "anon": True,
    }


def test_console_script_exit_codes(tmp_path):
    """The installed entry point, as a user runs it: bad input → 2, no traceback."""
    m = write_jsonl(tmp_path / "m.jsonl", [{"audio_filepath": "gone.wav", "duration": 1}])
    p = subprocess.run(
        [sys.executable, "-m", "streambatch.cli", "write", str(m), str(tmp_path / "ds")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and f"{m}:1: audio file not found" in p.stderr and "Traceback" not in p.stderr


# ---- edge errors: one line naming the file or value, exit 2 (issue 14, item 5) ----------------------
def _one_line_exit_2(code, err, *needles):
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "unexpected error" not in err and "Traceback" not in err
    for n in needles:
        assert str(n) in err, err


def test_write_into_a_file_or_below_one_exits_2(capsys, tmp_path, audio_folder):
    folder, _ = audio_folder
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    _one_line_exit_2(*run(capsys, "write", folder, a_file, "--no-progress")[::2], a_file, "not a folder")
    _one_line_exit_2(
        *run(capsys, "write", folder, a_file / "out", "--no-progress")[::2], a_file / "out", "not a directory"
    )


def _world_readable_copy(folder) -> str:
    """A copy of ``folder`` under a fresh /tmp folder that every user can read (pytest's tmp_path is 0700)."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="sb-perm-")
    os.chmod(base, 0o755)
    shutil.copytree(folder, os.path.join(base, "audio"))
    for d, _, files in os.walk(base):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return base


def test_write_permission_denied_exits_2(capsys, tmp_path, audio_folder):
    """A real EACCES: chmod 0555 denies an ordinary user; root ignores modes, so as root the command runs as
    the unprivileged user 'nobody' (setpriv), and the test is skipped where neither can be arranged."""
    import shutil

    folder, _ = audio_folder
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        _one_line_exit_2(
            *run(capsys, "write", folder, locked / "out", "--no-progress")[::2], locked / "out", "permission denied"
        )
        return
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no way to be denied a folder")
    base = _world_readable_copy(folder)
    try:
        locked = os.path.join(base, "locked")
        os.mkdir(locked, 0o555)
        for out in (os.path.join(locked, "out"), locked):  # a folder to create in it, and the folder itself
            p = subprocess.run(
                [
                    "setpriv",
                    "--reuid",
                    "65534",
                    "--regid",
                    "65534",
                    "--clear-groups",
                    sys.executable,
                    "-m",
                    "streambatch.cli",
                    "write",
                    os.path.join(base, "audio"),
                    out,
                    "--no-progress",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=base,
            )
            if "No module named" in p.stderr:
                pytest.skip("user 'nobody' cannot import streambatch here")
            _one_line_exit_2(p.returncode, p.stderr, locked, "permission denied")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_non_utf8_first_line_is_reported_as_not_utf8(capsys, tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_bytes(b'\xff\xfe{"audio_filepath": "a.wav", "duration": 1}\n')
    code, _, err = run(capsys, "write", m, tmp_path / "ds", "--no-progress")
    _one_line_exit_2(code, err, f"{m}:1: not UTF-8 text", "0xff")
    assert "SpeechBrain" not in err
    m.write_bytes('{"audio_filepath": "a.wav", "text": "café"}\n'.encode("latin-1"))
    _one_line_exit_2(*run(capsys, "write", m, tmp_path / "ds", "--no-progress")[::2], f"{m}:1: not UTF-8 text")


@pytest.mark.parametrize("budget", ["nan", "inf", "0", "-2s", "lots", "3 tokens"])
def test_inspect_bad_budget_exits_2(capsys, dataset, budget):
    out, _ = dataset
    _one_line_exit_2(*run(capsys, "inspect", out, f"--budget={budget}")[::2], "--budget", budget)


def test_inspect_few_samples_suggests_no_boundaries(capsys, tmp_path):
    """60 samples at ~32 per suggested batch: splitting them into buckets would only leave part-filled batches."""
    from streambatch.synthetic import write_audio_corpus

    write_audio_corpus(str(tmp_path / "audio"), 60, seed=1, sample_rate=8000)
    assert main(["write", str(tmp_path / "audio"), str(tmp_path / "ds"), "--no-progress"]) == 0
    code, stdout, err = run(capsys, "inspect", tmp_path / "ds", "--json")
    assert code == 0, err
    assert json.loads(stdout)["bucket_boundaries"] == []
    code, stdout, _ = run(capsys, "inspect", tmp_path / "ds")
    assert "buckets    1 (no boundaries: 60 samples are too few" in stdout
    code, stdout, _ = run(capsys, "inspect", tmp_path / "ds", "--num-buckets", "4")
    assert code == 0 and "buckets    4 (3 boundaries)" in stdout  # asked for: given


def test_inspect_plot_draws_a_readable_number_of_boundaries(capsys, dataset, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from streambatch.cli.inspect import MAX_PLOTTED_BOUNDARIES, plotted_boundaries

    drawn = []
    real = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(
        matplotlib.axes.Axes, "axvline", lambda self, x, *a, **k: drawn.append(x) or real(self, x, *a, **k)
    )
    out, _ = dataset
    bounds = [float(b) for b in range(1, 41)]
    monkeypatch.setattr("streambatch.cli.inspect.estimate_boundaries", lambda *a, **k: bounds)
    code, _, err = run(capsys, "inspect", out, "--plot", tmp_path / "p.png")
    assert code == 0, err
    assert len(drawn) == MAX_PLOTTED_BOUNDARIES
    assert plotted_boundaries(bounds)[0] == 1.0 and plotted_boundaries(bounds)[-1] == 40.0
    assert plotted_boundaries(bounds[:5]) == bounds[:5]


def test_every_option_of_every_command_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in sub.choices.items()
        for a in p._actions
        if not a.help and not isinstance(a, cli.argparse._HelpAction)
    ]
    assert missing == []
    epilog = sub.choices["calibrate"].epilog
    assert "Example: shardify calibrate " in epilog and "python -m" not in epilog


def test_calibrate_max_batch_size_must_be_positive(capsys):
    code, _, err = run(capsys, "calibrate", "ds", "--model", "m:f", "--max-batch-size", "0")
    assert code == 2 and "--max-batch-size: must be at least 1: '0'" in err


def test_the_command_line_starts_without_torch():
    """`shardify` and every subcommand's parser load without torch (about a second and a half of start-up each
    time a job, a test or a pool worker runs a command); only the loader and calibration pull it in."""
    code = "import sys, streambatch.cli; streambatch.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
