"""``storage.copy`` within one bucket (staging and shared index copies): an object up to the store's one-request copy
limit is copied by the store; a larger one goes through the process in parts. Either way the copy holds exactly the
source's bytes. Against the loopback S3 server, in a fresh interpreter (obstore's runtime must not run in the test
process, whose later loaders fork their workers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

COPY = r"""
import hashlib, json, os, sys
from streambatch.io import storage

opts, bucket = json.loads(sys.argv[1]), sys.argv[2]
data = os.urandom(11 << 20)  # over two of the parts below
src = f"s3://{bucket}/copy-test/src.bin"
storage.write_bytes_atomic(src, data, opts)
out = {}
storage.copy(src, f"s3://{bucket}/copy-test/in-store.bin", opts)  # under the limit: the store's own copy
storage.COPY_IN_STORE, storage.COPY_PIECE = 1 << 20, 5 << 20  # as if over the limit: in parts through here
storage.copy(src, f"s3://{bucket}/copy-test/in-parts.bin", opts)
for name in ("in-store", "in-parts"):
    got = storage.read_whole(f"s3://{bucket}/copy-test/{name}.bin", opts)
    out[name] = [len(got), hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()]
print(json.dumps(out))
"""


def test_a_copy_in_one_bucket_holds_the_sources_bytes_below_and_above_the_one_request_limit(moto_endpoint):
    from conftest_s3 import BUCKET, s3_options

    opts = json.dumps(s3_options(moto_endpoint))
    run = subprocess.run([sys.executable, "-c", COPY, opts, BUCKET], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == {"in-store": [11 << 20, True], "in-parts": [11 << 20, True]}
