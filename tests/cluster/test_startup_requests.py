"""Start-up in O(nodes) storage requests (format/shared_index.py): with a node cache folder, a remote index's
header and shard table are fetched once per node and shared by its ranks; each rank then reads only its own
shards' sample-table row groups. Counted through the request-logging proxy (tests/faultproxy.py) in front of a
real S3-compatible server on loopback."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import TESTS, free_port, popen
from faultproxy import FaultProxy, byte_range, times_read
from torchrun_jobs import BUDGET, SR, batches, read_logs, wait

from streambatch import ShardIndex
from streambatch.errors import IndexFormatError, UntrustedURL
from streambatch.format import columnar
from streambatch.format.shards import ShardInfo
from streambatch.format.shared_index import NodeCopies, load_shared

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

INDEX, TABLE, PART = "index.json", "index.shards.parquet", "part-00000.parquet"



def opts(endpoint: str) -> dict:
    from conftest_s3 import s3_options

    return s3_options(endpoint)


@pytest.fixture(scope="module")
def dataset(moto_endpoint, tmp_path_factory) -> str:
    """80 samples in 8 shards on S3, one sample-table row group per shard (so a rank's row groups are its own)."""
    from conftest_s3 import BUCKET

    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    audio = str(tmp_path_factory.mktemp("startup") / "audio")
    write_audio_corpus(audio, 80, seed=5, sample_rate=SR)
    url = f"s3://{BUCKET}/startup"
    saved = columnar.ROWS_PER_GROUP
    columnar.ROWS_PER_GROUP = 10
    try:
        write_shards(audio, url, storage_options=opts(moto_endpoint), max_count=10, seed=1, progress=False)
    finally:
        columnar.ROWS_PER_GROUP = saved
    return url


def requests_for(proxy: FaultProxy, name: str) -> list:
    return [r for r in proxy.requests if r[1].split("?")[0].endswith("/" + name)]


def test_ranks_of_one_job_share_one_fetch(dataset, proxy, tmp_path):
    """Four ranks of one job on one node: one version check, one fetch of header and table; a new job checks the
    version again (one request) and fetches nothing while the index is unchanged."""
    for _ in range(4):
        ix = load_shared(dataset, str(tmp_path), opts(proxy.url), job="job-1")
        assert ix.num_samples == 80 and ix.num_shards == 8
    assert len(requests_for(proxy, INDEX)) == 2  # the version check (HEAD) and the fetch
    table = requests_for(proxy, TABLE)
    assert times_read([r for r in table if r[0] == "GET"], ix.shards.reader.shard_entry["bytes"]) == 1
    proxy.reset()
    for _ in range(4):
        again = load_shared(dataset, str(tmp_path), opts(proxy.url), job="job-2")
    assert [r[0] for r in requests_for(proxy, INDEX)] == ["HEAD"] and not requests_for(proxy, TABLE)
    assert again.shard_urls() == ShardIndex.load(dataset, opts(proxy.url)).shard_urls()  # the remote's own URLs


def test_a_check_holds_for_its_job_only_a_while(dataset, proxy, tmp_path, monkeypatch):
    from streambatch.format import shared_index

    load_shared(dataset, str(tmp_path), opts(proxy.url), job="job-1")
    proxy.reset()
    load_shared(dataset, str(tmp_path), opts(proxy.url), job="job-1")
    assert not requests_for(proxy, INDEX)
    monkeypatch.setattr(shared_index, "REUSE_SECONDS", 0.0)
    load_shared(dataset, str(tmp_path), opts(proxy.url), job="job-1")
    assert [r[0] for r in requests_for(proxy, INDEX)] == ["HEAD"]


def small_index(n: int) -> ShardIndex:
    """An index of ``n`` shards of 4 samples (no tars: only the index is read here)."""
    shards = [ShardInfo(f"shard-{i:06d}.tar", 4, 100, np.arange(4) + 10 * i, sha256=f"{i:064x}") for i in range(n)]
    return ShardIndex(shards, "samples", SR)


def test_a_changed_index_is_fetched_again(moto_endpoint, tmp_path):
    from conftest_s3 import BUCKET

    url = f"s3://{BUCKET}/changing"
    small_index(3).save(url, opts(moto_endpoint))
    first = load_shared(url, str(tmp_path), opts(moto_endpoint), job=None)
    small_index(5).save(url, opts(moto_endpoint))
    second = load_shared(url, str(tmp_path), opts(moto_endpoint), job=None)
    assert (first.num_shards, second.num_shards) == (3, 5)
    assert second.shard_lengths([4])[0].tolist() == [40, 41, 42, 43]
    assert len(os.listdir(tmp_path / "index")) == 3  # two versions' folders and the stamp


def test_a_node_copy_is_checked_like_the_original(moto_endpoint, tmp_path):
    """Shard URLs of a copy resolve against the original index's folder (an outside one is refused as from the
    store); a damaged copy is refused, removed, and fetched again by the next load."""
    from conftest_s3 import BUCKET

    url = f"s3://{BUCKET}/escaping"
    ix = small_index(2)
    ix.shards[1].url = "s3://elsewhere/shard.tar"
    ix.save(url, opts(moto_endpoint))
    with pytest.raises(UntrustedURL):
        load_shared(url, str(tmp_path), opts(moto_endpoint), job="j").check_urls()
    with pytest.raises(UntrustedURL):
        ShardIndex.load(url, opts(moto_endpoint)).check_urls()
    assert load_shared(url, str(tmp_path), opts(moto_endpoint), ["s3://elsewhere/"], job="j").check_urls() is None

    copies = NodeCopies(str(tmp_path))
    version = copies.checked(f"{url}/index.json", "j")
    folder = copies.folder(f"{url}/index.json", version)
    with open(os.path.join(folder, "shards.parquet"), "r+b") as f:
        f.truncate(50)
    with pytest.raises(IndexFormatError, match="bytes, the index says"):
        load_shared(url, str(tmp_path), opts(moto_endpoint), job="j")
    assert not os.path.exists(folder)
    assert load_shared(url, str(tmp_path), opts(moto_endpoint), job="j").num_shards == 2


@pytest.mark.parametrize("reads", [1, 2, 3])
def test_a_table_copied_in_several_reads_is_whole(dataset, moto_endpoint, tmp_path, monkeypatch, reads):
    """The shard table copied to the node in reads of a fixed size, its size a whole number of them (no read may
    start at its end: a store refuses such a range) or not: the copy is the table, and the index loads."""
    from streambatch.format import shared_index

    table = ShardIndex.load(dataset, opts(moto_endpoint)).shards.reader.shard_entry["bytes"]
    monkeypatch.setattr(shared_index, "CHUNK", max(1, table // reads))
    ix = load_shared(dataset, str(tmp_path), opts(moto_endpoint), job=None)
    assert (ix.num_samples, ix.num_shards) == (80, 8)


def row_group_spans(url: str, endpoint: str) -> list[tuple[int, int]]:
    """Byte span of each row group of the sample table (column chunks first to last)."""
    import pyarrow.parquet as pq

    from streambatch.io import storage

    with storage.open_url(f"{url}/index.samples/{PART}", "rb", opts(endpoint)) as f:
        meta = pq.ParquetFile(f).metadata
    spans = []
    for g in range(meta.num_row_groups):
        cols = [meta.row_group(g).column(c) for c in range(meta.num_columns)]
        starts = [min(x for x in (c.dictionary_page_offset, c.data_page_offset) if x is not None) for c in cols]
        spans.append((min(starts), max(s + c.total_compressed_size for s, c in zip(starts, cols))))
    return spans


def test_two_nodes_of_four_ranks_fetch_the_index_once_per_node(dataset, moto_endpoint, tmp_path):
    """torchrun, 2 nodes × 4 ranks on loopback, 2 epochs, each rank behind a proxy of its own and each node with its
    own cache folder: per node one rank fetched header and shard table (once), the others asked nothing of them;
    every rank read sample-table row groups, and only those of the shards it streamed."""
    proxies = [FaultProxy(moto_endpoint).start() for _ in range(8)]
    try:
        port, out = free_port(), tmp_path / "logs"
        out.mkdir()
        jobs = []
        for node in (0, 1):
            args = ["--data", dataset, "--out", str(out), "--cache-dir", str(tmp_path / f"node{node}")]
            args += ["--endpoints", ",".join(p.url for p in proxies), "--budget", str(BUDGET)]
            rdzv = ["--nnodes=2", f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
            jobs.append(torchrun_startup(args, rdzv))
        for job in jobs:
            wait(job, 300)
        logs = read_logs(out)
        check_epochs(logs, 2)
        ix = ShardIndex.load(dataset, opts(moto_endpoint))
        node_of = {r: next(e["node"] for e in log if e["event"] == "node") for r, log in logs.items()}
        for node in (0, 1):
            ranks = [r for r in logs if node_of[r] == node]
            assert len(ranks) == 4
            fetchers = [r for r in ranks if requests_for(proxies[r], INDEX) or requests_for(proxies[r], TABLE)]
            assert len(fetchers) == 1, f"node {node}: ranks {fetchers} asked the store for the index"
            gets = [q for q in requests_for(proxies[fetchers[0]], TABLE) if q[0] == "GET"]
            assert times_read(gets, ix.shards.reader.shard_entry["bytes"]) == 1
        check_own_row_groups(logs, proxies, ix, row_group_spans(dataset, moto_endpoint))
    finally:
        for p in proxies:
            p.stop()


def torchrun_startup(args: list[str], rdzv: list[str]):
    import sys

    script = str(TESTS / "ddp" / "startup_job.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc_per_node=4", script, *args]
    return popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def check_epochs(logs: dict[int, list[dict]], epochs: int) -> None:
    """Equal steps equal to len() on every rank, no sample twice in an epoch, no batch over the budget."""
    assert sorted(logs) == list(range(8))
    for epoch in range(epochs):
        steps = {len(batches(log, epoch)) for log in logs.values()}
        heads = {next(e["len"] for e in log if e["event"] == "epoch" and e["epoch"] == epoch) for log in logs.values()}
        assert len(steps) == 1 and heads == steps
        keys = [k for log in logs.values() for b in batches(log, epoch) for k in b["keys"]]
        assert keys and len(keys) == len(set(keys))
        assert all(b["cost"] <= BUDGET for log in logs.values() for b in batches(log, epoch))


def dealt_shards(ix: ShardIndex, rank: int, epochs: int) -> set[int]:
    """The shards whose stretch of the epoch's sample stream reaches the one slot of ``rank`` (1 worker, 8 ranks,
    seed 0) in the first ``epochs`` epochs: those it streams, and those at its edges whose lengths say where its
    share begins or ends."""
    from streambatch.plan.config import BatchingConfig
    from streambatch.plan.lengths import index_lengths
    from streambatch.plan.shards import Deal

    seed = BatchingConfig(budget=float(BUDGET)).epoch_seed
    deals = [Deal.of(index_lengths(ix), 8, seed, e, True) for e in range(epochs)]
    return {int(d.order[i]) for d in deals for i in d.positions(rank, rank + 1)}


def check_own_row_groups(logs, proxies, ix: ShardIndex, spans: list[tuple[int, int]]) -> None:
    """Every sample-table GET of a rank lies in the footer or in the row groups of the shards dealt to it."""
    size = ix.shards.reader.parts[0]["bytes"]
    for r in logs:
        mine = dealt_shards(ix, r, 2)  # one row group per shard
        assert len(mine) < len(spans)
        data = []
        for _, _, rng, _ in [q for q in requests_for(proxies[r], PART) if q[0] == "GET"]:
            lo, hi = byte_range(rng, size)
            if hi >= size - 1:  # the footer (pyarrow reads the last 64 KiB at once: this whole small table)
                continue
            touched = {g for g, (a, b) in enumerate(spans) if lo < b and hi >= a}
            assert touched <= mine, (r, rng, touched, mine)
            data.append(touched)
        assert data, f"rank {r} read no sample-table row group"


def test_a_small_table_costs_one_request(dataset, proxy):
    """The shard table and a small sample file are each read in one ranged GET, with no size request before it
    (the header knows their sizes): a round trip less, twice, at the start of every loader on an object store."""
    ix = ShardIndex.load(dataset, opts(proxy.url))
    assert ix.shard_lengths([0])[0].tolist()
    for name in (TABLE, PART):
        assert [r[0] for r in requests_for(proxy, name)] == ["GET"], name


def test_a_loader_reads_each_index_table_once(dataset, proxy):
    """Building a loader and running its epoch reads the index header, the shard table and the sample file in one
    GET each: no size request before the header, and the shard table's planning columns and its other columns
    (URLs, checksums) from the same bytes, not two round trips."""
    from streambatch import StreamBatchLoader

    loader = StreamBatchLoader(dataset, budget=BUDGET, storage_options=opts(proxy.url), seed=0)
    assert sum(len(b["keys"]) for b in loader) == 80
    for name in (INDEX, TABLE, PART):
        assert [r[0] for r in requests_for(proxy, name)] == ["GET"], name


def test_a_loader_fetches_the_first_plans_lengths_while_it_is_built(dataset, proxy):
    """A loader over a small remote index asks for its sample file while it is being built, beside the shard
    table, so the first epoch's planning does not wait a round trip for it; opening the index alone (as the
    command line does) reads no sample file until lengths are asked for."""
    import time

    from streambatch import StreamBatchLoader

    ShardIndex.load(dataset, opts(proxy.url))
    assert not requests_for(proxy, PART)
    loader = StreamBatchLoader(dataset, budget=BUDGET, storage_options=opts(proxy.url), seed=0)
    deadline = time.monotonic() + 30
    while not requests_for(proxy, PART) and time.monotonic() < deadline:  # sent in the background
        time.sleep(0.05)
    assert [r[0] for r in requests_for(proxy, PART)] == ["GET"]
    proxy.reset()
    assert sum(len(b["keys"]) for b in loader) == 80
    assert not requests_for(proxy, PART) and not requests_for(proxy, TABLE)
