#!/usr/bin/env python3
"""The rank script of ``bench/migration.py``: the same training in model-aware and in model-transparent form.

* ``aware``: the TorchPass API (``tp.init``, ``wrap_model``, ``wrap_optimizer``, ``ctx.steps`` over a
  ``StepLoader``), run by ``torchpass run --local``;
* ``transparent``: an unmodified DDP script (``init_process_group``, ``DistributedDataParallel``, AdamW, a
  DataLoader over a ``DistributedSampler``), run by ``torchpass run --local --transparent``;
* ``lightning``: an unmodified PyTorch Lightning script (a ``LightningModule``, ``Trainer(strategy="ddp")``, a
  DataLoader without a sampler), run by ``torchpass run --local --transparent``;
* ``hf_trainer``: an unmodified Hugging Face ``Trainer`` script (``TrainingArguments(use_cpu=True,
  ddp_backend="gloo")``, the MLP behind a module that returns the loss), run the same way.

Both train the same MLP (``--layers`` x ``--hidden``, AdamW) on the same synthetic dataset (``--samples`` rows),
so the state a migration moves is the same size (transparent mode adds its data position: three integers). An
epoch is ``--samples`` / (``--batch`` x ranks) steps and training runs whole epochs, so ``--samples``, not
``--steps`` alone, bounds how long a job trains after its migration (``--quick`` of the benchmark: a small
one). Slot 0 writes ``at-step`` under ``--out`` when it starts step ``--mark-step``, so the benchmark knows
training is under way; every step sleeps ``--step-sleep`` seconds so the migration lands mid-run. With
``--kill`` slot 1 SIGKILLs itself at that step instead (once: a marker file keeps its replacement alive), for a
crash recovery's figures. One intra-op thread.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

SAMPLES = 4096  # the default dataset: 128 steps an epoch with 2 ranks of batch 16
FEATURES = 64


def _model(layers: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    parts: list[nn.Module] = [nn.Linear(FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        parts += [nn.Linear(hidden, hidden), nn.ReLU()]
    parts.append(nn.Linear(hidden, 1))
    return nn.Sequential(*parts)


def _dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def _mark(args: argparse.Namespace, slot: int, step: int) -> None:
    if slot == 0 and step == args.mark_step:
        (Path(args.out) / "at-step").write_text(str(time.time()))
    if args.kill and slot == 1 and step == args.mark_step:
        try:
            os.close(os.open(Path(args.out) / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass  # the replacement, at the same step
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    if args.step_sleep:
        time.sleep(args.step_sleep)


def aware(args: argparse.Namespace) -> None:
    import torchpass as tp

    ctx = tp.init()
    model = _model(args.layers, args.hidden)
    ddp = ctx.wrap_model(model)
    opt = ctx.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = tp.StepLoader(_dataset(args.samples), batch_size=args.batch, seed=1)
    per_epoch = loader.steps_per_epoch(ctx.world_size)
    total = -(-args.steps // per_epoch) * per_epoch  # whole epochs, as the transparent form trains
    for step, (x, y) in ctx.steps(loader, total):
        _mark(args, ctx.slot, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def transparent(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    model = _model(args.layers, args.hidden)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    dataset = _dataset(args.samples)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, seed=1, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    step = 0
    epochs = -(-args.steps // len(loader))
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            _mark(args, rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1  # only for the marker (a local: a newcomer's restarts, see the user guide)
    dist.destroy_process_group()


def lightning(args: argparse.Namespace) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(args.layers, args.hidden)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            _mark(args, self.global_rank, self.global_step)  # Lightning's counter: right on a newcomer too
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = DataLoader(_dataset(args.samples), batch_size=args.batch, shuffle=True, drop_last=True)
    world = int(os.environ["WORLD_SIZE"])
    per_epoch = len(loader) // world
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy="ddp",
        max_epochs=-(-args.steps // per_epoch),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), loader)


def hf_trainer(args: argparse.Namespace) -> None:
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Regression(nn.Module):  # the Trainer wants the loss from the model
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(args.layers, args.hidden)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    class Rows(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.x, self.y = _dataset(args.samples).tensors

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.y[i]}

    class Mark(TrainerCallback):
        def on_step_begin(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _mark(args, int(os.environ["RANK"]), state.global_step)  # the Trainer's counter: right on a newcomer

    world = int(os.environ["WORLD_SIZE"])
    per_epoch = len(Rows()) // (args.batch * world)
    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "hf-out"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=args.batch,
        num_train_epochs=-(-args.steps // per_epoch),
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    Trainer(model=Regression(), args=targs, train_dataset=Rows(), callbacks=[Mark()]).train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("aware", "transparent", "lightning", "hf_trainer"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=64, help="steps, rounded up to whole epochs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=SAMPLES, help="rows of the synthetic dataset (one epoch)")
    parser.add_argument("--mark-step", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--kill", action="store_true", help="slot 1 SIGKILLs itself at --mark-step (once)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    {"aware": aware, "transparent": transparent, "lightning": lightning, "hf_trainer": hf_trainer}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
