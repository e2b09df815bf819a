"""Storage benchmark: the same shards from local disk, from an S3 server on loopback, and through a proxy
that adds 20 ms or 100 ms to every request, with read-ahead on and off.

    python tools/bench_storage.py [--samples 2000] [--decode audio|none] [--workers 0] [--runs 3] [--only-100ms]

With ``--runs N`` every configuration runs N times, each run beside its own local-disk run, and a last table
gives each row's ratio to local disk in every run and the worst. The +100 ms rows show the adaptive read-ahead
(the default, up to ``max_read_concurrency`` requests in flight) beside the fixed 4 in flight it replaced.

Prints samples/s and MB/s of StreamBatchLoader over one epoch, the ratio to local disk, and the peak RSS of
the process that iterates (each configuration runs in a fresh process; "growth" is the peak minus the RSS
before the first batch). The S3 server is moto (``pip install -e .[test]``) in its own process, the latency
proxy is tests/faultproxy.py, also in its own process; everything stays on 127.0.0.1. torch runs one
intra-op thread (``torch.set_num_threads(1)``), as loader workers should on a small machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _bench_common import machine, table  # noqa: E402

from streambatch.procs import set_parent_death_signal  # noqa: E402

BUCKET = "bench"


def rss_mb() -> float:
    """Peak RSS of this process (VmHWM: unlike ru_maxrss it does not inherit the parent's peak over fork+exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(spec: dict) -> dict:
    """One configuration, one epoch; runs in its own process."""
    import torch

    torch.set_num_threads(1)
    from streambatch import StreamBatchLoader

    loader = StreamBatchLoader(
        spec["source"],
        budget=spec["budget"],
        storage_options=spec.get("storage_options"),
        read_ahead=spec["read_ahead"],
        **({"max_read_concurrency": spec["max_in_flight"]} if spec.get("max_in_flight") else {}),
        decode=spec["decode"],
        num_workers=spec["workers"],
        seed=0,
        buffer_size=spec["buffer_size"],
    )
    total_bytes = sum(s.bytes for s in loader.index.shards)
    before = current_rss_mb()
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(b["keys"])
    dt = time.perf_counter() - t0
    return {
        "samples": n,
        "bytes": total_bytes,
        "seconds": dt,
        "rss_before": before,
        "rss_peak": rss_mb(),
        "stats": loader.fault_stats(),
        "storage_wait": loader.metrics().get("waited_on_storage_s", 0.0),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


#: Linux: a server gets SIGTERM when the process that started it dies, even by SIGKILL (set in the child before
#: exec; the one implementation the package's pool workers use too)
_die_with_parent = functools.partial(set_parent_death_signal, signal.SIGTERM)


def start_moto(log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, AWS_DEFAULT_REGION="us-east-1")
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
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc)
    return proc, url


def start_proxy(upstream: str, latency: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "faultproxy.py"),
            "--upstream",
            upstream,
            "--port",
            str(port),
            "--latency",
            str(latency),
        ],
        stdout=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the proxy did not start")


def options(endpoint: str) -> dict:
    return {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}


def make_data(work: str, samples: int, sample_rate: int) -> str:
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    ds = os.path.join(work, f"shards-{samples}-{sample_rate}")
    if os.path.exists(os.path.join(ds, "index.json")):
        return ds
    audio = os.path.join(work, "audio")
    shutil.rmtree(audio, ignore_errors=True)
    write_audio_corpus(audio, samples, seed=1, sample_rate=sample_rate)
    write_shards(audio, ds, max_count=100, shuffle=True, seed=0, progress=False, overwrite=True)
    shutil.rmtree(audio, ignore_errors=True)
    return ds


def run_child(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=dict(os.environ, AWS_DEFAULT_REGION="us-east-1"),
    )
    if out.returncode:
        raise RuntimeError(f"configuration {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_aheads(name: str, remote: bool, read_ahead: str) -> list[tuple[str | int, int | None]]:
    """(read_ahead, max_read_concurrency or None for the default) of each row of a source."""
    if not remote:
        return [(0, None)]
    if name.endswith("+100 ms/request"):  # the adaptive read-ahead beside the fixed 4 in flight it replaced
        return [(read_ahead, None), (read_ahead, 4), ("256M", None), (0, None)]
    return [(read_ahead, None), (0, None)]


def measure(configs: list[tuple[str, str, dict | None]], base: dict, read_ahead: str) -> list[list]:
    """One run of every configuration, each in a fresh process; rows with the ratio to this run's local disk."""
    rows: list[list] = []
    local_rate = None
    for name, source, so in configs:
        for ra, fixed in read_aheads(name, so is not None, read_ahead):
            spec = dict(base, source=source, storage_options=so, read_ahead=ra, max_in_flight=fixed)
            r = run_child(spec)
            sps = r["samples"] / r["seconds"]
            mbs = r["bytes"] / 2**20 / r["seconds"]
            if local_rate is None:
                local_rate = sps
            ra_txt = "-" if so is None else ((f"on ({ra})" if ra else "off") + (f", fixed {fixed}" if fixed else ""))
            growth = f"{r['rss_peak'] - r['rss_before']:+.0f}"
            ratio = f"{sps / local_rate:.2f}x"
            wait = f"{r['storage_wait']:.2f}"
            rows.append([name, ra_txt, f"{sps:,.0f}", f"{mbs:,.1f}", ratio, wait, f"{r['rss_peak']:.0f}", growth])
            print(
                f"  {name}, read-ahead {ra_txt}: {sps:,.0f} samples/s ({ratio}, waited {wait} s)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000, help="utterances in the synthetic corpus")
    ap.add_argument("--sample-rate", type=int, default=16000)
    ap.add_argument(
        "--decode",
        default="audio",
        choices=["audio", "none"],
        help="audio: full loader (decode + pad); none: the read stages only",
    )
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    ap.add_argument("--read-ahead", default="64M", help="the read-ahead limit of the 'on' rows")
    ap.add_argument("--buffer-size", type=int, default=300, help="the loader's buffer_size (samples held)")
    ap.add_argument("--runs", type=int, default=1, help="runs of every configuration, each against its own local run")
    ap.add_argument(
        "--only-100ms", action="store_true", help="local disk and the +100 ms rows only (the adaptive read-ahead's)"
    )
    ap.add_argument("--work", default=os.path.join("/tmp", "streambatch-bench-storage"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    os.makedirs(a.work, exist_ok=True)
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    t0 = time.perf_counter()
    local = make_data(a.work, a.samples, a.sample_rate)
    from streambatch import ShardIndex

    ix = ShardIndex.load(local)
    total = sum(s.bytes for s in ix.shards)
    print(
        f"data: {ix.num_samples} utterances, {ix.num_shards} shards, {total / 2**20:.1f} MiB "
        f"(made in {time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    procs = []
    try:
        moto, endpoint = start_moto(os.path.join(a.work, "moto.log"))
        procs.append(moto)
        import s3fs

        fs = s3fs.S3FileSystem(**options(endpoint))
        fs.mkdir(BUCKET)
        fs.put(local + "/", f"{BUCKET}/ds/", recursive=True)
        url = f"s3://{BUCKET}/ds"
        p20, url20 = start_proxy(endpoint, 0.02)
        p100, url100 = start_proxy(endpoint, 0.1)
        procs += [p20, p100]
        budget = 60 * a.sample_rate  # one minute of audio per batch
        base = dict(budget=budget, decode=a.decode, workers=a.workers, buffer_size=a.buffer_size)
        configs = [("local disk", local, None)]
        for name, ep in (("S3 loopback", endpoint), ("S3 +20 ms/request", url20), ("S3 +100 ms/request", url100)):
            if not a.only_100ms or "100" in name:
                configs.append((name, url, options(ep)))
        runs = [measure(configs, base, a.read_ahead) for _ in range(a.runs)]
        header = [
            "source",
            "read-ahead",
            "samples/s",
            "MB/s",
            "vs local",
            "waited on storage s",
            "peak RSS MB",
            "growth MB",
        ]
        print()
        print(
            f"StreamBatchLoader, one epoch, decode={a.decode}, num_workers={a.workers}, buffer_size={a.buffer_size}, "
            f"chunk_size 8M, read_concurrency 4 (adaptive up to max_read_concurrency 16 unless 'fixed'); {machine()}"
        )
        for i, rows in enumerate(runs):
            print(f"\nrun {i + 1} of {len(runs)}:")
            print(table(rows, header))
        if len(runs) > 1:
            print("\nvs local disk, each run (local measured in the same run), and the worst:")
            summary = []
            for j, row in enumerate(runs[0]):
                ratios = [float(r[j][4].rstrip("x")) for r in runs]
                waits = " / ".join(r[j][5] for r in runs)
                summary.append([row[0], row[1], " / ".join(f"{x:.2f}" for x in ratios), f"{min(ratios):.2f}x", waits])
            print(table(summary, ["source", "read-ahead", "vs local per run", "worst", "waited on storage s per run"]))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
