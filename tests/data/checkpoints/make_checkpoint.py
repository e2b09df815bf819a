"""Make the stored loader checkpoints that ``tests/loader/test_checkpoint_compat.py`` resumes from.

Each scenario builds a small dataset from fixed seeds (the same helpers the tests use, so the test rebuilds
it byte for byte), runs a :class:`~streambatch.StreamBatchLoader` for ``k`` batches mid-epoch, saves its
``state_dict()`` with ``torch.save`` (as a training script does) and the keys of the batches the uninterrupted
run yields after those ``k``. A state saved by an older version must resume to exactly those batches.

Run from the repository root (it overwrites the stored files; only to add a scenario, never to "fix" one):
``PYTHONPATH=$PWD python tests/data/checkpoints/make_checkpoint.py``
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for conftest's dataset helpers

SR = 8000
BUDGET = 10 * SR

#: name -> the dataset it reads, the loader's options, the batches taken before the state is saved, and (for a
#: resume on another layout) the options the resuming loader changes
SCENARIOS: dict[str, dict[str, Any]] = {
    # one dataset, two workers, hardest batch first
    "workers": {
        "data": "single",
        "options": {"num_workers": 2, "buffer_size": 24, "seed": 11, "hardest_first": True, "decode": "none"},
        "take": 4,
    },
    # a filtered dataset, in the main process
    "where": {
        "data": "single",
        "options": {"buffer_size": 16, "seed": 3, "where": "length < 40000", "max_batch_size": 6, "decode": "none"},
        "take": 3,
    },
    # two datasets mixed by weights, drop-last and bucket boundaries
    "mixture": {
        "data": "mixture",
        "options": {
            "weights": {"a": 1.5, "b": 0.5},
            "buffer_size": 20,
            "seed": 5,
            "drop_last": True,
            "num_buckets": 3,
            "decode": "none",
        },
        "take": 5,
    },
    # saved on rank 0 of 2 ranks (no process group: the whole epoch planned on the rank), resumed on 1 rank:
    # the samples not yet consumed are planned again over the new layout
    "relayout": {
        "data": "single",
        "options": {"rank": 0, "world_size": 2, "buffer_size": 20, "seed": 8, "even_batches": "pad", "decode": "none"},
        "take": 3,
        "resume": {"rank": 0, "world_size": 1},
    },
}


def build_data(root: Path) -> dict[str, Any]:
    """The datasets the scenarios read, written under ``root``: the ``source`` argument of each."""
    from conftest import audio_dataset

    single = audio_dataset(root / "single", 90, 21, SR, max_count=15, shuffle=True, seed=4)
    mix = {
        name: audio_dataset(root / name, n, 30 + i, SR, max_count=12)
        for i, (name, n) in enumerate((("a", 40), ("b", 30)))
    }
    return {"single": single, "mixture": mix}


def loader_for(data: dict[str, Any], scenario: dict[str, Any], resuming: bool = False) -> Any:
    """The scenario's loader (``resuming``: with the options of the run that loads the state)."""
    from streambatch import StreamBatchLoader

    options = {**scenario["options"], **(scenario.get("resume", {}) if resuming else {})}
    return StreamBatchLoader(data[scenario["data"]], BUDGET, **options)


def remaining_keys(loader: Any) -> list[list[str]]:
    """The samples of each batch the loader still yields in its epoch: their keys (``dataset/key`` in a mixture)."""
    out = []
    for b in loader:
        names = b.get("dataset") or [None] * len(b["keys"])
        out.append([k if d is None else f"{d}/{k}" for d, k in zip(names, b["keys"])])
    return out


def save_state(data: dict[str, Any], name: str, scenario: dict[str, Any]) -> None:
    """Run ``take`` batches, save the state, then record what the resumed run must yield."""
    import torch

    loader = loader_for(data, scenario)
    it = iter(loader)
    for _ in range(scenario["take"]):
        next(it)
    state = loader.state_dict()
    del it
    torch.save({"loader": state}, HERE / f"{name}.pt")
    resumed = loader_for(data, scenario, resuming=True)
    resumed.load_state_dict(state)
    steps, remaining = len(resumed), remaining_keys(resumed)
    if "resume" not in scenario:  # on the same layout: exactly the uninterrupted run's tail
        assert remaining == remaining_keys(loader_for(data, scenario))[scenario["take"] :]
    lines = ",\n".join("  " + json.dumps(b) for b in remaining)
    text = f'{{"scenario": "{name}", "steps": {steps}, "remaining": [\n{lines}\n]}}\n'
    (HERE / f"{name}.json").write_text(text)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = build_data(Path(tmp))
        for name, scenario in SCENARIOS.items():
            save_state(data, name, scenario)
            print(f"{name}: saved")


if __name__ == "__main__":
    main()
