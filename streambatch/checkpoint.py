"""What a loader checkpoint holds beyond its plain fields: the checks that a state belongs to this loader, the
layout an interrupted epoch ran on, and the packed consumed-sample mask of the oldest state format."""

from __future__ import annotations

from typing import Any

import numpy as np

from .dataset.mixture import MixedIndex
from .dataset.where import left_out
from .plan.epoch import make_epoch_plan
from .plan.resume import Layout, Resumed


def check_state(loader: Any, state: dict[str, Any]) -> int:
    """The state's batches consumed, once it is known to belong to this loader's dataset and seed."""
    if state.get("seed", loader.config.seed) != loader.config.seed:
        raise ValueError(f"state was saved with seed {state['seed']}, this loader has seed {loader.config.seed}")
    if loader.index is not None and state.get("num_samples") not in (None, loader.index.num_samples):
        raise ValueError(
            f"state was saved for a dataset of {state['num_samples']} samples, this one has {loader.index.num_samples}"
        )
    mine = loader.index.state() if isinstance(loader.index, MixedIndex) else None
    if state.get("mixture") != mine and "mixture" in state:
        raise ValueError(f"state was saved for the mixture {state['mixture']}, this loader reads {mine}")
    where = loader.filter.expr if loader.filter is not None else None
    if "where" in state and state["where"] != where:
        raise ValueError(f"state was saved with where={state['where']!r}, this loader has where={where!r}")
    consumed = int(state.get("batches_consumed", 0))
    if loader.index is None and consumed:
        raise ValueError("mid-epoch resumption needs an index (the epoch's batches must be planned)")
    return consumed


def old_layout(loader: Any, state: dict[str, Any], consumed: int, before: Resumed) -> Layout:
    """The layout the state was saved on. A state from before ``steps`` was saved gets its step count
    from the old layout's whole plan (O(N), once)."""
    world, workers = int(state["world_size"]), int(state["num_workers"])
    even = state.get("even_batches", loader.even_batches)
    hardest = bool(state.get("hardest_first", loader.hardest_first))
    steps = state.get("steps")
    if steps is None:
        lengths = loader._lengths(loader.epoch)
        steps = make_epoch_plan(lengths, loader.config, loader.epoch, world, workers, even,
                                before.consumed(lengths, loader.config, left_out(loader.index, loader.filter, loader.epoch,
                                                                                 loader.config.seed, lengths.offsets)),
                                hardest).steps
    return Layout(world, workers, even, hardest, int(steps), consumed)


def pack_mask(mask: np.ndarray) -> str:
    """A consumed-sample mask as text (the oldest state format held one)."""
    import base64
    import zlib

    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode("ascii")


def unpack_mask(packed: str, n: int) -> np.ndarray:
    """Inverse of :func:`pack_mask` for ``n`` samples."""
    import base64
    import zlib

    bits = np.frombuffer(zlib.decompress(base64.b64decode(packed)), dtype=np.uint8)
    return np.unpackbits(bits)[:n].astype(bool)
