"""How a pass reaches the training loop: the torch ``DataLoader`` over the loader's epoch stream, its workers'
set-up, and the optional progress bar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader

from ..read.ring import BatchRing
from ..read.worker import EpochStream
from .options import RunOptions


def _identity(x: Any) -> Any:
    return x


class WorkerInit:
    """DataLoader workers ignore SIGUSR1: a scheduler's warning signal (SLURM ``--signal=USR1@T``) may reach the
    whole process group, and its default action would kill the workers while the training process is saving
    its checkpoint. SIGTERM keeps its default: torch ends workers with it. Then the user's ``worker_init_fn``."""

    def __init__(self, user: Any = None):
        self.user = user

    def __call__(self, worker_id: int) -> None:
        import signal

        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)


def make_dataloader(stream: EpochStream, run: RunOptions, ring: BatchRing | None, forkserver: bool) -> DataLoader:
    """The DataLoader of one pass (or of every pass, with persistent workers); ``ring``: the workers' reused batch
    buffers; ``forkserver``: workers start from a clean forkserver (DuckDB, behind a filter, is not fork-safe)."""
    kwargs: dict[str, Any] = {}
    if run.num_workers > 0:
        kwargs["prefetch_factor"] = run.prefetch_factor or 2
        kwargs["persistent_workers"] = run.persistent_workers
        kwargs["worker_init_fn"] = WorkerInit(run.worker_init_fn)
        if forkserver:
            kwargs["multiprocessing_context"] = "forkserver"
    return DataLoader(
        stream, batch_size=None, num_workers=run.num_workers, collate_fn=_identity, pin_memory=run.pin_memory, **kwargs
    )


def progress_bar(items: Iterable[Any], epoch: int, total: int | None, initial: int) -> Iterable[Any]:
    """A tqdm bar over a pass, from the batches already consumed (``progress=True``)."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, initial=initial, desc=f"epoch {epoch}", unit="batch")
