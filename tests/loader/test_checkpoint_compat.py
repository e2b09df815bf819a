"""A checkpoint saved by an earlier version resumes exactly: the loader states stored in tests/data/checkpoints
(made by its make_checkpoint.py, with torch.save, from datasets built with fixed seeds) are loaded into today's
loader over the same datasets rebuilt here, and the batches it yields are the ones the saving version yielded."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import TESTS

STORED = TESTS / "data" / "checkpoints"


def _maker():
    spec = importlib.util.spec_from_file_location("make_checkpoint", STORED / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _maker()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return MAKER.build_data(tmp_path_factory.mktemp("checkpoints"))


@pytest.mark.parametrize("name", sorted(MAKER.SCENARIOS))
def test_a_stored_checkpoint_resumes_to_the_stored_batches(data, name):
    scenario = MAKER.SCENARIOS[name]
    state = torch.load(STORED / f"{name}.pt", weights_only=True)["loader"]  # plain values: no pickled objects
    expected = json.loads((STORED / f"{name}.json").read_text())
    loader = MAKER.loader_for(data, scenario, resuming=True)
    loader.load_state_dict(state)
    assert len(loader) == expected["steps"]
    assert loader.remaining == len(expected["remaining"])
    assert MAKER.remaining_keys(loader) == expected["remaining"]
    # and what the new version saves at once resumes the same way
    again = MAKER.loader_for(data, scenario, resuming=True)
    again.load_state_dict(state)
    second = MAKER.loader_for(data, scenario, resuming=True)
    second.load_state_dict(json.loads(json.dumps(again.state_dict())))
    assert MAKER.remaining_keys(second) == expected["remaining"]
