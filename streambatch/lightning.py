"""Lightning: a ``LightningDataModule`` over `StreamBatchLoader` (the optional extra ``streambatch[lightning]``).

Lightning saves the ``state_dict()`` of a stateful train loader in its checkpoints and hands it back on
restore, as it does for torchdata's ``StatefulDataLoader``; ``StreamBatchLoader`` has that protocol, so a
Trainer stopped mid-epoch resumes with exactly the batches that remained. `LightningLoader` is the loader
as Lightning iterates it: Lightning stops asking for batches once ``len()`` of them are out, without ending the
loader's pass, so the wrapper follows Lightning's epoch counter to start the loader's next epoch.
`StreamBatchDataModule` builds the loaders on each rank and keeps the train loader's state in the
checkpoint (the guide "Lightning").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the older package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError("streambatch.lightning needs Lightning: pip install 'streambatch[lightning]'") from None

from .errors import OptionError
from .format.index import ShardIndex
from .loader import StreamBatchLoader

log = logging.getLogger("streambatch.lightning")


class LightningLoader:
    """A `StreamBatchLoader` as a Lightning Trainer iterates it; ``len()``, iteration, ``state_dict()``.

    ``epoch``: a callable giving Lightning's current epoch (``lambda: trainer.current_epoch``); the loader
    follows it. Lightning reads ``len()`` batches and then starts its next epoch without asking for one more,
    so the loader's pass never ends by itself: when Lightning's epoch moves past the loader's, the finished
    pass is closed (the loader checks its count and moves on) and the loader set to Lightning's epoch; a pass
    Lightning cut short (``limit_train_batches``) is closed and its rest skipped, as Lightning means. Until
    then the loader stays in its epoch, so a checkpoint taken after the last batch still says "epoch e, all
    batches consumed", which is what Lightning's own progress says. ``rewind=True`` (evaluation): every pass
    is the whole of the loader's epoch 0, from its first batch.
    """

    def __init__(self, loader: StreamBatchLoader, epoch: Callable[[], int] | None = None, *, rewind: bool = False):
        self.loader = loader
        self._epoch = epoch
        self._rewind = rewind
        self._pass: Iterator[dict[str, Any]] | None = None  # the loader's pass under way (its iterator)
        self._loaded: dict[str, Any] | None = None  # the state loaded last, until a pass starts from it

    def __len__(self) -> int:
        self._follow()
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._batches()

    def _batches(self) -> Iterator[dict[str, Any]]:
        # a generator: nothing happens until Lightning asks for the first batch (it calls iter() more often)
        self._follow()
        self.close()
        if self._rewind:
            _rewind(self.loader, 0)
        it = iter(self.loader)
        self._pass, self._loaded = it, None
        yield from it

    def _follow(self) -> None:
        """Move the loader to Lightning's epoch when Lightning has gone past it."""
        target = self._epoch() if self._epoch is not None and not self._rewind else None
        if target is None or self.loader.epoch >= target:
            return
        self.close(finish=self._pass is not None and self.loader.remaining == 0)
        if self.loader.epoch < target:
            self.loader.set_epoch(target)

    def close(self, finish: bool = False) -> None:
        """End the pass under way, if any: ``finish`` runs a pass whose batches are all out to its end (the
        loader checks the count and moves to its next epoch), else the pass stops where it is (the loader keeps
        its place); either way its DataLoader workers stop."""
        it, self._pass = self._pass, None
        if it is None:
            return
        if finish:
            extra = next(it, None)
            if extra is not None:
                raise RuntimeError(
                    f"the loader yielded a batch past its planned {len(self.loader)} in epoch {self.loader.epoch}"
                )
        else:
            it.close()  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """The loader's `state_dict()` (Lightning stores it in the checkpoint)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader; the same state loaded again before a pass (the DataModule's copy, then the
        fit loop's) is loaded once."""
        if self._loaded is not None and state == self._loaded:
            return
        self.close()
        self.loader.load_state_dict(state)
        self._loaded = state


def _rewind(loader: StreamBatchLoader, epoch: int) -> None:
    """Put the loader at the start of ``epoch``: ``set_epoch`` keeps the place in the epoch it is already in
    (a restored resume point), so step off it first."""
    loader.set_epoch(epoch + 1)
    loader.set_epoch(epoch)


def _check_options(options: Any, what: str) -> None:
    """The loader options a DataModule is given, checked now rather than when the Trainer sets it up: known names,
    and each value of the read, per-sample and run groups (the batching options are checked with the index)."""
    from .loader.options import check_options

    if not isinstance(options, dict):
        raise OptionError(f"{what} must be a dict of loader options, got {options!r}")
    check_options(options)


class StreamBatchDataModule(pl.LightningDataModule):
    """A Lightning DataModule over streambatch: ``train_dataloader()`` is a `StreamBatchLoader` of
    ``source`` with ``budget`` and ``options`` (any loader option by name) on this rank, and its state travels
    in Lightning's checkpoints, so ``trainer.fit(model, datamodule=dm, ckpt_path=...)`` resumes mid-epoch
    with exactly the remaining batches.

    ``val_source`` (optional) gives ``val_dataloader()``: the same options with ``shuffle=False`` updated by
    ``val_options``, every validation run the whole set once. Rank and world size come from the Trainer
    unless given. Every epoch's plan has its own number of batches and Lightning reads ``len()`` only when it
    reloads its loaders, so ``setup`` sets ``trainer.reload_dataloaders_every_n_epochs = 1`` (it returns the
    same loader: cheap).
    """

    def __init__(
        self,
        source: str | list[str] | ShardIndex,
        budget: float | str | None = None,
        *,
        val_source: str | list[str] | ShardIndex | None = None,
        val_options: dict[str, Any] | None = None,
        **options: Any,
    ):
        super().__init__()
        _check_options(options, "options")
        _check_options(val_options or {}, "val_options")
        self.source, self.budget, self.options = source, budget, options
        self.val_source = val_source
        self.val_options = {**options, "shuffle": False, **(val_options or {})}
        self.train_loader: LightningLoader | None = None
        self.val_loader: LightningLoader | None = None
        self._pending: dict[str, Any] | None = None

    def _make(self, source: Any, options: dict[str, Any]) -> StreamBatchLoader:
        kwargs = dict(options)
        trainer = self.trainer
        if trainer is not None and kwargs.get("run") is None:  # a RunOptions given says its own rank
            kwargs.setdefault("rank", trainer.global_rank)
            kwargs.setdefault("world_size", trainer.world_size)
        return StreamBatchLoader(source, self.budget, **kwargs)

    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def setup(self, stage: str) -> None:
        """Build the loaders the stage needs (once)."""
        if stage == "fit" and self.train_loader is None:
            self.train_loader = LightningLoader(self._make(self.source, self.options), self._current_epoch)
            if self._pending is not None:
                self.train_loader.load_state_dict(self._pending)
                self._pending = None
        if stage in ("fit", "validate") and self.val_source is not None and self.val_loader is None:
            self.val_loader = LightningLoader(self._make(self.val_source, self.val_options), rewind=True)
        trainer: Any = self.trainer  # its data connector sets reload_dataloaders_every_n_epochs on it at runtime
        if trainer is not None and stage == "fit" and trainer.reload_dataloaders_every_n_epochs != 1:
            if trainer.reload_dataloaders_every_n_epochs:
                log.warning(
                    "reload_dataloaders_every_n_epochs=%d set to 1: every epoch of the plan has its own "
                    "number of batches, which Lightning reads when it reloads",
                    trainer.reload_dataloaders_every_n_epochs,
                )
            trainer.reload_dataloaders_every_n_epochs = 1

    def train_dataloader(self) -> LightningLoader:
        """The train loader (built by `setup()`)."""
        if self.train_loader is None:
            self.setup("fit")
        assert self.train_loader is not None
        return self.train_loader

    def val_dataloader(self) -> LightningLoader | list:
        """The validation loader, or no loader (an empty list) without ``val_source``."""
        if self.val_source is None:
            return []
        if self.val_loader is None:
            self.setup("validate")
        return self.val_loader if self.val_loader is not None else []

    def state_dict(self) -> dict[str, Any]:
        """``{"train": the train loader's state}`` for Lightning's checkpoint."""
        return {"train": self.train_loader.state_dict()} if self.train_loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the train loader's place (Lightning calls this after ``setup``, before the fit loop reads
        ``len()``, so the restored epoch's length is the one it counts)."""
        state = state_dict.get("train")
        if state is None:
            return
        if self.train_loader is None:
            self._pending = state
        else:
            self.train_loader.load_state_dict(state)

    def teardown(self, stage: str) -> None:
        """Stop the passes under way (their DataLoader workers) when the Trainer is done; places are kept."""
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.close()
