"""One rank of a STOCK transformers run with ``DistributedConfig`` (tensor parallel or FSDP2 through transformers, no
hf_resumable), started by tests/test_convert_hf_storage.py (2 gloo ranks on CPU, torchrun).

Usage:

* ``torchrun --nproc-per-node 2 dcp_hf_worker.py save --output-dir DIR --layout tp``: rank 0 writes a tiny Llama
  (``DIR/seed``); every rank loads it with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))``
  (``--layout fsdp``: ``fsdp_size=2``), trains 3 steps with an AdamW of two param groups (decay / no decay, as the
  Trainer builds them), then saves ``save_pretrained(DIR/saved, distributed_checkpoint=True)`` and
  ``save_optimizer_distributed(model, optimizer, DIR/saved/optimizer)``. Rank 0 writes the consolidated state the
  conversion must carry bit for bit: ``expected-model.safetensors`` (the full weights), ``expected-optimizer
  .safetensors`` (``state/<fqn>/<key>``) and ``expected-optimizer.json`` (the param groups).
* ``... dcp_hf_worker.py load --output-dir DIR --layout tp --regular CKPT --pieces CKPT``:
  ``from_pretrained(regular, distributed_config=...)`` on a regular hf_resumable checkpoint, and
  ``load_checkpoint(pieces, model=, optimizer=)`` of a per-rank checkpoint into a model loaded at that layout
  (its weights zeroed first), which then saves it with ``save_checkpoint(..., layout="hf")`` and loads that
  with ``from_pretrained(..., distributed_config=...)``; rank 0 writes what each holds, consolidated:
  ``loaded-regular.safetensors``, ``loaded-pieces-model.safetensors``, ``loaded-pieces-optimizer.safetensors``,
  ``loaded-hf-weights.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

from helpers.tiny_models import VOCAB, decay_groups, tiny_llama  # noqa: E402

LAYOUTS = {"tp": {"tp_size": 2}, "fsdp": {"fsdp_size": 2}}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over two groups whose hyper-parameters differ (decay / no decay)."""
    return torch.optim.AdamW(decay_groups(model), lr=1e-2)


def full_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """The consolidated optimizer state: ``state/<fqn>/<key>`` tensors and the param groups (FQNs); a collective,
    whose result only rank 0 gets (empty elsewhere)."""
    state = get_optimizer_state_dict(model, optimizer, options=FULL)
    if not state:
        return {}, []
    tensors = {f"state/{fqn}/{key}": value.contiguous() for fqn, fields in state["state"].items()
               for key, value in fields.items() if torch.is_tensor(value)}
    return tensors, state["param_groups"]


def save(args: argparse.Namespace, rank: int) -> None:
    from transformers.distributed.checkpoint import save_optimizer_distributed

    seed = args.output_dir / "seed"
    if rank == 0:
        tiny_llama(num_attention_heads=4, num_key_value_heads=2).save_pretrained(seed)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(seed, distributed_config=DistributedConfig(**LAYOUTS[args.layout]))
    optimizer = build_optimizer(model)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(3, VOCAB, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = args.output_dir / "saved"
    model.save_pretrained(saved, distributed_checkpoint=True)
    save_optimizer_distributed(model, optimizer, str(saved / "optimizer"))
    weights = get_model_state_dict(model, options=FULL)
    tensors, groups = full_optimizer(model, optimizer)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, args.output_dir / "expected-model.safetensors")
        save_file(tensors, args.output_dir / "expected-optimizer.safetensors")
        (args.output_dir / "expected-optimizer.json").write_text(json.dumps(groups))


def load(args: argparse.Namespace, rank: int) -> None:
    from hf_resumable.checkpoint import load_checkpoint, save_checkpoint

    config = DistributedConfig(**LAYOUTS[args.layout])
    regular = LlamaForCausalLM.from_pretrained(args.regular, distributed_config=config)
    regular_weights = get_model_state_dict(regular, options=FULL)
    model = LlamaForCausalLM.from_pretrained(args.regular, distributed_config=config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    optimizer = build_optimizer(model)
    load_checkpoint(args.pieces, model=model, optimizer=optimizer, restore_rng=False,
                    allow_inexact_resume=True)
    weights = get_model_state_dict(model, options=FULL)
    tensors, _ = full_optimizer(model, optimizer)
    # a per-rank checkpoint saved at this layout with layout="hf": from_pretrained reads its directory as is
    with_weights = args.output_dir / "hf-weights"
    save_checkpoint(with_weights, model=model, optimizer=optimizer, step=3, layout="hf")
    reloaded = LlamaForCausalLM.from_pretrained(with_weights, distributed_config=config)
    reloaded_weights = get_model_state_dict(reloaded, options=FULL)
    if rank == 0:
        for name, state in (("loaded-regular", regular_weights), ("loaded-pieces-model", weights),
                            ("loaded-hf-weights", reloaded_weights)):
            save_file({k: v.contiguous() for k, v in state.items()}, args.output_dir / f"{name}.safetensors")
        save_file(tensors, args.output_dir / "loaded-pieces-optimizer.safetensors")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "load"))
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp")
    parser.add_argument("--regular", type=Path)
    parser.add_argument("--pieces", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        (save if args.mode == "save" else load)(args, dist.get_rank())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
