"""One writer per dataset on object storage: the lock is an object the store creates only when absent (S3's
``If-None-Match: *``), so of two ``shardify write`` started together into one S3 prefix exactly one wins and the
other exits 2 naming it, even when the store is slow to take the lock's put (the window in which a writer that
looked, found no lock and wrote one could not yet see the other's).

Real writers (the CLI, in processes of their own) against the loopback S3 server behind the fault proxy of
conftest_s3.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from subprocess import PIPE

import pytest
import s3fs
from conftest import popen
from faultproxy import Rule

from streambatch.io.lock import LOCK_NAME

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

SHARDIFY = [sys.executable, "-m", "streambatch.cli"]
ROWS = [{"id": f"s{i}", "text": " ".join(["word"] * (1 + i % 17))} for i in range(40)]


def test_two_writers_racing_on_s3_exactly_one_wins(s3_data, proxy, tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    url = f"s3://sb-test/race-{os.getpid()}"
    # every put of the lock takes 4 s (more than the two writers' starts differ by): both look, find no lock, and
    # put theirs before either put lands
    proxy.reset(Rule("latency", match=LOCK_NAME, seconds=4.0, methods=("PUT",)))
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL_S3=s3_data.proxy_url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    cmd = [*SHARDIFY, "write", str(src), url, "--kind", "text", "--no-progress"]
    procs = [popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    errs = [p.stderr.read().decode() for p in procs]
    assert sorted(codes) == [0, 2], (codes, errs)
    winner, loser = procs[codes.index(0)], errs[codes.index(2)]
    lines = loser.strip().splitlines()
    assert len(lines) == 1, loser
    assert "is being written by another shardify" in lines[0] and f"pid {winner.pid}" in lines[0], lines[0]
    proxy.reset()
    verified = subprocess.run(
        [*SHARDIFY, "verify", url, "--no-progress"], env=env, capture_output=True, text=True, timeout=300
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert re.search(r"\b40 samples\b", verified.stdout), verified.stdout


def test_an_interrupt_removes_the_lock_even_when_the_store_is_slow_to_read_it(s3_data, proxy, tmp_path):
    """Ctrl-C while a writer holds its lock (waiting for its source), the store taking 20 s to answer a read of
    the lock: the cleanup, which has a few seconds, removed the lock only after reading it back, so it gave up
    and left the lock, refusing the next writer on another host for minutes. The put that made the lock landed:
    it is ours, and is removed without the read."""
    fifo = tmp_path / "slow.jsonl"
    os.mkfifo(fifo)
    url = f"s3://sb-test/interrupted-{os.getpid()}"
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL_S3=s3_data.proxy_url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    proxy.reset(Rule("latency", match=LOCK_NAME, seconds=20.0, methods=("GET",)))
    proc = popen([*SHARDIFY, "write", str(fifo), url, "--kind", "text", "--no-progress"], env=env, stderr=PIPE)
    deadline = time.monotonic() + 120
    while not any(m == "PUT" and LOCK_NAME in p for m, p, _, _ in list(proxy.requests)):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer took no lock"
        time.sleep(0.05)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 130 and err.decode().strip() == "shardify: interrupted", err
    assert took < 15, f"took {took:.1f} s to end"
    proxy.reset()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_data.options)
    assert not fs.exists(f"{url.removeprefix('s3://')}/{LOCK_NAME}")
