"""Every answer of the store is checked against what was asked (issue 46): a store (or a proxy in front of it) that
answers a range request with the whole object, with another range, or with a Content-Length that lies, that
throttles, stalls, or is gone for 5 s or 90 s, costs retries at most: the loader gives exactly the batches local
disk gives, in the planned number of steps, and ``loader.metrics()`` counts no shard as bad and no sample as lost
(such faults are the store's, never corrupt data).

Faults come from tests/faultproxy.py in front of the loopback S3 server (conftest_s3.py)."""

from __future__ import annotations

import faulthandler

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


#: the misbehaviours, each made afresh for every test (a rule counts what it did)
FAULTS = {
    "whole-object 200": lambda: [Rule("whole", match=".tar", every=2)],
    "206 with another range": lambda: [Rule("shift", match=".tar", every=3, size=100)],
    "short Content-Length": lambda: [Rule("short", match=".tar", every=3, size=700)],
    "long Content-Length": lambda: [Rule("long", match=".tar", every=3, size=700)],
    "503 SlowDown and 500": lambda: [
        Rule("error", match=".tar", every=3),
        Rule("error", match=".tar", every=7, status=500),
    ],
    "a stall": lambda: [Rule("stall", match=".tar", every=4, limit=2, seconds=4)],
    "an outage of 5 s": lambda: [Rule("outage", match="shard-000003.tar", seconds=5)],
}


@pytest.mark.parametrize("read_ahead", [0, "64K"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_wrong_answers_cost_retries_not_data(s3_data, proxy, local_batches, fault, read_ahead):
    same_as_local_disk(s3_data, proxy, local_batches, FAULTS[fault](), read_ahead=read_ahead)


def patient(seconds: float) -> dict:
    """Retry options that outlast an outage of about ``seconds``: the waits, drawn uniformly up to 0.5 s doubling to
    the 20 s cap, add up to far more than that with all but a vanishing chance."""
    return dict(retries=20 if seconds <= 5 else 100, backoff=0.5, timeout=2.0)


@pytest.mark.slow
def test_an_outage_of_90_seconds_costs_time_not_data(s3_data, proxy, local_batches):
    faulthandler.dump_traceback_later(400, exit=True)  # longer than the module's watchdog: the outage itself is 90 s
    try:
        rules = [Rule("outage", match="shard-000003.tar", seconds=90)]
        same_as_local_disk(s3_data, proxy, local_batches, rules, read_ahead="64K", **patient(90))
    finally:
        faulthandler.cancel_dump_traceback_later()


def same_as_local_disk(s3_data, proxy, local_batches, rules, **options):
    """A pass over the dataset through the proxy with ``rules``: the batches of local disk, in the planned steps, and
    nothing counted as bad data (``loader.metrics()``); the store did misbehave."""
    proxy.reset(*rules)
    kw = patient(5) if any(r.action in ("stall", "outage") for r in rules) else dict(backoff=0.001)
    kw.update(options)
    loader = StreamBatchLoader(
        s3_data.url, storage_options=s3_data.proxied, budget=BUDGET, seed=7, chunk_size="16K", **kw
    )
    batches = run(loader)
    assert len(batches) == len(loader) == len(local_batches)  # the planned steps
    assert [b["keys"] for b in batches] == [b["keys"] for b in local_batches]
    for got, want in zip(batches, local_batches):
        assert torch.equal(got["audio"], want["audio"])
    m = loader.metrics()
    assert m["faults"]["bad_shards"] == m["faults"]["lost_samples"] == m["faults"]["redrawn_samples"] == 0, m
    assert m["faults"]["shrunk_batches"] == 0 and m["faults"]["bad_shard_urls"] == []
    assert any(rule.acted for rule in rules)  # the store did misbehave
    if any(r.action in ("stall", "outage", "error") for r in rules):
        assert m["storage"]["retries"] > 0  # and it cost retries
