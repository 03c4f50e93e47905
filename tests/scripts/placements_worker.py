"""One rank of a DTensor job on a 2-D (dp_shard x tp) or 1-D mesh over gloo, started by tests/test_placements.py.

Usage: ``python placements_worker.py save ROOT`` or ``python placements_worker.py load ROOT SOURCE [RESAVE]`` with
the torchrun environment set.

The model's parameters are DTensors of every placement the N-D layouts produce (built by torch's own
``distribute_tensor`` from full tensors every rank draws alike):

* ``col`` ``(_StridedShard(0, 2), Shard(0))``: FSDP2 over a colwise tensor-parallel weight;
* ``row`` ``(Shard(0), Shard(1))``: two mesh dimensions splitting two tensor dimensions;
* ``cols`` ``(Shard(1), Shard(1))``: two mesh dimensions splitting one tensor dimension, unevenly;
* ``emb`` ``(Shard(0), Replicate())``: split over dp_shard, replicated over tp (uneven rows);
* ``bias`` ``(Replicate(), Replicate())``;
* ``norm`` ``(Shard(0),)`` on the ``dp_shard`` sub-mesh, ``tpnorm`` ``(Shard(0),)`` on the ``tp`` sub-mesh: a
  tensor on one copy of a sub-mesh per coordinate of the other dimension (the RMSNorm of dp_shard x tp).

Modes:

* ``save`` (4 ranks, 2x2): two AdamW steps, ``save_checkpoint`` to ROOT/checkpoint-2, rank 0 writes the full
  tensors (``reference.safetensors``), each rank its pieces as held (``pieces-rank{r}.safetensors``); then a fresh
  model at the same layout loads it, and each rank checks its pieces bit for bit (``result-rank{r}.json``); a model
  whose ``norm`` differs between its tp copies is then refused at save (``diverged`` in the same file).
* ``load`` (any world size): the same parameters sharded ``Shard(0)`` on a 1-D mesh (or plain, on one process),
  loaded from ROOT/SOURCE and compared, gathered whole, with the reference (``load-{world}-rank{r}.json``); with
  RESAVE, saved again at this layout to ROOT/RESAVE.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_resumable.format.safetensors_io import read_safetensors, write_safetensors  # noqa: E402

SHAPES = {"col": (8, 6), "row": (6, 8), "cols": (4, 7), "emb": (7, 4), "bias": (5,), "norm": (6,), "tpnorm": (6,)}
STEPS = 2


def layout_2d(mesh):
    """``name -> (mesh, placements)`` of the 2x2 layout (see the module docstring)."""
    return {"col": (mesh, (_StridedShard(0, split_factor=2), Shard(0))), "row": (mesh, (Shard(0), Shard(1))),
            "cols": (mesh, (Shard(1), Shard(1))), "emb": (mesh, (Shard(0), Replicate())),
            "bias": (mesh, (Replicate(), Replicate())), "norm": (mesh["dp_shard"], (Shard(0),)),
            "tpnorm": (mesh["tp"], (Shard(0),))}


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def build(layout, *, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Module()
    for name, full in full_tensors(seed).items():
        value = full if layout is None else distribute_tensor(full, *layout[name])
        model.register_parameter(name, torch.nn.Parameter(value))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout) -> None:
    for step in range(STEPS):
        grads = full_tensors(100 + step)
        for name, param in model.named_parameters():
            param.grad = grads[name] if layout is None else distribute_tensor(grads[name], *layout[name])
        optimizer.step()
        optimizer.zero_grad()


def whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, view) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor, through ``view`` (``whole`` or ``local``); collective for ``whole``."""
    tensors = {f"weight/{name}": view(param.detach()) for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            tensors[f"state/{name}/{key}"] = view(value) if value.dim() else value
    return tensors


def differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in expected if name not in got or not torch.equal(got[name], expected[name])]


def save(root: Path, rank: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    layout = layout_2d(mesh)
    model, optimizer = build(layout, seed=0)
    train(model, optimizer, layout)
    reference = state(model, optimizer, whole)
    if rank == 0:
        write_safetensors(root / "reference.safetensors", sorted(reference.items()))
    pieces = state(model, optimizer, local)
    write_safetensors(root / f"pieces-rank{rank}.safetensors", sorted(pieces.items()))
    save_checkpoint(root / "checkpoint-2", model=model, optimizer=optimizer, step=STEPS, layout="pieces")
    fresh, fresh_optimizer = build(layout, seed=7)
    load_checkpoint(root / "checkpoint-2", model=fresh, optimizer=fresh_optimizer)
    result = {"problems": differences(state(fresh, fresh_optimizer, local), pieces), "diverged": diverged(root, mesh)}
    (root / f"result-rank{rank}.json").write_text(json.dumps(result))


def diverged(root: Path, mesh) -> str | None:
    """Save a model whose ``norm`` (on the dp_shard sub-mesh) differs between its two tp copies: the error each rank
    raised, as ``type: message`` (``None`` if the save went through). Rank 0 finds it; the others learn of it from
    rank 0's failed commit."""
    layout = layout_2d(mesh)
    model, optimizer = build(layout, seed=0)
    if mesh["tp"].get_local_rank() == 1:
        with torch.no_grad():
            model.norm.to_local().add_(1.0)
    try:
        save_checkpoint(root / "diverged-0", model=model, optimizer=optimizer, step=0, layout="pieces")
    except Exception as err:  # noqa: BLE001 - recorded, the test names what it expects on each rank
        return f"{type(err).__name__}: {err}"
    return None


def load(root: Path, rank: int, world_size: int, source: str, resave: str | None) -> None:
    layout = None
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        layout = {name: (mesh, (Shard(0),)) for name in SHAPES}
    model, optimizer = build(layout, seed=7)
    train(model, optimizer, layout)  # optimizer state to load into (other values)
    # per-rank RNG streams do not carry over to another world size; the tensors do, exactly
    load_checkpoint(root / source, model=model, optimizer=optimizer, restore_rng=False)
    reference = dict(read_safetensors(root / "reference.safetensors"))
    result = {"problems": differences(state(model, optimizer, whole), reference)}
    if resave:
        save_checkpoint(root / resave, model=model, optimizer=optimizer, step=STEPS, layout="pieces")
    (root / f"load-{world_size}-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        dist.init_process_group("gloo")
    try:
        if mode == "save":
            save(root, rank)
        else:
            load(root, rank, world_size, sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
