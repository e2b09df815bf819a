"""Which samples were in step k (``loader.step_samples``, ``shardify inspect --step``), and a resume that skips a
range of steps (``load_state_dict(state, skip_steps=...)``), over real shards written by ``shardify write``."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import audio_dataset, text_dataset

from streambatch import OptionError, StreamBatchLoader
from streambatch.cli import main

SR = 8000
BUDGET = 12 * SR
WORLD = 2


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return audio_dataset(tmp_path_factory.mktemp("steps_ds"), 120, 5, SR, max_count=20, shuffle=True, seed=1)


def loader(ds, rank, **options):
    base = dict(budget=BUDGET, buffer_size=30, seed=3, rank=rank, world_size=WORLD)
    return StreamBatchLoader(ds, **{**base, **options})


def steps_of(batches):
    """Each step's keys, the micro-batches of one step joined (sorted: they are dealt by length)."""
    out, part = [], []
    for b in batches:
        part += b["keys"]
        if b.get("last_micro_batch", True):
            out.append(sorted(part) if "micro_batch" in b else part)
            part = []
    return out


def steps_of_keys(steps):
    return [x for step in steps for x in steps_of(step)]


def planned(it, steps, rank, sort=False):
    got = [it.step_samples(k).batches[rank].keys for k in steps]
    return [sorted(k) for k in got] if sort else got


VARIANTS = [
    {"num_workers": 0},
    {"num_workers": 2},
    {"num_workers": 2, "even_batches": "pad", "hardest_first": True},
    {"num_workers": 2, "even_batches": "drop"},
    {"num_workers": 2, "micro_batches": 2},
]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_step_samples_are_what_the_loader_yields_at_every_step(ds, options):
    for rank in range(WORLD):
        a = loader(ds, rank, **options)
        n = len(a)
        expected = planned(a, range(n), rank, sort="micro_batches" in options)
        assert steps_of(a) == expected and len(expected) == n
        one = a.step_samples(n - 1, rank=rank, epoch=0)
        assert list(one.batches) == [rank] and one.batches[rank].keys == a.step_samples(n - 1, epoch=0).keys()[rank]


def test_a_later_epoch_is_named_before_it_runs(ds):
    a = loader(ds, 1, num_workers=2)
    steps = a.plan(2).steps
    ahead = [a.step_samples(k, epoch=2).batches[1].keys for k in range(steps)]
    a.set_epoch(2)
    assert steps_of(a) == ahead and ahead[0] != a.step_samples(0, epoch=0).batches[1].keys


def test_a_step_outside_the_epoch_or_a_rank_outside_the_job_is_an_option_error(ds):
    a = loader(ds, 0)
    n = len(a)
    with pytest.raises(OptionError, match=rf"step {n}: epoch 0 has {n} steps"):
        a.step_samples(n)
    with pytest.raises(OptionError, match="rank=2"):
        a.step_samples(0, rank=2)


def run_to(source, k):
    """The first ``k`` steps' batches (each a list of its micro-batches) and the state after them."""
    it = iter(source)
    got = []
    for _ in range(k):
        step = [next(it)]
        while not step[-1].get("last_micro_batch", True):
            step.append(next(it))
        got.append(step)
    state = source.state_dict()
    it.close()
    return got, state


SKIPS = [  # saved at step, skipped steps [a, b) (None: to the end), options, shards streamed (not read by position)
    (2, (5, 8), {}, False),
    (3, (3, 6), {}, True),
    (0, (0, 3), {"hardest_first": True, "even_batches": "pad"}, False),
    (4, (7, None), {"micro_batches": 2}, True),
]


@pytest.mark.parametrize("saved,skip,options,streamed", SKIPS)
def test_skipping_a_range_yields_exactly_the_other_steps_on_every_rank(
    ds, saved, skip, options, streamed, caplog
):
    # streamed: every shard through the tar parser, as remote shards are read
    options = {"num_workers": 2, "read_by_position": not streamed, **options}
    counts = []
    for rank in range(WORLD):
        full = steps_of(loader(ds, rank, **options))
        a, b = skip[0], skip[1] or len(full)
        before, state = run_to(loader(ds, rank, **options), saved)
        resumed = loader(ds, rank, **options)
        planned_skip = [resumed.step_samples(k).batches[rank].keys for k in range(a, b)]
        with caplog.at_level(logging.WARNING, logger="streambatch"):
            resumed.load_state_dict(state, skip_steps=range(a, b))
        warned = [r.getMessage() for r in caplog.records if "skipping steps" in r.getMessage()]
        assert warned and f"skipping steps {a}-{b - 1} of epoch 0 ({b - a} steps, " in warned[-1]
        n_samples = sum(len(k) for k in planned_skip)
        assert f"{n_samples:,} samples on this rank" in warned[-1]
        rest = steps_of(resumed)
        assert steps_of_keys(before) + rest == full[:a] + full[b:]  # the rest in order, nothing lost or repeated
        seen = {k for keys in rest for k in keys}
        assert not seen & {k for keys in planned_skip for k in keys}  # the skipped samples are absent
        stats = resumed.fault_stats()
        assert (stats["skipped_steps"], stats["skipped_samples"]) == (b - a, n_samples)
        assert resumed.epoch == 1 and resumed.state_dict()["skip_steps"] == []
        counts.append(saved + len(rest))
    assert counts[0] == counts[1]  # every rank steps the same number of times


def test_a_state_saved_after_a_skip_was_asked_for_resumes_with_it(ds):
    full = [x["keys"] for x in loader(ds, 1, num_workers=2)]
    _, state = run_to(loader(ds, 1, num_workers=2), 1)
    first = loader(ds, 1, num_workers=2)
    first.load_state_dict(state, skip_steps=[4, 5, 9])  # any step numbers: runs of them are ranges
    got, again = run_to(first, 2)  # saved before the skipped steps are reached
    assert again["skip_steps"] == [[4, 6], [9, 10]] and again["batches_consumed"] == 3
    second = loader(ds, 1, num_workers=2)
    second.load_state_dict(json.loads(json.dumps(again)))
    rest = [x["keys"] for x in second]
    assert full[:1] + steps_of_keys(got) + rest == full[:4] + full[6:9] + full[10:]


def test_skip_steps_already_consumed_or_beyond_the_epoch_are_refused(ds):
    n = len(loader(ds, 0))
    _, state = run_to(loader(ds, 0), 3)
    with pytest.raises(OptionError, match=r"step 2 of epoch 0 was consumed .* resumes at step 3"):
        loader(ds, 0).load_state_dict(state, skip_steps=range(2, 5))
    with pytest.raises(OptionError, match=rf"epoch 0 has {n} steps \(0 to {n - 1}\); step {n} is beyond it"):
        loader(ds, 0).load_state_dict(state, skip_steps=range(5, n + 1))


@pytest.mark.parametrize(
    "steps, said",
    [
        ([3.5], "skip_steps must be a whole number, got 3.5"),
        (["4"], "skip_steps must be a whole number"),
        ([-1], "skip_steps must be at least 0"),
        (range(-2, 3), "skip_steps must be at least 0"),
        (7, "give step numbers"),
    ],
)
def test_skip_steps_that_are_not_step_numbers_are_refused(ds, steps, said):
    """A step number is a whole number from 0: 3.5 is not step 3 (it was taken as 3), "4" not step 4."""
    _, state = run_to(loader(ds, 0), 1)
    with pytest.raises(OptionError, match=said):
        loader(ds, 0).load_state_dict(state, skip_steps=steps)


def test_steps_before_a_resume_on_another_layout_are_named_as_they_ran(ds):
    """Saved at step 3 on 2 ranks, resumed on 1: steps 0-2 are the 2-rank plan's, the rest the new layout's."""
    old = [[x["keys"] for x in loader(ds, r, num_workers=2)] for r in range(WORLD)]
    _, state = run_to(loader(ds, 0, num_workers=2), 3)
    one = StreamBatchLoader(ds, budget=BUDGET, buffer_size=30, seed=3, rank=0, world_size=1)
    one.load_state_dict(state)
    assert [one.step_samples(k).keys() for k in range(3)] == [{r: old[r][k] for r in range(WORLD)} for k in range(3)]
    n = len(one)
    ahead = [one.step_samples(k).batches[0].keys for k in range(3, n)]
    assert [x["keys"] for x in one] == ahead


def test_a_mixtures_steps_name_each_samples_dataset(tmp_path):
    for name in "ab":
        (tmp_path / name).mkdir()
    mix = {name: text_dataset(tmp_path / name, 60, seed, max_count=15) for name, seed in (("a", 1), ("b", 2))}
    a = StreamBatchLoader(mix, 400, weights={"a": 2, "b": 1}, buffer_size=20, seed=1)
    expected = [[(s.dataset, s.key) for s in a.step_samples(k).batches[0].samples] for k in range(len(a))]
    assert [list(zip(x["dataset"], x["keys"])) for x in a] == expected
    assert {d for step in expected for d, _ in step} == {"a", "b"}


def test_inspect_step_prints_step_samples_one_line_per_rank(ds, capsys):
    args = ["--budget", str(BUDGET), "--world-size", "2", "--num-workers", "2", "--seed", "3", "--epoch", "1"]
    a = StreamBatchLoader(ds, budget=BUDGET, seed=3, rank=0, world_size=2, num_workers=2)
    want = a.step_samples(4, epoch=1)
    assert main(["inspect", ds, "--step", "4", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 4 of epoch 1 (2 ranks x 2 workers")
    assert out[1:] == want.lines() and len(out) == 3
    assert main(["inspect", ds, "--step", "4", "--json", *args]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [s["key"] for s in got["ranks"]["1"]] == want.batches[1].keys
    assert main(["inspect", ds, "--step", "100000", *args]) == 2
    assert "epoch 1 has" in capsys.readouterr().err
