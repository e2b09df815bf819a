"""What a loader checkpoint holds beyond its plain fields: the checks that a state belongs to this loader, the
layout an interrupted epoch ran on, and the packed consumed-sample mask of the oldest state format."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dataset.mixture import MixedIndex
from ..dataset.where import left_out
from ..plan.epoch import make_epoch_plan
from ..plan.resume import Layout, Resumed


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
    if consumed and "batching" in state:  # between epochs the options may change; within one they decide what was seen
        _check_batching(state["batching"], batching_record(loader.config))
    return consumed


def batching_record(config: Any) -> dict[str, Any]:
    """The batching options that decide an epoch's batches, as plain values (a checkpoint holds them so that a
    mid-epoch resume with other options is refused rather than silently losing or repeating samples)."""
    fields = (
        "budget",
        "buffer_size",
        "refill",
        "max_batch_size",
        "batch_size_multiple_of",
        "min_length",
        "max_length",
        "drop_last",
        "strict",
        "shuffle",
        "pad_to_multiple_of",
        "batch_order",
        "output_budget",
        "batch_by",
    )
    out = {k: getattr(config, k) for k in fields}
    edges = config.bucket_boundaries
    out["bucket_boundaries"] = None if edges is None else [float(x) for x in edges]
    out["cost"] = config.cost.to_json()
    return out


def _check_batching(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    differ = [k for k in saved if k in mine and saved[k] != mine[k]]
    if differ:
        said = ", ".join(f"{k}={saved[k]!r} (now {mine[k]!r})" for k in differ)
        raise ValueError(
            f"state was saved mid-epoch with other batching options: {said}; resume with the same "
            "options, or from the end of an epoch"
        )


def old_layout(loader: Any, state: dict[str, Any], consumed: int, before: Resumed) -> Layout:
    """The layout the state was saved on. A state from before ``steps`` was saved gets its step count
    from the old layout's whole plan (O(N), once)."""
    world, workers = int(state["world_size"]), int(state["num_workers"])
    even = state.get("even_batches", loader.even_batches)
    hardest = bool(state.get("hardest_first", loader.hardest_first))
    steps = state.get("steps")
    if steps is None:
        lengths = loader._lengths(loader.epoch)
        steps = make_epoch_plan(
            lengths,
            loader.config,
            loader.epoch,
            world,
            workers,
            even,
            before.consumed(
                lengths,
                loader.config,
                left_out(loader.index, loader.filter, loader.epoch, loader.config.seed, lengths.offsets),
            ),
            hardest,
        ).steps
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
