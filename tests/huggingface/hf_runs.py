"""Training runs over StreamBatchLoader under Hugging Face accelerate and transformers.Trainer, for
tests/cluster/test_huggingface.py (real shards, a tiny local model: nothing downloaded).

Every batch a step trains on is appended to ``out`` as a JSON line (its sample keys). With ``ckpt_dir`` a
checkpoint is kept after every optimizer step (accelerate: ``step-N``, the state after N steps, through
``save_state`` with the loader registered for checkpointing; Trainer: its own ``checkpoint-N``, ``save_steps=1``).
``stop_at=S`` ends the run once step S and its checkpoint are done, as a job stopped there would end; its
objects are then dropped, and ``resume`` starts fresh ones from a checkpoint folder.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
from torch import nn

from streambatch import StreamBatchLoader


class Tiny(nn.Module):
    """An embedding and a linear layer over token ids; logs the keys of every batch it trains on."""

    def __init__(self, out: Path):
        super().__init__()
        self.out = out
        self.emb = nn.Embedding(1000, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, input_ids, padding_mask, keys, **_):
        with open(self.out, "a") as f:
            f.write(json.dumps(list(keys)) + "\n")
        h = self.head(self.emb(input_ids)).squeeze(-1)
        return {"loss": (h * padding_mask).pow(2).sum() / padding_mask.sum()}


class Steps:
    """The optimizer steps taken, saved with the accelerate state (``register_for_checkpointing``)."""

    def __init__(self):
        self.done = 0

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


def loader_of(data: str, num_workers: int = 0) -> StreamBatchLoader:
    torch.manual_seed(0)  # every run's model starts from the same weights
    return StreamBatchLoader(data, 400, seed=3, num_workers=num_workers)


def run_accelerate(
    data: str,
    out: Path,
    epochs: int = 2,
    ckpt_dir: Path | None = None,
    stop_at: int | None = None,
    resume: Path | None = None,
    num_workers: int = 0,
) -> tuple[int, dict[str, torch.Tensor]]:
    """A plain training loop prepared by ``Accelerator``; the steps done when it ends and the model's weights."""
    from accelerate import Accelerator

    loader = loader_of(data, num_workers)
    acc = Accelerator(cpu=True)
    model = Tiny(out)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, prepared = acc.prepare(model, opt, loader)
    assert prepared is loader, f"Accelerator.prepare returned {type(prepared).__name__}"
    steps = Steps()
    acc.register_for_checkpointing(loader, steps)
    if resume is not None:
        acc.load_state(str(resume))
    while loader.epoch < epochs:
        passed = iter(loader)
        for batch in passed:
            opt.zero_grad()
            acc.backward(model(**batch)["loss"])
            opt.step()
            steps.done += 1
            if ckpt_dir is not None:
                acc.save_state(str(ckpt_dir / f"step-{steps.done}"))
            if steps.done == stop_at:
                passed.close()  # the job ends here: its DataLoader workers stop
                return steps.done, weights_of(model)
    return steps.done, weights_of(model)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_trainer(
    data: str,
    out: Path,
    epochs: int = 2,
    ckpt_dir: Path | None = None,
    stop_at: int | None = None,
    resume: Path | None = None,
    accumulate: int = 1,
    num_workers: int = 0,
):
    """A ``StreamBatchTrainer`` run; its final ``TrainerState`` and the model's weights."""
    from transformers import TrainerCallback, TrainingArguments

    from streambatch.hf import StreamBatchTrainer

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True  # the Trainer saves this step's checkpoint, then ends

    args = TrainingArguments(
        output_dir=str(ckpt_dir or out.parent / "trainer-out"),
        num_train_epochs=epochs,
        gradient_accumulation_steps=accumulate,
        learning_rate=0.1,
        save_strategy="steps" if ckpt_dir else "no",
        save_steps=1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    loader = loader_of(data, num_workers)
    trainer = StreamBatchTrainer(model=Tiny(out), args=args, train_loader=loader, callbacks=[StopAt()])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    state, weights = trainer.state, weights_of(trainer.model)
    del trainer
    gc.collect()  # the stopped pass's generator closes: its DataLoader workers stop
    return state, weights
