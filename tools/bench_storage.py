"""Storage benchmark: the same shards from local disk and from S3 servers on loopback that answer every request
0, 20 or 100 ms late, with read-ahead on and off.

    python tools/bench_storage.py [--samples 2000] [--decode audio|none] [--workers 0] [--runs 3] [--only-100ms]
                                  [--server lite|moto|both] [--tls] [--default-only] [--latencies 0,100]

Remote shards are read through obstore (streambatch/io/objstore.py). ``--default-only``: the default read-ahead
rows only. ``--latencies``: the added milliseconds per request to measure (of 0, 20, 100).

Two S3 servers, each in its own process on 127.0.0.1 (``--server`` picks, both by default):

* ``lite`` (tools/_s3_lite.py): a read-only S3 endpoint over the shard folder that sleeps the latency before
  every answer and sends bodies with ``sendfile``, so it costs almost no CPU, like a remote store whose CPU is
  not the training node's. This is the fair stand-in on a small machine.
* ``moto`` (``pip install -e .[test]``, pure Python) with tests/faultproxy.py in front adding the latency (a
  second Python process that copies every byte): both spend CPU on the same cores as the loader.

``--tls``: the lite server also serves each latency over TLS (a self-signed certificate for 127.0.0.1, made with
``cryptography``), the row named "S3 lite TLS ...", at the default read-ahead: cloud stores speak HTTPS, and
the request threads then decrypt every byte, 16 KiB per ``recv``. Its server encrypts in Python on the same
cores (its CPU is in the "server CPU s" column).

With ``--runs N`` every configuration runs N times, each run beside its own local-disk run, and a last table
gives each row's ratio to local disk in every run and the worst. The +100 ms rows show the default read-ahead
(up to ``max_read_concurrency`` 16 requests in flight) beside 4 in flight.

Prints samples/s and MB/s of StreamBatchLoader over one epoch (timed from the start of its iteration), the ratio
to local disk, the seconds the loader took to build (the index's header and shard table; its sample files and
S3 client are started then, in the background) and from the iteration's start to the first batch (planning, the
first shards' round trips, what the build's background work had left), the CPU seconds of the
loader's process and of the server processes during that row, and the peak RSS of the process that iterates
(each configuration runs in a fresh process; "growth" is the peak minus the RSS before the first batch), and the
ratio to local disk of the rate after the first batch (the samples after it over the seconds after it: the
epoch's start, one round trip at least, left out). torch
runs one intra-op thread (``torch.set_num_threads(1)``), as loader workers should on a small machine. Every
server the benchmark starts is stopped when it ends, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _bench_common import machine, table  # noqa: E402

from streambatch.procs import set_parent_death_signal  # noqa: E402

BUCKET = "bench"
#: seconds a server may take to come up
START_TIMEOUT = 30.0
#: latencies (seconds added per request) of the S3 rows, and their names
LATENCIES = ((0.0, "loopback"), (0.02, "+20 ms/request"), (0.1, "+100 ms/request"))
#: with ``--default-only``: the default read-ahead only (not read-ahead off, nor the 4-in-flight and 256M rows)
ONLY_DEFAULT = False


def rss_mb() -> float:
    """Peak RSS of this process (VmHWM: unlike ru_maxrss it does not inherit the parent's peak over fork+exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    """The RSS of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def own_cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far (Linux; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(spec: dict) -> dict:
    """One configuration, one epoch; runs in its own process."""
    import torch

    torch.set_num_threads(1)
    from streambatch import StreamBatchLoader

    t_build = time.perf_counter()
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
        interleave=spec["interleave"],
    )
    built = time.perf_counter() - t_build
    index = loader.index
    assert index is not None, "a loader over an indexed dataset has its index"
    total_bytes = sum(int(s.bytes) for s in index.shards)
    before = current_rss_mb()
    cpu0, t0 = own_cpu_s(), time.perf_counter()
    n, first, first_samples = 0, None, 0
    for b in loader:
        n += len(b["keys"])
        if first is None:
            first, first_samples = time.perf_counter() - t0, n
    dt = time.perf_counter() - t0
    return {
        "samples": n,
        "bytes": total_bytes,
        "seconds": dt,
        "first": first or 0.0,
        "first_samples": first_samples,
        "build": built,
        "cpu": own_cpu_s() - cpu0,
        "rss_before": before,
        "rss_peak": rss_mb(),
        "stats": loader.fault_stats(),
        "storage_wait": loader.metrics().get("waited_on_storage_s", 0.0),
    }


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT, ca: str | None = None) -> None:
    """Wait until ``url`` answers (any HTTP status; HTTPS checked against the certificate file ``ca``); raise if the
    server exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    context = ssl.create_default_context(cafile=ca) if ca else None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1, context=context).read()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s")


#: Linux: a server gets SIGTERM when the process that started it dies, even by SIGKILL (set in the child before
#: exec; the one implementation the package's pool workers use too)
_die_with_parent = functools.partial(set_parent_death_signal, signal.SIGTERM)


def spawn(procs: list[subprocess.Popen], args: list[str], **kw: object) -> subprocess.Popen:
    """Start a server process and put it in ``procs`` at once, so it is stopped whatever happens next."""
    proc = subprocess.Popen([sys.executable, *args], preexec_fn=_die_with_parent, **kw)  # type: ignore[call-overload]
    procs.append(proc)
    return proc


def start_moto(procs: list[subprocess.Popen], log: str) -> tuple[int, str]:
    """moto's S3 server: (its pid, its URL)."""
    port = free_port()
    main_of_moto = "import sys; from moto.server import main; main(sys.argv[1:])"
    with open(log, "wb") as out:
        proc = spawn(procs, ["-c", main_of_moto, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc)
    return proc.pid, url


def start_proxy(procs: list[subprocess.Popen], upstream: str, latency: float) -> tuple[int, str]:
    """tests/faultproxy.py in front of ``upstream``, adding ``latency`` seconds: (its pid, its URL)."""
    port = free_port()
    proxy = os.path.join(ROOT, "tests", "faultproxy.py")
    args = [proxy, "--upstream", upstream, "--port", str(port), "--latency", str(latency)]
    proc = spawn(procs, args, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc)
    return proc.pid, url


def start_lite(procs: list[subprocess.Popen], root: str, latency: float, tls: tuple | None = None) -> tuple[int, str]:
    """tools/_s3_lite.py serving ``root`` as bucket BUCKET, ``latency`` seconds per answer, over TLS with ``tls``
    (certificate, key): (its pid, its URL, which it prints once it listens)."""
    args = [os.path.join(HERE, "_s3_lite.py"), "--root", root, "--bucket", BUCKET, "--latency", str(latency)]
    args += ["--cert", tls[0], "--key", tls[1]] if tls else []
    proc = spawn(procs, args, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith(("http://", "https://")):
        raise RuntimeError(f"the lite S3 server did not start (exit status {proc.poll()}, said {line!r})")
    wait_http(line + "/", proc, ca=tls[0] if tls else None)
    return proc.pid, line


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop every server: SIGTERM, then SIGKILL to one that has not ended 10 s later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def options(endpoint: str, ca: str | None = None) -> dict:
    """s3fs's storage options for a loopback server (which checks no signature); ``ca``: the certificate file an
    HTTPS one is checked against."""
    return {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": endpoint, **({"verify": ca} if ca else {})},
    }


def self_signed(work: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files in ``work``, valid for a day), made with cryptography."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([ip]), critical=False)
        .sign(key, hashes.SHA256())
    )
    paths = os.path.join(work, "lite-cert.pem"), os.path.join(work, "lite-key.pem")
    with open(paths[0], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths[1], "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return paths


def make_data(work: str, samples: int, sample_rate: int) -> str:
    """The shards (written once per size and rate, kept in ``work`` for the next run)."""
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


def self_check(url: str, endpoint: str, local: str, ca: str | None = None) -> None:
    """The lite server must give s3fs, unmodified, the files' own bytes: the index whole, a listing, and a
    range of the first shard (a wrong server would make every lite row meaningless)."""
    import s3fs

    fs = s3fs.S3FileSystem(**options(endpoint, ca), skip_instance_cache=True)
    path = url[len("s3://") :]
    with open(os.path.join(local, "index.json"), "rb") as f:
        if fs.cat_file(path + "/index.json") != f.read():
            raise RuntimeError(f"{endpoint}: index.json differs from the local file")
    names = sorted(os.path.basename(p) for p in fs.ls(path))
    shard = next((n for n in names if n.endswith(".tar")), None)
    if shard is None or names != sorted(os.listdir(local)):
        raise RuntimeError(f"{endpoint}: the listing of {url} is not the folder's ({names[:5]} ...)")
    with open(os.path.join(local, shard), "rb") as f:
        f.seek(1000)
        if fs.cat_file(f"{path}/{shard}", start=1000, end=70_000) != f.read(69_000):
            raise RuntimeError(f"{endpoint}: a range of {shard} differs from the local file")


def moto_sources(procs: list[subprocess.Popen], work: str, local: str, latencies: list[tuple]) -> list[tuple]:
    """moto with the shards uploaded, and one latency proxy per latency: (name, url, options, server pids)."""
    import s3fs

    moto, endpoint = start_moto(procs, os.path.join(work, "moto.log"))
    fs = s3fs.S3FileSystem(**options(endpoint), skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(local + "/", f"{BUCKET}/ds/", recursive=True)
    out = []
    for latency, name in latencies:
        proxy, ep = start_proxy(procs, endpoint, latency) if latency else (None, endpoint)
        pids = [moto] + ([proxy] if proxy else [])
        out.append((f"S3 moto {name}", f"s3://{BUCKET}/ds", options(ep), pids))
    return out


def lite_sources(procs: list[subprocess.Popen], local: str, latencies: list[tuple], tls: tuple | None) -> list[tuple]:
    """One lite server per latency over the shard folder (and one over TLS per latency with ``tls``, a certificate
    and its key), each checked: (name, url, options, server pids)."""
    root, name_of_ds = os.path.split(local)
    url = f"s3://{BUCKET}/{name_of_ds}"
    out = []
    for latency, name in latencies:
        for cert in [None, tls] if tls else [None]:
            pid, endpoint = start_lite(procs, root, latency, cert)
            ca = cert[0] if cert else None
            self_check(url, endpoint, local, ca)
            out.append((f"S3 lite {'TLS ' if cert else ''}{name}", url, options(endpoint, ca), [pid]))
    return out


def run_child(spec: dict) -> dict:
    """One configuration in a fresh process (its result is the last line it prints)."""
    env = dict(os.environ, AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode:
        raise RuntimeError(f"configuration {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_aheads(name: str, remote: bool, read_ahead: str) -> list[tuple[str | int, int | None]]:
    """(read_ahead, max_read_concurrency or None for the default) of each row of a source."""
    if not remote:
        return [(0, None)]
    if " TLS " in name:  # the default read-ahead only: what TLS adds to it
        return [(read_ahead, None)]
    if ONLY_DEFAULT:
        return [(read_ahead, None)]
    if name.endswith("+100 ms/request"):  # the default read-ahead beside 4 requests in flight
        return [(read_ahead, None), (read_ahead, 4), ("256M", None), (0, None)]
    return [(read_ahead, None), (0, None)]


def measure_row(spec: dict, server_pids: list[int]) -> tuple[dict, float]:
    """One configuration's result, and the CPU seconds its servers used while it ran."""
    before = sum(cpu_s(p) for p in server_pids)
    r = run_child(spec)
    return r, sum(cpu_s(p) for p in server_pids) - before


def measure(sources: list[tuple], base: dict, read_ahead: str) -> list[list]:
    """One run of every configuration, each in a fresh process; rows with the ratio to this run's local disk."""
    rows: list[list] = []
    local_rate = local_steady = None
    for name_of_source, source, so, pids in sources:
        for ra, fixed in read_aheads(name_of_source, so is not None, read_ahead):
            name = name_of_source
            spec = dict(base, source=source, storage_options=so, read_ahead=ra, max_in_flight=fixed)
            r, server_cpu = measure_row(spec, pids)
            sps = r["samples"] / r["seconds"]
            steady = (r["samples"] - r["first_samples"]) / max(r["seconds"] - r["first"], 1e-9)
            local_rate, local_steady = local_rate or sps, local_steady or steady
            ra_txt = "-" if so is None else ((f"on ({ra})" if ra else "off") + (f", {fixed} max" if fixed else ""))
            ratio, wait = f"{sps / local_rate:.2f}x", f"{r['storage_wait']:.2f}"
            server = f"{server_cpu:.2f}" if pids else "-"
            rows.append(
                [name, ra_txt, f"{sps:,.0f}", f"{r['bytes'] / 2**20 / r['seconds']:,.1f}", ratio, wait]
                + [f"{r['build']:.2f}", f"{r['first']:.2f}", f"{r['cpu']:.2f}", server]
                + [f"{r['rss_peak']:.0f}", f"{r['rss_peak'] - r['rss_before']:+.0f}"]
                + [f"{steady / local_steady:.2f}x"]
            )
            print(f"  {name}, read-ahead {ra_txt}: {sps:,.0f} samples/s ({ratio}, waited {wait} s)", file=sys.stderr)
    return rows


HEADER = [
    "source",
    "read-ahead",
    "samples/s",
    "MB/s",
    "vs local",
    "waited on storage s",
    "build s",
    "first batch s",
    "loader CPU s",
    "server CPU s",
    "peak RSS MB",
    "growth MB",
    "vs local after 1st batch",
]


def report(runs: list[list[list]], a: argparse.Namespace) -> None:
    """Each run's table, then (several runs) each row's ratio per run and the worst."""
    print()
    print(
        f"StreamBatchLoader, one epoch, decode={a.decode}, num_workers={a.workers}, buffer_size={a.buffer_size}, "
        f"interleave={a.interleave}, "
        f"chunk_size 8M, max_read_concurrency 16 unless a row says another max; {machine()}"
    )
    for i, rows in enumerate(runs):
        print(f"\nrun {i + 1} of {len(runs)}:")
        print(table(rows, HEADER))
    if len(runs) < 2:
        return
    print("\nvs local disk, each run (local measured in the same run), and the worst:")
    summary = []
    for j, row in enumerate(runs[0]):
        ratios = [float(r[j][4].rstrip("x")) for r in runs]
        after = [float(r[j][12].rstrip("x")) for r in runs]
        waits, builds, firsts = (" / ".join(r[j][k] for r in runs) for k in (5, 6, 7))
        per_run = [" / ".join(f"{x:.2f}" for x in ratios), f"{min(ratios):.2f}x", waits, builds, firsts]
        per_run += [" / ".join(f"{x:.2f}" for x in after), f"{min(after):.2f}x"]
        summary.append([row[0], row[1], *per_run])
    head = ["source", "read-ahead", "vs local per run", "worst", "waited on storage s per run", "build s per run"]
    head += ["first batch s per run", "after 1st batch per run", "worst"]
    print(table(summary, head))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    ap.add_argument("--interleave", type=int, default=8, help="shards a worker streams at once")
    ap.add_argument("--runs", type=int, default=1, help="runs of every configuration, each against its own local run")
    ap.add_argument(
        "--only-100ms", action="store_true", help="local disk and the +100 ms rows only (the adaptive read-ahead's)"
    )
    ap.add_argument(
        "--server",
        default="both",
        choices=["lite", "moto", "both"],
        help="lite: tools/_s3_lite.py (latency inside, sendfile); moto: moto behind the latency proxy",
    )
    ap.add_argument("--tls", action="store_true", help="also the lite server over TLS (needs cryptography)")
    ap.add_argument("--default-only", action="store_true", help="the default read-ahead rows only")
    ap.add_argument("--latencies", default="", help="comma-separated added ms per request, of 0, 20, 100 (all)")
    ap.add_argument("--work", default=os.path.join("/tmp", "streambatch-bench-storage"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Make the data, start the servers, measure every row ``--runs`` times, print the tables, stop the servers."""
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    os.makedirs(a.work, exist_ok=True)
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    t0 = time.perf_counter()
    local = make_data(a.work, a.samples, a.sample_rate)
    from streambatch import ShardIndex

    ix = ShardIndex.load(local)
    total = sum(s.bytes for s in ix.shards) / 2**20
    made = time.perf_counter() - t0
    print(f"data: {ix.num_samples} utterances, {ix.num_shards} shards, {total:.1f} MiB (made in {made:.0f}s)")
    latencies = [x for x in LATENCIES if not a.only_100ms or x[0] == 0.1]
    if a.latencies:
        latencies = [x for x in latencies if round(x[0] * 1000) in {int(v) for v in a.latencies.split(",")}]
    global ONLY_DEFAULT
    ONLY_DEFAULT = a.default_only
    base = dict(budget=60 * a.sample_rate, decode=a.decode, workers=a.workers, buffer_size=a.buffer_size)
    base["interleave"] = a.interleave
    procs: list[subprocess.Popen] = []
    try:
        sources: list[tuple] = [("local disk", local, None, [])]
        if a.server in ("lite", "both"):
            sources += lite_sources(procs, local, latencies, self_signed(a.work) if a.tls else None)
        if a.server in ("moto", "both"):
            sources += moto_sources(procs, a.work, local, latencies)
        report([measure(sources, base, a.read_ahead) for _ in range(a.runs)], a)
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
