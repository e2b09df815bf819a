"""The data-parallel options in one process: ``dp_rank``/``dp_size``/``dp_mesh`` checked where the loader is built,
a data-parallel rank planned as the rank of a plain layout of ``dp_size`` ranks, and the step agreement's rows
(tagged with their data-parallel rank) checked. The multi-process behaviour is tests/cluster/test_dp_mesh.py."""

from __future__ import annotations

import pytest
from conftest import text_dataset

from streambatch import OptionError, StreamBatchLoader
from streambatch.loader import mesh
from streambatch.loader.mesh import DataParallel


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("dp"), 60, 1, max_count=8)


@pytest.mark.parametrize(
    "options, said",
    [
        ({"dp_rank": 0}, "dp_rank and dp_size are given together"),
        ({"dp_size": 2}, "dp_rank and dp_size are given together"),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank must be below dp_size=2"),
        ({"dp_rank": -1, "dp_size": 2}, "dp_rank must be at least 0"),
        ({"dp_rank": 0, "dp_size": 0}, "dp_size must be at least 1"),
        ({"dp_rank": True, "dp_size": 2}, "dp_rank must be a whole number"),
        ({"dp_rank": 0, "dp_size": 1, "dp_mesh": object()}, "dp_mesh gives the data-parallel rank and size"),
        ({"dp_mesh": "dp"}, "dp_mesh must be a torch DeviceMesh"),
    ],
)
def test_a_bad_data_parallel_option_is_an_option_error(dataset, options, said):
    with pytest.raises(OptionError, match=said):
        StreamBatchLoader(dataset, 400, **options)


def test_dp_size_must_divide_the_processes_of_the_job(dataset, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(OptionError, match="dp_size=3 does not divide the 4 processes"):
        StreamBatchLoader(dataset, 400, dp_rank=0, dp_size=3)
    with pytest.raises(OptionError, match="dp_size=3 does not divide the 5 processes"):
        StreamBatchLoader(dataset, 400, dp_rank=0, dp_size=3, rank=0, world_size=5)
    loader = StreamBatchLoader(dataset, 400, dp_rank=1, dp_size=2)  # process 1 of 4: rank 1's second peer, say
    assert (loader.rank, loader.world_size, loader.data_parallel.peers) == (1, 2, 2)


def test_a_data_parallel_rank_gets_the_batches_of_that_rank_of_a_plain_layout(dataset):
    """Without a process group both plan the whole epoch: the same batches, the same state to resume from."""
    for r in (0, 1):
        dp = StreamBatchLoader(dataset, 400, dp_rank=r, dp_size=2, seed=3)
        plain = StreamBatchLoader(dataset, 400, rank=r, world_size=2, seed=3)
        assert [b["keys"] for b in dp] == [b["keys"] for b in plain]
        assert dp.state_dict() == plain.state_dict() and dp.state_dict()["world_size"] == 2


def rows_gathered(monkeypatch, rows):
    monkeypatch.setattr(mesh, "all_gather_ints", lambda values, group=None: rows)


def test_the_step_agreement_takes_one_row_per_data_parallel_rank(monkeypatch):
    rows_gathered(monkeypatch, [[0, 5, 1], [0, 5, 1], [1, 4, 2], [1, 4, 2]])
    assert DataParallel(0, 2, "dp_rank", processes=4).gather([5, 1]) == [[5, 1], [4, 2]]


def test_peers_that_planned_otherwise_are_an_error(monkeypatch):
    rows_gathered(monkeypatch, [[0, 5, 1], [0, 6, 1], [1, 4, 2], [1, 4, 2]])
    with pytest.raises(OptionError, match="the peers of data-parallel rank 0 planned different epochs"):
        DataParallel(0, 2, "dp_rank", processes=4).gather([5, 1])


def test_a_data_parallel_rank_without_a_process_is_an_error(monkeypatch):
    rows_gathered(monkeypatch, [[0, 5, 1], [0, 5, 1], [2, 4, 2], [2, 4, 2]])
    with pytest.raises(OptionError, match=r"data-parallel ranks \[1\] have no process"):
        DataParallel(0, 3, "dp_rank", processes=6).gather([5, 1])
