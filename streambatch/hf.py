"""Hugging Face ``transformers.Trainer`` over `StreamBatchLoader` (the optional extra ``streambatch[hf-train]``).

The Trainer counts a fixed number of batches per epoch, read once from ``len()``, and resumes by replaying the
batches a checkpoint had consumed. A streambatch epoch has its own number of batches (each epoch is planned
afresh) and resumes from a few-hundred-byte ``state_dict()``. `StreamBatchTrainer` reconciles the two:
the Trainer sees the run's epochs as one pass of exactly as many batches as they hold (`TrainerLoader`),
each checkpoint holds the loader's state of every rank, and ``train(resume_from_checkpoint=...)`` restores it
instead of replaying (the Trainer's ``ignore_data_skip``), so a run stopped mid-epoch goes on with exactly the
remaining batches (the guide "Hugging Face accelerate and Trainer"). ``accelerate`` needs no adapter: its
``Accelerator.prepare`` returns the loader unchanged and ``register_for_checkpointing(loader)`` saves its state.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError:
    raise ImportError("streambatch.hf needs transformers: pip install 'streambatch[hf-train]'") from None

from .errors import OptionError, StreamBatchError
from .loader import StreamBatchLoader

#: the file each rank's loader state is kept in, inside a Trainer checkpoint folder
STATE_FILE = "streambatch-loader-rank{rank}.json"


class TrainerLoader:
    """A `StreamBatchLoader` as one pass over a whole run: ``epochs`` of the loader (or ``batches``
    batches, crossing epochs as needed), one after the other; ``len()`` is exactly the batches of the run.

    `position` (batches of the run already yielded, from the loader's epoch and place) is where a
    restored loader picks up. Each epoch's batch count is planned once and kept, so ``len()`` does not change
    while the run goes on.
    """

    def __init__(self, loader: StreamBatchLoader, epochs: int | None = None, batches: int | None = None):
        if (epochs is None) == (batches is None):
            raise OptionError("TrainerLoader: give either epochs or batches")
        if (epochs if epochs is not None else batches or 0) < 1:
            raise OptionError(f"TrainerLoader: epochs and batches must be >= 1, got {epochs or batches}")
        self.loader, self.epochs, self.batches = loader, epochs, batches
        self._steps: dict[int, int] = {}  # each epoch's batch count, planned once

    def steps(self, epoch: int) -> int:
        """The batches of ``epoch`` (the current one as ``len(loader)`` counts it, a resume's earlier part
        included)."""
        if epoch not in self._steps:
            loader = self.loader
            self._steps[epoch] = len(loader) if epoch == loader.epoch else loader.schedule(epoch).steps
        return self._steps[epoch]

    def __len__(self) -> int:
        if self.batches is not None:
            return self.batches
        assert self.epochs is not None
        return sum(self.steps(e) for e in range(self.epochs))

    @property
    def position(self) -> int:
        """Batches of the run already yielded (the epochs before the loader's, then its consumed batches)."""
        return sum(self.steps(e) for e in range(self.loader.epoch)) + self.loader.consumed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total = len(self)
        while self.position < total:
            it = iter(self.loader)
            for batch in it:
                yield batch
                if self.position >= total and self.loader.remaining > 0:
                    it.close()  # type: ignore[attr-defined]  # a run of `batches` ends mid-epoch: keep the place
                    return

    def set_epoch(self, epoch: int) -> None:
        """The Trainer's epoch (always 0: the run is one pass); the loader follows its own epochs."""

    @property
    def epoch(self) -> float:
        """The loader's epoch and the fraction of it consumed (what the Trainer logs as ``epoch``)."""
        n = self.steps(self.loader.epoch)
        return self.loader.epoch + (self.loader.consumed / n if n else 0.0)

    def state_dict(self) -> dict[str, Any]:
        """The loader's `state_dict()`."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader's place; the epochs' batch counts are planned again from it."""
        self.loader.load_state_dict(state)
        self._steps = {}


class _FollowEpochs(TrainerCallback):
    """Sets the Trainer's ``state.epoch`` to the loader's (epoch and fraction) after each optimizer step, so logs
    and checkpoints say which epoch of the data the run is in."""

    def __init__(self, view: TrainerLoader):
        self.view = view

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.epoch = self.view.epoch


class _SaveLoaderState(TrainerCallback):
    """After the Trainer saved a checkpoint (its ``on_save`` event, sent right after the save), this rank's loader
    state goes into that checkpoint's folder, ``checkpoint-{global_step}`` under ``args.output_dir``."""

    def __init__(self, view: TrainerLoader):
        self.view = view

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):  # a checkpoint saved elsewhere (a hyperparameter search's trial folders)
            raise StreamBatchError(
                f"StreamBatchTrainer: the checkpoint of step {state.global_step} is not at {folder}, so its loader "
                "state has nowhere to go; save checkpoints under args.output_dir (hyperparameter search is not "
                "supported)"
            )
        write_loader_state(folder, args.process_index, self.view.state_dict())


class StreamBatchTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on ``train_loader`` (a `StreamBatchLoader` of this rank)
    and resumes it exactly from its checkpoints.

    The run is ``args.num_train_epochs`` epochs of the loader (an integer), or ``args.max_steps`` optimizer
    steps if that is set; the Trainer's ``max_steps`` is set to the run's exact step count (so a schedule
    built from it ends with the data). Every checkpoint gets each rank's loader state
    (``streambatch-loader-rank{R}.json``); ``train(resume_from_checkpoint=...)`` loads it and the Trainer skips
    no batches (``args.ignore_data_skip`` is set). Other arguments are the Trainer's own (``train_dataset`` is
    not used).
    """

    def __init__(self, *args: Any, train_loader: StreamBatchLoader, **kwargs: Any):
        super().__init__(*args, **kwargs)
        a = self.args
        if a.max_steps > 0:
            view = TrainerLoader(train_loader, batches=a.max_steps * a.gradient_accumulation_steps)
        elif float(a.num_train_epochs) != int(a.num_train_epochs):
            raise OptionError(f"num_train_epochs must be a whole number of epochs, got {a.num_train_epochs}")
        else:
            view = TrainerLoader(train_loader, epochs=int(a.num_train_epochs))
        self.train_loader = view
        a.ignore_data_skip = True  # the loader's state says where to go on: nothing is replayed
        self.add_callback(_FollowEpochs(view))
        self.add_callback(_SaveLoaderState(view))

    def get_train_dataloader(self) -> TrainerLoader:  # type: ignore[override]
        """The run as one pass (`TrainerLoader`); sets ``args.max_steps`` to its optimizer steps."""
        ga = self.args.gradient_accumulation_steps
        self.args.max_steps = math.ceil(len(self.train_loader) / ga)
        return self.train_loader

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        """The Trainer's counts, with the pass's length as what is left of it after a resume: the Trainer
        numbers the batches of a resumed pass from 0, and uses this length to find the pass's last batch (its
        last optimizer step when gradient accumulation does not divide the run)."""
        values = list(super().set_initial_training_values(args, dataloader))
        if isinstance(dataloader, TrainerLoader):
            values[5] = len(dataloader) - dataloader.position  # steps_in_epoch
        return tuple(values)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``resume_from_checkpoint`` (a folder, or True for the last in
        ``output_dir``) the loader is restored from the checkpoint's state first."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise StreamBatchError(f"no checkpoint to resume from in {self.args.output_dir}")
        if resume_from_checkpoint:
            self.train_loader.load_state_dict(read_loader_state(str(resume_from_checkpoint), self.args.process_index))
        return super().train(resume_from_checkpoint or None, *args, **kwargs)


def write_loader_state(folder: str, rank: int, state: dict[str, Any]) -> str:
    """Write ``state`` as this rank's loader state in a checkpoint ``folder`` (a whole file or none); its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    return path


def read_loader_state(folder: str, rank: int) -> dict[str, Any]:
    """This rank's loader state from a checkpoint ``folder``; a clear error when it has none (a checkpoint of
    a plain ``Trainer``, or of fewer ranks)."""
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise StreamBatchError(
            f"{folder} holds no loader state for rank {rank} ({os.path.basename(path)}): resume from a checkpoint "
            "a StreamBatchTrainer saved on as many ranks"
        ) from None
    except (OSError, ValueError) as e:
        raise StreamBatchError(f"{path}: unreadable loader state ({e})") from None
    if not isinstance(state, dict):
        raise StreamBatchError(f"{path}: a loader state is a JSON object, got {type(state).__name__}")
    return state
