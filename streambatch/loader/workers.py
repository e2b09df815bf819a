"""How a pass reaches the training loop: the torch ``DataLoader`` over the loader's epoch stream, its workers'
set-up, and the optional progress bar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader

from ..errors import OptionError
from ..io.objstore import fork_unsafe
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


def start_method(urls: Any = None, storage_options: dict | None = None) -> str:
    """How the workers start: by forkserver where a fork could not read ``urls`` (obstore's runtime runs in this
    process: `fork_unsafe()`), else as Python's multiprocessing starts processes. A filter changes nothing: the
    workers read its answers from the loader's bit mask and never load its engine."""
    import multiprocessing

    method = multiprocessing.get_start_method()
    return "forkserver" if method == "fork" and fork_unsafe(urls, storage_options) else method


def check_sendable(
    callables: dict[str, Any], run: RunOptions, urls: Any = None, storage_options: dict | None = None
) -> None:
    """With workers that do not fork (spawn, forkserver), every user callable the workers run must pickle: one
    that does not (a lambda, a function defined inside another) is an `OptionError` naming the option and
    the fix, here, instead of a pickling traceback from inside the DataLoader. Forked workers inherit it as is."""
    import multiprocessing
    import pickle

    method = start_method(urls, storage_options)
    if run.num_workers == 0 or method == "fork":
        return
    for name, fn in callables.items():
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - any failure to pickle is the same mistake, said in one line
            why = " ".join(f"{type(e).__name__}: {e}".split())
            instead = (
                "read object storage only in the workers (they start by forkserver once this process has made "
                "object-store requests itself: docs/guide/storage.md)"
                if multiprocessing.get_start_method() == "fork"
                else "use fork"
            )
            raise OptionError(
                f"{name}={fn!r} cannot be sent to the {run.num_workers} worker processes, which start by "
                f"{method} ({why}): define it at the top level of a module (not a lambda or a function inside "
                f"another), or pass num_workers=0, or {instead}"
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
        forkserver = start_method(stream.ctx.urls, stream.ctx.storage_options) == "forkserver"
        if forkserver:
            kwargs["multiprocessing_context"] = "forkserver"
        check_sendable(callables, run, stream.ctx.urls, stream.ctx.storage_options)
    return DataLoader(
        stream, batch_size=None, num_workers=run.num_workers, collate_fn=_identity, pin_memory=run.pin_memory, **kwargs
    )


def progress_bar(items: Iterable[Any], epoch: int, total: int | None, initial: int) -> Iterable[Any]:
    """A tqdm bar over a pass, from the batches already consumed (``progress=True``)."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, initial=initial, desc=f"epoch {epoch}", unit="batch")
