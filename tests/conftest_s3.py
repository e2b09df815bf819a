"""Fixtures for the object-storage tests: a real S3-compatible server on loopback, our fault proxy in front
of it, and one small dataset written both to local disk and to S3.

Loaded by the S3 test modules with ``pytest_plugins = ["conftest_s3"]``. The server is ``moto[server]``
(``pip install -e .[test]``) in a subprocess of its own, on a free port of 127.0.0.1; nothing here listens
on another interface or reaches out.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import pytest
from conftest import LONG_LIVED, free_port, keep_running

from streambatch.procs import set_parent_death_signal

SR = 8000
BUCKET = "sb-test"
#: a test that runs longer than this is stuck: its stacks are dumped and the run stops, loudly
WATCHDOG_SECONDS = float(os.environ.get("STREAMBATCH_TEST_WATCHDOG", "120"))



def s3_options(endpoint: str) -> dict:
    """storage_options for s3fs against a loopback server (it does not check signatures)."""
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


#: Linux: a server gets SIGTERM when the process that started it dies, even by SIGKILL (set in the child before
#: exec; the one implementation the package's pool workers use too)
_die_with_parent = functools.partial(set_parent_death_signal, signal.SIGTERM)


@pytest.fixture
def watchdog():
    """Fail loudly instead of hanging: dump every thread's stack and exit if the test runs too long."""
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def s3_env():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in ("AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")}
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # never look for instance credentials
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _wait_http(url: str, proc: subprocess.Popen, log, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the S3 server exited with {proc.returncode}: {open(log).read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"the S3 server at {url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def moto_endpoint(s3_env, tmp_path_factory):
    """URL of a moto S3 server in its own process (its own interpreter lock: the loader's threads and
    DataLoader workers do not compete with it)."""
    port = free_port()
    env = dict(os.environ, AWS_DEFAULT_REGION="us-east-1")
    log = tmp_path_factory.mktemp("moto") / "server.log"  # a file, not a pipe: it logs every request
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from moto.server import main; main(sys.argv[1:])",
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
    keep_running(proc.pid)  # a session-long server, not a process some test left behind
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/", proc, log)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()
        LONG_LIVED.discard(proc.pid)


@pytest.fixture(scope="session")
def fault_proxy(moto_endpoint):
    from faultproxy import FaultProxy

    px = FaultProxy(moto_endpoint).start()
    yield px
    px.stop()


@pytest.fixture
def proxy(fault_proxy):
    """The fault proxy with no rules and an empty request log (and again so after the test)."""
    fault_proxy.reset()
    yield fault_proxy
    fault_proxy.reset()


@dataclass
class S3Data:
    audio: str  # local audio folder (the source)
    local: str  # the dataset written to local disk
    url: str  # the same source written to s3://
    endpoint: str
    proxy_url: str

    @property
    def options(self) -> dict:
        return s3_options(self.endpoint)

    @property
    def proxied(self) -> dict:
        return s3_options(self.proxy_url)


@pytest.fixture(scope="session")
def s3_data(moto_endpoint, fault_proxy, tmp_path_factory) -> S3Data:
    """80 short audio samples in 8 shards, written to local disk and to ``s3://sb-test/ds``."""
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    root = tmp_path_factory.mktemp("s3data")
    audio = str(root / "audio")
    write_audio_corpus(audio, 80, seed=11, sample_rate=SR)
    kw = dict(max_count=10, shuffle=True, seed=2, progress=False)
    write_shards(audio, str(root / "local"), **kw)
    url = f"s3://{BUCKET}/ds"
    write_shards(audio, url, storage_options=s3_options(moto_endpoint), **kw)
    return S3Data(audio, str(root / "local"), url, moto_endpoint, fault_proxy.url)


def pytest_sessionfinish(session, exitstatus):
    """A test run must end: if anything keeps the interpreter alive at exit (a stuck non-daemon thread, a
    DataLoader worker that ignores SIGTERM), dump the stacks and exit after 5 minutes instead of hanging CI."""
    import threading

    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if stuck:
        print(f"\nconftest_s3: threads still running at the end: {stuck}", file=sys.stderr)
    faulthandler.dump_traceback_later(300, exit=True)
