"""Mixture weights that change over training: ``weights`` as a list per epoch or a callable of the epoch, over two
real datasets. Each epoch takes exactly what its weights say, the callable equals the list, ``len()`` follows the
epoch, a resume mid-epoch continues exactly (0 and 2 workers), and every epoch's weights are checked."""

from __future__ import annotations

import collections

import pytest

from streambatch import StreamBatchLoader
from streambatch.errors import OptionError
from streambatch.synthetic import write_audio_corpus
from streambatch.write.writer import write_shards

SR = 8000
SIZES = {"a": 20, "b": 12}
SCHEDULE = [{"a": 1, "b": 1}, {"a": 3, "b": 1}, {"a": 1, "b": 2}]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    """Two small real audio datasets, several shards each."""
    root = tmp_path_factory.mktemp("schedule")
    for i, (name, n) in enumerate(SIZES.items()):
        write_audio_corpus(str(root / f"{name}-audio"), n, seed=20 + i, sample_rate=SR)
        write_shards(str(root / f"{name}-audio"), str(root / name), max_count=5, shuffle=True, seed=i, progress=False)
    return {name: str(root / name) for name in SIZES}


def make(datasets: dict[str, str], weights, num_workers: int = 0, **kw) -> StreamBatchLoader:
    return StreamBatchLoader(datasets, weights=weights, budget=10 * SR, num_workers=num_workers, buffer_size=16, **kw)


def samples(batches) -> list[list[tuple[str, str]]]:
    """Each batch as its (dataset, key) pairs."""
    return [list(zip(b["dataset"], b["keys"])) for b in batches]


def run_epochs(loader: StreamBatchLoader, epochs: int) -> list[list[list[tuple[str, str]]]]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        steps = len(loader)
        got = samples(loader)
        assert len(got) == steps  # len() follows the epoch's weights
        out.append(got)
    return out


def check_counts(epoch: int, batches: list[list[tuple[str, str]]]) -> None:
    """Epoch ``epoch`` takes round(w·N) of each dataset; a whole-number weight takes every sample exactly w times."""
    per_key = collections.Counter(s for b in batches for s in b)
    per_dataset = collections.Counter(d for d, _ in per_key.elements())
    weights = SCHEDULE[min(epoch, len(SCHEDULE) - 1)]
    assert dict(per_dataset) == {n: weights[n] * SIZES[n] for n in SIZES}
    for name in SIZES:
        assert {c for (d, _), c in per_key.items() if d == name} == {weights[name]}
        assert len({k for d, k in per_key if d == name}) == SIZES[name]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_epoch_takes_what_its_weights_say_and_a_callable_equals_the_list(datasets, num_workers):
    listed = run_epochs(make(datasets, SCHEDULE, num_workers), 4)
    for epoch, batches in enumerate(listed):
        check_counts(epoch, batches)  # the last entry holds for epoch 3
    assert len(listed[1]) > len(listed[0])  # three times dataset a: more steps
    calls = []

    def weights(epoch: int) -> dict[str, float]:
        calls.append(epoch)
        return SCHEDULE[min(epoch, 2)]

    called = run_epochs(make(datasets, weights, num_workers, persistent_workers=num_workers > 0), 4)
    assert called == listed
    assert calls == [0, 1, 2, 3, 4]  # once per epoch (the last pass moved on to epoch 4), in the main process


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_2_is_exact(datasets, num_workers):
    """A state after k batches of the second epoch; a new loader continues it and the third epoch exactly."""
    whole = run_epochs(make(datasets, SCHEDULE, num_workers), 3)
    loader = make(datasets, SCHEDULE, num_workers)
    loader.set_epoch(1)
    k = 7
    head = []
    for batch in loader:
        head.append(batch)
        if len(head) == k:
            break
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches_consumed"] == k
    assert {row[0]: row[1] for row in state["mixture"]} == {"a": 3.0, "b": 1.0}  # the weights in force
    resumed = make(datasets, lambda e: SCHEDULE[min(e, 2)], num_workers)  # the same schedule, as a callable
    resumed.load_state_dict(state)
    assert len(resumed) == len(whole[1]) and resumed.remaining == len(whole[1]) - k
    rest = samples(resumed)
    assert samples(head) + rest == whole[1]
    assert resumed.epoch == 2 and len(resumed) == len(whole[2])
    assert samples(resumed) == whole[2]


def test_a_resume_on_other_weights_for_the_saved_epoch_is_refused(datasets):
    loader = make(datasets, SCHEDULE)
    loader.set_epoch(1)
    next(iter(loader))
    state = loader.state_dict()
    other = make(datasets, [{"a": 1, "b": 1}, {"a": 2, "b": 1}])
    with pytest.raises(ValueError, match=r"epoch 1 with weights \{'a': 3.0, 'b': 1.0\}.*\{'a': 2.0, 'b': 1.0\}"):
        other.load_state_dict(state)
    earlier = make(datasets, [{"a": 2, "b": 1}, {"a": 3, "b": 1}])  # same weights at epoch 1, another history
    with pytest.raises(ValueError, match="resume with the schedule the state was saved with"):
        earlier.load_state_dict(state)
    fixed = make(datasets, {"a": 3, "b": 1})  # fixed weights: the mixture differs as well
    with pytest.raises(ValueError, match="mixture"):
        fixed.load_state_dict(state)


def test_fixed_weights_go_on_under_a_schedule_that_gave_the_same_weights(datasets):
    """Adding an annealing phase to a run on fixed weights: a state saved between epochs resumes under a schedule
    whose earlier epochs had those weights (it takes what set_epoch would); one saved mid-epoch is refused with
    the reason (the same samples, other batches), not "other weights before it"."""
    w, anneal = {"a": 1, "b": 2}, {"a": 3, "b": 1}
    fixed = make(datasets, w)
    run_epochs(fixed, 2)
    state = fixed.state_dict()
    assert state["epoch"] == 2 and state["batches_consumed"] == 0
    resumed = make(datasets, [w, w, anneal])
    resumed.load_state_dict(state)
    fresh = make(datasets, [w, w, anneal])
    fresh.set_epoch(2)
    steps = len(resumed)
    assert steps == len(fresh)
    got = samples(resumed)
    assert got == samples(fresh) and len(got) == steps
    assert collections.Counter(d for b in got for d, _ in b) == {"a": 3 * SIZES["a"], "b": SIZES["b"]}
    back = make(datasets, w)  # and from the schedule's state back to fixed weights, whose draw is the same
    back.load_state_dict(make(datasets, [w, w, anneal]).state_dict())
    assert samples(back) == samples(make(datasets, w))

    fixed.set_epoch(1)
    next(iter(fixed))
    with pytest.raises(ValueError, match=r"during epoch 1 under fixed weights.*the same samples, but .*other batches"):
        make(datasets, [w, w, anneal]).load_state_dict(fixed.state_dict())


def test_plan_of_another_epoch_and_planned_metrics_after_a_pass(datasets):
    loader = make(datasets, SCHEDULE)
    loader.set_epoch(1)
    shares = {name: row["samples"] for name, row in loader.plan(0).datasets.items()}
    assert shares == {"a": 20, "b": 12}  # epoch 0's weights, while the loader stays at epoch 1
    assert {name: row["samples"] for name, row in loader.plan().datasets.items()} == {"a": 60, "b": 12}
    steps = len(loader)
    assert {name: row["samples"] for name, row in loader.plan(2).datasets.items()} == {"a": 20, "b": 24}
    loader.plan(3)
    assert len(loader) == steps and loader.state_dict()["mixture"][0][:2] == ["a", 3.0]  # still at epoch 1
    list(loader)  # epoch 1's pass: the loader moves on to epoch 2
    assert loader.epoch == 2
    assert loader.metrics(planned=True)["planned"]  # of the pass just finished (epoch 1), on its weights
    with pytest.raises(ValueError, match=r"set_epoch\(0\)"):
        loader.schedule(0)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([{"a": 1, "b": 1}, {"a": 1, "b": -1}], r"weights for epoch 1: weights\['b'\]"),
        ([{"a": 1}, {"a": 1, "c": 2}], "epoch 1: weights name unknown datasets: c"),
        ([{"a": 1, "b": 1}, {"a": 1, "b": float("nan")}], "epoch 1"),
        ([{"a": 1, "b": 1}, {"a": 10**9, "b": 1}], r"epoch 1: weights\['a'\]=1e\+09 .*max_plan_bytes"),
    ],
)
def test_every_entry_of_a_list_is_checked_at_construction(datasets, weights, message):
    with pytest.raises(OptionError, match=message):
        make(datasets, weights)


def test_a_callables_result_is_checked_when_its_epoch_is_set(datasets):
    loader = make(datasets, lambda e: {"a": 1, "b": 1} if e < 2 else {"a": "many"})
    loader.set_epoch(1)
    with pytest.raises(OptionError, match=r"weights for epoch 2: weights\['a'\]"):
        loader.set_epoch(2)
    with pytest.raises(ValueError, match="weights= needs several datasets"):
        StreamBatchLoader(next(iter(datasets.values())), weights=SCHEDULE, budget=10 * SR)


def test_a_schedule_that_gives_none_is_refused(datasets):
    """None meant equal weights: a function that missed its ``return`` trained on them without a word."""
    loader = make(datasets, lambda e: {"a": 1, "b": 2} if e < 1 else None)
    with pytest.raises(OptionError, match=r"^weights for epoch 1: the weight function returned None; .*\{\} for equal"):
        loader.set_epoch(1)
    with pytest.raises(OptionError, match=r"^weights for epoch 0: the weight function returned None"):
        make(datasets, lambda e: None)
    with pytest.raises(OptionError, match=r"^weights for epoch 1: the schedule gives None"):
        make(datasets, [{"a": 1, "b": 1}, None])
    assert len(make(datasets, lambda e: {})) == len(make(datasets, {"a": 1, "b": 1}))  # {}: equal weights


def test_where_follows_the_schedule(datasets):
    """A filter keeps working when the epoch's mixture is laid out anew (the filter is not evaluated again)."""
    loader = make(datasets, SCHEDULE, where="length > 0")
    for epoch, batches in enumerate(run_epochs(loader, 3)):
        check_counts(epoch, batches)


def test_a_single_entry_schedule_takes_like_fixed_weights(datasets):
    """Counts equal to fixed weights' (the draw continues its cycles either way)."""
    fixed = run_epochs(make(datasets, {"a": 1, "b": 2}), 2)
    scheduled = run_epochs(make(datasets, [{"a": 1, "b": 2}]), 2)
    for f, s in zip(fixed, scheduled):
        assert collections.Counter(x for b in f for x in b) == collections.Counter(x for b in s for x in b)


def test_resume_mid_epoch_on_another_world_size_takes_the_epochs_weights(datasets):
    """Two ranks stop 2 steps into the second epoch; three ranks resume it: together exactly its weights' counts."""
    old = [make(datasets, SCHEDULE, rank=r, world_size=2) for r in range(2)]
    before, states = [], []
    for loader in old:
        loader.set_epoch(1)
        it = iter(loader)
        before += samples(next(it) for _ in range(2))
        states.append(loader.state_dict())
    new = [make(datasets, SCHEDULE, rank=r, world_size=3) for r in range(3)]
    after = []
    for r, loader in enumerate(new):
        loader.load_state_dict(states[r % 2])
        after += samples(loader)
    assert len({len(loader) for loader in new}) == 1
    check_counts(1, before + after)
