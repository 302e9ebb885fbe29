"""A hand-written accelerate training loop (no Trainer, no TorchPass): it trains under ``torchrun --nproc-per-node 2``;
transparent mode refuses it at start, with the reason and the alternative (tests/unit/test_torchpass_hf_trainer.py)."""

import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> int:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 4)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return 0


if __name__ == "__main__":
    sys.exit(main())
