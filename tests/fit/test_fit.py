"""Fitting batches to the model: cost models, packed batches, micro-batches, hardest first (issue 7)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import audio_dataset
from torch import nn

from streambatch import StreamBatchLoader
from streambatch.read.collate import to_packed_sequence

SR = 8000
BUDGET = 12 * SR


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    return audio_dataset(root, 120, 9, SR, max_count=20)


def test_packed_batches_are_padding_free_and_within_budget(ds):
    keys = []
    for b in StreamBatchLoader(ds, budget=BUDGET, packed=True, buffer_size=60, num_workers=2):
        assert b["audio"].dim() == 1 and b["audio"].shape[0] == int(b["lengths"].sum()) <= BUDGET
        cu = b["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == b["audio"].shape[0]
        assert torch.equal(cu[1:] - cu[:-1], b["lengths"].to(torch.int32))
        assert b["max_seqlen"] == int(b["lengths"].max())
        keys += b["keys"]
    assert len(keys) == len(set(keys)) == 120


def test_quadratic_cost_budget_holds_on_tensors(ds):
    q = 4 * SR
    for b in StreamBatchLoader(ds, budget=BUDGET, cost="quadratic", quadratic_factor=q):
        n, t = b["audio"].shape
        assert n * (t + t * t / q) <= BUDGET


def test_calibration_file_gives_cost_and_budget(ds, tmp_path):
    calib = tmp_path / "calib.json"
    calib.write_text(
        json.dumps(
            {"format": "streambatch-calibration", "cost": "quadratic", "quadratic_factor": 4 * SR, "budget": BUDGET}
        )
    )
    loader = StreamBatchLoader(ds, cost=str(calib))
    assert loader.config.budget == BUDGET and loader.config.cost.factor == 4 * SR
    with pytest.raises(ValueError, match="budget"):
        StreamBatchLoader(ds)


def test_max_batch_size_and_multiple_of(ds):
    sizes = [
        len(b["keys"]) for b in StreamBatchLoader(ds, budget=BUDGET * 4, max_batch_size=16, batch_size_multiple_of=4)
    ]
    assert max(sizes) <= 16
    assert sum(s % 4 != 0 for s in sizes) <= 1  # only the stream's last leftovers may break the multiple


class MaskedMeanModel(nn.Module):
    """Per-frame features averaged over the real frames only, so padding does not change the output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(1, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, audio, mask):
        h = torch.tanh(self.proj(audio[..., None]))
        keep = (~mask).float()[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1))


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("by", ["samples", "frames"])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(ds, by):
    whole = StreamBatchLoader(ds, budget=BUDGET, seed=2)
    micro = StreamBatchLoader(ds, budget=BUDGET, seed=2, micro_batches=3, loss_weight_by=by)
    micro_it = iter(micro)
    model = MaskedMeanModel()
    for step, batch in enumerate(whole):
        if step == 4:
            break
        target = torch.tensor([len(k) % 3 for k in batch["keys"]])
        per = nn.functional.cross_entropy(model(batch["audio"], batch["padding_mask"]), target, reduction="none")
        w = batch["lengths"].double() if by == "frames" else torch.ones(len(target), dtype=torch.double)
        model.zero_grad()
        ((per.double() * w).sum() / w.sum()).backward()
        expected = grads(model).clone()
        model.zero_grad()
        seen = []
        while True:
            mb = next(micro_it)
            t = torch.tensor([len(k) % 3 for k in mb["keys"]])
            l = nn.functional.cross_entropy(model(mb["audio"], mb["padding_mask"]), t, reduction="none").double()
            wm = mb["lengths"].double() if by == "frames" else torch.ones(len(t), dtype=torch.double)
            (mb["loss_weight"] * (l * wm).sum() / wm.sum()).backward()
            seen += mb["keys"]
            if mb["last_micro_batch"]:
                break
        assert sorted(seen) == sorted(batch["keys"])
        assert mb["num_micro_batches"] == min(3, len(seen))
        assert torch.allclose(grads(model).double(), expected.double(), atol=1e-6)


def test_micro_batch_resume_restarts_the_batch(ds):
    kw = dict(budget=BUDGET, seed=5, micro_batches=2)
    full = [mb["keys"] for mb in StreamBatchLoader(ds, **kw)]
    a = StreamBatchLoader(ds, **kw)
    it = iter(a)
    got, done = [], 0
    while True:  # stop inside a batch: after the first of its two micro-batches
        mb = next(it)
        got.append(mb["keys"])
        if mb["last_micro_batch"]:
            done += 1
        elif done >= 1:
            break
    state = a.state_dict()
    assert state["batches_consumed"] == done
    b = StreamBatchLoader(ds, **kw)
    b.load_state_dict(state)
    rest = [mb["keys"] for mb in b]
    assert got[:-1] + rest == full  # the interrupted batch comes again, whole


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hardest_first_on_every_rank(ds, num_workers):
    q = 2 * SR
    costs_first = []
    for rank in (0, 1):
        loader = StreamBatchLoader(
            ds,
            budget=BUDGET,
            cost="quadratic",
            quadratic_factor=q,
            hardest_first=True,
            rank=rank,
            world_size=2,
            num_workers=num_workers,
            seed=3,
        )
        out = list(loader)
        batches = [b["lengths"] for b in out]
        cost = [len(x) * (int(x.max()) + int(x.max()) ** 2 / q) for x in batches]
        assert cost[0] == max(cost)
        costs_first.append(cost[0])
        # the rest of the epoch is unchanged: the same samples once
        plain = StreamBatchLoader(
            ds,
            budget=BUDGET,
            cost="quadratic",
            quadratic_factor=q,
            rank=rank,
            world_size=2,
            num_workers=num_workers,
            seed=3,
        )
        assert sorted(k for b in plain for k in b["keys"]) == sorted(k for b in out for k in b["keys"])


def test_hardest_first_resume(ds):
    kw = dict(budget=BUDGET, seed=1, hardest_first=True, num_workers=2)
    full = [b["keys"] for b in StreamBatchLoader(ds, **kw)]
    a = StreamBatchLoader(ds, **kw)
    it = iter(a)
    head = [next(it)["keys"] for _ in range(3)]
    b = StreamBatchLoader(ds, **kw)
    b.load_state_dict(a.state_dict())
    assert head + [x["keys"] for x in b] == full


def test_packed_sequence_for_rnns(ds):
    batch = next(iter(StreamBatchLoader(ds, budget=BUDGET)))
    packed = to_packed_sequence(batch)
    assert int(packed.batch_sizes.sum()) == int(batch["lengths"].sum())
    padded, lengths = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=True)
    assert torch.equal(lengths, batch["lengths"]) and torch.equal(padded, batch["audio"][:, : padded.shape[1]])
    rnn = nn.GRU(1, 2, batch_first=True)  # an RNN takes it as is (features as the last dim)
    short = to_packed_sequence({"inputs": batch["audio"][:, :50, None], "lengths": batch["lengths"].clamp(max=50)})
    out, _ = rnn(short)
    assert out.data.shape == (int(batch["lengths"].clamp(max=50).sum()), 2)


def test_calibration_file_unit_and_batch_cap(ds, tmp_path):
    calib = {
        "format": "streambatch-calibration",
        "cost": "padded",
        "budget": BUDGET,
        "unit": "samples",
        "max_batch_size": 3,
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(calib))
    assert max(len(b["keys"]) for b in StreamBatchLoader(ds, cost=str(path))) <= 3  # measured, not extrapolated
    path.write_text(json.dumps({**calib, "unit": "tokens"}))
    with pytest.raises(ValueError, match="unit"):
        StreamBatchLoader(ds, cost=str(path))
