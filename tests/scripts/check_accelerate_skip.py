"""A stock accelerate loop (plain ``DataLoader``, ``load_state`` then the script's own resume skip) on
ResumableAccelerator, for tests/test_check.py.

    python tests/scripts/check_accelerate_skip.py --output-dir OUT --skip {once,every-epoch,by-hand}

Rerunning the same command resumes from the newest checkpoint under OUT; the script computes ``resume_step`` (the
batches of the resumed epoch already trained) from the restored step, as accelerate's examples do from the folder
name, and skips them the way scripts written for stock accelerate do:

- ``once``: ``skip_first_batches(loader, resume_step)`` in the epoch it resumed in (accelerate's example): exact;
- ``every-epoch``: the same call in every epoch after the resume: the later calls skip nothing (a WARNING), exact;
- ``by-hand``: ``if step < resume_step: continue``: refused at the first backward (``DoubleSkipError``).
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

from hf_resumable.integrations.accelerate import ResumableAccelerator

EPOCHS = 2
SAVE_EVERY = 3  # optimizer steps; an epoch has 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--skip", choices=["once", "every-epoch", "by-hand"], default="once")
    args = parser.parse_args()

    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=f"{args.output_dir}/checkpoints", keep_last=None)
    torch.manual_seed(0)
    data = torch.randn(32, 4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4, shuffle=True))

    resume_step, starting_epoch = None, 0
    if accelerator.load_state() is not None:
        starting_epoch, resume_step = divmod(accelerator.global_step, len(loader))
    for epoch in range(starting_epoch, EPOCHS):
        skip = resume_step if args.skip == "every-epoch" or epoch == starting_epoch else None
        active = accelerator.skip_first_batches(loader, skip) if args.skip != "by-hand" and skip else loader
        for step, batch in enumerate(active):
            if args.skip == "by-hand" and skip and step < skip:
                continue
            loss = model(batch).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.global_step % SAVE_EVERY == 0:
                accelerator.save_state()


if __name__ == "__main__":
    main()
