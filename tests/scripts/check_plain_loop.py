"""A plain loop over the script's own ``torch.utils.data.DataLoader``, for tests/test_check.py.

    python tests/scripts/check_plain_loop.py --output-dir OUT [--transform unseeded] [--running-average]

The loop saves and loads with save_checkpoint/load_checkpoint, keeps its own data position (epoch, batches
consumed) in ``training_state``, shuffles with a generator seeded per epoch, starts each epoch's DataLoader after
the consumed samples (without loading them) and prints each step's loss. Rerunning the same command resumes from
the newest checkpoint under OUT. By default it is exact. Two flags break it the way user scripts break, outside
what the library saves:

- ``--transform unseeded``: the data set adds noise from a module-level ``numpy.random.default_rng(0)``, which
  restarts from its seed after a restart: the DataLoader's batches differ;
- ``--running-average``: the printed loss is a running average kept in a local variable, which restarts from zero
  after a restart: only the printed number differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from hf_resumable import find_latest_checkpoint, load_checkpoint, save_checkpoint

NOISE = np.random.default_rng(0)  # module-level: not in any checkpoint
SAVE_EVERY = 3
BATCH = 5


class Points(torch.utils.data.Dataset):
    def __init__(self, transform: str) -> None:
        self.x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        if self.transform == "unseeded":
            x = x + torch.from_numpy(NOISE.normal(size=8)).float() * 0.1
        return x, x.sum(dim=0, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--transform", choices=["none", "unseeded"], default="none")
    parser.add_argument("--running-average", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    checkpoints = Path(args.output_dir) / "checkpoints"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    data, order = Points(args.transform), torch.Generator()

    epoch, consumed, step, total, count = 0, 0, 0, 0.0, 0
    latest = find_latest_checkpoint(checkpoints)
    if latest is not None:
        state = load_checkpoint(latest, model=model, optimizer=optimizer)
        epoch, consumed, step = state.training_state["epoch"], state.training_state["consumed"], state.step
        print(f"resumed from step {step}")
    while epoch < args.epochs:
        indices = torch.randperm(len(data), generator=order.manual_seed(epoch))[consumed * BATCH:].tolist()
        # a generator of its own: without one, each iter() would draw a seed from the global generator
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data, indices), batch_size=BATCH,
                                             generator=torch.Generator())
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            consumed, step = consumed + 1, step + 1
            total, count = total + loss.item(), count + 1
            shown = total / count if args.running_average else loss.item()
            print(f"step {step} loss {shown:.6f}")
            if step % SAVE_EVERY == 0:
                save_checkpoint(checkpoints / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                                training_state={"epoch": epoch, "consumed": consumed}, keep_last=2)
        epoch, consumed = epoch + 1, 0


if __name__ == "__main__":
    main()
