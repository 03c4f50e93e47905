"""A plain training loop on save_checkpoint/load_checkpoint and the library's data loader, for tests/test_check.py.

    python tests/scripts/check_loop.py --output-dir OUT [--collator global-generator] [--forget-scheduler]

Rerunning the same command resumes from the newest checkpoint under OUT. By default it is exact. Two flags break
it the way user scripts break:

- ``--collator global-generator``: the collator draws noise from a module-level ``numpy.random.default_rng(0)``,
  which the library cannot see, so after a restart it starts again from its seed;
- ``--forget-scheduler``: the scheduler is saved but not given to ``load_checkpoint``, so after a restart the
  learning-rate schedule starts over.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from hf_resumable import find_latest_checkpoint, load_checkpoint, save_checkpoint
from hf_resumable.data import build_map_dataloader

NOISE = np.random.default_rng(0)  # module-level: not reachable from the collator, so never reseeded
GA = 2
SAVE_EVERY = 4


def collate_exact(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    x = torch.stack(rows)
    return {"x": x + 0.01 * torch.randn(x.shape), "y": x.sum(dim=1, keepdim=True)}  # the global generator


def collate_global_generator(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    x = torch.stack(rows)
    noise = torch.from_numpy(NOISE.normal(size=tuple(x.shape))).float()
    return {"x": x + 0.01 * noise, "y": x.sum(dim=1, keepdim=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--collator", choices=["exact", "global-generator"], default="exact")
    parser.add_argument("--forget-scheduler", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    checkpoints = Path(args.output_dir) / "checkpoints"

    torch.manual_seed(0)
    data = list(torch.randn(48, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    collate = collate_exact if args.collator == "exact" else collate_global_generator
    loader = build_map_dataloader(data, collate_fn=collate, batch_size=4, seed=0)

    epoch, consumed, step = 0, 0, 0
    latest = find_latest_checkpoint(checkpoints)
    if latest is not None:
        state = load_checkpoint(latest, model=model, optimizer=optimizer,
                                scheduler=None if args.forget_scheduler else scheduler)
        epoch, consumed, step = state.training_state["epoch"], state.training_state["consumed"], state.step
    while epoch < args.epochs:
        loader.set_epoch(epoch)
        for batch in loader.skip(consumed) if consumed else loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            (loss / GA).backward()
            consumed += 1
            if consumed % GA and consumed < len(loader):
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % SAVE_EVERY == 0:
                save_checkpoint(checkpoints / f"checkpoint-{step}", model=model, optimizer=optimizer,
                                scheduler=scheduler, step=step, training_state={"epoch": epoch, "consumed": consumed},
                                keep_last=2)
        epoch, consumed = epoch + 1, 0


if __name__ == "__main__":
    main()
