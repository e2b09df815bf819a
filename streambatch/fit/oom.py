"""The training-time out-of-memory guard: split a batch that does not fit instead of ending the run.

`run_with_oom_split()` (and `OOMGuard`, which counts) catches an out-of-memory in a step, frees
memory, cuts the batch in halves along the batch dimension with `split_batch()` and runs those,
recursively, down to ``min_size`` samples; the pieces' ``loss_weight`` keeps the accumulated gradient the
whole batch's.
"""

from __future__ import annotations

import functools
import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OptionError, callable_option, choice_option, int_option, shown
from .memory import free_memory, is_oom

log = logging.getLogger("streambatch.calibrate")
#: what a piece's ``loss_weight`` may be the share of: its samples, or its real frames (``lengths``/``cu_seqlens``)
WEIGHT_BY = ("samples", "frames")


# ---- cutting a batch -----------------------------------------------------------------------------------
def batch_size_of(batch: Any) -> int:
    """Samples in a batch: ``len(cu_seqlens) - 1`` for packed batches, ``len(lengths)``, or the first
    tensor's (or list's) leading dimension."""
    if isinstance(batch, dict):
        if batch.get("cu_seqlens") is not None:
            return int(len(batch["cu_seqlens"]) - 1)
        if batch.get("lengths") is not None and hasattr(batch["lengths"], "__len__"):
            return len(batch["lengths"])
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)) and batch and all(_is_array(v) for v in batch):
        values = list(batch)
    else:
        values = [batch]
    for v in values:
        if _is_array(v) and getattr(v, "ndim", 0) >= 1:
            return int(v.shape[0])
    for v in values:
        if isinstance(v, (list, tuple)):
            return len(v)
    raise OptionError(f"cannot tell the batch size of {shown(batch)}: no tensor, array or list in it")


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "__getitem__")


def split_batch(batch: Any, sizes: Sequence[int], *, weight_by: str = "samples") -> list[tuple[Any, float]]:
    """Cut a batch into consecutive pieces of ``sizes`` samples; returns ``(piece, share)`` pairs.

    Tensors and arrays whose leading dimension is the batch size are sliced, and lists/tuples of that
    length; other values are shared. A packed batch (``cu_seqlens``) is cut at sample boundaries: the
    token-level tensors (leading dimension = total length) are sliced by token range, ``cu_seqlens``
    rebased and ``max_seqlen`` recomputed. ``share`` is the piece's share of the samples, or with
    ``weight_by="frames"`` of the real lengths (``lengths`` or ``cu_seqlens``). Dict batches get
    ``loss_weight`` = the share times the batch's own ``loss_weight`` (a loader micro-batch's), tuples and
    bare tensors only the share. Pieces keep the batch's padded length.
    """
    choice_option("weight_by", weight_by, WEIGHT_BY)
    n = batch_size_of(batch)
    if sum(sizes) != n:
        raise OptionError(f"piece sizes {list(sizes)} do not add up to the batch size {n}")
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    frames = _frames(batch, n) if weight_by == "frames" else None
    out = []
    for i in range(len(sizes)):
        s, e = int(bounds[i]), int(bounds[i + 1])
        share = (e - s) / n if frames is None else float(frames[s:e].sum() / max(frames.sum(), 1e-30))
        out.append((_slice(batch, n, s, e, share), share))
    return out


def _frames(batch: Any, n: int) -> np.ndarray:
    if isinstance(batch, dict):
        if batch.get("cu_seqlens") is not None:
            return np.diff(np.asarray(_to_numpy(batch["cu_seqlens"]), dtype=np.float64))
        if batch.get("lengths") is not None:
            return np.asarray(_to_numpy(batch["lengths"]), dtype=np.float64)
    return np.ones(n)


def _to_numpy(v: Any) -> np.ndarray:
    return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)


def _slice(batch: Any, n: int, s: int, e: int, share: float) -> Any:
    if isinstance(batch, dict):
        packed = batch.get("cu_seqlens") is not None
        if packed:
            cu = batch["cu_seqlens"]
            t0, t1 = int(cu[s]), int(cu[e])
            total = int(cu[-1])
        piece = {}
        for k, v in batch.items():
            if packed and k == "cu_seqlens":
                piece[k] = v[s : e + 1] - v[s]
            elif packed and k == "max_seqlen":
                seg = np.diff(np.asarray(_to_numpy(cu[s : e + 1])))
                m = int(seg.max()) if seg.size else 0
                piece[k] = (
                    type(v)(m) if isinstance(v, (int, float)) else (v.new_tensor(m) if hasattr(v, "new_tensor") else m)
                )
            elif packed and _is_array(v) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == total and total != n:
                piece[k] = v[t0:t1]
            elif _is_array(v) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == n:
                piece[k] = v[s:e]
            elif isinstance(v, (list, tuple)) and len(v) == n:
                piece[k] = type(v)(v[s:e]) if isinstance(v, tuple) else v[s:e]
            else:
                piece[k] = v
        piece["loss_weight"] = float(batch.get("loss_weight", 1.0)) * share
        return piece
    if isinstance(batch, (list, tuple)):
        return type(batch)(
            v[s:e] if _is_array(v) and getattr(v, "ndim", 0) >= 1 and v.shape[0] == n else v for v in batch
        )
    return batch[s:e]


# ---- running a step, split on out-of-memory ------------------------------------------------------------
@dataclass
class SplitResult:
    """What `run_with_oom_split()` did: the combined ``value``, the ``pieces`` the batch ran as,
    the ``ooms`` caught and the ``splits`` made (one per out-of-memory, halving a piece)."""

    value: Any
    pieces: int
    ooms: int
    splits: int


def _combine(values: list[Any], shares: list[float]) -> Any:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    if all(v is None for v in values):
        return None
    first = values[0]
    if isinstance(first, dict):
        return {k: _combine([v[k] for v in values], shares) for k in first}
    if hasattr(first, "detach"):
        return sum(s * v.detach() for v, s in zip(values, shares))
    if isinstance(first, (int, float, np.floating, np.integer)) and not isinstance(first, bool):
        return float(sum(s * float(v) for v, s in zip(values, shares)))
    return values


_Attempt = Callable[[Any], tuple]  # _attempt with the step bound: (ok, value, error)


def _attempt(step_fn: Callable[[Any], Any], b: Any, device: Any = None) -> tuple[bool, Any, BaseException | None]:
    """``(True, value, None)``, or ``(False, None, error)`` after an out-of-memory, with memory freed."""
    try:
        return True, step_fn(b), None
    except Exception as e:
        if not is_oom(e):
            raise
        err = e
        where = "".join(traceback.format_tb(e.__traceback__)[-3:])
    # outside the except block, and without its traceback, so the frames' tensors can be freed
    err.__traceback__ = None
    if hasattr(err, "add_note") and where:
        err.add_note("out of memory at (traceback cut to free memory):\n" + where)
    free_memory(device)
    return False, None, err


@dataclass(frozen=True)
class SplitOptions:
    """How `run_with_oom_split()` splits a batch that runs out of memory; each value checked once, here (an
    `OptionError` naming it), so `OOMGuard` refuses a bad one when it is built."""

    min_size: int = 1
    """The smallest piece, in samples: a piece this small that still runs out of memory re-raises."""
    reset: Callable[[], Any] | None = None
    """Called before a batch restarts in more pieces (zeroes the gradients); None: failed pieces are retried."""
    weight_by: str = "samples"
    """What a piece's ``loss_weight`` is the share of (`WEIGHT_BY`)."""
    device: Any = None
    """The device whose cached memory is freed after an out-of-memory; None: the current one."""
    logger: logging.Logger | None = None
    """Where splits are logged (warning); None: the ``streambatch.calibrate`` logger."""

    def __post_init__(self) -> None:
        int_option("min_size", self.min_size, 1)
        choice_option("weight_by", self.weight_by, WEIGHT_BY)
        if self.reset is not None:
            callable_option("reset", self.reset, "reset()", 0)
        if self.logger is not None and not isinstance(self.logger, logging.Logger):
            raise OptionError(f"logger must be a logging.Logger (or None), got {shown(self.logger)}")


def _step(step_fn: Any) -> Callable[[Any], Any]:
    """``step_fn`` once it is a callable ``step_fn(batch)``, else an OptionError."""
    return callable_option("step_fn", step_fn, "step_fn(batch)", 1)


def run_with_oom_split(
    step_fn: Callable[[Any], Any],
    batch: Any,
    *,
    min_size: int = 1,
    reset: Callable[[], Any] | None = None,
    weight_by: str = "samples",
    device: Any = None,
    logger: logging.Logger | None = None,
) -> SplitResult:
    """Run ``step_fn(batch)``; on an out-of-memory split the batch in halves and run those (recursively).

    Every split is logged (warning) and counted. The pieces carry ``loss_weight`` = their share of the
    samples (or frames) times the batch's own ``loss_weight``: a step that multiplies its mean loss by
    ``batch.get("loss_weight", 1.0)`` before ``backward()`` accumulates the same gradient over the pieces as
    over the whole batch. The returned ``value`` combines the pieces' return values weighted by share (the
    whole batch's mean loss when ``step_fn`` returns its piece's unweighted mean loss).

    A step that runs out of memory in ``backward()`` may already have added part of its gradient. Without
    ``reset`` the failed piece is simply retried in halves (that part stays: usually a small error, logged);
    with ``reset`` (e.g. ``lambda: opt.zero_grad(set_to_none=True)``, when the gradients were zero before
    this batch) every out-of-memory resets the gradients and restarts the whole batch cut into twice as
    many pieces, which is exact. A piece of ``min_size`` samples that still runs out of memory re-raises.
    """
    o = SplitOptions(min_size, reset, weight_by, device, logger)
    return _run_split(_step(step_fn), batch, o)


def _run_split(step_fn: Callable[[Any], Any], batch: Any, o: SplitOptions) -> SplitResult:
    """`run_with_oom_split()` with its options checked."""
    n = batch_size_of(batch)
    attempt = functools.partial(_attempt, step_fn, device=o.device)
    if o.reset is None:
        return _run_halving(attempt, batch, n, o.min_size, o.weight_by, o.logger or log)
    return _run_restarting(attempt, batch, n, o.min_size, o.reset, o.weight_by, o.logger or log)


def _run_halving(
    attempt: _Attempt, batch: Any, n: int, min_size: int, weight_by: str, logger: logging.Logger
) -> SplitResult:
    """Without ``reset``: a piece that runs out of memory is retried in halves, recursively."""
    state = {"ooms": 0, "splits": 0, "pieces": 0}

    def run(b: Any, size: int) -> Any:
        ok, value, err = attempt(b)
        if ok:
            state["pieces"] += 1
            return value
        state["ooms"] += 1
        if size <= min_size or size < 2:
            raise err
        h = size // 2
        state["splits"] += 1
        logger.warning("out of memory on a batch of %d samples: splitting into %d + %d", size, h, size - h)
        halves = split_batch(b, [h, size - h], weight_by=weight_by)
        values = [run(p, size_) for (p, _), size_ in zip(halves, (h, size - h))]
        return _combine(values, [s for _, s in halves])

    value = run(batch, n)
    return SplitResult(value, state["pieces"], state["ooms"], state["splits"])


def _run_restarting(
    attempt: _Attempt,
    batch: Any,
    n: int,
    min_size: int,
    reset: Callable[[], Any],
    weight_by: str,
    logger: logging.Logger,
) -> SplitResult:
    """With ``reset``: every out-of-memory resets and restarts the whole batch in twice as many pieces."""
    ooms = splits = 0
    k = 1
    while True:
        if k == 1:
            pieces = [(batch, 1.0)]
        else:
            sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
            pieces = split_batch(batch, [s for s in sizes if s > 0], weight_by=weight_by)
        values, failed = [], None
        for p, _ in pieces:
            ok, value, err = attempt(p)
            if not ok:
                failed = err
                break
            values.append(value)
        if failed is None:
            return SplitResult(_combine(values, [s for _, s in pieces]), len(pieces), ooms, splits)
        ooms += 1
        if math.ceil(n / k) <= min_size or k >= n:
            raise failed
        reset()
        k *= 2
        splits += 1
        logger.warning("out of memory on a batch of %d samples: restarting it in %d pieces", n, min(k, n))
        k = min(k, n)


class OOMGuard:
    """Wrap a training step so that an out-of-memory splits the batch instead of ending the run.

    ``guard = OOMGuard(step_fn); for batch in loader: loss = guard(batch)`` calls
    `run_with_oom_split()` (same arguments) and keeps counters: ``calls``, ``ooms`` (out-of-memory
    errors caught), ``splits`` and ``split_batches`` (batches that needed any split). How the pieces' losses
    combine: each piece gets ``loss_weight`` = its share of the batch's samples (``weight_by="frames"``: of
    its real frames, for a loss averaged over frames); multiply the piece's mean loss by it before
    ``backward()``, and the accumulated gradient is the whole batch's. Under DDP each ``backward()`` outside
    ``no_sync()`` all-reduces, so a split on one rank only would leave the ranks' collectives out of step (a
    hang): run the step's ``backward()`` inside ``model.no_sync()`` and all-reduce the gradients once after
    the guard returns (``dist.all_reduce(p.grad); p.grad /= world_size`` for each parameter).
    """

    def __init__(self, step_fn: Callable[[Any], Any], **kwargs: Any):
        self.step_fn = _step(step_fn)
        self.options = SplitOptions(**kwargs)  # an unknown name is a TypeError, a bad value an OptionError, now
        self.calls = self.ooms = self.splits = self.split_batches = 0
        self.last: SplitResult | None = None

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        res = _run_split(self.step_fn, batch, self.options)
        self.ooms += res.ooms
        self.splits += res.splits
        self.split_batches += bool(res.splits)
        self.last = res
        return res.value

    def stats(self) -> dict[str, int]:
        """The counters as a dict: ``calls``, ``ooms``, ``splits``, ``split_batches``."""
        return {"calls": self.calls, "ooms": self.ooms, "splits": self.splits, "split_batches": self.split_batches}


def oom_guard(step_fn: Callable[[Any], Any], **kwargs: Any) -> OOMGuard:
    """``OOMGuard(step_fn, **kwargs)``: see `OOMGuard` and `run_with_oom_split()`."""
    return OOMGuard(step_fn, **kwargs)
