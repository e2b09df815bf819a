"""Calibration on CPU: the search, the fit, the JSON the cost models read, the CLI, and the OOM split guard.

The step functions here allocate (and touch) a numpy buffer whose size is a known function of the batch,
so the true largest batch per length is known; each trial runs in a forked child like any CPU calibration.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import text_dataset

import streambatch.cli.calibrate as calibrate_cli
import streambatch.fit.calibrate as calib
import streambatch.fit.memory as memory
from streambatch.fit.calibrate import calibrate, default_make_batch
from streambatch.fit.memory import CalibrationError, Trial
from streambatch.fit.oom import OOMGuard, run_with_oom_split, split_batch
from streambatch.fit.search import fit_memory_model, search_max_batch
from streambatch.format.index import ShardIndex, ShardInfo
from streambatch.plan.batcher import plan_batches
from streambatch.plan.cost import PaddedCost, QuadraticCost, resolve_cost

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU calibration measures through /proc")

MiB = 1 << 20
LIMIT = 48 * MiB
K = 24  # bytes per element n·L
Q = 4000.0  # quadratic factor of the attention-like step


def sized(n: int, length: float) -> tuple[int, float]:
    """A tiny stand-in batch: the steps below allocate what a real batch would cost."""
    return (n, length)


def linear_step(batch) -> float:
    n, length = batch
    buf = np.ones(int(n * length * K), dtype=np.uint8)  # np.ones writes every page
    return float(buf[:: 1 << 16].sum())


def quad_bytes(n: int, length: float) -> float:
    return K * n * length + K * n * length * length / Q


def quadratic_step(batch) -> float:
    n, length = batch
    buf = np.ones(int(quad_bytes(n, length)), dtype=np.uint8)
    return float(buf[:: 1 << 16].sum())


LIN_LENGTHS = np.random.default_rng(0).integers(2_000, 20_000, 5_000)
QUAD_LENGTHS = np.random.default_rng(1).integers(1_000, 12_000, 5_000)


@pytest.fixture(scope="module")
def linear_cal(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "linear.json"
    return calibrate(
        linear_step, LIN_LENGTHS, unit="tokens", memory_limit=LIMIT, make_batch=sized, out=str(out), trial_timeout=60
    ), out


@pytest.fixture(scope="module")
def quadratic_cal(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "quadratic.json"
    return calibrate(
        quadratic_step,
        QUAD_LENGTHS,
        unit="tokens",
        memory_limit=LIMIT,
        make_batch=sized,
        out=str(out),
        trial_timeout=60,
    ), out


def test_linear_step_finds_each_lengths_largest_batch_and_fits_padded(linear_cal):
    cal, _ = linear_cal
    assert cal["cost"] == "padded" and cal["limit"] == LIMIT
    assert len(cal["per_length"]) >= 6
    for row in cal["per_length"]:
        truth = LIMIT / (K * row["length"])
        # RSS measurement is good to a fraction of a MiB: within 1 % above, a few % below (the child's own pages)
        assert 0.95 * truth <= row["max_batch_size"] <= 1.01 * truth, row
        assert row["min_failing"] is not None and row["min_failing"] <= row["max_batch_size"] * 1.011 + 1
        assert row["admitted"] <= row["max_batch_size"]  # the budget never admits what was not seen to fit
        assert row["trials"] <= 12
    assert cal["budget"] == pytest.approx(LIMIT / K, rel=0.08)
    # the rows are each within 5 % below the truth (above), so the slope fitted through them is too; 3 % failed
    # once on a loaded machine (0.958x)
    assert cal["fit"]["b"] == pytest.approx(K, rel=0.05)
    fits = [m for m in cal["measurements"] if m["fits"]]
    assert fits and all(m["peak"] <= LIMIT for m in fits)


def test_quadratic_step_fits_quadratic_with_its_factor(quadratic_cal):
    cal, _ = quadratic_cal
    assert cal["cost"] == "quadratic"
    assert cal["quadratic_factor"] == pytest.approx(Q, rel=0.15)
    for row in cal["per_length"]:
        truth = LIMIT / quad_bytes(1, row["length"])
        assert 0.95 * truth <= row["max_batch_size"] <= 1.01 * truth, row
        assert row["admitted"] <= row["max_batch_size"]
        assert row["admitted"] >= 0.85 * row["max_batch_size"]  # and does not waste much either


def test_calibration_json_round_trips_through_resolve_cost(linear_cal, quadratic_cal):
    for cal, path in (linear_cal, quadratic_cal):
        on_disk = json.loads(path.read_text())
        assert on_disk["format"] == "streambatch-calibration"
        assert {"cost", "budget", "unit", "sample_rate", "device", "limit", "measurements"} <= set(on_disk)
        model, budget = resolve_cost(str(path))
        assert budget == cal["budget"] == on_disk["budget"]
        if cal["cost"] == "quadratic":
            assert isinstance(model, QuadraticCost) and model.factor == pytest.approx(cal["quadratic_factor"])
        else:
            assert isinstance(model, PaddedCost)
        assert resolve_cost(on_disk)[1] == budget  # the dict form too


@pytest.mark.parametrize("which", ["linear", "quadratic"])
def test_plan_with_the_calibrated_cost_never_exceeds_the_limit(which, linear_cal, quadratic_cal):
    (cal, path), lengths, mem = {
        "linear": (linear_cal, LIN_LENGTHS, lambda n, L: K * n * L),
        "quadratic": (quadratic_cal, QUAD_LENGTHS, quad_bytes),
    }[which]
    plan = plan_batches(lengths, cal["budget"], cost=str(path), buffer_size=2_000, seed=3)
    assert plan.num_samples == len(lengths)  # the calibrated budget takes the dataset's longest sample
    # What the step truly allocates for each planned batch. The fitted intercept ``a`` is not added: this step
    # holds nothing besides its buffer, so ``a`` is the forked child's measuring offset (copy-on-write pages,
    # the heap), which on a loaded machine comes out near +0.9 MiB while the slopes come out 2 % low, and
    # adding it to the true bytes counted the offset twice (a CI run failed at 1.0006× with the truth at 0.982×).
    sim = np.array([mem(len(b), float(lengths[b].max())) for b in plan])
    assert sim.max() <= LIMIT
    assert np.median(sim) >= 0.8 * LIMIT  # and batches still fill the memory


def test_torch_step_in_forked_children_with_the_default_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 8, 16, stride=8), torch.nn.ReLU())

    def step(batch):
        assert batch["audio"].dtype == torch.float32 and batch["padding_mask"].shape == batch["audio"].shape
        model.zero_grad(set_to_none=True)
        model(batch["audio"][:, None, :]).square().mean().backward()

    cal = calibrate(
        step,
        None,
        lengths=[8_000, 32_000],
        unit="samples",
        sample_rate=16000,
        memory_limit="24M",
        max_batch_size=256,
        trial_timeout=60,
    )
    rows = {r["length"]: r for r in cal["per_length"]}
    assert 0 < rows[32_000]["max_batch_size"] < rows[8_000]["max_batch_size"] <= 256
    assert all(p.grad is None for p in model.parameters())  # the parent ran nothing: every trial was a child


def test_cuda_path_catches_out_of_memory_and_measures_the_peak(monkeypatch):
    """The CUDA trial logic against a fake device: peak stats, OOM caught and freed, memory_fraction."""
    total = 1_000_000
    state = {"peak": 0, "empty_cache": 0, "calls": []}
    fake = {
        "is_available": lambda: True,
        "current_device": lambda: 0,
        "get_device_properties": lambda d: type("P", (), {"total_memory": total})(),
        "get_device_name": lambda d=None: "FakeGPU",
        "reset_peak_memory_stats": lambda d=None: state.update(peak=0),
        "max_memory_allocated": lambda d=None: state["peak"],
        "synchronize": lambda d=None: None,
        "empty_cache": lambda: state.update(empty_cache=state["empty_cache"] + 1),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(memory.gc, "collect", lambda *a: 0)  # a full collection per trial is slow under pytest

    def make_step(need):
        def step(batch):
            n, length = batch
            state["calls"].append((n, length))
            if need(n, length) > 0.95 * total:
                state["peak"] = int(0.95 * total)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
            state["peak"] = need(n, length)

        return step

    linear = lambda n, L: 100_000 + 10 * n * L
    cal = calibrate(
        make_step(linear), None, lengths=[50, 200, 800], unit="tokens", device="cuda", make_batch=sized, rel_tol=0.0
    )
    assert cal["limit"] == 0.9 * total and "FakeGPU" in cal["device"]
    assert state["calls"][0] == (1, 50)  # the warm-up step
    for row in cal["per_length"]:
        assert row["max_batch_size"] == (0.9 * total - 100_000) // (10 * row["length"])
        assert row["min_failing"] == row["max_batch_size"] + 1
    assert state["empty_cache"] >= 2 * len(cal["measurements"])
    assert cal["cost"] == "padded" and cal["fit"]["b"] == pytest.approx(10, rel=1e-3)

    # memory that grows faster than the measured line: the search overshoots into out-of-memory errors
    steep = lambda n, L: 100_000 + 10 * n * L * (1 + n / 20)
    cal = calibrate(
        make_step(steep), None, lengths=[50, 200], unit="tokens", device="cuda", make_batch=sized, rel_tol=0.0
    )
    assert any(m["note"] == "out of memory" and m["peak"] is None for m in cal["measurements"])
    for row in cal["per_length"]:
        truth = max(n for n in range(1, 2000) if steep(n, row["length"]) <= 0.9 * total)
        assert (row["max_batch_size"], row["min_failing"]) == (truth, truth + 1)


def test_default_make_batch_shapes():
    audio = default_make_batch("samples", 16000)(3, 1600)
    assert audio["audio"].shape == (3, 1600) and audio["lengths"].tolist() == [1600] * 3
    secs = default_make_batch("seconds", 16000)(2, 0.5)
    assert secs["audio"].shape == (2, 8000)
    tokens = default_make_batch("tokens", vocab_size=50)(4, 7)
    assert tokens["input_ids"].shape == (4, 7) and tokens["input_ids"].dtype == torch.int64
    assert int(tokens["input_ids"].max()) < 50
    frames = default_make_batch("frames", feature_dim=5)(2, 9)
    assert frames["inputs"].shape == (2, 9, 5)


def test_search_max_batch_on_a_known_curve():
    limit = 1000.0

    def measure(n, length):
        peak = 37 + 3.1 * n * length
        return Trial(n, length, peak, peak <= limit)

    truth = lambda L: int((limit - 37) // (3.1 * L))
    for L in (1, 3, 17, 100):
        lo, hi, trials = search_max_batch(measure, L, limit, max_batch_size=4096, rel_tol=0.0)
        assert lo == truth(L) and hi == lo + 1, (L, lo, hi)
        assert len(trials) <= 16
    lo, hi, _ = search_max_batch(measure, 1, limit, max_batch_size=50)
    assert (lo, hi) == (50, None)  # the cap fits
    lo, hi, _ = search_max_batch(measure, 400, limit)
    assert (lo, hi) == (0, 1)  # not even one sample
    # out-of-memory trials (no peak) still bracket the search
    oom = lambda n, L: Trial(n, L, None, False) if n * L > 500 else Trial(n, L, 10.0 * n * L, True)
    lo, hi, _ = search_max_batch(oom, 5, 1e9, rel_tol=0.0)
    assert (lo, hi) == (100, 101)


def test_fit_memory_model_recovers_the_coefficients():
    trials = [Trial(n, L, 5e6 + 7.0 * n * L + 0.01 * n * L * L, True) for L in (100, 400, 900) for n in (1, 10, 50)]
    fit = fit_memory_model(trials, limit=1e8)
    assert fit["a"] == pytest.approx(5e6, rel=1e-6)
    assert fit["b"] == pytest.approx(7.0, rel=1e-6) and fit["c"] == pytest.approx(0.01, rel=1e-6)
    # a negative quadratic term is clamped to zero
    trials = [Trial(n, L, 1e6 + 7.0 * n * L - 1e-4 * n * L * L, True) for L in (100, 400, 900) for n in (1, 10, 50)]
    assert fit_memory_model(trials, limit=1e8)["c"] == 0.0


def test_step_errors_are_reported_not_taken_for_out_of_memory():
    def broken(batch):
        raise ValueError("shape mismatch in my model")

    with pytest.raises(CalibrationError, match="shape mismatch in my model"):
        calibrate(broken, None, lengths=[100], unit="tokens", memory_limit="8M", make_batch=sized, trial_timeout=60)


def test_module_is_callable_as_streambatch_calibrate():
    import streambatch

    assert callable(streambatch.calibrate) and streambatch.calibrate is calib.calibrate


def test_cli_prints_the_table_and_writes_the_file(tmp_path, capsys):
    data = tmp_path / "data"
    lengths = np.random.default_rng(2).integers(4_000, 64_000, 2_000)
    ShardIndex([ShardInfo("shard-000000.tar", len(lengths), 0, lengths)], unit="samples", sample_rate=16000).save(
        str(data)
    )
    (tmp_path / "my_model.py").write_text(
        textwrap.dedent("""
        import numpy as np

        def make_step(device):
            assert device == "cpu"
            def step(batch):
                n, L = batch
                np.ones(int(n * L * 16), dtype=np.uint8)
            return step, (lambda n, L: (n, L))
    """)
    )
    out = tmp_path / "calib.json"
    rc = calibrate_cli.main(
        [
            str(data),
            "--model",
            f"{tmp_path / 'my_model.py'}:make_step",
            "--device",
            "cpu",
            "--memory-limit",
            "32M",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "max batch" in text and "cost='padded'" in text and "seconds" in text
    cal = json.loads(out.read_text())
    assert cal["unit"] == "samples" and cal["sample_rate"] == 16000 and cal["limit"] == 32 * MiB
    assert max(r["length"] for r in cal["per_length"]) == lengths.max()
    assert resolve_cost(str(out))[1] == cal["budget"]


def test_loader_reads_the_calibration_file_end_to_end(tmp_path):
    """calibrate over a real text dataset's index, then StreamBatchLoader(budget=None, cost=FILE) batches."""
    from streambatch import StreamBatchLoader

    text_dataset(tmp_path, 300, 0, max_count=40)
    per_token = 2048  # bytes of activation memory per padded token

    def step(batch):  # the loader's batch: input_ids [n, L]
        np.ones(batch["input_ids"].numel() * per_token, dtype=np.uint8)

    limit = 16 * MiB
    cal = calibrate(
        step, str(tmp_path / "shards"), memory_limit=limit, out=str(tmp_path / "calib.json"), trial_timeout=60
    )
    assert cal["unit"] == "tokens" and cal["cost"] == "padded"
    loader = StreamBatchLoader(str(tmp_path / "shards"), budget=None, cost=str(tmp_path / "calib.json"), decode="text")
    batches = list(loader)
    assert sorted(k for b in batches for k in b["keys"]) == sorted(f"s{i}" for i in range(300))
    for b in batches:
        assert b["input_ids"].numel() <= cal["budget"]
        assert cal["fit"]["a"] + b["input_ids"].numel() * per_token <= limit


# ---- OOM split guard ----------------------------------------------------------------------------------
def _batch(n: int, t: int = 40) -> dict:
    g = torch.Generator().manual_seed(n)
    return {
        "audio": torch.randn(n, t, generator=g),
        "lengths": torch.full((n,), t),
        "keys": [f"k{i}" for i in range(n)],
        "sample_rate": 16000,
    }


def test_oom_split_halves_until_the_pieces_fit_and_counts():
    sizes = []

    def step(batch):
        n = batch["audio"].shape[0]
        sizes.append(n)
        if n * batch["audio"].shape[1] > 200:  # "memory" over 200 elements
            raise MemoryError(f"cannot allocate {n} samples")
        assert len(batch["keys"]) == n and batch["sample_rate"] == 16000
        return float(batch["audio"].mean())

    b = _batch(16)
    res = run_with_oom_split(step, b)
    assert sizes == [16, 8, 4, 4, 8, 4, 4]
    assert (res.pieces, res.ooms, res.splits) == (4, 3, 3)
    assert res.value == pytest.approx(float(b["audio"].mean()), rel=1e-5)  # weighted by sample share

    guard = OOMGuard(step)
    guard(_batch(4))
    guard(_batch(16))
    assert guard.stats() == {"calls": 2, "ooms": 3, "splits": 3, "split_batches": 1}

    def never(batch):
        raise MemoryError("no")

    with pytest.raises(MemoryError):
        run_with_oom_split(never, _batch(4))
    with pytest.raises(ValueError):  # other errors pass through untouched
        run_with_oom_split(lambda b: (_ for _ in ()).throw(ValueError("bug")), _batch(4))


@pytest.mark.parametrize("reset", [False, True])
def test_oom_split_accumulates_the_whole_batchs_gradient(reset):
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 1)
    b = _batch(10)
    target = torch.randn(10, generator=torch.Generator().manual_seed(5))
    b["target"] = target

    model.zero_grad()
    torch.nn.functional.mse_loss(model(b["audio"]).squeeze(-1), target).backward()
    whole = [p.grad.clone() for p in model.parameters()]

    def step(batch):
        if batch["audio"].shape[0] > 3:
            raise MemoryError("too big")
        loss = torch.nn.functional.mse_loss(model(batch["audio"]).squeeze(-1), batch["target"])
        (loss * batch.get("loss_weight", 1.0)).backward()
        return loss.detach()

    model.zero_grad()
    res = run_with_oom_split(step, b, reset=(lambda: model.zero_grad()) if reset else None)
    assert res.splits >= 2
    for g, w in zip((p.grad for p in model.parameters()), whole):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_split_batch_packed_and_by_frames():
    packed = {
        "input_ids": torch.arange(10),
        "cu_seqlens": torch.tensor([0, 3, 4, 8, 10], dtype=torch.int32),
        "max_seqlen": 4,
        "lengths": torch.tensor([3, 1, 4, 2]),
        "keys": list("abcd"),
        "loss_weight": 0.5,
    }
    (p1, s1), (p2, s2) = split_batch(packed, [2, 2], weight_by="frames")
    assert p1["input_ids"].tolist() == [0, 1, 2, 3] and p1["cu_seqlens"].tolist() == [0, 3, 4] and p1["max_seqlen"] == 3
    assert p2["input_ids"].tolist() == [4, 5, 6, 7, 8, 9] and p2["cu_seqlens"].tolist() == [0, 4, 6]
    assert p2["max_seqlen"] == 4 and p2["keys"] == ["c", "d"]
    assert (s1, s2) == (pytest.approx(0.4), pytest.approx(0.6))
    assert p1["loss_weight"] == pytest.approx(0.2) and p2["loss_weight"] == pytest.approx(0.3)
    (q1, t1), (q2, t2) = split_batch(_batch(5), [2, 3])
    assert q1["audio"].shape == (2, 40) and q2["keys"] == ["k2", "k3", "k4"] and math.isclose(t1 + t2, 1.0)
