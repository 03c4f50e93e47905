"""One rank of an engine-level resume at another world size (started by tests/test_engines_elastic.py).

Usage: ``torchrun --nproc-per-node N ds_elastic_worker.py --engine ENGINE --checkpoint DIR
--dump FILE (--train | --load) [--save DIR]``.

ENGINE: ``fsdp2``, ``fsdp1`` (``use_orig_params=True``, FULL_SHARD), ``fsdp1-flat`` (``use_orig_params=False``),
``fsdp1-noshard`` (``NO_SHARD``), ``zero1``, ``zero2`` or ``zero3``.

``--train`` trains a tiny GPT-2 two optimizer steps under the engine (gloo, CPU) and saves ``--checkpoint`` with
``save_checkpoint``; ``--load`` builds the engine afresh (its weights differ), tries a plain open of the
checkpoint (refused with ``ConfigDriftError`` at another world size; recorded), then opens it with ``reshard=True``
and fills the engine with ``OpenedCheckpoint.load_into``, and saves it again into ``--save`` if given. Either way
rank 0 writes ``--dump``: the engine's own consolidated view of the run (whole weights, and per parameter the fp32
master weights, Adam moments and step counts), gathered with the engine's own functions
(``torch.distributed.checkpoint.state_dict`` full state dicts for FSDP, ``deepspeed.utils.safe_get_full_*`` for
ZeRO), independent of hf_resumable's reading.
``--bf16`` (ZeRO-2/3): the model in bf16 over DeepSpeed's fp32 master weights. ``--trainer-groups`` (ZeRO): the
Trainer's two param groups, to load a checkpoint converted from a stock Trainer + DeepSpeed run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from hf_resumable.checkpoint import open_checkpoint, save_checkpoint  # noqa: E402
from hf_resumable.errors import ConfigDriftError  # noqa: E402

from helpers import engine_fixtures as fx  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True, choices=("fsdp2", "fsdp1", "fsdp1-flat", "fsdp1-noshard", "zero1",
                                                                "zero2", "zero3"))
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--dump", required=True, type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--bf16", action="store_true", help="ZeRO: bf16 weights over fp32 master weights")
    parser.add_argument("--trainer-groups", action="store_true",
                        help="ZeRO: the Trainer's two param groups (decay, no decay), as a converted stock run has")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train", action="store_true")
    mode.add_argument("--load", action="store_true")
    return parser.parse_args()


def _param_groups(model: torch.nn.Module, trainer_groups: bool) -> list[dict] | object:
    """The Trainer's param groups (weight decay, then none; transformers' own rule) or all parameters in one."""
    if not trainer_groups:
        return model.parameters()
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def build(engine: str, *, seed: int, bf16: bool = False, trainer_groups: bool = False):
    """``(model to checkpoint, optimizer to checkpoint, step function)`` of a tiny GPT-2 under ``engine``."""
    torch.manual_seed(seed)
    model = fx.build_model()
    torch.manual_seed(seed)  # another seed: a fresh engine's weights differ from the saved ones
    for param in model.parameters():
        param.data.normal_(0, 0.02)
    if engine.startswith("zero"):
        import deepspeed

        from hf_resumable.integrations._deepspeed import checkpoint_optimizer

        config = {**fx.deepspeed_config(int(engine[-1]), batch_size=2), "bf16": {"enabled": bf16}}
        optimizer = torch.optim.AdamW(_param_groups(model, trainer_groups), lr=1e-2)
        ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def step(batch):
            ds.backward(ds(**batch).loss)
            ds.step()

        return ds, ds.module, checkpoint_optimizer(ds.optimizer), step
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        strategy = ShardingStrategy.NO_SHARD if engine == "fsdp1-noshard" else ShardingStrategy.FULL_SHARD
        wrapped = FullyShardedDataParallel(model, use_orig_params=engine != "fsdp1-flat", sharding_strategy=strategy,
                                           device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)

    def step(batch):
        wrapped(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return wrapped, wrapped, optimizer, step


def batch() -> dict[str, torch.Tensor]:
    rank = torch.distributed.get_rank()
    ids = torch.randint(3, fx.VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + rank))
    return {"input_ids": ids, "labels": ids}


def dump_fsdp(model, optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    tensors = {f"model/{name}": value for name, value in get_model_state_dict(model, options=options).items()}
    for fqn, fields in get_optimizer_state_dict(model, optimizer, options=options)["state"].items():
        tensors.update({f"optim/{fqn}/{key}": value for key, value in fields.items()})
    return tensors


def dump_zero(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    tensors = {}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_tensor")):
        tensors.update({f"model/{name}": p.detach().clone() for name, p in params})
    for name, param in params:
        tensors[f"optim/{name}/fp32"] = safe_get_full_fp32_param(param)
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"optim/{name}/{key}"] = safe_get_full_optimizer_state(param, key)
    steps = [state["step"] for state in engine.optimizer.optimizer.state.values()]
    tensors["optim/steps"] = torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in steps]).unique()
    return tensors


def main() -> int:
    options = parse_args()
    torch.distributed.init_process_group("gloo")
    if options.engine.startswith("zero"):
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of a CPU op
    engine, model, optimizer, step = build(options.engine, seed=0 if options.train else 1, bf16=options.bf16,
                                           trainer_groups=options.trainer_groups)
    result = {}
    if options.train:
        for _ in range(2):
            step(batch())
        save_checkpoint(options.checkpoint, model=model, optimizer=optimizer, step=2, layout="pieces")
    else:
        try:  # without elastic=True, another world size stays refused (before anything is loaded)
            open_checkpoint(options.checkpoint).load_into(model=model, optimizer=optimizer,
                              restore_rng=False)
            result["refused"] = False
        except ConfigDriftError:
            result["refused"] = True
        opened = open_checkpoint(options.checkpoint, reshard=True)
        opened.load_into(model=model, optimizer=optimizer, restore_rng=False)
        if options.save is not None:
            save_checkpoint(options.save, model=model, optimizer=optimizer, step=2, layout="pieces")
    tensors = dump_zero(engine) if options.engine.startswith("zero") else dump_fsdp(model, optimizer)
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.detach().clone() for k, v in tensors.items()}, str(options.dump))  # tied: two copies
        options.dump.with_suffix(".json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
