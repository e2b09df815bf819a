"""``shardify write/index --engine ray`` on a real Ray cluster: a head and a second node started here on loopback,
one write task killed mid-write and retried by Ray; the dataset equals a single-process write byte for byte (the
index's time and random id aside, which differ between any two writes)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import LONG_LIVED, free_port, keep_running, kill_tree, make_audio

from streambatch.cli import main

TASKS = 3


@pytest.fixture(scope="module")
def ray_installed() -> None:
    pytest.importorskip("ray")



def ray_env(home: Path, **more: str) -> dict[str, str]:
    """The environment of every Ray process here: a home and a temporary folder of its own (Ray keeps its auth
    token and the cluster's address there), no usage reports, no RAY_ADDRESS of the machine's, and everything on
    127.0.0.1: Ray's setting that stops it rewriting a loopback address to the machine's interface address, and
    an HTTP proxy nothing listens at for every host but loopback (Ray's dashboard asks cloud metadata addresses
    which cloud it runs on, usage reports on or off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and not k.lower().endswith("_proxy")}
    nowhere = f"http://127.0.0.1:{free_port()}"  # free: nothing listens there
    proxy = {"http_proxy": nowhere, "https_proxy": nowhere, "no_proxy": "127.0.0.1,localhost,::1"}
    proxy |= {k.upper(): v for k, v in proxy.items()}
    loopback = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": str(home)}
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", **loopback, **proxy, **more}


def loopback(address: str) -> bool:
    """Whether a socket address's host is on loopback (or the wildcard a listening socket binds)."""
    host = ipaddress.ip_address(address.split("%")[0])
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped:
        host = host.ipv4_mapped
    return host.is_loopback or host.is_unspecified


class Sockets:
    """Watches, from a thread, every inet socket of this process's descendants (the cluster's Ray processes and
    the ``shardify`` drivers) and keeps those whose local or remote address is off loopback: (command, local,
    remote). ``ss``/psutil read the kernel's tables, so a connection that lives between two samples can be
    missed; Ray's connections to its nodes live as long as the cluster."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval, self.outside = interval, set[tuple[str, str, str]]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
        for c in psutil.net_connections(kind="inet"):
            if c.pid not in mine:
                continue
            ends = [c.laddr] + ([c.raddr] if c.raddr else [])
            if not all(loopback(end.ip) for end in ends):
                try:
                    name = " ".join(psutil.Process(c.pid).cmdline())[:120]
                except psutil.Error:
                    name = str(c.pid)
                remote = f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else "-"
                self.outside.add((name, f"{c.laddr.ip}:{c.laddr.port}", remote))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> set[tuple[str, str, str]]:
        self._stop.set()
        self._thread.join()
        return self.outside


#: the running cluster's socket watcher (one at most), for the tests to check after they ran
CLUSTER_SOCKETS: list[Sockets] = []


@pytest.fixture(scope="module")
def cluster(ray_installed, tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A Ray head and a second node on 127.0.0.1 (one CPU each, ``ray_cluster.py``): (address, environment,
    kill-hook marker). The node processes and all below them are ended after the module's tests; no `ray stop`
    (which would end every Ray process of the machine's user). No socket of any of them, nor of a driver, leaves
    loopback while it runs (checked after each test that uses it and when the cluster stops)."""
    home = tmp_path_factory.mktemp("rayhome")
    top = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths must fit in 107 characters
    marker = home / "killed-once"
    env = ray_env(top, STREAMBATCH_RAY_TEST_KILL=f"1:{marker}")
    sockets = Sockets()
    helper = Path(__file__).with_name("ray_cluster.py")
    proc = subprocess.Popen(
        [sys.executable, str(helper), str(top / "t")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(home / "cluster.log", "wb"),
        text=True,
        start_new_session=True,
    )
    keep_running(proc.pid)  # outlives each test by design: the leak check leaves its tree alone
    try:
        address = proc.stdout.readline().strip()  # type: ignore[union-attr]
        if not address:
            pytest.fail(f"the Ray cluster did not start: {(home / 'cluster.log').read_text(errors='replace')[-2000:]}")
        CLUSTER_SOCKETS.append(sockets)
        yield address, env, marker
    finally:
        kill_tree(proc.pid)
        proc.wait()
        LONG_LIVED.discard(proc.pid)
        shutil.rmtree(top, ignore_errors=True)
        outside = sockets.stop()
        assert not outside, f"Ray sockets off loopback: {sorted(outside)}"


def assert_on_loopback() -> None:
    """No socket of the cluster or of a driver has left loopback so far."""
    outside = CLUSTER_SOCKETS[-1].outside if CLUSTER_SOCKETS else set()
    assert not outside, f"sockets off loopback: {sorted(outside)}"


def shardify(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``shardify ARGS`` as its own process (a Ray driver), in the cluster's environment."""
    return subprocess.run(
        [sys.executable, "-m", "streambatch.cli", *args], env=env, capture_output=True, text=True, timeout=180
    )


def same_output(a: Path, b: Path) -> None:
    """Every file of the two folders byte for byte the same: shards, index.json and the Parquet tables (both
    writes ran with the same ``SOURCE_DATE_EPOCH``, which fixes the index's creation time and id)."""
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert "index.json" in names and any(n.endswith(".parquet") for n in names)
    for name in names:
        assert (b / name).read_bytes() == (a / name).read_bytes(), name


def test_source_date_epoch_makes_two_local_writes_byte_identical(tmp_path, audio, monkeypatch):
    """Without SOURCE_DATE_EPOCH two writes differ in their index id; with it they are byte-identical."""
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(["write", str(audio), str(first), *WRITE]) == 0
    assert main(["write", str(audio), str(second), *WRITE]) == 0
    ids = {json.loads((d / "index.json").read_text())["id"] for d in (first, second)}
    assert len(ids) == 2
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    shutil.rmtree(first), shutil.rmtree(second)
    assert main(["write", str(audio), str(first), *WRITE]) == 0
    assert main(["write", str(audio), str(second), *WRITE]) == 0
    same_output(first, second)
    assert json.loads((first / "index.json").read_text())["meta"]["created"].startswith("2023-11-14T22:13:20")


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "audio"
    for i in range(31):
        make_audio(d / f"spk{i % 3}" / f"u{i:03d}.{['wav', 'flac'][i % 2]}", 0.03 + 0.01 * (i % 5), seed=i)
        if i % 3 == 0:
            (d / f"spk{i % 3}" / f"u{i:03d}.txt").write_text(f"words {i}\n")
    return d


EPOCH = "1700000000"  # SOURCE_DATE_EPOCH: the index's creation time and id, the same for both writes
WRITE = ["--max-count", "3", "--shuffle", "--seed", "7", "--no-progress"]


def test_ray_write_with_a_killed_task_equals_a_single_process_write(tmp_path, cluster, audio, monkeypatch):
    address, env, marker = cluster
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    env = {**env, "SOURCE_DATE_EPOCH": EPOCH}
    single, on_ray = tmp_path / "single", tmp_path / "ray"
    assert main(["write", str(audio), str(single), *WRITE]) == 0
    r = shardify(env, "write", str(audio), str(on_ray), *WRITE, "--engine", "ray", "--ray-address", address)
    assert r.returncode == 0, r.stderr
    assert "wrote 31 samples in 11 shards" in r.stdout
    assert marker.exists(), "the kill hook did not run: no task was killed"
    same_output(single, on_ray)
    assert_on_loopback()
    assert len([n for n in os.listdir(single) if n.endswith(".tar")]) == 11
    assert not [n for n in os.listdir(on_ray) if ".tmp" in n]  # the retry removed the killed attempt's leftovers


def test_ray_index_of_tars_equals_a_local_index(tmp_path, cluster, audio, monkeypatch):
    address, env, _ = cluster
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    env = {**env, "SOURCE_DATE_EPOCH": EPOCH}
    tars = tmp_path / "tars"
    assert main(["write", str(audio), str(tars), *WRITE]) == 0
    for name in os.listdir(tars):
        if not name.endswith(".tar"):
            shutil.rmtree(tars / name) if (tars / name).is_dir() else (tars / name).unlink()
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert main(["index", str(tars), "--out", str(local), "--no-progress"]) == 0
    args = ["--engine", "ray", "--ray-address", address, "--tasks", str(TASKS), "--no-progress"]
    r = shardify(env, "index", str(tars), "--out", str(on_ray), *args)
    assert r.returncode == 0, r.stderr
    assert re.search(r"indexed 31 samples in 11 tars", r.stdout), r.stdout
    same_output(local, on_ray)
    assert_on_loopback()


def test_a_local_ray_instance_stays_on_loopback(ray_installed, tmp_path, audio):
    """Without an address the write starts a local Ray instance for itself: it and every process it starts stay
    on 127.0.0.1 (Ray's own default would run it on the machine's interface address), and it is stopped after."""
    env = ray_env(Path(tempfile.mkdtemp(prefix="r", dir="/tmp")))
    del env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]  # the write itself keeps the instance on loopback
    sockets = Sockets()
    try:
        r = shardify(env, "write", str(audio), str(tmp_path / "o"), *WRITE, "--engine", "ray")
    finally:
        outside = sockets.stop()
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert r.returncode == 0, r.stderr
    assert "wrote 31 samples in 11 shards" in r.stdout
    assert not outside, f"sockets off loopback: {sorted(outside)}"


def test_engine_options_need_the_ray_engine(capsys, audio, tmp_path):
    """--ray-address and --tasks without --engine ray are refused; the write's help documents all three."""
    assert main(["write", str(audio), str(tmp_path / "o"), "--tasks", "2"]) == 2
    assert "options of --engine ray" in capsys.readouterr().err
    assert main(["write", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--engine", "--ray-address", "--tasks"):
        assert flag in text


def test_a_ray_address_nothing_answers_at_is_one_line(ray_installed, capsys, audio, tmp_path):
    """Ray retries an address that does not answer for minutes, printing warnings: the write says it at once."""
    address = f"127.0.0.1:{free_port()}"  # free: nothing listens there
    out = tmp_path / "o"
    code = main(["write", str(audio), str(out), "--engine", "ray", "--ray-address", address, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0, err
    assert f"Ray address {address}: no Ray cluster answers there" in err and not out.exists()


NO_RAY = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
sys.meta_path.insert(0, NoRay())
from streambatch.cli import main
code = main(sys.argv[1:])
print("ray" in sys.modules, code)
"""


def test_without_ray_the_package_works_and_the_ray_engine_names_the_extra(tmp_path, audio):
    """Ray is an optional extra: without it the CLI starts and writes locally; --engine ray is a one-line error."""
    run = [sys.executable, "-c", NO_RAY]
    r = subprocess.run([*run, "write", "--help"], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "False 0"
    r = subprocess.run(
        [*run, "write", str(audio), str(tmp_path / "o"), "--engine", "ray"], capture_output=True, text=True
    )
    assert r.stdout.strip() == "False 2"
    assert r.stderr.strip() == "shardify: error: the Ray engine needs Ray: pip install 'streambatch[ray]'"
    assert not (tmp_path / "o").exists()
