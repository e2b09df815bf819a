"""``calibrate``'s trial options are checked before the first trial: a bad one is an OptionError naming it, and the
step never runs (a NaN threshold used to pick a cost model by a comparison that is always false)."""

from __future__ import annotations

import pytest

from streambatch import OptionError, calibrate


@pytest.mark.parametrize(
    "options, said",
    [
        ({"quadratic_threshold": float("nan")}, "quadratic_threshold must be a finite number"),
        ({"quadratic_threshold": 2}, r"quadratic_threshold must be in \[0, 1\]"),
        ({"trial_timeout": -1}, "trial_timeout must be positive"),
        ({"cpu_threads": 0}, "cpu_threads must be at least 1"),
        ({"warmup": "yes"}, "warmup must be True or False"),
    ],
)
def test_a_bad_trial_option_is_refused_before_the_first_trial(options, said):
    steps = []
    with pytest.raises(OptionError, match=said):
        calibrate(steps.append, lengths=[100.0], unit="samples", **options)
    assert steps == []
