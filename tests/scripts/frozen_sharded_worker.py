"""One rank of a 2-rank FSDP2 run (gloo, CPU) of a Llama with a frozen embedding, started by
tests/test_frozen_sharded.py.

Usage: ``python frozen_sharded_worker.py MODE ROOT`` with the torchrun environment set.

* ``save``: the tiny Llama (odd vocabulary: the frozen embedding splits 64 + 63 rows) with
  ``embed_tokens`` frozen, FSDP2, AdamW; 2 steps, ``save_checkpoint`` to ROOT/checkpoint-2 (the
  embedding recorded, not stored) and ROOT/standalone-2 (``standalone=True``); rank 0 writes the
  consolidated reference; then one more step of this uninterrupted run (ROOT/after-3.safetensors).
* ``resume``: fresh processes build the same base, overwrite every trainable weight, load ROOT/checkpoint-2,
  train one step and compare with ROOT/after-3.safetensors (``result-resume.json``); load ROOT/plain-2 (saved by
  one process: its one whole-tensor piece is held by no rank whole) and compare with the reference; then a base
  whose frozen embedding differs in one element must raise ``BaseMismatchError`` on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import init_device_mesh  # noqa: E402

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_resumable.data.elastic import ElasticSampler  # noqa: E402
from hf_resumable.errors import BaseMismatchError  # noqa: E402
from hf_resumable.format.safetensors_io import read_safetensors, write_safetensors  # noqa: E402

from helpers import sharded_fixtures as fx  # noqa: E402

AFTER = "after-3.safetensors"


def build(*, trainable_seed: int = 0, embedding_delta: float = 0.0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The base (tiny Llama, seed 0) with its embedding frozen; trainable weights re-drawn from ``trainable_seed``."""
    model, _ = fx.build("llama")
    embedding = model.model.embed_tokens.weight
    embedding.requires_grad_(False)
    with torch.no_grad():
        embedding[5, 3] += embedding_delta
        if trainable_seed:
            generator = torch.Generator().manual_seed(trainable_seed)
            for param in model.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sampler(rank: int, world_size: int) -> ElasticSampler:
    return ElasticSampler(fx.DATASET_LEN, seed=fx.SEED, rank=rank, world_size=world_size, batch_size=fx.BATCH_SIZE)


def save(root: Path, rank: int, world_size: int) -> None:
    model, _ = build()
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = sampler(rank, world_size)
    fx.train(model, optimizer, data, steps=2)
    save_checkpoint(root / "checkpoint-2", model=model, optimizer=optimizer, step=2,
                                   training_state={"sampler": data.state_dict()}, layout="pieces")
    save_checkpoint(root / "standalone-2", model=model, optimizer=optimizer, step=2, standalone=True,
                    training_state={"sampler": data.state_dict()}, rng=False, layout="pieces")
    fx.write_reference(root, model, optimizer, is_main=rank == 0)
    fx.train(model, optimizer, data, steps=1)  # nothing drew random numbers since the save: its RNG is current
    after, _ = fx.full_state(model, optimizer)
    if rank == 0:
        write_safetensors(root / AFTER, sorted(after.items()), fsync=False)


def resume(root: Path, rank: int, world_size: int) -> None:
    result: dict[str, object] = {}
    model, _ = build(trainable_seed=99)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    loaded = load_checkpoint(root / "checkpoint-2", model=model, optimizer=optimizer)
    result["problems"] = fx.compare_to_reference(root, model, optimizer)
    data = sampler(rank, world_size)
    data.load_state_dict(loaded.training_state["sampler"])
    fx.train(model, optimizer, data, steps=1)
    got, _ = fx.full_state(model, optimizer)
    expected = read_safetensors(root / AFTER) if rank == 0 else {}
    result["continued"] = sorted(k for k in expected if k not in got or not torch.equal(expected[k], got[k]))

    plain, _ = build(trainable_seed=98)
    shard(plain)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.5)
    load_checkpoint(root / "plain-2", model=plain, optimizer=plain_optimizer, allow_inexact_resume=True,
                    verify="full")
    result["plain_problems"] = fx.compare_to_reference(root, plain, plain_optimizer)

    other, _ = build(trainable_seed=97, embedding_delta=1.0)
    shard(other)
    try:
        load_checkpoint(root / "checkpoint-2", model=other)
        result["mismatch"] = None
    except BaseMismatchError as err:
        result["mismatch"] = str(err)
    (root / f"result-resume-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        {"save": save, "resume": resume}[mode](root, rank, dist.get_world_size())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
