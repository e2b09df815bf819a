"""A job reading S3 through the node cache (``cache_dir``), killed with ``kill -9`` while a shard is being
downloaded into the cache, resumes from its last ``state_dict()`` to exactly the batches the uninterrupted run
gives after that point. The dead processes' half-written downloads are never read as shards, and the resumed run
removes them: the cache then holds only whole shards.

Real shards on the loopback S3 server of conftest_s3.py, slowed by the fault proxy so that downloads take a while."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import kill_tree, popen
from faultproxy import Rule

from streambatch import ShardIndex, StreamBatchLoader

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SR = 8000
BUDGET = 12 * SR
#: a shard at a time, on demand, in the plain order, a small window: the downloads spread over the whole pass
ON_DEMAND = dict(interleave=1, step_balance=None, read_ahead=0, buffer_size=10)
FAST = dict(backoff=0.001, chunk_size="16K", timeout=5)

#: the job: one pass, its state saved after every batch (written whole: a kill leaves the last one or the one
#: before), the number of batches it yielded beside it
JOB = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from streambatch import StreamBatchLoader

    url, options, cache, out, num_workers, kw = json.loads(sys.argv[1])
    loader = StreamBatchLoader(url, storage_options=options, cache_dir=cache, num_workers=num_workers, **kw)
    for n, batch in enumerate(loader, 1):
        torch.save({"batches": n, "state": loader.state_dict()}, out + ".tmp")
        os.replace(out + ".tmp", out)
    open(out + ".done", "w").close()
    time.sleep(600)
    """
)


def in_flight(objects: str) -> list[str]:
    """The downloads under way in the cache's ``objects`` folder (their temporary files)."""
    try:
        return [f for f in os.listdir(objects) if ".tmp-" in f]
    except FileNotFoundError:
        return []


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_kill_9_mid_download_then_resume_over_s3_with_a_cache_is_exact(s3_data, proxy, tmp_path, num_workers):
    kw = dict(budget=BUDGET, seed=7, **ON_DEMAND)
    local = list(StreamBatchLoader(s3_data.local, num_workers=num_workers, **kw))
    cache, out = str(tmp_path / "cache"), str(tmp_path / "state.pt")
    objects = os.path.join(cache, "objects")
    proxy.reset(Rule("latency", match=".tar", seconds=0.03))  # each 16 KiB of a shard takes a while
    args = [s3_data.url, s3_data.proxied, cache, out, num_workers, {**kw, **FAST}]
    with open(tmp_path / "job.log", "wb") as log:
        job = popen([sys.executable, "-c", JOB, json.dumps(args)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (os.path.exists(out) and in_flight(objects)):  # a batch yielded and a download under way
        ended = job.poll() is not None or os.path.exists(out + ".done") or time.monotonic() > deadline
        assert not ended, "no kill mid-download: " + (tmp_path / "job.log").read_text()[-2000:]
        time.sleep(0.005)
    kill_tree(job.pid, grace=0)  # kill -9 of the job and its DataLoader workers, mid-download
    job.wait(30)
    saved = torch.load(out, weights_only=False)
    assert 0 < saved["batches"] < len(local)

    proxy.reset()
    resumed = StreamBatchLoader(
        s3_data.url, storage_options=s3_data.proxied, cache_dir=cache, num_workers=num_workers, **kw, **FAST
    )
    resumed.load_state_dict(saved["state"])
    rest = list(resumed)
    assert [b["keys"] for b in rest] == [b["keys"] for b in local[saved["batches"] :]]
    for x, y in zip(rest, local[saved["batches"] :]):
        assert torch.equal(x["audio"], y["audio"]) and torch.equal(x["lengths"], y["lengths"])
    assert resumed.fault_stats()["bad_shards"] == 0
    # no half-written download is left, and every copy the cache holds is a whole shard of the dataset
    assert in_flight(objects) == []
    whole = {s.sha256 for s in ShardIndex.load(s3_data.local).shards}
    kept = [os.path.join(objects, f) for f in os.listdir(objects)]
    assert kept and all(sha256_of(p) in whole for p in kept)
