"""``http(s)://`` reads go through obstore once this process runs its runtime (and through fsspec before): the
same bytes, sizes and existence either way. Against a plain HTTP server on loopback, in a fresh interpreter (the
calls start obstore's runtime, which the test process must not run)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import functools, http.server, json, sys, threading, time
import obstore
from obstore.store import MemoryStore
from streambatch.io import objstore, storage

handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
handler.log_message = lambda *a: None
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
base = f"http://127.0.0.1:{server.server_address[1]}"
out = {}
for when in ("before", "after"):
    if when == "after":
        obstore.put(MemoryStore(), "x", b"x")  # obstore's runtime now runs in this process (not streambatch's call:
        deadline = time.monotonic() + 10  # seen by its threads' names, which they take a moment after they start)
        while not objstore.runtime_running() and time.monotonic() < deadline:
            time.sleep(0.01)
    out[when] = {
        "through_obstore": storage.store_of(f"{base}/index.json", None) is not None,
        "whole": storage.read_whole(f"{base}/index.json").decode(),
        "prefix": storage.read_prefix(f"{base}/index.json", 4).decode(),
        "size": storage.size(f"{base}/index.json"),
        "exists": [storage.exists(f"{base}/index.json"), storage.exists(f"{base}/missing.json")],
    }
server.shutdown()
print(json.dumps(out))
"""


def test_http_reads_are_the_same_through_fsspec_and_obstore(tmp_path):
    (tmp_path / "index.json").write_text('{"format": "x"}')
    run = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["before"].pop("through_obstore") is False and out["after"].pop("through_obstore") is True
    want = {"whole": '{"format": "x"}', "prefix": '{"fo', "size": 15, "exists": [True, False]}
    assert out["before"] == want and out["after"] == want
