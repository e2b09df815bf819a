"""The out-of-memory guard's options are checked when it is built, each bad one an OptionError naming it: a
guard built wrong fails at construction, before the first step of a run, not at the first out-of-memory."""

from __future__ import annotations

import pytest
import torch

from streambatch import OOMGuard, OptionError, run_with_oom_split
from streambatch.fit.oom import split_batch


def batch(n: int = 4) -> dict:
    return {"audio": torch.zeros(n, 8), "lengths": torch.full((n,), 8)}


@pytest.mark.parametrize(
    "options,said",
    [
        ({"min_size": 0}, "min_size must be at least 1"),
        ({"min_size": 1.5}, "min_size must be a whole number"),
        ({"weight_by": "bytes"}, "weight_by must be one of 'samples', 'frames'"),
        ({"reset": "zero_grad"}, "reset must be a callable"),
        ({"logger": "log"}, "logger must be a logging.Logger"),
    ],
)
def test_a_bad_option_is_refused_when_the_guard_is_built(options, said):
    calls = []
    with pytest.raises(OptionError, match=said):
        OOMGuard(calls.append, **options)
    with pytest.raises(OptionError, match=said):
        run_with_oom_split(calls.append, batch(), **options)
    assert calls == []  # the step never ran


def test_an_unknown_option_is_a_type_error_at_construction():
    with pytest.raises(TypeError, match="min_sise"):
        OOMGuard(lambda b: 0.0, min_sise=2)


def test_a_step_that_is_not_callable_is_refused():
    with pytest.raises(OptionError, match="step_fn must be a callable"):
        OOMGuard("train_step")
    with pytest.raises(OptionError, match="step_fn must be a callable"):
        run_with_oom_split(None, batch())


def test_a_batch_without_a_size_is_named():
    with pytest.raises(OptionError, match="cannot tell the batch size of None"):
        run_with_oom_split(lambda b: 0.0, None)
    with pytest.raises(OptionError, match="do not add up to the batch size 4"):
        split_batch(batch(), [1, 2])
