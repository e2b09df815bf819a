"""Shared test helpers: real (tiny) audio files and sources to shard, the check that no test leaves a process
running, and the paths the tests find their scripts by. Being the root conftest, it puts tests/ on sys.path (pytest's
default import mode), so the test modules in the feature folders import it and the helper modules beside it."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

SR = 16000
#: the tests' folder and the repository's root
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

#: the record of shards hashed on this node (streambatch/io/verified.py) goes to this test run's own folder, not
#: the user's: the subprocesses a test starts inherit it, and it goes when the run ends
_RECORD = tempfile.mkdtemp(prefix="streambatch-tests-verified-")
os.environ.setdefault("STREAMBATCH_VERIFY_RECORD", _RECORD)
atexit.register(shutil.rmtree, _RECORD, True)
#: the temporary files of the processes a test starts (torchrun's torchelastic_* logs, multiprocessing's pymp-*,
#: which a killed rank never removes) go to this run's own folder, removed when the run ends
_CHILD_TMP = tempfile.mkdtemp(prefix="streambatch-tests-tmp-")
os.environ["TMPDIR"] = _CHILD_TMP
atexit.register(shutil.rmtree, _CHILD_TMP, True)
#: every process a test starts names its loopback peers without a DNS query (tests/netguard: torch.distributed's
#: stores would otherwise send reverse queries for 127.0.0.1 to the machine's resolver)
from netguard import install as _install_name_wrapper  # noqa: E402

_install_name_wrapper()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_audio(path: str | os.PathLike, seconds: float = 0.25, sr: int = SR, seed: int = 0) -> int:
    """Write a short tone+noise file (format from the extension: wav, flac, ogg); returns its frame count
    as the header reports it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(1, int(round(seconds * sr)))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    wav = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.01 * rng.standard_normal(n)).astype("float32")
    fmt = path.suffix.lstrip(".").upper()
    subtype = "VORBIS" if fmt == "OGG" else "PCM_16"
    sf.write(str(path), wav, sr, format=fmt, subtype=subtype)
    return sf.info(str(path)).frames


def six_field_manifest(folder: Path, lines: int, files: int = 8, seconds: float = 0.02) -> str:
    """A NeMo manifest of ``lines`` lines in ``folder`` (six fields: ``audio_filepath``, ``duration``, ``text``,
    ``lang``, ``speaker``, ``id``) over ``files`` WAV files of ``seconds`` each (made under ``folder/wavs``); its
    path. The memory tests' source: the lines grow, the audio does not."""
    for i in range(files):
        wav = folder / "wavs" / f"w{i}.wav"
        if not wav.exists():
            make_audio(wav, seconds, seed=i)
    path = folder / f"m{lines}.json"
    with open(path, "w") as f:
        for i in range(lines):
            row = {
                "audio_filepath": f"wavs/w{i % files}.wav",
                "duration": seconds,
                "text": f"utterance number {i} of the corpus",
                "lang": "en",
                "speaker": f"spk{i % 30}",
                "id": f"utt{i:07d}",
            }
            f.write(json.dumps(row) + "\n")
    return str(path)


def copy_with_own_record(source: str, tmp_path: Path, monkeypatch: Any) -> Iterator[str]:
    """For a fixture (``yield from``): a fresh copy of the dataset ``source`` and a node record of the test's own
    (every shard hashed anew in the test, nothing remembered in the process)."""
    from streambatch.io import verified

    monkeypatch.setenv(verified.RECORD_ENV, str(tmp_path / "record"))
    verified.forget_in_process()
    copy = str(tmp_path / "ds")
    shutil.copytree(source, copy)
    yield copy
    verified.forget_in_process()


def error_of(fn: Any) -> tuple[type | None, str]:
    """(type, message) of what ``fn()`` raises, keeping no traceback (so a DataLoader's workers stop at once)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, ""


def audio_dataset(root: Path, n: int, corpus_seed: int, sample_rate: int = SR, **write: Any) -> str:
    """A synthetic audio corpus of ``n`` clips under ``root``, written as shards (``write``: the
    ``write_shards`` options): the shards' folder."""
    from streambatch.synthetic import write_audio_corpus
    from streambatch.write.writer import write_shards

    write_audio_corpus(str(root / "audio"), n, seed=corpus_seed, sample_rate=sample_rate)
    write_shards(str(root / "audio"), str(root / "shards"), progress=False, **write)
    return str(root / "shards")


def text_dataset(root: Path, n: int, seed: int, max_tokens: int = 120, with_text: bool = False, **write: Any) -> str:
    """``n`` token-id documents of 1 .. ``max_tokens`` - 1 random ids (``with_text``: also their ids as a
    ``text`` field), written as shards under ``root`` (``write``: the ``write_shards`` options): the shards' folder."""
    from streambatch.write.writer import write_shards

    rng = np.random.default_rng(seed)
    with open(root / "text.jsonl", "w") as f:
        for i in range(n):
            ids = rng.integers(1, 1000, size=int(rng.integers(1, max_tokens))).tolist()
            row = {"id": f"s{i}", "input_ids": ids, **({"text": " ".join(map(str, ids))} if with_text else {})}
            f.write(json.dumps(row) + "\n")
    write_shards(str(root / "text.jsonl"), str(root / "shards"), progress=False, **write)
    return str(root / "shards")


def text_mixture(root: Path, n: int) -> dict[str, str]:
    """Two text datasets of ``n`` documents, ``a`` and ``b`` (seeds 1 and 2), under ``root``: {name: folder}."""
    for name in "ab":
        (root / name).mkdir()
    return {"a": text_dataset(root / "a", n, seed=1), "b": text_dataset(root / "b", n, seed=2)}


def write_jsonl(path: str | os.PathLike, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Write rows as JSON lines; ``raw_lines`` {position: text} inserts verbatim (e.g. broken) lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows]
    for pos, text in sorted((raw_lines or {}).items()):
        lines.insert(pos, text)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def audio_folder(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A folder tree of mixed wav/flac/ogg at 16 kHz, some with ``.txt`` transcripts.
    Returns (folder, {key: {"path", "frames", "text"}})."""
    root = tmp_path / "audio"
    spec = [
        ("spk1/utt-a.wav", 0.10, "hello world"),
        ("spk1/utt-b.flac", 0.30, None),
        ("spk2/utt.c.ogg", 0.20, "third one here"),
        ("spk2/deep/utt-d.flac", 0.50, "four"),
        ("top.wav", 0.15, None),
    ]
    expected = {}
    for i, (rel, secs, text) in enumerate(spec):
        p = root / rel
        frames = make_audio(p, secs, seed=i)
        if text is not None:
            p.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        key = os.path.splitext(rel)[0].replace("/", "__").replace(".", "_")
        expected[key] = {"path": p, "frames": frames, "text": text}
    (root / "notes.md").write_text("not audio")
    return root, expected


@pytest.fixture
def nemo_manifest(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A NeMo JSONL manifest with relative paths, durations, text and an extra field.
    Returns (manifest, {key: {"path", "frames", "text"}})."""
    d = tmp_path / "nemo"
    rows, expected = [], {}
    for i in range(6):
        rel = f"wavs/s{i % 2}/u{i}.{'flac' if i % 2 else 'wav'}"
        frames = make_audio(d / rel, 0.1 + 0.05 * i, seed=i)
        rows.append({"audio_filepath": rel, "duration": frames / SR, "text": f"utterance {i}", "lang": "en"})
        expected[f"wavs__s{i % 2}__u{i}"] = {"path": d / rel, "frames": frames, "text": f"utterance {i}"}
    return write_jsonl(d / "train_manifest.json", rows), expected


# ---- processes: every test stops what it starts -----------------------------------------------------------
#: processes that outlive a test by design (a session fixture's server): the leak check leaves them and what
#: they start alone. Fixtures add their pids with :func:`keep_running`.
LONG_LIVED: set[int] = set()
#: the interpreter's own helpers, started once on first use and kept until it exits
SINGLETONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")
#: how long the processes a test started may take to exit after it
LEAK_GRACE = 5.0

Table = dict[int, tuple[int, str, int, int, int]]  # pid -> (ppid, state, start time, process group, session)


def keep_running(pid: int) -> None:
    """Mark ``pid`` (and what it starts) as a session-long process that the leak check does not count."""
    LONG_LIVED.add(pid)


def proc_table() -> Table:
    """Every process, from /proc: pid → (parent pid, state, start time, process group, session); the start
    time tells a process from a later one that got the same pid."""
    out: Table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(entry)] = (int(fields[1]), fields[0], int(fields[19]), int(fields[2]), int(fields[3]))
            except (OSError, ValueError, IndexError):
                continue
    return out


def descendants(pid: int, skip: Collection[int] = (), table: Table | None = None) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), whatever session they are in; not those in
    ``skip`` nor below them."""
    children: dict[int, list[int]] = {}
    for p, (ppid, *_) in (proc_table() if table is None else table).items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in skip:
                out.append(c)
                todo.append(c)
    return out


def members(leaders: Collection[int], table: Table) -> list[int]:
    """The processes in a session or process group that one of ``leaders`` started (Linux does not reuse its
    pid while the group lives): with them, the orphans whose parent has already ended."""
    ids = set(leaders) - {os.getpgid(0), os.getsid(0)}
    return [p for p, v in table.items() if v[3] in ids or v[4] in ids]


def running(known: dict[int, int], table: Table | None = None) -> list[int]:
    """The processes of ``known`` (pid → start time) that still run (a zombie has ended)."""
    table = proc_table() if table is None else table
    return [p for p, t in known.items() if p in table and table[p][2] == t and table[p][1] not in "ZX"]


def _signal(pids: Collection[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _freeze(known: dict[int, int]) -> list[int]:
    """SIGSTOP the ``known`` processes, every process below them and in the sessions they started, again until
    no new one appears (a stopped process starts no other), adding those to ``known``; returns the ones running."""
    while True:
        table, n = proc_table(), len(known)
        for root in list(known):
            if root in running(known, table):
                known.update({c: table[c][2] for c in descendants(root, (os.getpid(),), table)})
        known.update({p: table[p][2] for p in members(known, table) if p != os.getpid()})
        alive = [p for p in running(known, table) if p != os.getpid()]
        _signal(alive, signal.SIGSTOP)
        if len(known) == n:
            return alive


def kill_all(known: dict[int, int], grace: float = 3.0) -> None:
    """End the ``known`` processes (pid → start time) and all below them: SIGTERM, up to ``grace`` seconds to
    exit, then SIGKILL (``grace=0``: SIGKILL at once). Their trees are frozen first, so none escapes by
    starting a child while the others are signalled."""
    if grace > 0:
        alive = _freeze(known)
        _signal(alive, signal.SIGTERM)
        _signal(alive, signal.SIGCONT)
        deadline = time.monotonic() + grace
        while running(known) and time.monotonic() < deadline:
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while (alive := _freeze(known)) and time.monotonic() < deadline:
        _signal(alive, signal.SIGKILL)
        time.sleep(0.05)
    _signal(running(known), signal.SIGCONT)  # none is left stopped, whatever did not die


def kill_tree(pid: int, grace: float = 3.0) -> list[int]:
    """End a process and every process below it (see :func:`kill_all`); returns their pids. torchrun starts its
    ranks in their own sessions, so killing its process group alone leaves the ranks and their DataLoader
    workers running."""
    table = proc_table()
    known = {pid: table[pid][2]} if pid in table else {}
    kill_all(known, grace)
    return sorted(known)


def stop_tree(proc: subprocess.Popen) -> None:
    """End a started command and every process below it if it still runs (:func:`kill_tree`), wait for it and
    close its stderr pipe."""
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait(timeout=60)
    if proc.stderr is not None:
        proc.stderr.close()


_STARTED: list[tuple[subprocess.Popen, int]] = []


def popen(cmd: list[str], **kw) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kw)`` in a session of its own, owned by the running test: its teardown ends
    the process and every process below it if it still runs, whatever way the test ended."""
    kw.setdefault("start_new_session", True)
    proc = subprocess.Popen(cmd, **kw)
    _STARTED.append((proc, proc_table().get(proc.pid, (0, "", -1))[2]))
    return proc


def stop_started() -> None:
    """End what :func:`popen` started that still runs, with all below it and in its session (even once it has
    ended itself), and close its pipes."""
    while _STARTED:
        proc, start = _STARTED.pop()
        kill_all({proc.pid: start})
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def finish(proc: subprocess.Popen, timeout: float, what: str = "the job", hint: str = "") -> None:
    """Wait for a started job to exit 0; past ``timeout`` its whole process tree is killed and the test fails
    (``hint``: the likely cause of a hang, for the message)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        pytest.fail(f"{what} did not finish in {timeout} s{hint}")
    assert rc == 0, f"{what} exited with {rc}"


def cmdline(pid: int) -> str:
    """A process's command line (empty once it has ended)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class ProcessWatch:
    """Every process below this one that starts while a test runs, less the ones already running when it began:
    sampled from /proc, so the ranks of a killed torchrun (re-parented to init) are still known, as are the
    processes in the sessions and process groups that those started."""

    def __init__(self, interval: float = 0.2):
        table = proc_table()
        self.before = {p: table[p][2] for p in descendants(os.getpid(), (), table)}
        self.seen: dict[int, int] = {}
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-watch", daemon=True)

    def start(self) -> ProcessWatch:
        self._thread.start()
        return self

    def _sample(self) -> None:
        table = proc_table()
        skip = {p for p, t in self.before.items() if p in table and table[p][2] == t} | LONG_LIVED
        for p in descendants(os.getpid(), skip, table):
            self.seen[p] = table[p][2]  # a reused pid: the process seen before it has ended
        for p in members(self.seen, table):  # re-parented away from us between two samples
            self.seen.setdefault(p, table[p][2])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def leftovers(self, grace: float = LEAK_GRACE) -> dict[int, int]:
        """Stop watching; the processes seen that still run after up to ``grace`` seconds (pid → start time),
        less the long-lived ones and the interpreter's helpers."""
        self._stop.set()
        self._thread.join()
        self._sample()
        if not self._counted():
            return {}
        gc.collect()  # a DataLoader iterator in a reference cycle stops its workers when it is collected
        deadline = time.monotonic() + grace
        while (left := self._counted()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def _counted(self) -> dict[int, int]:
        table = proc_table()
        exempt = set(LONG_LIVED).union(*(descendants(p, (), table) for p in LONG_LIVED))
        alive = [p for p in running(self.seen, table) if p not in exempt]
        return {p: self.seen[p] for p in alive if not any(s in cmdline(p) for s in SINGLETONS)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for the leak check to know whether the test itself failed."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """Every test stops the processes it starts: one still running after it (and a short grace) is an error at
    its teardown that names it, and is killed so that none piles up. Session-long ones: :func:`keep_running`."""
    if not os.path.isdir("/proc"):
        yield
        return
    watch = ProcessWatch().start()
    yield
    stop_started()
    left = watch.leftovers()
    if not left:
        return
    names = "; ".join(f"{p}: {cmdline(p)[:300]}" for p in sorted(left))
    kill_all(dict(left), grace=1.0)
    rep = getattr(request.node, "rep_call", None)
    if rep is None or rep.passed:  # a failed test keeps its locals (and their workers) in its traceback
        pytest.fail(f"the test left {len(left)} process(es) running (now killed): {names}", pytrace=False)


# ---- datasets compared ----------------------------------------------------------------------------------------
def samples_of(out, shard_roots: Collection[str] = ()) -> list[tuple]:
    """Every sample as a plain webdataset reader sees it, in index order: (key, json bytes, payload bytes);
    ``shard_roots``: where shards outside ``out`` may be read (the loader's option)."""
    import webdataset as wds

    from streambatch.format.index import ShardIndex

    index = ShardIndex.load(str(out), shard_roots=list(shard_roots))
    rows = []
    for s in wds.WebDataset(index.shard_urls(), shardshuffle=False, empty_check=False):
        payload = {k: v for k, v in s.items() if not k.startswith("__") and k != "json"}
        rows.append((s["__key__"], s["json"], sorted(payload.items())))
    return rows


def assert_same_dataset(parts_out, single_out) -> None:
    """What a merged --part run shares with a single-process write (see slurm/README.md)."""
    from streambatch.format.index import ShardIndex
    from streambatch.write.verify import verify_dataset

    a, b = ShardIndex.load(str(parts_out)), ShardIndex.load(str(single_out))
    assert verify_dataset(a, progress=False) == []
    assert samples_of(parts_out) == samples_of(single_out)
    assert a.lengths.tolist() == b.lengths.tolist()
    assert (a.num_samples, a.total_length, a.unit, a.sample_rate) == (
        b.num_samples,
        b.total_length,
        b.unit,
        b.sample_rate,
    )
    ma, mb = dict(a.meta), dict(b.meta)
    for m in (ma, mb):
        m.pop("created")
    assert ma.pop("parts") >= 1 and ma == mb
    # the merged sample table keeps each sample's key and byte span (the parts' tables carried them through)
    per_sample = [[ix.shards.reader.shard_samples(i) for i in range(ix.num_shards)] for ix in (a, b)]
    for name in ("keys", "sizes"):
        got = [[x for s in shards for x in list(s[name])] for shards in per_sample]
        assert got[0] == got[1] and len(got[0]) == a.num_samples


# ---- kinds of test: cluster, s3, slow (registered in pyproject.toml) -------------------------------------------
#: the folders and modules whose every test is of a kind (relative to tests/); single tests elsewhere carry the
#: mark themselves (``@pytest.mark.cluster``), or a module its ``pytestmark``
KIND_PATHS = {"cluster": ("cluster/", "write/test_ray_engine.py")}
#: a test that uses one of these fixtures (directly or through another fixture) is of the kind
KIND_FIXTURES = {"s3": ("s3_env",)}
#: single tests of a kind (``path::name`` marks every parameter, ``path::name[id]`` one): the slowest of the rest,
#: found with ``--durations`` (each took several seconds; most start worker processes or a filter engine)
KIND_TESTS = {
    "slow": {
        "loader/test_small_epochs.py::test_a_filter_that_keeps_a_few_loses_none",
        "loader/test_metrics.py::test_inspect_plan_shows_the_planned_epoch",
        "loader/test_option_checks.py::test_the_lightning_datamodule_checks_its_options_when_it_is_made",
        "loader/test_option_checks.py::test_a_weight_of_1e9_fails_fast_in_bounded_memory",
        "loader/test_option_checks.py::test_a_lambda_the_workers_cannot_receive_is_named_before_they_start",
        "loader/test_planned_lengths.py::test_a_loader_whose_workers_do_not_fork_holds_no_lengths",
        "loader/test_planned_lengths.py::test_forked_workers_read_no_lengths_and_yield_the_same_batches",
        "loader/test_checkpoint_compat.py::test_a_stored_checkpoint_resumes_to_the_stored_batches[where]",
        "loader/test_loader.py::test_without_index_an_epoch_of_skipped_samples_is_an_error",
        "loader/test_loader.py::test_a_resume_from_a_state_without_equalisation_yields_the_same_batches",
        "loader/test_loader.py::test_budget_as_a_duration_string_matches_the_cli",
        # over 10 s each in a whole run on an idle 2-core machine (pytest --durations)
        "package/test_hygiene.py::test_mypy_finds_nothing_in_the_package",
        "package/test_examples.py::test_example_runs_as_written",
        "plan/test_step_balance.py::test_the_balanced_order_keeps_every_promise_of_the_plan",
        "plan/test_batch_by.py::test_no_batch_mixes_keys_every_sample_once_budget_holds",
        "plan/test_level_cut.py::test_budget_exactly_once_and_online_equals_plan_under_the_level_cut",
        "plan/test_batcher.py::test_online_push_equals_plan",
        "plan/test_batcher.py::test_budget_exactly_once_and_bounds",
        "plan/test_rank_local.py::test_resume_on_other_layouts_plans_as_the_global_oracle",
        "plan/test_freshness.py::test_trading_keeps_sizes_budget_buckets_and_exactly_once",
        "plan/test_resume_prefix.py::test_marking_from_the_yielded_batches_equals_the_full_replan",
        "cli/test_interrupts.py::test_ctrl_c_with_workers_ends_promptly_in_one_line",
        "cli/test_signals_more.py::test_verify_decode_interrupted_in_one_line",
        "cli/test_signals_more.py::test_demo_interrupted_while_streaming_in_one_line",
        "cli/test_stage_export_safety.py::test_export_overwrite_failing_at_any_rename_leaves_one_export_whole",
        "write/test_text_sources.py::test_hub_really_unreachable_is_one_line_exit_2",
        "dataset/test_filters.py::test_a_filter_keeps_the_same_samples_in_every_time_zone",
        "read/test_transforms.py::test_kill_and_resume_gives_bit_identical_augmented_batches",
        # over 2 s each in a quick-loop run (pytest --durations, on the loaded shared machine): the quick loop keeps
        # the cheapest case of a parametrized promise, and a cheaper test of each promise where one exists
        "cli/test_calibrate_errors.py::test_the_command_prints_one_line_and_exits_2",
        "cli/test_demo.py::test_demo_reuses_existing_data",
        "cli/test_demo.py::test_demo_says_what_it_does_before_the_data_is_written",
        "cli/test_demo.py::test_demo_table",
        "cli/test_interrupts.py::test_a_process_pool_left_on_an_interrupt_stops_its_workers",
        "cli/test_interrupts.py::test_a_signal_after_the_summary_keeps_the_success",
        "cli/test_interrupts.py::test_index_of_a_really_read_only_folder",
        "cli/test_interrupts.py::test_sigterm_cleans_up_like_ctrl_c",
        "cli/test_signals_more.py::test_a_disk_input_output_error_names_the_file",
        "cli/test_signals_more.py::test_a_fifo_named_like_a_shard_is_a_problem_not_a_hang",
        "cli/test_signals_more.py::test_a_temporary_file_that_cannot_be_removed_does_not_hide_the_error",
        "cli/test_signals_more.py::test_calibrate_interrupted_in_one_line_its_trial_stopped",
        "cli/test_stage_export_safety.py::test_a_stage_overwrite_cut_short_leaves_the_old_dataset_readable[s3]",
        "cli/test_stage_export_safety.py::test_a_write_overwrite_is_refused_while_an_upgrade_runs",
        "dataset/test_filters.py::test_workers_of_a_filtered_loader_never_load_duckdb",
        "dataset/test_fuzz_index.py::test_mutated_header_fields",
        "dataset/test_fuzz_index.py::test_mutated_table_bytes",
        "dataset/test_fuzz_index.py::test_mutated_table_values",
        "dataset/test_fuzz_index.py::test_mutated_v1_lengths",
        "dataset/test_fuzz_tar.py::test_sizes_claimed_by_headers",
        "dataset/test_fuzz_tar.py::test_streamed_gnu_tars",
        "dataset/test_fuzz_tar.py::test_streamed_pax_tars",
        "dataset/test_fuzz_tar.py::test_tars_read_from_a_buffer",
        "dataset/test_fuzz_tar.py::test_tars_scanned_for_shardify_index",
        "dataset/test_verify_index.py::test_a_flipped_byte_in_any_table_fails_verify",
        "dataset/test_where_limits.py::test_a_filter_that_runs_too_long_is_stopped",
        "dataset/test_where_limits.py::test_a_second_statement_or_clause_is_refused",
        "dataset/test_where_limits.py::test_an_engine_that_stops_answering_is_killed",
        "dataset/test_where_limits.py::test_in_process_and_engine_answers_agree",
        "dataset/test_where_limits.py::test_memory_hungry_filters_fail_in_one_line_within_the_bound",
        "fit/test_calibrate.py::test_cli_prints_the_table_and_writes_the_file",
        "fit/test_calibrate.py::test_loader_reads_the_calibration_file_end_to_end",
        "fit/test_calibrate.py::test_oom_split_accumulates_the_whole_batchs_gradient[False]",
        "fit/test_calibrate.py::test_oom_split_halves_until_the_pieces_fit_and_counts",
        "fit/test_calibrate.py::test_torch_step_in_forked_children_with_the_default_batch",
        "fit/test_fit.py::test_hardest_first_on_every_rank[2]",
        "fit/test_fit.py::test_hardest_first_resume",
        "io/test_http_reads.py::test_http_reads_are_the_same_through_fsspec_and_obstore",
        "io/test_object_store_faults.py::test_a_store_that_does_not_answer_is_a_storage_fault_naming_the_url",
        "io/test_object_store_options.py::test_a_read_starts_no_obstore_runtime",
        "loader/test_checkpoint_compat.py::test_a_stored_checkpoint_resumes_to_the_stored_batches[workers]",
        "loader/test_dropped_pass.py::test_each_pass_stopped_at_len_is_a_whole_epoch[2]",
        "loader/test_loader.py::test_len_after_resumes_on_other_world_sizes_adds_every_earlier_layout",
        "loader/test_loader.py::test_resume_chain_on_other_world_sizes_sees_every_sample_once",
        "loader/test_loader.py::test_resume_mid_epoch_gives_the_remaining_batches[2]",
        "loader/test_loader.py::test_without_index_lengths_come_from_json",
        "loader/test_planned_lengths.py::test_a_filtered_loaders_workers_fork_and_take_its_lengths",
        "loader/test_planned_lengths.py::test_forked_workers_read_no_lengths_and_yield_the_planned_batches",
        "loader/test_planned_lengths.py::test_persistent_workers_read_later_epochs_lengths_themselves",
        "loader/test_planned_once.py::test_the_stream_yields_the_planned_batches_as_a_worker_planning_its_own_would",
        "loader/test_small_epochs.py::test_split_leaves_nothing_out_of_a_tiny_epoch[3-2]",
        "loader/test_small_epochs.py::test_split_leaves_nothing_out_of_a_tiny_epoch[4-2]",
        "loader/test_step_samples.py::test_a_state_saved_after_a_skip_was_asked_for_resumes_with_it",
        "loader/test_step_samples.py::test_skipping_a_range_yields_exactly_the_other_steps_on_every_rank[0-skip2-options2-False]",
        "loader/test_step_samples.py::test_skipping_a_range_yields_exactly_the_other_steps_on_every_rank[2-skip0-options0-False]",
        "loader/test_step_samples.py::test_skipping_a_range_yields_exactly_the_other_steps_on_every_rank[4-skip3-options3-True]",
        "loader/test_step_samples.py::test_step_samples_are_what_the_loader_yields_at_every_step[num_workers=2,even_batches=drop]",
        "loader/test_step_samples.py::test_step_samples_are_what_the_loader_yields_at_every_step[num_workers=2,even_batches=pad,hardest_first=True]",
        "loader/test_step_samples.py::test_step_samples_are_what_the_loader_yields_at_every_step[num_workers=2,micro_batches=2]",
        "loader/test_step_samples.py::test_step_samples_are_what_the_loader_yields_at_every_step[num_workers=2]",
        "loader/test_step_samples.py::test_steps_before_a_resume_on_another_layout_are_named_as_they_ran",
        "loader/test_window.py::test_text_packs_within_two_percent_of_a_global_sort_at_the_default_window",
        "package/test_docs.py::test_the_docs_build_strictly",
        "package/test_hygiene.py::test_a_killed_write_strands_no_worker",
        "package/test_hygiene.py::test_a_leaky_test_fails_and_its_process_is_killed",
        "package/test_hygiene.py::test_the_check_finds_a_process_in_another_session_whose_parent_ended",
        "package/test_hygiene.py::test_the_check_names_a_left_process_and_not_an_ended_one",
        "package/test_layers.py::test_no_two_layers_import_each_other",
        "package/test_layout.py::test_no_import_cycles_and_plan_below_loader",
        "plan/test_batch_by.py::test_every_batch_from_one_dataset_with_exact_counts_and_len[2]",
        "plan/test_batch_by.py::test_rank_local_plans_equal_the_global_plan_and_never_mix_datasets",
        "plan/test_batch_by.py::test_resume_mid_epoch_yields_the_remaining_batches_exactly",
        "plan/test_batch_order.py::test_loader_takes_both_by_name_and_sorts_each_workers_batches",
        "plan/test_batch_order.py::test_sorted_orders_are_the_random_plans_batches_sorted_by_longest_sample[librispeech]",
        "plan/test_batcher.py::test_packed_batches_fill_the_budget",
        "plan/test_batcher.py::test_text_packs_close_to_a_global_sort_with_random_order",
        "plan/test_interleave.py::test_arrival_is_a_merge_of_each_group_keeping_tar_order",
        "plan/test_level_cut.py::test_a_level_top_bounds_its_level_within_a_level_width",
        "plan/test_mixing.py::test_each_epoch_takes_exactly_what_the_weights_say",
        "plan/test_mixing.py::test_resume_mid_epoch_is_exact_on_another_world_size",
        "plan/test_plan.py::test_consumed_split_follows_the_round_robin_order",
        "plan/test_rank_local.py::test_a_rank_resuming_on_another_world_size_reads_only_its_share",
        "plan/test_rank_local.py::test_rank_local_plans_equal_the_global_plan",
        "plan/test_resume_prefix.py::test_a_chain_of_resumes_marks_from_yielded_batches_exactly",
        "plan/test_resume_prefix.py::test_a_resume_on_more_ranks_batches_about_what_a_fresh_plan_does",
        "plan/test_resume_prefix.py::test_asked_a_shard_at_a_time_the_mask_is_the_oracles",
        "plan/test_resume_prefix.py::test_the_split_rule_in_two_numbers_cuts_as_halve_largest",
        "plan/test_speed_perturb.py::test_factors_follow_seed_epoch_and_id_and_differ_by_epoch",
        "plan/test_step_balance_band.py::test_a_checkpoints_equalisation_marks_exactly_the_batches_yielded_before_it[4]",
        "plan/test_step_balance_band.py::test_a_loader_resumed_mid_epoch_yields_the_rest_of_the_sliding_order",
        "plan/test_step_balance_band.py::test_sliding_evens_speech_steps_more_than_groups_of_the_same_span",
        "plan/test_two_length.py::test_both_budgets_hold_and_online_equals_plan",
        "plan/test_weight_schedule.py::test_each_epoch_takes_what_its_weights_say_and_a_callable_equals_the_list[2]",
        "plan/test_weight_schedule.py::test_resume_mid_epoch_2_is_exact[2]",
        "read/test_batch_ring.py::test_a_pass_stopped_early_leaves_no_buffer_held",
        "read/test_batch_ring.py::test_batches_the_loop_keeps_are_never_written_over[micro-batches]",
        "read/test_batch_ring.py::test_batches_the_loop_keeps_are_never_written_over[plain]",
        "read/test_batch_ring.py::test_the_main_process_keeps_only_the_batches_it_holds_resident",
        "read/test_direct_read.py::test_read_by_position_gives_the_streamed_batches[kw1]",
        "read/test_features.py::test_batches_of_fbank_frames_keep_a_budget_in_frames",
        "read/test_lanes.py::test_a_resume_on_two_workers_from_one_streams_the_rest_once",
        "read/test_lanes.py::test_lanes_give_the_batches_read_by_position[3-2]",
        "read/test_read_ahead_stall.py::test_stalled_read_ahead_counts_the_shard_bad",
        "read/test_read_ahead_start.py::test_the_ramp_never_passes_max_read_concurrency",
        "read/test_resampling.py::test_a_tone_above_the_new_nyquist_does_not_alias",
        "read/test_resampling.py::test_without_soxr_nothing_is_resampled_by_interpolation",
        "read/test_wds_stage.py::test_every_batch_holds_the_budget_and_every_sample_leaves_once",
        "read/test_wds_stage.py::test_real_shards_through_webdataset_with_two_workers",
        "select/test_where_short_path.py::test_plain_filters_need_no_duckdb",
        "select/test_where_short_path.py::test_random_plain_filters_keep_what_duckdb_keeps",
        "write/test_adopt.py::test_nemo_tarred_dataset",
        "write/test_adopt.py::test_output_lengths_and_filters_on_an_adopted_nemo_dataset",
        "write/test_adopt.py::test_webdataset_tars_indexed_in_place",
        "write/test_adopt_segments.py::test_resume_mid_epoch_gives_exactly_the_rest[streamed-2]",
        "write/test_adopt_segments.py::test_shar_cut_ids_with_dots_are_indexed_and_streamed",
        "write/test_bombs.py::test_300000_keys_give_a_bounded_set_of_columns",
        "write/test_fuzz_manifests.py::test_kaldi_folder",
        "write/test_fuzz_manifests.py::test_lhotse_cuts",
        "write/test_fuzz_manifests.py::test_lhotse_supervisions_plain_and_gzipped",
        "write/test_fuzz_manifests.py::test_nemo_manifest",
        "write/test_fuzz_manifests.py::test_nemo_manifest_beside_adopted_tars",
        "write/test_fuzz_manifests.py::test_speechbrain_csv",
        "write/test_fuzz_manifests.py::test_speechbrain_json",
        "write/test_fuzz_manifests.py::test_text_jsonl",
        "write/test_lock.py::test_killed_writer_lock_is_taken_over",
        "write/test_lock.py::test_lock_file_of_a_dead_pid_is_taken_over",
        "write/test_lock.py::test_lock_of_a_killed_writer_is_free_while_its_workers_still_run",
        "write/test_lock.py::test_parts_run_together_but_not_beside_a_whole_write",
        "write/test_lock.py::test_parts_started_together_all_write",
        "write/test_lock.py::test_second_index_into_one_folder_is_refused",
        "write/test_lock.py::test_second_stage_into_one_folder_waits_then_keeps_the_copy",
        "write/test_lock.py::test_second_writer_is_refused_naming_the_first",
        "write/test_lock.py::test_two_writers_started_together",
        "write/test_manifest_memory.py::test_a_manifest_line_is_held_in_bounded_bytes",
        "write/test_output_full.py::test_the_index_past_the_limit",
        "write/test_overwrite_safety.py::test_interrupted_overwrite_puts_the_old_dataset_back",
        "write/test_overwrite_safety.py::test_killed_overwrite_is_put_back_by_the_next_write",
        "write/test_overwrite_safety.py::test_killed_overwrite_keeps_the_old_dataset_until_a_new_one_is_complete",
        "write/test_overwrite_safety.py::test_overwrite_that_does_not_fit_puts_the_old_dataset_back",
        "write/test_overwrite_safety.py::test_resume_of_a_complete_dataset_touches_nothing",
        "write/test_overwrite_safety.py::test_resume_refuses_another_commands_dataset",
        "write/test_overwrite_safety.py::test_resume_still_finishes_an_interrupted_write",
        "write/test_overwrite_safety.py::test_write_with_bad_input_leaves_old_dataset_untouched",
        "write/test_publish.py::test_a_merge_with_no_room_to_keep_the_errors_file_leaves_it_as_it_was",
        "write/test_publish.py::test_a_stage_overwrite_killed_at_any_step_leaves_the_old_dataset_or_the_new",
        "write/test_real_corpora.py::test_native_rate_streams_exactly_the_decoded_frames[2]",
        "write/test_real_corpus_gaps.py::test_batches_of_adopted_tars_say_their_sample_rate[2]",
        "write/test_text_sources.py::test_hf_arrays_give_the_same_shards_for_any_workers_and_keep_int16",
        "write/test_text_sources.py::test_hub_unreachable_is_one_line_exit_2",
        "write/test_write_parts.py::test_a_killed_shardify_write_resumes_to_the_clean_result",
        "write/test_write_parts.py::test_parts_merged_equal_a_single_process_write[30]",
        "write/test_write_parts.py::test_parts_merged_equal_a_single_process_write[3]",
        "write/test_write_parts.py::test_parts_merged_equal_a_single_process_write[7]",
        "write/test_writer.py::test_bad_input_skip_mode_writes_the_rest_and_errors_jsonl[2]",
        "write/test_writer.py::test_shuffle_is_seeded_and_identical_for_any_workers",
    }
}


def pytest_collection_modifyitems(config, items):
    """Mark each test by kind, from where it lives, its name and the fixtures it uses (:data:`KIND_PATHS`,
    :data:`KIND_TESTS`, :data:`KIND_FIXTURES`)."""
    for item in items:
        where = Path(str(item.path)).resolve()
        rel = where.relative_to(TESTS).as_posix() if where.is_relative_to(TESTS) else ""
        for kind, paths in KIND_PATHS.items():
            if any(rel.startswith(p) for p in paths):
                item.add_marker(kind)
        test = f"{rel}::{item.name}"
        for kind, tests in KIND_TESTS.items():
            if test in tests or test.split("[", 1)[0] in tests:
                item.add_marker(kind)
        names = set(getattr(item, "fixturenames", ()))
        for kind, fixtures in KIND_FIXTURES.items():
            if names.intersection(fixtures):
                item.add_marker(kind)
