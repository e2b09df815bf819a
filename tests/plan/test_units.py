"""The length unit as a value: parsed once where it enters (index header, writer and calibration options), the
same strings on disk, a one-line error for a unit that does not exist, and the conversions it owns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streambatch import IndexFormatError, ShardIndex, ShardInfo, suggest_budget
from streambatch.errors import OptionError, ShardifyError
from streambatch.units import Unit
from streambatch.write.probe import check_unit

SR = 16000


def _index(unit: str | Unit) -> ShardIndex:
    lengths = np.array([SR, 2 * SR, 3 * SR], dtype=np.int64)
    return ShardIndex([ShardInfo("a.tar", 3, 1000, lengths)], unit=unit, sample_rate=SR)


@pytest.mark.parametrize("version", [1, 2])
def test_an_index_keeps_the_unit_name_on_disk_and_loads_it_as_a_unit(tmp_path, version):
    url = _index("samples").save(str(tmp_path / "ds"), version=version)
    with open(url) as f:
        assert json.load(f)["unit"] == "samples"
    ix = ShardIndex.load(str(tmp_path / "ds"))
    assert ix.unit is Unit.SAMPLES and ix.unit == "samples" and f"{ix.unit}" == "samples"
    assert ix.seconds_per_unit() == 1 / SR and ix.stats()["total_hours"] == pytest.approx(6 / 3600)


def test_an_index_with_an_unknown_unit_is_refused_naming_the_file(tmp_path):
    url = _index(Unit.SECONDS).save(str(tmp_path / "ds"), version=1)
    with open(url) as f:
        d = json.load(f)
    d["unit"] = "furlongs"
    with open(url, "w") as f:
        json.dump(d, f)
    with pytest.raises(IndexFormatError, match=r"index.json: unknown unit 'furlongs'; choose one of samples, seconds"):
        ShardIndex.load(str(tmp_path / "ds"))


def test_a_unit_given_by_the_user_is_checked_once_with_the_units_there_are():
    assert check_unit("audio", None, None) is Unit.SAMPLES and check_unit("text", None, None) is Unit.TOKENS
    assert check_unit("audio", "seconds", None) is Unit.SECONDS
    with pytest.raises(OptionError, match=r"unknown unit 'minutes'; choose one of samples, seconds, tokens$"):
        check_unit("audio", "minutes", None)
    with pytest.raises(ShardifyError, match="a text source is measured in tokens, not seconds"):
        check_unit("text", Unit.SECONDS, None)
    with pytest.raises(OptionError, match="unknown unit 'frames'"):  # a planned unit, never one a dataset is written in
        check_unit("audio", "frames", None)


def test_durations_convert_only_where_lengths_are_audio():
    assert Unit.SAMPLES.from_seconds(1.5, SR) == 24000 and Unit.SECONDS.from_seconds(1.5, None) == 1.5
    assert Unit.SAMPLES.from_seconds(1.5, None) is None and Unit.TOKENS.from_seconds(1.5, SR) is None
    assert Unit.SECONDS.seconds_per_unit(SR) == 1.0 and Unit.FRAMES.seconds_per_unit(SR) is None
    # audio frames at 3 Hz counted at 2 Hz, halves rounded up as the writer counts them; seconds are exact
    assert [Unit.SAMPLES.audio_length(n, 3, 2) for n in (1, 2, 3)] == [1, 1, 2]
    assert Unit.SECONDS.audio_length(3, 2, None) == 1.5
    with pytest.raises(OptionError):
        Unit.TOKENS.audio_length(3, 2, None)


def test_the_suggested_budget_takes_a_unit_or_its_name():
    lengths = np.full(100, 1.5 * SR)
    by_name, by_unit = suggest_budget(lengths, "samples", SR), suggest_budget(lengths, Unit.SAMPLES, SR)
    assert by_name == by_unit == 48 * SR  # 32 medians, rounded up to whole seconds
    assert suggest_budget(lengths, "tokens", SR) == 32 * 1.5 * SR
