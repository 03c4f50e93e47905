"""One rank of a 2-rank FSDP2 run on gloo (CPU), started by tests/test_sharded.py.

Usage: ``python sharded_worker.py MODE ROOT MODEL [STEP]`` with the torchrun environment set.

* ``save``: FSDP2 model + AdamW, 2 training steps on ElasticSampler batches, ``save_checkpoint``
  to ROOT/checkpoint-2 with the sampler position (and to ROOT/hf-2 with ``layout="hf"``); rank 0
  writes the consolidated reference and each
  rank the indices it trained on (``seen-rank{r}.json``); then loads it back into a fresh FSDP2 model at
  the same world size, compares, and trains one more step on both the resumed and the uninterrupted
  model (``result-same-world.json``).
* ``crash``: as ``save`` to ROOT/checkpoint-STEP, but rank 1 SIGKILLs itself while writing its model pieces.
* ``load``: fresh FSDP2 model (other weights) + AdamW, ``load_checkpoint`` of ROOT/checkpoint-2
  (saved at another world size) and of ROOT/regular-2 (a regular checkpoint), compare the consolidated
  state with ROOT's reference (``result.json`` from rank 0), then iterate the rest of the epoch
  (``rest-rank{r}.json``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import init_device_mesh  # noqa: E402

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_resumable.data.elastic import ElasticSampler  # noqa: E402
from hf_resumable.format.rng import restore_rng_state  # noqa: E402

from helpers import sharded_fixtures as fx  # noqa: E402


def shard(model: torch.nn.Module) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def sampler(rank: int, world_size: int) -> ElasticSampler:
    return ElasticSampler(fx.DATASET_LEN, seed=fx.SEED, rank=rank, world_size=world_size, batch_size=fx.BATCH_SIZE)


def kill_inside_piece_write(rank: int) -> None:
    """Make rank 1 die by SIGKILL in the middle of writing its model pieces (other ranks carry on)."""
    from hf_resumable.checkpoint.commit import _writer

    original = _writer.write_safetensors

    def write_then_die(path, tensors, **kwargs):
        if rank == 1 and "model-rank00001" in str(path):
            Path(path).write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, tensors, **kwargs)

    _writer.write_safetensors = write_then_die


def crash(root: Path, kind: str, rank: int, world_size: int, step: int) -> None:
    kill_inside_piece_write(rank)
    model, _ = fx.build(kind)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step, layout="pieces")


def save(root: Path, kind: str, rank: int, world_size: int, step: int) -> None:
    model, _ = fx.build(kind)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = sampler(rank, world_size)
    seen = fx.train(model, optimizer, data, steps=2)
    save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                    training_state={"sampler": data.state_dict()}, layout="pieces")
    # The same state with whole HF weight shards (several files, so both ranks write some).
    save_checkpoint(root / f"hf-{step}", model=model, optimizer=optimizer, step=step, layout="hf",
                    max_shard_size=40_000)
    # ... and in one file (model.safetensors, as save_pretrained), which rank 0 alone writes.
    save_checkpoint(root / f"hf-single-{step}", model=model, step=step, layout="hf")
    fx.write_reference(root, model, optimizer, is_main=rank == 0)
    (root / f"seen-rank{rank}.json").write_text(json.dumps(seen))
    # Same world size: exact resume, RNG included (no allow_inexact_resume needed) ...
    fresh, _ = fx.build(kind, seed=99)
    shard(fresh)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    loaded = load_checkpoint(root / f"checkpoint-{step}", model=fresh, optimizer=fresh_optimizer)
    problems = fx.compare_to_reference(root, fresh, fresh_optimizer)
    # ... and one more step (dropout on) of the resumed run equals that step of the uninterrupted run, bitwise.
    resumed = sampler(rank, world_size)
    resumed.load_state_dict(loaded.training_state["sampler"])
    fx.train(fresh, fresh_optimizer, resumed, steps=1)
    after_resume, _ = fx.full_state(fresh, fresh_optimizer)
    restore_rng_state(loaded.rng_state)  # the uninterrupted run's RNG where it stood at the save
    fx.train(model, optimizer, data, steps=1)
    uninterrupted, _ = fx.full_state(model, optimizer)
    if rank == 0:
        continued = [k for k in uninterrupted if not torch.equal(uninterrupted[k], after_resume[k])]
        (root / "result-same-world.json").write_text(json.dumps({"problems": problems, "continued": continued}))


def load(root: Path, kind: str, rank: int, world_size: int, step: int) -> None:
    model, _ = fx.build(kind, seed=99)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    loaded = load_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer,
                             allow_inexact_resume=True)
    problems = fx.compare_to_reference(root, model, optimizer)
    # A regular single-writer checkpoint reshards the same way (each tensor one whole piece).
    regular, _ = fx.build(kind, seed=98)
    shard(regular)
    regular_optimizer = torch.optim.AdamW(regular.parameters(), lr=0.5)
    load_checkpoint(root / f"regular-{step}", model=regular, optimizer=regular_optimizer,
                    allow_inexact_resume=True)
    regular_problems = fx.compare_to_reference(root, regular, regular_optimizer)
    if rank == 0:
        (root / "result.json").write_text(json.dumps({"problems": problems, "regular_problems": regular_problems,
                                                      "step": loaded.step}))
    data = sampler(rank, world_size)
    data.load_state_dict(loaded.training_state["sampler"])
    (root / f"rest-rank{rank}.json").write_text(json.dumps([i for batch in data for i in batch]))


def main() -> None:
    mode, root, kind = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    step = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        {"save": save, "load": load, "crash": crash}[mode](root, kind, rank, dist.get_world_size(), step)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
