"""A DDP training loop (gloo, CPU) that resumes by itself: run under ``torchrun --max-restarts=N``.

Usage: ``ddp_restart_loop.py OUT [--kill-at STEP] [--kill-in step|save] [--kill-rank R] [--async]``

Every start resumes from ``find_latest_checkpoint(OUT/ckpt)`` (weights, AdamW, per-rank RNG, the sampler's
global cursor) and trains to 8 optimizer steps with dropout, saving ``checkpoint-<step>`` every 2 steps
(``keep_last=2``). On the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``), rank ``--kill-rank``
SIGKILLs itself at step ``--kill-at``: inside the step (after backward, before the optimizer step) or inside
the save (while its files are being written). torchrun then restarts the whole group.

Rank 0 appends each step's loss to ``OUT/losses.jsonl`` (with the attempt) and, at the end, writes the final
weights' sha256 to ``OUT/final.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hf_resumable.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint, wait_for_pending_saves
from hf_resumable.checkpoint.commit import _writer
from hf_resumable.data.elastic import ElasticSampler
from hf_resumable.distributed import all_gather_json

STEPS, SAVE_EVERY, DATASET, BATCH = 8, 2, 48, 4


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-2)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-in", choices=["step", "save"], default="step")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--async", dest="blocking", action="store_false")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after every step")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # a loaded machine is only slower
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    killing = attempt == 0 and rank == args.kill_rank and args.kill_at > 0
    torch.set_num_threads(1)
    torch.manual_seed(1000 + rank)  # per-rank dropout streams
    inputs = torch.randn(DATASET, 6, generator=torch.Generator().manual_seed(7))
    targets = inputs.sum(dim=1, keepdim=True).sin()
    model, optimizer = build()
    sampler = ElasticSampler(DATASET, seed=3, rank=rank, world_size=world, batch_size=BATCH)
    root = args.out / "ckpt"
    step = 0
    latest = find_latest_checkpoint(root) if rank == 0 else None
    gathered = [str(latest) if latest else None]
    dist.broadcast_object_list(gathered)  # test script only; the library never pickles
    if gathered[0] is not None:
        loaded = load_checkpoint(gathered[0], model=model, optimizer=optimizer)
        step = loaded.training_state["step"]
        sampler.load_state_dict(loaded.training_state["sampler"])
    ddp = DistributedDataParallel(model)
    if killing and args.kill_in == "save":
        original = _writer.write_safetensors

        def write_then_die(path, tensors, **kwargs):
            if f"checkpoint-{args.kill_at}" in str(path):
                Path(path).write_bytes(b"partial")
                die()
            return original(path, tensors, **kwargs)

        original_rng = _writer.save_rng_state

        def rng_then_die(path, state, **kwargs):
            if f"checkpoint-{args.kill_at}" in str(path):
                die()
            return original_rng(path, state, **kwargs)

        _writer.write_safetensors = write_then_die
        _writer.save_rng_state = rng_then_die
    batches = iter(sampler)
    while step < STEPS:
        try:
            batch = next(batches)
        except StopIteration:  # next epoch (the order of epoch e depends only on the seed and e)
            sampler.set_epoch(sampler.state_dict()["epoch"] + 1)
            batches = iter(sampler)
            batch = next(batches)
        loss = torch.nn.functional.mse_loss(ddp(inputs[batch]), targets[batch])
        loss.backward()
        if killing and args.kill_in == "step" and step + 1 == args.kill_at:
            die()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        time.sleep(args.step_delay)
        losses = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        if rank == 0:
            with open(args.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "attempt": attempt, "loss": [x.item() for x in losses]}) + "\n")
        if step % SAVE_EVERY == 0:
            save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                            training_state={"step": step, "sampler": sampler.state_dict()}, keep_last=2,
                            blocking=args.blocking)
    wait_for_pending_saves()
    # Restarts are counted per agent: take the most restarted. all_gather_json, not a bare all_reduce: the process
    # exits right after, and gloo may still hold a bare collective's tensor then (see distributed.settle).
    attempt = max(all_gather_json(attempt))
    if rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
        (args.out / "final.json").write_text(json.dumps({"sha256": digest.hexdigest(), "attempt": attempt}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
