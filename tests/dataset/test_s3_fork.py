"""A loader's DataLoader workers read ``s3://`` shards through obstore also when the training process made obstore
requests itself before (a pass without workers): obstore's tokio runtime does not survive a fork, so such workers
start by forkserver, and the pass gives the batches of local disk instead of waiting forever. Against the real
S3-compatible server on loopback, through the fault proxy (which logs each request's client)."""

from __future__ import annotations

import pytest

from streambatch import StreamBatchLoader

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

BUDGET = 12 * 8000


def keys(loader) -> list[list[str]]:
    return [list(b["keys"]) for b in loader]


def shard_clients(proxy) -> list[str]:
    return [agent for path, agent, _ in proxy.clients if ".tar" in path]


def test_workers_read_through_obstore_after_this_process_did(s3_data, proxy):
    from streambatch.io.objstore import runtime_running

    local = {n: keys(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=3, num_workers=n)) for n in (0, 2)}
    remote = dict(storage_options=s3_data.proxied, budget=BUDGET, seed=3)
    assert keys(StreamBatchLoader(s3_data.url, **remote)) == local[0]  # this process reads the shards itself
    assert runtime_running()  # so a worker forked from it now could not
    proxy.reset()
    loader = StreamBatchLoader(s3_data.url, num_workers=2, **remote)
    assert keys(loader) == local[2]
    clients = shard_clients(proxy)
    assert clients and all(a.startswith("object_store") for a in clients), set(clients)
    assert loader.metrics()["faults"]["bad_shards"] == 0
