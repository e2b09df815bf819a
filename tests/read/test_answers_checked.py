"""Every answer of the store is checked against what was asked (issue 46): a store (or a proxy in front of it) that
answers a range request with the whole object, with another range, or with a Content-Length that lies, or that
throttles, costs retries at most: the loader gives exactly the batches local disk gives, in the planned number of
steps, and counts no shard as bad and no sample as lost (such faults are the store's, never corrupt data).

Faults come from tests/faultproxy.py in front of the loopback S3 server (conftest_s3.py)."""

from __future__ import annotations

import pytest
import torch
from faultproxy import Rule

from streambatch import StreamBatchLoader

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

BUDGET = 12 * 8000


def run(loader):
    return [b for b in loader]


@pytest.fixture(scope="module")
def local_batches(s3_data):
    return run(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=7))


FAULTS = {
    "whole-object 200": [Rule("whole", match=".tar", every=2)],
    "206 with another range": [Rule("shift", match=".tar", every=3, size=100)],
    "short Content-Length": [Rule("short", match=".tar", every=3, size=700)],
    "long Content-Length": [Rule("long", match=".tar", every=3, size=700)],
    "503 SlowDown and 500": [Rule("error", match=".tar", every=3), Rule("error", match=".tar", every=7, status=500)],
}


@pytest.mark.parametrize("read_ahead", [0, "64K"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_wrong_answers_cost_retries_not_data(s3_data, proxy, local_batches, fault, read_ahead):
    proxy.reset(*FAULTS[fault])
    loader = StreamBatchLoader(
        s3_data.url,
        storage_options=s3_data.proxied,
        budget=BUDGET,
        seed=7,
        backoff=0.001,
        chunk_size="16K",
        read_ahead=read_ahead,
    )
    batches = run(loader)
    assert len(batches) == len(loader) == len(local_batches)  # the planned steps
    assert [b["keys"] for b in batches] == [b["keys"] for b in local_batches]
    for got, want in zip(batches, local_batches):
        assert torch.equal(got["audio"], want["audio"])
    st = loader.fault_stats()
    assert st["bad_shards"] == st["lost_samples"] == st["redrawn_samples"] == 0, st
    assert any(rule.acted for rule in FAULTS[fault])  # the store did misbehave
