"""One rank of a 2-rank gloo group saving a DDP-style replica (see tests/test_replicas.py).

Usage: ``replica_worker.py MODE ROOT`` with the torchrun environment set; ``HF_RESUMABLE_SPLIT_REPLICAS=0`` selects the
single-writer plan.

* ``blocking`` / ``async``: save the same model and optimizer (several shards each) as ``ROOT/checkpoint-1``, and
  record which safetensors files this rank wrote (``written-rank{R}.json``).
* ``fail``: as ``blocking``, but rank 1 fails with ENOSPC writing a replicated file; every rank records the error
  it raised (``error-rank{R}.json``).
"""

from __future__ import annotations

import datetime
import errno
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import hf_resumable.checkpoint.commit._writer as writer
from hf_resumable.checkpoint import save_checkpoint, wait_for_pending_saves


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer (with state) on every rank and in every run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48),
                                torch.nn.Linear(48, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def record_writes(rank: int, *, fail: bool) -> list[str]:
    """Log the relative path of every tensor file the writer writes on this rank (``fail``: rank 1 fails)."""
    written: list[str] = []
    original = writer.write_safetensors

    def write(path, tensors, **kwargs):
        parts = Path(path).parts
        relpath = "/".join(parts[next(i for i, part in enumerate(parts) if part.startswith(".tmp-")) + 1:])
        written.append(relpath)
        if fail and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        return original(path, tensors, **kwargs)

    writer.write_safetensors = write
    return written


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # a loaded machine is only slower
    rank = dist.get_rank()
    root_path = Path(root)
    model, optimizer = build()
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(100 + rank)
    written = record_writes(rank, fail=mode == "fail")
    try:
        save_checkpoint(root_path / "checkpoint-1", model=model, optimizer=optimizer, step=1,
                        training_state={"global_step": 1}, data_state={"rank": rank}, max_shard_size=4000,
                        blocking=mode != "async")
        wait_for_pending_saves()
    except Exception as err:  # noqa: BLE001 - recorded for the test
        (root_path / f"error-rank{rank}.json").write_text(json.dumps({"type": type(err).__name__,
                                                                    "errno": getattr(err, "errno", None)}))
    (root_path / f"written-rank{rank}.json").write_text(json.dumps(sorted(written)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
