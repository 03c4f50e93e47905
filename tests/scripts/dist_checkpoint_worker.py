"""One rank of a gloo process group that saves or loads an hf_resumable checkpoint (see test_distributed_checkpoint).

Usage: ``dist_checkpoint_worker.py MODE ROOT STEP`` with the torchrun environment set.

* ``save``: give this rank its own RNG and data position, save ``ROOT/checkpoint-STEP`` on every rank,
  then record the random numbers the RNG yields next (``expected-step{STEP}-rank{R}.json``).
* ``crash``: as ``save``, but rank 1 SIGKILLs itself while writing its RNG file inside the save.
* ``resume``: load the latest valid checkpoint under ROOT, record what this rank got back
  (``loaded-rank{R}.json``), then save ``ROOT/checkpoint-STEP`` (the restart keeps training).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import hf_resumable.checkpoint.commit._writer as writer
from hf_resumable.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint


def build(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer on every rank; weights depend on ``step``."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def seed_this_rank(rank: int, step: int) -> None:
    """Different generator states on every rank (and at every step)."""
    random.seed(1000 * step + rank)
    np.random.seed(2000 * step + rank)
    torch.manual_seed(3000 * step + rank)
    torch.rand(rank + 1)  # advance by a rank-dependent amount: states are not just fresh seeds


def data_state_of(rank: int, step: int) -> dict:
    return {"kind": "map", "epoch": step, "step": 10 * step + rank, "rank": rank, "order": [rank, step, 7]}


def draws() -> dict:
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(4).tolist()}


def save(root: Path, step: int, rank: int) -> None:
    model, optimizer = build(step)
    seed_this_rank(rank, step)
    save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                    training_state={"global_step": step}, data_state=data_state_of(rank, step))
    (root / f"expected-step{step}-rank{rank}.json").write_text(json.dumps({**draws(),
                                                                          "data_state": data_state_of(rank, step)}))


def kill_rank_1_inside_save(rank: int) -> None:
    if rank != 1:
        return
    original = writer.save_rng_state

    def die(path, state=None, **kwargs):  # the RNG file is the last thing a rank writes before the gather
        with open(path, "wb") as handle:
            handle.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
        return original(path, state, **kwargs)

    writer.save_rng_state = die


def resume(root: Path, step: int, rank: int) -> None:
    latest = find_latest_checkpoint(root, cleanup=rank == 0)
    model, optimizer = build(0)
    loaded = load_checkpoint(latest, model=model, optimizer=optimizer)
    drawn = draws()  # before anything else touches the generators
    reference, _ = build(loaded.step)
    same_weights = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                        reference.state_dict().values()))
    record = {**drawn, "data_state": loaded.data_state, "step": loaded.step, "path": str(latest),
              "same_weights": same_weights}
    (root / f"loaded-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    save(root, step, rank)


def main(mode: str, root: str, step: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # a loaded machine is only slower
    rank = dist.get_rank()
    if mode == "crash":
        kill_rank_1_inside_save(rank)
    if mode in ("save", "crash"):
        save(Path(root), int(step), rank)
    elif mode == "resume":
        resume(Path(root), int(step), rank)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
