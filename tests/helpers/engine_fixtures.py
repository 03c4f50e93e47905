"""TEST-ONLY helpers of the FSDP / DeepSpeed engine tests (tests/test_engines.py and its worker scripts).

* :func:`requested_device`: the worker's ``--device`` (``cpu``, the default, or ``cuda``: the real engines on a GPU
  with NCCL, tests/test_gpu.py), read before anything builds accelerate's state.
* :func:`install_cpu_engines`: accelerate turns FSDP (and DeepSpeed) on only for accelerator devices; with ``cpu=True``
  it silently trains DDP. Called by a worker script before it builds an ``Accelerator`` or ``TrainingArguments``, it
  makes accelerate see GPUs whose collective backend is gloo and whose device is the CPU
  (``ACCELERATE_TORCH_DEVICE=cpu``), so the FSDP and DeepSpeed code paths run as on GPUs, where they use NCCL.
  DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, whose collectives fall back to gloo without oneCCL;
  no compiled ops: the optimizer is a torch one). The library never depends on it: nothing in ``hf_resumable``
  imports it.
* :func:`deepspeed_config`: the tiny runs' ZeRO config (no offload, a torch optimizer of the script's own).
* :func:`parse_worker_args`: the options of both worker scripts.
* :func:`build_model`: a tiny GPT-2 (2 layers, ``n_embd`` 32, dropout on).
* :func:`hold_after_save`: ``HFR_HOLD_AFTER_SAVE=k`` makes every rank stop for good once it has saved step ``k``
  (a background save still commits); the test polls for the committed checkpoint and SIGKILLs the job.
  :func:`hold_inside_save`: ``HFR_HOLD_IN_SAVE=k`` stops the save of checkpoint ``k`` right before its commit.
* :func:`dump_local_state` / :func:`read_local_state`: every rank's parameter pieces and optimizer state, as it holds
  them (``DTensor.to_local()``), for bitwise comparisons.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import torch

__all__ = ["requested_device", "install_cpu_engines", "parse_worker_args", "deepspeed_config", "build_model",
           "hold_after_save", "hold_inside_save", "dump_local_state", "read_local_state", "RANK", "VOCAB"]

RANK = int(os.environ.get("RANK", "0"))
VOCAB = 64


def requested_device(argv: list[str] | None = None) -> str:
    """The ``--device`` of the worker's command line (``cpu`` without one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser.parse_known_args(sys.argv[1:] if argv is None else argv)[0].device


def install_cpu_engines() -> None:
    """Patch ``PartialState._prepare_backend`` to ``("gloo", MULTI_GPU)`` with the CPU as the device."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported (accelerate imports it for a DeepSpeed run)
    if "deepspeed" in sys.argv:
        import deepspeed.ops

        # DeepSpeed's CPU collectives would JIT-compile a shared-memory op (minutes, and a compiler); gloo does it all.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    def prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = prepare_backend


def parse_worker_args() -> argparse.Namespace:
    """The options of both worker scripts (the same command line trains, is held, and resumes)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--engine", choices=("fsdp", "deepspeed"), default="fsdp")
    parser.add_argument("--version", type=int, default=2, help="FSDP version")
    parser.add_argument("--zero-stage", type=int, default=2, help="DeepSpeed ZeRO stage")
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=32, help="n_embd of the GPT-2 (build_model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the real engines on the GPU with NCCL (no install_cpu_engines)")
    return parser.parse_args()


def deepspeed_config(stage: int, *, batch_size: int | str = "auto") -> dict:
    """ZeRO ``stage`` without offload; the optimizer is the script's torch AdamW (no compiled DeepSpeed ops here)."""
    return {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1 if batch_size != "auto"
            else "auto", "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def build_model(width: int = 32) -> torch.nn.Module:
    """A 2-layer GPT-2 of ``n_embd=width`` (wider: piece files above the quick-verification hash limit)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(config)


def hold_after_save(step: int) -> None:
    """Stop this rank for good if ``HFR_HOLD_AFTER_SAVE`` is ``step`` (the test kills the job)."""
    if os.environ.get("HFR_HOLD_AFTER_SAVE") == str(step):
        threading.Event().wait()


def hold_inside_save() -> None:
    """``HFR_HOLD_IN_SAVE=k``: the save of checkpoint-k stops for good right before it commits (every rank's files
    written, rank 0 about to rename the directory into place), after writing ``held-in-save`` next to it; the test
    SIGKILLs the job then: a kill inside a save. Call it once, before training."""
    from hf_resumable.checkpoint.commit import _writer

    step, commit = os.environ.get("HFR_HOLD_IN_SAVE"), _writer.commit_dir

    def held_commit(tmp, target, **kwargs):
        if step is not None and Path(target).name == f"checkpoint-{step}":
            (Path(target).parent / "held-in-save").write_text(str(tmp))
            threading.Event().wait()
        return commit(tmp, target, **kwargs)

    _writer.commit_dir = held_commit


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().to("cpu", copy=True).contiguous()


def _shard(value: torch.Tensor) -> torch.Tensor:
    """A ShardedTensor's local shard (empty if this rank holds none), or the tensor itself."""
    if not hasattr(value, "local_shards"):
        return _local(value)
    shards = value.local_shards()
    return _local(shards[0].tensor) if shards else torch.empty(0)


def _fsdp1_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """FSDP1: the local shards of its sharded state dicts (what every rank holds of each weight and moment)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    tensors = {f"model/{name}": _shard(value) for name, value in get_model_state_dict(model).items()}
    for fqn, fields in get_optimizer_state_dict(model, optimizer)["state"].items():
        tensors.update({f"optim/{fqn}/{key}": _shard(value) for key, value in fields.items()
                        if torch.is_tensor(value)})
    return tensors


def dump_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """This rank's parameter pieces and optimizer state tensors into ``path`` (safetensors); under ZeRO-1/2/3
    (``optimizer`` is DeepSpeed's), this rank's partitions of the fp32 master weights and of the moments (and, under
    ZeRO-3, of every parameter); for FSDP1 (``model`` is its root wrapper), the local shards of its sharded
    state dicts."""
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # FSDP1 (the root wrapper)
        save_file(_fsdp1_local_state(model, optimizer), str(path))
        return
    # ZeRO-3: a parameter's data is empty (or gathered); this rank holds its partition, ds_tensor
    tensors = {f"model/{name}": _local(getattr(param, "ds_tensor", None) if hasattr(param, "ds_tensor") else param)
               for name, param in model.named_parameters()}
    names = {id(param): name for name, param in model.named_parameters()}
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2: one flat partition per group
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", flats)  # ZeRO-3: one per sub-group
    if flats is not None:
        for index, flat in enumerate(flats):
            names[id(flat)] = f"group{index}"
            tensors[f"optim/group{index}/fp32"] = _local(flat)
        optimizer = optimizer.optimizer
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optim/{names[id(param)]}/{key}"] = _local(value)
    save_file(tensors, str(path))


TIMING = ("_runtime", "_samples_per_second", "_steps_per_second")  # wall-clock log fields, different every run


def write_trainer_result(trainer, output: Path) -> None:
    """``result-rank{r}.json``: the Trainer's log history without wall-clock fields, and where it resumed from."""
    history = [{k: v for k, v in entry.items() if not k.endswith(TIMING)} for entry in trainer.state.log_history]
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    result = {"log_history": history, "resumed_from": str(trainer.resumed_from or ""), "backend": backend}
    (output / f"result-rank{RANK}.json").write_text(json.dumps(result, indent=1))


def read_local_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
