"""A store that does not answer is a storage fault naming the URL, for every call `storage` makes through obstore:
never a corrupt index or shard, never a hang. Against a loopback port nothing listens on (connection refused), in
a fresh interpreter: the calls start obstore's runtime, which the test process must not run (its later loaders
would start their workers by forkserver)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

PROBE = r"""
import json, sys
from streambatch.errors import StorageError
from streambatch.io import objstore, storage

opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": sys.argv[1]},
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
url = "s3://bucket/ds/index.json"
out = {"runtime_before": objstore.runtime_running()}
for name, call in [
    ("write_bytes_atomic", lambda: storage.write_bytes_atomic(url, b"{}", opts)),
    ("read_whole", lambda: storage.read_whole(url, opts)),
    ("read_prefix", lambda: storage.read_prefix(url, 10, opts)),
    ("size", lambda: storage.size(url, opts)),
    ("listdir", lambda: storage.listdir("s3://bucket/ds", opts)),
    ("remove", lambda: storage.remove(url, opts)),
]:
    try:
        call()
        out[name] = "no error"
    except StorageError as e:
        out[name] = ["StorageError", isinstance(e, ConnectionError), url.split("/index")[0] in str(e)]
    except Exception as e:
        out[name] = type(e).__name__
out["through_obstore"] = storage.store_of(url, opts) is not None
print(json.dumps(out))
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_that_does_not_answer_is_a_storage_fault_naming_the_url():
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    run = subprocess.run([sys.executable, "-c", PROBE, endpoint], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out.pop("runtime_before") is False
    assert out.pop("through_obstore") is True  # the write started obstore's runtime: the reads went through it too
    # transient (a ConnectionError: retried where a caller retries), a StorageError, the URL named
    assert out == {name: ["StorageError", True, True] for name in out}, out


READS_FIRST = r"""
import json, sys
from streambatch.errors import StorageError
from streambatch.io import objstore, storage

opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": sys.argv[1]},
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
url = "s3://bucket/ds/index.json"
out = {}
for name, call in [
    ("read_whole", lambda: storage.read_whole(url, opts)),
    ("read_range", lambda: storage.read_range(url, 5, 10, opts)),
    ("version", lambda: storage.version(url, opts)),
    ("exists", lambda: storage.exists(url, opts)),
]:
    try:
        call()
        out[name] = "no error"
    except StorageError as e:
        out[name] = ["StorageError", url in str(e)]
    except Exception as e:
        out[name] = type(e).__name__
out["runtime_after"] = objstore.runtime_running()
print(json.dumps(out))
"""


def test_reads_before_any_write_fail_the_same_way_and_start_no_runtime():
    """A process that has written nothing reads through fsspec (so it can still fork workers): a store that does
    not answer is a storage fault naming the URL there too, and no obstore runtime was started."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    run = subprocess.run([sys.executable, "-c", READS_FIRST, endpoint], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out.pop("runtime_after") is False
    assert out == {name: ["StorageError", True] for name in out}, out
