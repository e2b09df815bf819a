"""``shardify demo``: writes a small dataset, streams it three ways, prints the comparison table."""

from __future__ import annotations

import re

import numpy as np

from streambatch.demo import fixed_random_batches, fixed_sorted_batches, run_demo


def _rows(text: str) -> dict[str, list[str]]:
    """The table rows by their label "(a)", "(b)", "(c)": the figures after the method name."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\((a|b|c)\) .*?\s{2,}(\S.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2).split()
    return rows


def test_demo_table(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run_demo(str(out), num_utterances=300, seed=0) == 0
    text = capsys.readouterr().out
    rows = _rows(text)
    assert set(rows) == {"a", "b", "c"}, text
    # columns: batches, samples/batch, padding %, over budget, max cost/budget, samples/s, batch-mates kept %
    batches = {k: int(v[0].replace(",", "")) for k, v in rows.items()}
    padding = {k: float(v[2]) for k, v in rows.items()}
    over = {k: v[3] for k, v in rows.items()}
    cost = {k: float(v[4]) for k, v in rows.items()}
    kept = {k: float(v[6]) for k, v in rows.items()}  # same batch-mates next epoch %
    assert kept["b"] == 100.0 and kept["a"] < 10.0, text  # (c) depends on the dataset beside its window
    assert padding["c"] < padding["a"], text
    assert over["c"] == f"0/{batches['c']}", text
    assert cost["c"] <= 1.0
    # the fixed rows use streambatch's mean batch size, so they have about as many batches
    assert abs(batches["a"] - batches["c"]) <= 1 and batches["a"] == batches["b"]
    assert (out / "shards" / "index.json").exists()
    assert len(list((out / "audio").glob("*.flac"))) == 300
    assert "StreamBatchLoader(" in text and str(out / "shards") in text


def test_demo_reuses_existing_data(tmp_path, capsys):
    out = tmp_path / "demo"
    run_demo(str(out), num_utterances=120, seed=1)
    first = capsys.readouterr().out
    index = (out / "shards" / "index.json").read_bytes()
    assert "reusing" not in first
    assert run_demo(str(out), num_utterances=120, seed=1) == 0
    second = capsys.readouterr().out
    assert "reusing" in second
    assert (out / "shards" / "index.json").read_bytes() == index
    assert set(_rows(second)) == {"a", "b", "c"}


def test_fixed_baselines_cover_every_sample_once():
    lengths = np.random.default_rng(0).integers(1, 100, 103)
    for batches in (fixed_random_batches(103, 10, 0), fixed_sorted_batches(lengths, 10, 0)):
        assert sorted(np.concatenate(batches).tolist()) == list(range(103))
        assert [len(b) for b in batches].count(10) == 10
    # sorted batches hold neighbouring lengths
    sb = fixed_sorted_batches(lengths, 10, 0)
    spans = [lengths[b].max() - lengths[b].min() for b in sb]
    assert max(spans) < 30


def test_batch_mates_kept_counts_pairs_batched_together_again():
    from streambatch.demo import batch_mates_kept

    a = [np.array([0, 1, 2]), np.array([3, 4])]
    assert batch_mates_kept(a, a[::-1], 5) == 1.0  # the same batches in another order
    assert batch_mates_kept(a, [np.array([0, 3]), np.array([1, 4]), np.array([2])], 5) == 0.0
    assert batch_mates_kept(a, [np.array([0, 1]), np.array([2, 3, 4])], 5) == 2 / 4  # (0,1) and (3,4) of 4 pairs


def test_demo_says_what_it_does_before_the_data_is_written(tmp_path):
    """The demo's first line comes before its data is written (it printed nothing for the 17-27 s that took),
    and into a pipe no progress bar's \\r redraws."""
    import subprocess
    import sys

    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streambatch.cli", "demo", str(out), "--num-utterances", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        first = proc.stdout.readline().decode()
        written = (out / "shards" / "index.json").exists()
        rest, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert first.startswith("writing 200 synthetic utterances") and not written
    text = first + rest.decode()
    assert "writing them as shards" in text and "\nstreaming: " in text
    assert b"\r" not in err and "\r" not in text
