"""``cost=`` is checked where the loader is built: a calibration file that is not there is an ``OptionError``, one that
is not a calibration (not JSON, not an object, a field the cost model uses missing or out of range) an
``IndexFormatError`` naming the file; a callable of the wrong shape, or one returning anything but a finite number of
at least 0, is an ``OptionError`` naming ``cost`` (and the value), raised at build, never in a worker. A callable that
raises keeps its own exception and traceback."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import text_dataset

from streambatch import IndexFormatError, OptionError, StreamBatchLoader
from streambatch.plan.cost import CallableCost, PaddedCost, QuadraticCost, resolve_cost

GOOD = {"format": "streambatch-calibration", "cost": "padded", "budget": 2000, "unit": "tokens", "max_batch_size": 64}


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("cost"), 30, seed=3)


def one_line(e: pytest.ExceptionInfo, *words: str) -> None:
    text = str(e.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, (w, text)


def test_a_missing_calibration_file_is_an_option_error(ds, tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(OptionError) as e:
        StreamBatchLoader(ds, 2000, cost=path)
    one_line(e, "cost", path)
    with pytest.raises(OptionError) as e:
        resolve_cost(path)
    one_line(e, "cost", path)


BAD_FILES = [
    ("{bad", "not a calibration file"),
    ("[1]", "[1]"),
    ('"padded"', "'padded'"),
    ('{"format": "x"}', "'x'"),
    ('{"a": 1}', "no 'format'"),  # a JSON object, but no calibration: it was taken as padded cost
    ('{"format": "streambatch-calibration", "cost": "cubic", "budget": 10}', "'cubic'"),
    ('{"format": "streambatch-calibration", "cost": "quadratic", "budget": 10}', "quadratic_factor"),
    (
        '{"format": "streambatch-calibration", "cost": "quadratic", "quadratic_factor": -5, "budget": 10}',
        "quadratic_factor",
    ),
    (
        '{"format": "streambatch-calibration", "cost": "quadratic", "quadratic_factor": "big", "budget": 10}',
        "quadratic_factor",
    ),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": -1}', "budget"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": 0}', "budget"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": "lots"}', "budget"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": NaN}', "budget"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": 10, "unit": "furlongs"}', "furlongs"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": 10, "unit": 5}', "unit"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": 10, "max_batch_size": 0}', "max_batch_size"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": 10, "max_batch_size": 2.5}', "max_batch_size"),
    ('{"format": "streambatch-calibration", "cost": "padded", "budget": 10, "max_batch_size": "64"}', "max_batch_size"),
]


@pytest.mark.parametrize("text, word", BAD_FILES)
def test_a_file_that_is_not_a_calibration_is_an_index_format_error(ds, tmp_path, text, word):
    path = tmp_path / "calib.json"
    path.write_text(text)
    for build in (lambda: StreamBatchLoader(ds, None, cost=str(path)), lambda: resolve_cost(str(path))):
        with pytest.raises(IndexFormatError) as e:
            build()
        one_line(e, str(path), word)


@pytest.mark.parametrize(
    "text, word", [("[" * 100_000, "nested too deep"), (" " * (2 << 20) + "{}", "more than 1,048,576 bytes")]
)
def test_a_calibration_file_nested_too_deep_or_too_large_is_refused(tmp_path, text, word):
    """The file is data: a nesting that overflows the parser or a file of megabytes is one line naming it."""
    path = tmp_path / "calib.json"
    path.write_text(text)
    with pytest.raises(IndexFormatError, match=word) as e:
        resolve_cost(str(path))
    one_line(e, str(path), word)


@pytest.mark.parametrize("text, word", BAD_FILES[3:])
def test_a_calibration_dict_is_checked_as_the_file_is(text, word):
    with pytest.raises(OptionError) as e:
        resolve_cost(json.loads(text))
    one_line(e, "cost", word)


def test_a_good_calibration_still_sets_the_model_budget_and_cap(ds, tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(GOOD))
    model, budget = resolve_cost(str(path))
    assert isinstance(model, PaddedCost) and budget == 2000
    quadratic = {**GOOD, "cost": "quadratic", "quadratic_factor": 50, "unit": None, "max_batch_size": None}
    model, budget = resolve_cost(quadratic)
    assert isinstance(model, QuadraticCost) and model.factor == 50 and budget == 2000
    loader = StreamBatchLoader(ds, None, cost=str(path))
    assert loader.config.budget == 2000 and loader.config.max_batch_size == 64


def test_a_quadratic_factor_that_is_not_a_positive_number_is_refused():
    for factor in (math.nan, 0, -1, "10"):
        with pytest.raises(OptionError, match="quadratic_factor"):
            QuadraticCost(factor)


@pytest.mark.parametrize(
    "fn", [lambda n: n, lambda: 1, lambda n, m, k: n, lambda *, n, m: n], ids=["one", "none", "three", "keywords"]
)
def test_a_callable_of_the_wrong_arity_is_refused_where_it_is_given(ds, fn):
    with pytest.raises(OptionError) as e:
        StreamBatchLoader(ds, 2000, cost=fn)
    one_line(e, "cost", "cost(n, max_len)")


def test_a_cost_model_class_for_an_instance_is_refused():
    with pytest.raises(OptionError, match=r"PaddedCost\(\)"):
        resolve_cost(PaddedCost)


@pytest.mark.parametrize(
    "returned, shown",
    [("x", "'x'"), (math.nan, "nan"), (-1.0, "-1.0"), (None, "None"), (math.inf, "inf"), (True, "True")],
)
def test_a_callable_returning_no_cost_is_refused_at_build(ds, returned, shown):
    with pytest.raises(OptionError) as e:
        StreamBatchLoader(ds, 2000, cost=lambda n, m: returned)
    one_line(e, "cost", shown)
    shards = sorted(str(p) for p in Path(ds).glob("*.tar"))
    assert shards
    with pytest.raises(OptionError) as e:  # no index: still refused where the loader is built, not in a worker
        StreamBatchLoader(shards, 2000, cost=lambda n, m: returned)
    one_line(e, "cost", shown)


def test_a_callable_bad_only_at_the_data_lengths_is_refused_at_build(ds):
    """Fine at (1, 1.0), negative at the dataset's lengths: the check over the data's lengths names the value."""
    with pytest.raises(OptionError) as e:
        StreamBatchLoader(ds, 2000, cost=lambda n, m: n * (10 - m))
    one_line(e, "cost", "returned -")


def test_a_vectorised_callable_is_checked_too():
    cost = CallableCost(lambda n, m: np.where(np.asarray(m) > 50, -np.ones_like(n * m, dtype=float), n * m))
    assert cost.capacity(np.array([10.0]), 100, 64)[0] == 10
    with pytest.raises(OptionError, match="cost"):
        cost.capacity(np.array([10.0, 60.0]), 100, 64)


def test_a_callable_that_raises_keeps_its_exception_and_raises_at_build(ds):
    def cost(n, max_len):
        return n * max_len / 0

    with pytest.raises(ZeroDivisionError) as e:
        StreamBatchLoader(ds, 2000, cost=cost)
    assert any(entry.name == "cost" for entry in e.traceback)  # the user's own frame is in the traceback


def test_a_good_callable_still_batches(ds):
    loader = StreamBatchLoader(ds, 2000, cost=lambda n, m: n * m + n)
    assert sum(len(b["lengths"]) for b in loader) == 30


def test_calibrate_ranges_are_checked_by_the_shared_number_option():
    """``calibrate``'s two-sided ranges (``memory_fraction`` in (0, 1], ``rel_tol`` in [0, 0.5), ``margin`` in
    [0, 1)) are ``number_option``'s, which names the interval."""
    from streambatch.errors import number_option
    from streambatch.fit.calibrate import calibration_options

    assert number_option("x", 1, positive=True, maximum=1) == 1.0
    assert number_option("x", 0, 0, below=0.5) == 0.0
    for value, kw, interval in [
        (0, {"positive": True, "maximum": 1}, "(0, 1]"),
        (1.5, {"positive": True, "maximum": 1}, "(0, 1]"),
        (0.5, {"minimum": 0, "below": 0.5}, "[0, 0.5)"),
    ]:
        with pytest.raises(OptionError, match=re.escape(f"x must be in {interval}, got {value}")):
            number_option("x", value, **kw)
    with pytest.raises(OptionError, match="must be below 3"):
        number_option("x", 3, below=3)
    with pytest.raises(OptionError, match="must be at most 3"):
        number_option("x", 4, maximum=3)
    for option, value, interval in [
        ("memory_fraction", 0, "(0, 1]"),
        ("rel_tol", 0.5, "[0, 0.5)"),
        ("margin", 1, "[0, 1)"),
    ]:
        with pytest.raises(OptionError, match=re.escape(f"{option} must be in {interval}")):
            calibration_options(lengths=[10], unit="tokens", **{option: value})
