"""Under torchrun (2 ranks, gloo on CPU), for tests/cluster/test_huggingface.py: on each rank, an uninterrupted
StreamBatchTrainer run, a run stopped after the checkpoint of step ``--stop-at``, and a run of fresh objects
resumed from that checkpoint (hf_runs.run_trainer, one process group for the three). Each rank logs its batches'
keys per run (``full-rankR.jsonl``, ``a-rankR.jsonl``, ``b-rankR.jsonl``) and writes ``result-rankR.json``: the
step counts and whether the resumed run's weights equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the huggingface helpers
from huggingface import hf_runs  # noqa: E402

from streambatch.procs import watch_parent  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-at", type=int, required=True)
    a = p.parse_args()
    watch_parent(os.getppid())
    torch.set_num_threads(1)
    rank, out = int(os.environ["RANK"]), Path(a.out)
    full, weights = hf_runs.run_trainer(a.data, out / f"full-rank{rank}.jsonl")
    ckpt = out / "ckpt"
    hf_runs.run_trainer(a.data, out / f"a-rank{rank}.jsonl", ckpt_dir=ckpt, stop_at=a.stop_at)
    resumed, after = hf_runs.run_trainer(
        a.data, out / f"b-rank{rank}.jsonl", ckpt_dir=ckpt, resume=ckpt / f"checkpoint-{a.stop_at}"
    )
    result = {
        "full": [full.global_step, full.max_steps],
        "resumed": [resumed.global_step, resumed.max_steps],
        "same_weights": all(torch.equal(after[k], w) for k, w in weights.items()),
    }
    (out / f"result-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
