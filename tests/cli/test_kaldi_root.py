"""A Kaldi folder whose ``wav.scp`` paths are relative to another folder than the working directory: one line
with the count, the first path and ``--data-root`` (it printed a "not found" line per recording and no hint);
with ``--data-root`` the same folder writes. A single missing file among found ones is still bad input of its own."""

from __future__ import annotations

import os

from conftest import make_audio

from streambatch.cli import main


def kaldi_folder(root, n=30):
    """``root/data/train`` with a wav.scp of ``n`` paths relative to ``root``."""
    lines = []
    for i in range(n):
        make_audio(root / "corpus" / f"u{i:03d}.wav", 0.1, seed=i)
        lines.append(f"u{i:03d} corpus/u{i:03d}.wav")
    folder = root / "data" / "train"
    folder.mkdir(parents=True)
    (folder / "wav.scp").write_text("\n".join(lines) + "\n")
    return folder


def test_relative_paths_from_another_folder_are_one_line_naming_data_root(capsys, tmp_path, monkeypatch):
    folder = kaldi_folder(tmp_path / "recipe")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["write", str(folder), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "30 relative audio paths" in err and "'corpus/u000.wav'" in err and "--data-root" in err
    assert not (tmp_path / "out").exists()
    code = main(["write", str(folder), str(tmp_path / "out"), "--no-progress", "--data-root", str(tmp_path / "recipe")])
    assert code == 0
    assert "wrote 30 samples" in capsys.readouterr().out


def test_one_missing_file_among_found_ones_is_its_own_bad_input(capsys, tmp_path, monkeypatch):
    folder = kaldi_folder(tmp_path / "recipe", n=5)
    os.remove(tmp_path / "recipe" / "corpus" / "u002.wav")
    monkeypatch.chdir(tmp_path / "recipe")
    capsys.readouterr()
    assert main(["write", str(folder), str(tmp_path / "out"), "--no-progress", "--on-error", "skip"]) == 0
    out, err = capsys.readouterr()
    assert "wrote 4 samples" in out and "skipped 1 bad input" in err
