"""One rank of a 2-rank gloo group resuming a DDP replica (see tests/test_shared_read.py).

Usage: ``shared_read_worker.py MODE ROOT`` with the torchrun environment set; ``HF_RESUMABLE_SHARED_READS`` chooses the
reads (``always``: split and exchanged; ``1``: the default; ``0``: every rank reads every file).

* ``save``: save the same model and optimizer (files above the quick-hash limit) as ``ROOT/checkpoint-1``.
* ``load``: drop the checkpoint's pages from the page cache, load it into a fresh model and optimizer, and record
  the bytes this rank read from storage (``/proc/self/io`` read_bytes), whether the ranks exchanged the files over
  gloo, whether the state is bitwise the saved one, or the error it raised (``result-rank{R}.json``).
* ``load-unhinted``: as ``load``, without torchrun's ``LOCAL_WORLD_SIZE`` (a launcher that does not say which ranks
  share this machine: the ranks find out from the checkpoint's page cache identity).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def drop_from_page_cache(directory: Path) -> None:
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def same_state(model, optimizer, reference_model, reference_optimizer) -> bool:
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference_model.state_dict().values()))
    for param, reference in zip(model.parameters(), reference_model.parameters()):
        got, want = optimizer.state[param], reference_optimizer.state[reference]
        same = same and got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)
    return same


def count_exchanges() -> list:
    """Record every exchange over gloo that a shared load starts (one entry each)."""
    import hf_resumable.checkpoint._shared_read as shared_read

    started: list = []
    original = shared_read._Exchange

    class Counted(original):
        def __init__(self, *args, **kwargs) -> None:
            started.append(True)
            super().__init__(*args, **kwargs)

    shared_read._Exchange = Counted
    return started


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # a loaded machine is only slower
    rank = dist.get_rank()
    checkpoint = Path(root) / "checkpoint-1"
    if mode == "load-unhinted":
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    if mode == "save":
        model, optimizer = build(0)
        save_checkpoint(checkpoint, model=model, optimizer=optimizer, step=1, max_shard_size="5MB", rng=False)
    else:
        model, optimizer = build(1)  # other weights and state: the load must replace all of them
        if rank == 0:
            drop_from_page_cache(checkpoint)
        dist.barrier()
        exchanges = count_exchanges()
        before = read_bytes()
        result: dict = {}
        try:
            load_checkpoint(checkpoint, model=model, optimizer=optimizer, restore_rng=False,
                            allow_inexact_resume=True)
            result["same"] = same_state(model, optimizer, *build(0))
        except Exception as err:  # noqa: BLE001 - recorded for the test
            result["error"] = type(err).__name__
        result["read_bytes"] = read_bytes() - before
        result["exchanged"] = bool(exchanges)
        (Path(root) / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
