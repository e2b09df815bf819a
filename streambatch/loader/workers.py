"""How a pass reaches the training loop: the torch ``DataLoader`` over the loader's epoch stream, its workers'
set-up, and the optional progress bar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader

from ..errors import OptionError
from ..io.ranges import before_workers
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


def start_method() -> str:
    """How the workers start: as Python's multiprocessing starts processes (a filter changes nothing: the workers
    read its answers from the loader's bit mask and never load its engine)."""
    import multiprocessing

    return multiprocessing.get_start_method()


def check_sendable(callables: dict[str, Any], run: RunOptions) -> None:
    """With workers that do not fork (spawn, forkserver), every user callable the workers run must pickle: one
    that does not (a lambda, a function defined inside another) is an `OptionError` naming the option and
    the fix, here, instead of a pickling traceback from inside the DataLoader. Forked workers inherit it as is."""
    import pickle

    method = start_method()
    if run.num_workers == 0 or method == "fork":
        return
    for name, fn in callables.items():
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - any failure to pickle is the same mistake, said in one line
            why = " ".join(f"{type(e).__name__}: {e}".split())
            raise OptionError(
                f"{name}={fn!r} cannot be sent to the {run.num_workers} worker processes, which start by "
                f"{method} ({why}): define it at the top level of a module (not a lambda or a function inside "
                f"another), or pass num_workers=0, or use fork"
            ) from None


def make_dataloader(
    stream: EpochStream, run: RunOptions, ring: BatchRing | None, callables: dict[str, Any]
) -> DataLoader:
    """The DataLoader of one pass (or of every pass, with persistent workers); ``ring``: the workers' reused batch
    buffers; ``callables``: the user's functions the workers run, by option (`check_sendable()`)."""
    kwargs: dict[str, Any] = {}
    if run.num_workers > 0:
        kwargs["prefetch_factor"] = run.prefetch_factor or 2
        kwargs["persistent_workers"] = run.persistent_workers
        kwargs["worker_init_fn"] = WorkerInit(run.worker_init_fn)
        if start_method() == "fork":  # forked workers inherit what this process's S3 client has loaded
            before_workers(stream.ctx.urls, stream.ctx.storage_options)
        check_sendable(callables, run)
    return DataLoader(
        stream, batch_size=None, num_workers=run.num_workers, collate_fn=_identity, pin_memory=run.pin_memory, **kwargs
    )


def progress_bar(items: Iterable[Any], epoch: int, total: int | None, initial: int) -> Iterable[Any]:
    """A tqdm bar over a pass, from the batches already consumed (``progress=True``)."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, initial=initial, desc=f"epoch {epoch}", unit="batch")
