"""One rank of a 2-rank gloo run that saves in the background while it trains (tests/test_distributed_async.py).

Usage: ``dist_async_worker.py MODE ROOT`` with the torchrun environment set.

Every mode trains the same data-parallel loop for 6 steps (gradients all-reduced on the default group after
every backward, so training collectives run while background saves are in flight) and saves at steps 2, 4
and 6 with ``save_checkpoint`` (``layout="pieces"`` on an FSDP2 model).

* ``blocking`` / ``async``: saves with ``blocking=True`` / ``blocking=False``; writes ``result-rank{R}.json``
  (losses, final weight digest, the stall of each save call). The background copies of the saves at steps 2 and 4
  start only once the next optimizer step has begun (``tests/helpers/staging_probe.py``), which must wait for them
  (``blocked``: the steps that did).
* ``sharded-blocking`` / ``sharded-async``: the same on an FSDP2 (``fully_shard``) model, whose optimizer gets the
  last layer as a new param group after the first save (the structure changes between two saves). Every checkpoint
  is loaded into a fresh model and optimizer at the end and compared with torch's own full state dicts taken at the
  save (``reloaded``).
* ``sharded-frozen-blocking`` / ``sharded-frozen-async``: the same with the first layer frozen (recorded in
  ``frozen_base.json``, not stored).
* ``fail``: async; rank 1's background write of the step-4 save fails with ENOSPC. Every rank records the
  error it got at the next wait (``error-rank{R}.json``).
* ``kill``: async; rank 1 is SIGKILLed inside its background write of the step-4 save.
* ``sharded-fail``: sharded async; rank 0's write of ``sharded_layout.json`` (built from every rank's report once
  every rank's files are durable) fails with ENOSPC in the step-4 save.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint, wait_for_pending_saves
from hf_resumable.checkpoint.background._step_gate import step_gate
from hf_resumable.checkpoint.commit import _writer
from hf_resumable.errors import AsyncSaveError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers.staging_probe import copy_after_next_step  # noqa: E402


def build(sharded: bool, *, frozen: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer; a sharded model's optimizer leaves out the last layer (see :func:`regroup`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    if not sharded:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    model[0].requires_grad_(not frozen)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for index in (0, 2):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for index in (0, 2) for p in model[index].parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2)


def regroup(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The last layer joins the optimizer as a group of its own (new parameters, a new group)."""
    optimizer.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3})


def full_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of torch's own full (consolidated) model and optimizer state dicts (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    tensors = {f"model/{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    tensors.update({f"optim/{fqn}/{key}": value for fqn, fields in optim["state"].items()
                    for key, value in fields.items()})
    h = hashlib.sha256(json.dumps([{k: v for k, v in g.items() if k != "params"} | {"params": g["params"]}
                                   for g in optim["param_groups"]], sort_keys=True, default=list).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest(model: torch.nn.Module) -> str:
    state = model.state_dict()
    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        h.update(name.encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sabotage(mode: str, rank: int) -> None:
    """Make rank 1's background write of the step-4 save fail (ENOSPC) or die (SIGKILL).

    Rank 1 writes only its RNG file in a regular checkpoint (rank 0 writes model and optimizer), so that write
    is the one that fails.
    """
    original = _writer.save_rng_state

    def write(path, state, **kwargs):
        if rank == 1 and ".tmp-checkpoint-4" in str(path):
            if mode == "kill":
                Path(path).write_bytes(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return original(path, state, **kwargs)

    _writer.save_rng_state = write


def sabotage_layout(rank: int) -> None:
    """Make rank 0's write of the step-4 save's layout fail (ENOSPC), after every rank's files are durable."""
    original = _writer.write_bytes_durably

    def write(path, data, **kwargs):
        if rank == 0 and Path(path).name == "sharded_layout.json" and ".tmp-checkpoint-4" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return original(path, data, **kwargs)

    _writer.write_bytes_durably = write


def main() -> int:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # a loaded machine is only slower
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sharded = mode.startswith("sharded")
    frozen = mode.startswith("sharded-frozen")
    blocking = mode.endswith("blocking")
    failing = mode in ("fail", "kill", "sharded-fail")
    if mode in ("fail", "kill"):
        sabotage(mode, rank)
    if mode == "sharded-fail":
        sabotage_layout(rank)
    model, optimizer = build(sharded, frozen=frozen)
    losses, stalls, error, saved = [], [], None, {}
    generator = torch.Generator().manual_seed(100 + rank)
    probe = None
    for step in range(1, 7):
        inputs = torch.randn(8, 16, generator=generator)
        loss = model(inputs).pow(2).mean()
        loss.backward()
        if not sharded:
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)  # the training loop's collectives, on the default group
                parameter.grad /= world
        optimizer.step()
        if probe is not None:
            probe.__exit__(None, None, None)
            probe = None
        optimizer.zero_grad()
        losses.append(loss.item())
        if sharded and step == 3:
            regroup(model, optimizer)
        if step % 2 == 0:
            if not blocking and not failing and step < 6:  # the next step begins before the copy
                probe = copy_after_next_step(optimizer)
                probe.__enter__()
            started = time.perf_counter()
            try:
                if sharded:
                    save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                                    blocking=blocking, layout="pieces")
                else:
                    save_checkpoint(root / f"checkpoint-{step}", model=model, optimizer=optimizer, step=step,
                                    blocking=blocking)
            except AsyncSaveError as err:
                error = {"step": step, "type": type(err).__name__, "cause": type(err.__cause__).__name__,
                         "errno": getattr(err.__cause__, "errno", None), "message": str(err)}
                break
            stalls.append(time.perf_counter() - started)
            if sharded:
                saved[step] = full_digest(model, optimizer)
    try:
        wait_for_pending_saves()
    except AsyncSaveError as err:
        error = error or {"step": None, "type": type(err).__name__, "cause": type(err.__cause__).__name__,
                          "errno": getattr(err.__cause__, "errno", None), "message": str(err)}
    reloaded = {}
    for step, expected in {} if failing else saved.items():  # every checkpoint, into a fresh model and optimizer
        fresh, fresh_optimizer = build(True, frozen=frozen)
        if step > 3:
            regroup(fresh, fresh_optimizer)
        load_checkpoint(root / f"checkpoint-{step}", model=fresh, optimizer=fresh_optimizer)
        reloaded[step] = full_digest(fresh, fresh_optimizer) == expected
    name = "error" if failing else "result"
    (root / f"{name}-rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "digest": digest(model), "stalls": stalls, "error": error, "reloaded": reloaded,
         "blocked": None if blocking else step_gate(optimizer).blocked}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
