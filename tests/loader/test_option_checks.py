"""Every loader option is checked where the loader is built: a bad value of each (wrong type, a bool or text where
a number goes, a fraction where a whole number goes, NaN or infinity, out of range) is one line of
``OptionError`` naming the option and the value. Weights are bounded by the plan they imply, before anything of it
is allocated, and a callable the workers cannot receive is named before they start."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import re
import subprocess
import sys

import pytest
from conftest import text_dataset, text_mixture

from streambatch import BudgetError, OptionError, StreamBatchLoader
from streambatch.loader.options import GROUPS, init_fields

NAN, INF = float("nan"), float("inf")

#: (option, a bad value, other options it needs): the checks no field's metadata states (`generated()` makes the
#: rest from the bounds written in the fields)
BAD = [
    # batching: BatchingConfig and BatchingConfig.make
    ("buffer_size", 1.5, {}),
    ("buffer_size", "10", {}),
    ("buffer_size", True, {}),
    ("buffer_size", 0, {}),
    ("buffer_size", 10**12, {}),  # its window's arrays would take terabytes
    ("refill", -1, {}),
    ("interleave", 0, {}),
    ("interleave", 65, {}),  # that many open shards per worker
    ("interleave", 2.5, {}),
    ("level_width", 0, {}),
    ("level_width", "1s", {}),
    ("level_width", 16000.0, {"num_buckets": 4}),  # buckets: the level cut would be ignored
    ("step_balance", "quadratic-ish", {}),  # not a step-time model's name
    ("step_balance", 3, {}),
    ("refill", 2.5, {}),
    ("bucket_boundaries", [10, NAN], {}),
    ("bucket_boundaries", "abc", {}),
    ("bucket_boundaries", [10, "20"], {}),
    ("num_buckets", 0, {}),
    ("num_buckets", 2.5, {}),
    ("num_buckets", 5000, {}),  # more than the boundaries can tell apart (MAX_BUCKETS)
    ("bucket_spacing", "exponential", {}),  # spaces boundaries that num_buckets asks for: none
    ("bucket_spacing", "linear", {}),
    ("max_batch_size", 0, {}),
    ("max_batch_size", True, {}),
    ("max_batch_size", 2**63, {}),  # was an OverflowError from numpy
    ("batch_size_multiple_of", 0, {}),
    ("batch_size_multiple_of", 1.5, {}),
    ("batch_size_multiple_of", 2**63, {}),  # accepted, then an OverflowError at the first batch
    ("min_length", -1, {}),
    ("min_length", 50000, {"max_length": 40000}),  # every sample skipped: an EmptyEpochError at len()
    ("min_length", INF, {}),
    ("min_length", "0", {}),
    ("max_length", 0, {}),
    ("max_length", NAN, {}),
    ("max_length", True, {}),
    ("drop_last", 1, {}),
    ("drop_last", "yes", {}),
    ("strict", 0, {}),
    ("shuffle", "True", {}),
    ("seed", [1], {}),  # a sequence seeds one stream of plan_batches; accepted, then refused at len()
    ("pad_to_multiple_of", 0, {}),
    ("pad_to_multiple_of", 2.5, {}),
    ("batch_order", "sorted", {}),
    ("output_budget", INF, {}),
    ("output_budget", "100", {}),
    ("output_budget", True, {}),
    ("batch_by", "corpus", {}),
    ("cost", "cubic", {}),
    ("cost", 3, {}),
    ("quadratic_factor", NAN, {"cost": "quadratic"}),
    ("quadratic_factor", "x", {"cost": "quadratic"}),
    ("quadratic_factor", 0, {"cost": "quadratic"}),
    ("quadratic_factor", -1.0, {}),
    ("packed", 1, {}),
    # reading: ReadOptions
    ("chunk_size", 0, {}),
    ("chunk_size", 1.5, {}),
    ("chunk_size", True, {}),
    ("chunk_size", "lots", {}),
    ("chunk_size", None, {}),  # was a TypeError
    ("chunk_size", "0.5", {}),  # half a byte: was taken as 0
    ("read_ahead", -1, {}),
    ("read_ahead", None, {}),  # accepted, then a TypeError when a remote shard was read
    ("read_ahead", NAN, {}),
    ("read_concurrency", 0, {}),
    ("read_concurrency", 1.5, {}),
    ("max_read_concurrency", 0, {}),
    ("max_read_concurrency", "16", {}),
    ("retries", -1, {}),
    ("retries", "3", {}),
    ("retries", 1100, {}),  # the backoff's float overflowed at the first retry
    ("backoff", -1, {}),
    ("backoff", NAN, {}),
    ("backoff", True, {}),
    ("timeout", 0, {}),
    ("timeout", INF, {}),
    ("timeout", 3e8, {}),  # the read-ahead's watchdog wait overflowed: every remote shard went bad
    ("verify", "md5", {}),
    ("max_bad_shards", -1, {}),
    ("max_bad_shards", 1.5, {}),
    ("read_by_position", 1, {}),
    ("cache_dir", 3, {}),
    ("cache_size", "abc", {}),
    ("cache_size", -1, {}),
    ("cache_size", 1.5, {}),
    # per sample: SampleOptions
    ("decode", "bogus", {}),
    ("decode", 3, {}),
    ("transform", "upper", {}),
    ("speed_perturb", "fast", {}),
    ("speed_perturb", (0.9, -1), {}),
    ("speed_perturb", {0.9: NAN}, {}),
    ("speed_perturb", (True, 1.1), {}),
    ("speed_perturb", 1.1, {}),
    ("features", "mfcc", {}),
    ("features", 3, {}),
    # the run: RunOptions
    ("rank", 3, {"world_size": 2}),
    ("dp_rank", 2, {"dp_size": 2}),
    ("dp_rank", -1, {"dp_size": 2}),
    ("dp_rank", 1, {}),
    ("dp_size", 0, {"dp_rank": 0}),
    ("dp_mesh", "dp", {}),
    ("worker_init_fn", 3, {}),
    ("max_plan_bytes", 1.5, {}),
    ("max_plan_bytes", "lots", {}),
    ("max_plan_bytes", None, {}),
    ("shard_roots", 3, {}),
    ("shard_roots", ["", "/data"], {}),
    # options of no group
    ("where", 3, {}),
    ("storage_options", "anon", {}),
    ("budget", NAN, {}),
    ("budget", INF, {}),
    ("budget", True, {}),
    ("budget", -5, {}),
    ("budget", "lots", {}),
]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    return text_dataset(root, 40, seed=5)


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return text_mixture(tmp_path_factory.mktemp("mixture"), 30)


def shown(value) -> list[str]:
    """How a bad value may appear in the message: itself, or (a container) the bad element in it."""
    if isinstance(value, dict):
        return [repr(value)] + [repr(v) for v in value.values()]
    if isinstance(value, (list, tuple)):
        return [repr(value)] + [repr(v) for v in value]
    return [repr(value)]


def build(ds, name, value, extra):
    options = {"budget": 1000, **extra, name: value}
    budget = options.pop("budget")
    return StreamBatchLoader(ds, budget, **options)


def generated() -> list[tuple[str, object]]:
    """Bad values of every field whose metadata bounds it: below and above its bounds, a fraction, text and a bool
    where a whole number goes; a name outside its choices; a number where True or False goes."""
    out: list[tuple[str, object]] = []
    for group in GROUPS.values():
        for f in dataclasses.fields(group):
            if "whole" in f.metadata:
                low, high = f.metadata["whole"]
                out += [(f.name, v) for v in (1.5, "2", True)]
                out += [(f.name, low - 1)] if low is not None else []
                out += [(f.name, high + 1)] if high is not None else []
            elif "one_of" in f.metadata:
                out += [(f.name, "bogus"), (f.name, 3)]
            elif "flag" in f.metadata:
                out += [(f.name, 1), (f.name, "yes")]
    return out


GENERATED = generated()


def test_every_option_has_a_bad_value():
    wanted = {name for group in GROUPS.values() for name in init_fields(group)} | {"where", "storage_options", "budget"}
    covered = {name for name, _, _ in BAD} | {name for name, _ in GENERATED}
    assert wanted <= covered, sorted(wanted - covered)


@pytest.mark.parametrize(("name", "value"), GENERATED, ids=[f"{n}={v!r}" for n, v in GENERATED])
def test_a_value_outside_its_fields_bounds_is_one_line_naming_it(ds, name, value):
    with pytest.raises(OptionError) as got:
        StreamBatchLoader(ds, 400, **{name: value})
    text = str(got.value)
    assert "\n" not in text and name in text and any(s in text for s in shown(value)), text


@pytest.mark.parametrize(("name", "value", "extra"), BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_option_and_the_value(ds, name, value, extra):
    with pytest.raises(OptionError) as got:
        build(ds, name, value, extra)
    message = str(got.value)
    assert "\n" not in message
    assert name in message
    assert any(s in message for s in shown(value)), message


@pytest.mark.parametrize(
    ("name", "value"),
    [("num_workers", 2), ("micro_batches", 2), ("chunk_size", 64e6), ("cache_size", "1G"), ("max_plan_bytes", "1T")],
)
def test_good_values_still_pass(ds, tmp_path, name, value):
    given = {"cache_dir": str(tmp_path / "cache")} if name == "cache_size" else {}  # a cache's size needs a cache
    assert len(build(ds, name, value, given)) > 0


@pytest.mark.parametrize("value", [10**400, 10**5000], ids=["10**400", "10**5000"])
def test_a_budget_beyond_a_float_is_a_budget_error(ds, value):
    """An int too large for a float was an OverflowError; one too long to print, a ValueError from repr."""
    with pytest.raises(BudgetError) as got:
        StreamBatchLoader(ds, value)
    assert "\n" not in str(got.value) and "budget must be a positive finite number" in str(got.value)


def test_a_budget_far_above_every_length_makes_one_batch_of_the_window(ds):
    """A budget of 1e30 is not "smaller than the shortest sample": every batch is then as large as the window
    lets it be (bounded by buffer_size), and every sample is still yielded once."""
    loader = StreamBatchLoader(ds, 1e30, buffer_size=16, num_workers=0)
    batches = list(loader)
    assert len(batches) == len(loader)
    assert max(len(b["keys"]) for b in batches) <= 16
    assert sum(len(b["keys"]) for b in batches) == 40


@pytest.mark.parametrize(
    ("weights", "named"),
    [
        ({"a": True}, "weights['a']"),
        ({"a": "2"}, "weights['a']"),
        ({"a": -1}, "weights['a']"),
        ({"b": NAN}, "weights['b']"),
        ({"a": INF}, "weights['a']"),
        ([1, "x"], "weights[1]"),
        ("ab", "weights"),
    ],
)
def test_a_bad_weight_is_named(mix, tmp_path, weights, named):
    folders = []  # a list of folders names each dataset by its folder: two of them, not two "shards"
    for name, url in mix.items():
        (tmp_path / name).symlink_to(url)
        folders.append(str(tmp_path / name))
    with pytest.raises(OptionError, match=r"^" + named.replace("[", r"\[").replace("]", r"\]")):
        StreamBatchLoader(mix if isinstance(weights, dict) else folders, 1000, weights=weights)


def test_a_mixture_files_bad_weight_names_the_file_and_the_dataset(mix, tmp_path):
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"datasets": [{"name": "a", "path": mix["a"], "weight": "heavy"}]}))
    with pytest.raises(OptionError, match=r"mix\.json: the weight of dataset 'a' must be a finite number"):
        StreamBatchLoader(str(spec), 1000, shard_roots=[mix["a"]])  # the dataset lies outside the file's folder


def test_weights_beyond_the_plan_bound_are_refused_and_the_bound_can_be_raised(mix):
    weights = {"a": 400, "b": 1}  # 12,000 planned samples of a: about half a MiB of plan
    with pytest.raises(OptionError) as got:
        StreamBatchLoader(mix, 1000, weights=weights, max_plan_bytes="256K")
    message = str(got.value)
    assert message.startswith("weights['a']=400 implies 1.2e+04 samples per epoch") and "\n" not in message
    assert "at most 256 KiB" in message and "max_plan_bytes" in message
    loader = StreamBatchLoader(mix, 1000, weights=weights, max_plan_bytes="64M")
    assert loader.index.draws[0].take == 12_000


GREEDY = """
import sys
from streambatch import OptionError, StreamBatchLoader
try:
    StreamBatchLoader({"a": sys.argv[1], "b": sys.argv[2]}, 1000, weights={"a": 1e9, "b": 1})
except OptionError as e:
    print("refused:", e)
# this process's own peak (VmHWM): ru_maxrss starts from the parent's peak at fork+exec (pytest's, here)
print("maxrss_kib", next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def test_a_weight_of_1e9_fails_fast_in_bounded_memory(mix):
    """It grew to 22 GB until the kernel killed the process; now the size it implies is refused before the
    mixture's virtual shards are built, with the memory of an import and two small indexes."""
    run = subprocess.run(
        [sys.executable, "-c", GREEDY, mix["a"], mix["b"]], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    refused, rss = run.stdout.strip().splitlines()
    assert refused.startswith("refused: weights['a']=1e+09 implies 3e+10 samples per epoch"), refused
    assert "TiB" in refused and "max_plan_bytes" in refused
    assert int(rss.split()[1]) < 1 << 20  # KiB: under 1 GiB, most of it torch's import


def local_transform():
    return lambda sample, rng: sample


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork", reason="workers fork only where that is the default")
def test_a_filter_leaves_the_workers_forked_so_they_take_a_lambda(ds):
    """A filter's answers are read from the loader's bit mask, so its workers fork like an unfiltered loader's
    and take a callable that does not pickle."""
    loader = StreamBatchLoader(ds, 1000, where="length > 3", num_workers=2, transform=local_transform())
    assert sum(len(b["keys"]) for b in loader) > 0


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork", reason="workers fork only where that is the default")
def test_forked_workers_still_take_a_lambda(ds):
    loader = StreamBatchLoader(ds, 1000, num_workers=2, transform=local_transform())
    assert sum(len(b["keys"]) for b in loader) == 40


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"num_workers": 1.5}, "num_workers must be a whole number, got 1.5"),
        ({"decode": "bogus"}, "decode must be one of"),
        ({"shard_size": 3}, "unknown loader option 'shard_size': did you mean 'dp_size'?"),
        ({"val_options": {"pin_memory": "no"}}, "pin_memory must be True or False, got 'no'"),
        ({"val_options": "fast"}, "val_options must be a dict of loader options"),
    ],
)
def test_the_lightning_datamodule_checks_its_options_when_it_is_made(ds, options, says):
    lightning = pytest.importorskip("streambatch.lightning")
    with pytest.raises(OptionError, match=re.escape(says)):
        lightning.StreamBatchDataModule(ds, 1000, **options)
    assert lightning.StreamBatchDataModule(ds, 1000, num_workers=2, seed=3).options == {"num_workers": 2, "seed": 3}
