"""One rank of ``accelerate launch --multi_gpu --num_processes N`` with ``Accelerator(cpu=True)``: build the loader
after the Accelerator (it reads the rank from the process group), pass it through ``prepare()``, and write the
rank's batches (their sample keys) and ``len(loader)`` to ``OUT/rank{R}.json``."""

from __future__ import annotations

import json
import sys

from accelerate import Accelerator

from streambatch import StreamBatchLoader


def main() -> int:
    data, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)
    loader = StreamBatchLoader(data, budget=400, seed=3)
    prepared = accelerator.prepare(loader)
    keys = [list(batch["keys"]) for batch in prepared]
    state = accelerator.state
    with open(f"{out}/rank{state.process_index}.json", "w") as f:
        json.dump(
            {
                "world": state.num_processes,
                "distributed_type": str(state.distributed_type),
                "same_object": prepared is loader,
                "len": len(loader),
                "batches": keys,
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
