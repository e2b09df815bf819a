"""``shardify inspect --plan`` reports freshness: the share of epoch 0's batch-mate pairs that are batch-mates again
in epoch 1, the same figure the loader's own plans of the two epochs give."""

from __future__ import annotations

import json

import pytest
from conftest import text_dataset

from streambatch import StreamBatchLoader
from streambatch.cli import main
from streambatch.plan.freshness import epoch_batches, pairs_kept

BUDGET = 2000


@pytest.fixture(scope="module")
def text_ds(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("fresh"), 300, 3, max_count=30)


def _inspect(capsys: pytest.CaptureFixture[str], ds: str, *extra: str) -> tuple[int, str, str]:
    """The command run in this process (its exit code, what it printed): the command line's own start is tested
    in tests/cli/test_cli.py."""
    capsys.readouterr()
    code = main(["inspect", ds, "--plan", "--budget", str(BUDGET), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_plan_reports_the_pairs_kept_from_epoch_0_to_1(text_ds, capsys):
    code, out, err = _inspect(capsys, text_ds, "--num-workers", "2", "--json")
    assert code == 0, err
    got = json.loads(out)["pairs_kept_pct"]
    loader = StreamBatchLoader(text_ds, budget=BUDGET, num_workers=2)
    e0, e1 = epoch_batches(loader.plan(0)), epoch_batches(loader.plan(1))
    assert got == pytest.approx(100 * pairs_kept(e0, e1, 300))
    code, table, err = _inspect(capsys, text_ds, "--num-workers", "2")
    assert code == 0, err
    assert f"freshness  {got:.1f}% of the batch-mate pairs meet again in the next epoch" in table


def test_inspect_plan_plans_the_seed_epoch_and_even_batches_given(text_ds, capsys):
    """``--seed``, ``--epoch`` and ``--even-batches`` shape the planned epoch as they shape the loader's (they were
    taken for --step only, and silently left out of --plan); ``--where`` with ``--plan`` is refused, not ignored."""
    opts = {"seed": 7, "world_size": 3, "even_batches": "pad"}
    code, out, err = _inspect(
        capsys, text_ds, "--seed", "7", "--epoch", "2", "--world-size", "3", "--even-batches", "pad", "--json"
    )
    assert code == 0, err
    got = json.loads(out)
    loader = StreamBatchLoader(text_ds, budget=BUDGET, rank=0, **opts)
    e2, e3 = epoch_batches(loader.plan(2)), epoch_batches(loader.plan(3))
    assert got["pairs_kept_pct"] == pytest.approx(100 * pairs_kept(e2, e3, 300))
    assert got["steps"] == loader.plan(2).steps
    code, _, err = _inspect(capsys, text_ds, "--where", "length > 3")
    assert code == 2 and err.count("\n") == 1 and "--where" in err
