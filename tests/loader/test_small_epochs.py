"""An epoch with too few samples for ``even_batches="split"`` to give every rank the longest rank's steps (a few
samples per (rank, worker) slot: a tiny dataset, a tight ``where=``): no sample is left out; the ranks that
cannot split that far repeat some of their batches, counted and logged as a warning (before plan rule 4 the
longer ranks' other batches were left out, logged at INFO only; found by a DDP probe, 2026-11-27)."""

from __future__ import annotations

import logging

import pytest
from conftest import text_dataset

from streambatch import StreamBatchLoader
from streambatch.plan.config import with_plan_version
from streambatch.plan.epoch import make_epoch_plan
from streambatch.plan.layout import Layout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("tiny"), 7, seed=4, max_count=2)


def epoch_keys(src, world, workers, **kw):
    keys, lens = [], []
    for rank in range(world):
        loader = StreamBatchLoader(src, 1000, rank=rank, world_size=world, num_workers=workers, **kw)
        batches = list(loader)
        lens.append((len(batches), len(loader)))
        keys += [k for b in batches for k in b["keys"]]
    return keys, lens, loader.plan(0)


@pytest.mark.parametrize("world,workers", [(4, 2), (3, 2), (2, 2)])
def test_split_leaves_nothing_out_of_a_tiny_epoch(tiny, world, workers, caplog):
    with caplog.at_level(logging.WARNING, logger="streambatch"):
        keys, lens, plan = epoch_keys(tiny, world, workers)
    assert set(keys) == {f"s{i}" for i in range(7)}  # every sample
    assert len({n for pair in lens for n in pair}) == 1  # equal steps on every rank, len() exact
    assert plan.surplus_samples == 0 and len(keys) - 7 == plan.repeated_samples
    repeated = [r.getMessage() for r in caplog.records if "even_batches='split' could not" in r.getMessage()]
    assert bool(repeated) == (plan.repeated_samples > 0)


def test_a_filter_that_keeps_a_few_loses_none(tiny):
    keys, _, plan = epoch_keys(tiny, 3, 2, where="id != 's0'")
    assert set(keys) == {f"s{i}" for i in range(1, 7)} and len(keys) - 6 == plan.repeated_samples


def test_an_epoch_planned_by_rule_3_keeps_its_old_split():
    """A checkpoint of rule 3 resumes its epoch as it was planned: the old split, which left samples out."""
    import numpy as np

    from streambatch.plan.config import BatchingConfig

    shards = [np.array([26, 14]), np.array([3]), np.array([1]), np.array([40])]
    cfg = BatchingConfig(budget=100.0)
    old = make_epoch_plan(shards, with_plan_version(cfg.replace(), 3), 0, Layout(3, 2))
    new = make_epoch_plan(shards, cfg, 0, Layout(3, 2))
    assert old.surplus_samples > 0 and old.repeated_samples == 0
    assert new.surplus_samples == 0 and new.repeated_samples > 0 and new.steps >= old.steps
