"""Who am I: rank, world size, local rank and DataLoader worker, from wherever the launcher put them.

Order of precedence: explicit arguments, an initialised ``torch.distributed`` group, torchrun's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``),
else a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .errors import OptionError


@dataclass(frozen=True)
class ProcessInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"


def _env_int(name: str) -> int | None:
    """The whole number the launcher put in ``name`` (None when unset or empty). Anything else is an
    `OptionError` naming it: read as unset, every rank of a job would take the same data."""
    v = os.environ.get(name)
    if v is None or not v.strip():
        return None
    try:
        return int(v)
    except ValueError:
        raise OptionError(f"the environment variable {name}={v!r} is not a whole number") from None


def process_info(rank: int | None = None, world_size: int | None = None) -> ProcessInfo:
    """This process's place in the job; explicit ``rank``/``world_size`` win over everything else."""
    local = _env_int("LOCAL_RANK")
    if local is None:
        local = _env_int("SLURM_LOCALID") or 0
    if rank is not None or world_size is not None:
        r, w = int(rank or 0), int(world_size or 1)
        src = "explicit"
    else:
        r, w, src = _detect()
    if not 0 <= r < w:
        raise OptionError(f"rank {r} is outside world_size {w} (from {src})")
    return ProcessInfo(rank=r, world_size=w, local_rank=local, source=src)


def _detect() -> tuple[int, int, str]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), "torch.distributed"
    except Exception:  # pragma: no cover - torch without distributed support
        pass
    r, w = _env_int("RANK"), _env_int("WORLD_SIZE")
    if r is not None and w is not None:
        return r, w, "torchrun"
    r, w = _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS")
    if r is not None and w is not None:
        return r, w, "slurm"
    return 0, 1, "single"


def worker_info() -> tuple[int, int]:
    """(worker id, number of workers) inside a torch DataLoader worker, else (0, 1)."""
    from torch.utils.data import get_worker_info

    wi = get_worker_info()
    return (wi.id, wi.num_workers) if wi is not None else (0, 1)


def process_group_matches(rank: int, world_size: int) -> bool:
    """Whether an initialised ``torch.distributed`` group is this layout (so the ranks can agree by a collective)."""
    try:
        import torch.distributed as dist

        return bool(
            dist.is_available()
            and dist.is_initialized()
            and dist.get_rank() == rank
            and dist.get_world_size() == world_size
        )
    except Exception:  # pragma: no cover - torch without distributed support
        return False


def all_gather_ints(values: list[int], group: Any = None) -> list[list[int]]:
    """Every rank's ``values`` (a few integers), in rank order: one collective, any backend, over ``group``
    (a process group; None: the whole world)."""
    import torch.distributed as dist

    out: list[list[int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, [int(v) for v in values], group=group)
    return [list(v) for v in out]  # type: ignore[arg-type]
