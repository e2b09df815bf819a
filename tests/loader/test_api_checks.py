"""What a careless caller hands the public API besides the options: a ``state_dict`` whose fields hold garbage, a
planning call with arguments of the wrong type, ``set_epoch`` in the middle of a pass, a shard pattern of 10⁹
names. Each is refused where it comes in, as one line of the package's own error naming the field or argument
(found by a probe of the API, 2026-11-27); a state the loader saved still loads."""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest
from braceexpand import braceexpand
from conftest import text_dataset

from streambatch import BatchingConfig, Layout, OptionError, StateError, StreamBatchLoader, plan_batches
from streambatch.loader.state import pack_mask
from streambatch.plan.epoch import make_epoch_plan
from streambatch.plan.resume import equalised_of
from streambatch.select.source import MAX_SHARD_URLS, brace_count, expand_urls

BUDGET = 400
RUN = {"world_size": 2, "num_workers": 1, "even_batches": "pad", "hardest_first": False}  # an earlier layout


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("api"), 60, seed=3)


def mid_epoch_state(ds, **kw):
    loader = StreamBatchLoader(ds, BUDGET, **kw)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    it.close()
    return state


@pytest.fixture(scope="module")
def relaid(ds):
    """A state of a resume on another layout, with skipped steps: earlier_layouts, equalised and skip_steps full."""
    old = StreamBatchLoader(ds, BUDGET, rank=0, world_size=2, even_batches="pad")
    it = iter(old)
    for _ in range(2):
        next(it)
    saved = old.state_dict()
    it.close()
    loader = StreamBatchLoader(ds, BUDGET)
    loader.load_state_dict(saved)
    loader.load_state_dict(saved, skip_steps=range(loader.consumed + 1, loader.consumed + 2))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    assert state["earlier_layouts"] and state["equalised"] and state["skip_steps"]
    return json.loads(json.dumps(state))  # as a JSON checkpoint holds it


# ---- 1. every field of a state_dict is checked where the typed state is built --------------------------------------
GARBAGE = [
    ("skip_steps", "x"),
    ("skip_steps", ["a"]),
    ("skip_steps", [[-5, -1]]),
    ("skip_steps", [[3, 2]]),
    ("skip_steps", [[1, 2, 3]]),
    ("skip_steps", [[1.5, 4]]),
    ("skip_steps", [[0, float("nan")]]),
    ("skip_steps", [[0, 10**15]]),
    ("skip_steps", {"a": 1}),
    ("excluded", "x"),
    ("excluded", 5),
    ("excluded", ["abc"]),
    ("excluded", pack_mask(np.zeros(8, dtype=bool))),  # a mask of 8 samples for a dataset of 60
    ("earlier_layouts", "x"),
    ("earlier_layouts", {"world_size": 2}),
    ("earlier_layouts", [{"world_size": "a"}]),
    ("earlier_layouts", [5]),
    ("earlier_layouts", [RUN]),  # no steps or consumed
    ("earlier_layouts", [{**RUN, "steps": -1, "consumed": 0}]),
    ("earlier_layouts", [{**RUN, "steps": 5, "consumed": 9}]),
    ("earlier_layouts", [{**RUN, "world_size": 0, "steps": 5, "consumed": 1}]),
    ("earlier_layouts", [{**RUN, "even_batches": "odd", "steps": 5, "consumed": 1}]),
    ("earlier_layouts", [{**RUN, "steps": float("nan"), "consumed": 1}]),
    ("equalised", [[1, 2]]),
    ("equalised", "x"),
    ("equalised", [[0, 1, 0, 0, 10**9, -1, 1]]),  # more repeats than steps
    ("equalised", [[0, 1, 0, 0, 0, -1, "a"]]),
    ("batches_consumed", 10**6),
    ("steps", -3),
    ("steps", "11"),
    ("epoch", 2**70),
    ("world_size", "1"),
    ("num_workers", 0),
    ("even_batches", "weird"),
    ("hardest_first", "yes"),
    ("num_samples", -1),
    ("mixture", {"a": 1}),
    ("where", 5),
    ("batching", 5),
    ("seed", "x"),
    ("plan_version", "3"),
]


@pytest.mark.parametrize("field,value", GARBAGE, ids=[f"{f}={str(v)[:30]}" for f, v in GARBAGE])
def test_a_state_field_holding_garbage_is_a_state_error_naming_it(ds, field, value):
    state = mid_epoch_state(ds)
    state[field] = value
    loader = StreamBatchLoader(ds, BUDGET)
    with pytest.raises(StateError, match=f"loader state: {field}") as got:
        loader.load_state_dict(state)
    assert "\n" not in str(got.value) and len(str(got.value)) < 400
    assert isinstance(got.value, ValueError)  # what callers caught before
    assert loader.epoch == 0 and loader.consumed == 0  # refused before anything moved
    assert len(list(loader)) == len(loader)


def test_a_state_the_loader_saved_still_loads_after_a_relayout_and_skips(ds, relaid):
    loader = StreamBatchLoader(ds, BUDGET)
    loader.load_state_dict(copy.deepcopy(relaid))
    assert loader.state_dict()["earlier_layouts"] == relaid["earlier_layouts"]
    assert loader.state_dict()["skip_steps"] == relaid["skip_steps"]
    assert loader.consumed + loader.remaining == len(loader)
    assert sum(1 for _ in loader) <= loader.remaining  # the skipped steps are not yielded; the pass ends as planned
    assert loader.epoch == 1


def test_an_oldest_format_mask_of_the_right_size_loads(ds):
    mask = np.zeros(60, dtype=bool)
    mask[:5] = True
    loader = StreamBatchLoader(ds, BUDGET)
    loader.load_state_dict({"epoch": 0, "excluded": pack_mask(mask), "num_samples": 60})
    assert sum(len(b["keys"]) for b in loader) == 55  # the masked samples are left out


@pytest.mark.parametrize("even", ["split", "drop", "pad"])
@pytest.mark.parametrize("hardest", [False, True])
def test_every_equalisation_a_plan_makes_passes_the_checks(even, hardest):
    rng = np.random.default_rng(7)
    lengths = [rng.integers(1, 300, size=int(rng.integers(5, 60))) for _ in range(9)]
    for world, workers in [(1, 1), (2, 3), (4, 2), (3, 1)]:
        layout = Layout(world, workers, even, hardest)
        plan = make_epoch_plan(lengths, BatchingConfig(budget=900.0), 2, layout)
        rows = [r.to_ints() for r in plan.equalised]
        assert equalised_of(json.loads(json.dumps(rows)), layout, plan.steps) == tuple(plan.equalised)


# ---- 2. the planning calls check their arguments where they come in -----------------------------------------------
@pytest.mark.parametrize(
    "call,named",
    [
        (lambda lo: lo.step_samples("3"), "step"),
        (lambda lo: lo.step_samples(1.5), "step"),
        (lambda lo: lo.step_samples(float("nan")), "step"),
        (lambda lo: lo.step_samples(-1), "step"),
        (lambda lo: lo.step_samples(0, rank="0"), "rank"),
        (lambda lo: lo.step_samples(0, rank=-1), "rank"),
        (lambda lo: lo.step_samples(0, epoch=-1), "epoch"),
        (lambda lo: lo.step_samples(0, epoch="1"), "epoch"),
        (lambda lo: lo.plan(-1), "epoch"),
        (lambda lo: lo.plan("x"), "epoch"),
        (lambda lo: lo.schedule(2.5), "epoch"),
        (lambda lo: lo.set_epoch(2**70), "epoch"),
    ],
)
def test_a_planning_call_with_a_bad_argument_names_it(ds, call, named):
    loader = StreamBatchLoader(ds, BUDGET)
    with pytest.raises(OptionError, match=f"^{named} must be") as got:
        call(loader)
    assert "\n" not in str(got.value)


L3 = [10, 20, 30]


@pytest.mark.parametrize(
    "kw,named",
    [
        ({"lengths": ["a", "b"]}, "lengths"),
        ({"lengths": np.ones((3, 3))}, "lengths"),
        ({"lengths": np.array([np.nan, 10, 20])}, "lengths"),
        ({"lengths": np.array([np.inf, 10, 20])}, "lengths"),
        ({"lengths": np.array([-5, 10, 20])}, "lengths"),
        ({"lengths": "abc"}, "lengths"),
        ({"lengths": 5}, "lengths"),
        ({"lengths": [[1], [2, 3]]}, "lengths"),
        ({"options": {"output_budget": 50}, "output_lengths": [1]}, "output_lengths"),
        ({"options": {"output_budget": 50}, "output_lengths": [1, np.nan, 3]}, "output_lengths"),
        ({"options": {"output_budget": 50}}, "output_budget"),
        ({"options": {"batch_by": "dataset"}, "groups": ["a", "b", "c"]}, "groups"),
        ({"options": {"batch_by": "dataset"}, "groups": [0]}, "groups"),
        ({"options": {"batch_by": "dataset"}}, "batch_by"),
        ({"config": BatchingConfig.make(50)}, "plan_batches: pass either config= or"),
        ({"budget": None, "config": "config"}, "config"),
    ],
)
def test_plan_batches_arguments_are_checked_at_the_entry_point(kw, named):
    args = {"lengths": L3, "budget": 100, "config": None, "output_lengths": None, "groups": None, **kw}
    options = args.pop("options", {})
    with pytest.raises(OptionError, match=f"^{named}") as got:
        plan_batches(**args, **options)
    assert "\n" not in str(got.value)


def test_plan_batches_inputs_that_are_fine_pass_through():
    plan = plan_batches([10, 20.5, 5, 40], 100, groups=[1, 1, 2, 2], batch_by="dataset")
    assert sorted(plan.flat.tolist()) == [0, 1, 2, 3]  # every sample once
    assert all(len({[1, 1, 2, 2][i] for i in b}) == 1 for b in plan)  # no batch holds two groups
    assert len(plan_batches([], 100)) == 0


# ---- 3. set_epoch (and load_state_dict) during a pass ---------------------------------------------------------------
def test_set_epoch_during_a_pass_is_refused_and_the_pass_goes_on(ds):
    loader = StreamBatchLoader(ds, BUDGET)
    steps = len(loader)
    it = iter(loader)
    next(it)
    with pytest.raises(StateError, match=r"set_epoch\(3\) during a pass of epoch 0.*between passes") as got:
        loader.set_epoch(3)
    assert "\n" not in str(got.value)
    loader.set_epoch(0)  # the epoch it is in: nothing moves
    assert 1 + sum(1 for _ in it) == steps  # the pass ends as planned (no count mismatch)
    assert loader.epoch == 1
    loader.set_epoch(3)  # between passes: as DistributedSampler users call it
    assert loader.epoch == 3 and sum(1 for _ in loader) == len(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_second_pass_while_one_is_open_is_refused(ds, workers):
    """Two iterators of one loader at once would both yield the epoch's batches (found by a probe: the same
    batches twice, then a count mismatch). The second is refused; the first goes on; once it is closed (or
    dropped) a new pass resumes where it stopped."""
    loader = StreamBatchLoader(ds, BUDGET, num_workers=workers)
    steps = len(loader)
    first = iter(loader)
    seen = [next(first)["keys"]]
    with pytest.raises(StateError, match=r"a second iter\(loader\) during a pass of epoch 0"):
        next(iter(loader))
    seen.append(next(first)["keys"])
    del first  # an abandoned pass: the next one yields the rest
    seen += [b["keys"] for b in loader]
    assert len(seen) == steps and sorted(k for b in seen for k in b) == sorted(f"s{i}" for i in range(60))


def test_load_state_dict_during_a_pass_is_refused(ds):
    loader = StreamBatchLoader(ds, BUDGET)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(StateError, match=r"load_state_dict\(\) during a pass"):
        loader.load_state_dict(state)
    it.close()  # an ended pass: now it loads
    loader.load_state_dict(state)
    assert loader.consumed == 1


# ---- 4. a shard pattern is counted before it is expanded ----------------------------------------------------------
def test_a_pattern_of_a_billion_shards_is_refused_at_once():
    pattern = "shards/shard-{000000000..999999999}.tar"
    t0 = time.perf_counter()
    with pytest.raises(OptionError, match=r"shard-\{000000000\.\.999999999\}\.tar.*1,000,000,000 shard URLs") as got:
        expand_urls(pattern)
    assert time.perf_counter() - t0 < 1.0
    assert f"{MAX_SHARD_URLS:,}" in str(got.value)
    with pytest.raises(OptionError, match="source: the pattern"):
        StreamBatchLoader(pattern, BUDGET)
    with pytest.raises(OptionError, match=r"20,000,000 in all"):  # a list counts in all
        expand_urls(["a-{0000000..9999999}.tar", "b-{0000000..9999999}.tar"])


@pytest.mark.parametrize(
    "pattern",
    ["a", "x{1..3}", "{07..10}", "{a..g..2}", "{4..1}", "{2..-1}", "python{2.{5..7},3.{2,3}}", "i{,.bak}",
     r"{1\{2,3}", "{a,b}{c,d,e}", "{}", "{x}", "{0..10..0}", "{10..0..3}", "{Z..a..3}", "}{", "a{b{1..2}c,d}e",
     "{{a,b},{c,{d,e}}}x{1..2}", "{,,}"],
)  # fmt: skip
def test_the_count_is_what_braceexpand_yields(pattern):
    assert brace_count(pattern) == len(list(braceexpand(pattern)))
    assert expand_urls(pattern) == list(braceexpand(pattern))
