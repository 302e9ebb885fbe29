"""An ordinary Hugging Face Trainer script (no TorchPass): a tiny GPT-2 built from a config (nothing downloaded),
``TrainingArguments(use_cpu=True, ddp_backend="gloo")``. It trains under ``torchrun --nproc-per-node 2``;
transparent mode refuses it at start (tests/unit/test_torchpass_lightning.py)."""

import os
import sys

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=os.path.join(os.environ.get("CW_TEST_DIR", "."), "hf-out"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=8,
        num_train_epochs=1,
        save_strategy="no",
        report_to=[],
    )
    Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
