"""Data parallelism inside a model-parallel mesh: which data-parallel rank this process is, how many there are,
and how the data-parallel ranks agree on an epoch's step count.

With tensor, context or pipeline parallelism, the processes of one data-parallel group (its *peers*) must receive
bit-identical batches and different groups disjoint samples. The plan's layout then has ``dp_size`` ranks, not
one per process: every peer plans the same rank's slots, and the step count is agreed with one small collective.
`data_parallel()` resolves it from the loader's options (``dp_rank``/``dp_size``, ``dp_mesh``) or, without
them, from the job (``rank``/``world_size`` or what the launcher says: one data-parallel rank per process).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from ..dist import all_gather_ints, process_group_matches, process_info
from ..errors import OptionError, int_option
from ..plan.layout import check_slots

#: the name of a DeviceMesh's data-parallel dimension
DP_DIM = "dp"


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel ranks, and what it agrees on the step count with."""

    rank: int
    """The data-parallel rank (the plan's rank): peers share it."""
    size: int
    """The data-parallel ranks (the plan's layout's ranks)."""
    source: str
    """Where they came from: ``"dp_mesh"``, ``"dp_rank"`` (the options), or the job (``"torchrun"``, …)."""
    group: Any = None
    """The process group of the step agreement: the mesh's data-parallel group, else None (the whole world)."""
    processes: int = 1
    """Processes in the job (``size`` × peers per data-parallel rank)."""

    @property
    def peers(self) -> int:
        """Processes that receive each data-parallel rank's batches (tensor/context/pipeline peers)."""
        return max(1, self.processes // self.size)

    def can_agree(self) -> bool:
        """Whether an initialised process group lets the ranks agree by a collective (rank-local planning)."""
        if self.size <= 1:
            return False
        if self.group is not None:
            return True
        if self.source != "dp_rank":
            return process_group_matches(self.rank, self.size)
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() % self.size == 0

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every data-parallel rank's ``values``, in data-parallel rank order: one all_gather of a few integers
        over the mesh's data-parallel group, or over the whole world where peers contribute identical values
        (each row is tagged with its data-parallel rank; a peer that planned otherwise is an error)."""
        rows = all_gather_ints([self.rank, *values], self.group)
        by_rank: dict[int, list[int]] = {}
        for tag, *row in rows:
            if by_rank.setdefault(tag, row) != row:
                raise OptionError(
                    f"the peers of data-parallel rank {tag} planned different epochs ({by_rank[tag]} and {row}): "
                    "give every process of a data-parallel group the same loader options"
                )
        missing = [r for r in range(self.size) if r not in by_rank]
        if missing or len(by_rank) != self.size:
            raise OptionError(
                f"data-parallel ranks {missing or sorted(set(by_rank) - set(range(self.size)))} have no process "
                f"(dp_size={self.size} over {len(rows)} processes): check dp_rank on every process"
            )
        return [by_rank[r] for r in range(self.size)]


def data_parallel(run: Any) -> DataParallel:
    """The loader's data-parallel layout from its run options (`RunOptions`):
    a DeviceMesh (``dp_mesh``), ``dp_rank``/``dp_size``, or the job (one data-parallel rank per process)."""
    if run.dp_mesh is not None:
        return _from_mesh(run.dp_mesh)
    info = process_info(run.rank, run.world_size)
    dp_rank, dp_size = run.dp_rank, run.dp_size
    if dp_size is None:
        return DataParallel(info.rank, info.world_size, info.source, processes=info.world_size)
    assert dp_rank is not None, "RunOptions checks dp_rank and dp_size together"
    if info.source != "single" and info.world_size % dp_size:
        raise OptionError(
            f"dp_size={dp_size} does not divide the {info.world_size} processes of this job (from {info.source}): "
            "each data-parallel rank needs the same number of peers"
        )
    return DataParallel(dp_rank, dp_size, "dp_rank", processes=max(info.world_size, dp_size))


def _from_mesh(mesh: Any) -> DataParallel:
    """Rank, size and process group of a DeviceMesh's data-parallel dimension (a 1-D mesh: its only one)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    ndim = getattr(mesh, "ndim", None)
    if not isinstance(ndim, int) or not hasattr(mesh, "get_group"):
        raise OptionError(f"dp_mesh must be a torch DeviceMesh, got {reprlib.repr(mesh)}")
    if DP_DIM in names:
        dim: Any = DP_DIM
    elif ndim == 1:
        dim = 0
    else:
        raise OptionError(
            f"dp_mesh has dimensions {names or ndim} and none is named {DP_DIM!r}: pass its data-parallel "
            f'sub-mesh (dp_mesh=mesh["data"]) or name that dimension {DP_DIM!r}'
        )
    if mesh.get_coordinate() is None:
        raise OptionError("dp_mesh does not include this process")
    size = int(mesh.size(names.index(dim) if isinstance(dim, str) else dim))
    return DataParallel(int(mesh.get_local_rank(dim)), size, "dp_mesh", mesh.get_group(dim), int(mesh.size()))


def check_data_parallel(run: Any) -> None:
    """The data-parallel options of `RunOptions`, checked: ``dp_rank`` and
    ``dp_size`` together and in range, or a ``dp_mesh`` alone (``rank``/``world_size`` with them only say the
    job's processes, which ``dp_size`` must divide)."""
    given = [n for n in ("dp_rank", "dp_size", "dp_mesh") if getattr(run, n) is not None]
    if not given:
        return
    if run.dp_mesh is not None:
        if len(given) > 1:
            raise OptionError("dp_mesh gives the data-parallel rank and size: pass it without dp_rank/dp_size")
        return
    if len(given) == 1:
        raise OptionError(f"dp_rank and dp_size are given together, got only {given[0]}={getattr(run, given[0])!r}")
    size = int_option("dp_size", run.dp_size, 1)
    check_slots(size, run.num_workers, "dp_size")
    if int_option("dp_rank", run.dp_rank, 0) >= size:
        raise OptionError(f"dp_rank must be below dp_size={size}, got {run.dp_rank!r}")
