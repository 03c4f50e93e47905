"""One rank of a ``ResumableAccelerator`` loop over an accelerate ``ParallelismConfig`` layout (gloo ranks on CPU,
torchrun), shaped like accelerate's ``examples/torch_native_parallelism/nd_parallel.py``; started by
tests/test_accelerate_nd.py.

Usage: ``torchrun --nproc-per-node N nd_accelerate_worker.py --output-dir DIR --model-dir SEED [--dp-replicate R]
[--dp-shard S] [--tp T] [--cp C] [--max-steps K] [--elastic --accumulation A] [--replicate-shim]``.

``--replicate-shim``: installs the test-only ``ReplicateParallel`` (tests/helpers/replicate_parallel.py) that
accelerate's FSDP2 + tensor-parallel preparation imports from transformers, for ``dp_shard x tp`` layouts.

The model is a tiny Llama read with ``from_pretrained`` (tensor parallel: :func:`load_model`), FSDP2 over
``dp_shard`` when it is larger than 1. The same command trains uninterrupted, is held after a save
(``HFR_HOLD_AFTER_SAVE=k``, or inside the save of step k with ``HFR_HOLD_IN_SAVE=k``; then SIGKILLed by the
test) and resumes (``load_state()``). Each rank appends
``{"step", "loss", "batch"}`` (the loss as ``float.hex``, a digest of the batch's input ids) to
``losses-rank{r}.jsonl`` and writes ``final-rank{r}.safetensors`` (its parameter pieces and optimizer state).

``--elastic``: ``ResumableAccelerator(elastic=True, gradient_accumulation_steps=A)`` with a prepared learning-rate
schedule, the loader iterated inside ``accelerator.accumulate`` (accumulate's recipe: each micro-batch's mean loss);
after each optimizer step every rank appends ``{"step", "loss", "lr", "batches"}`` (the step's mean loss over the
global batch, the digests of the micro-batches this rank trained) and saves. The same command line resumes at any
layout: only the sizes change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from helpers import engine_fixtures as fx  # noqa: E402

fx.install_cpu_engines()  # before the accelerator builds its state
if "--replicate-shim" in sys.argv:  # before accelerate prepares FSDP2 with tensor parallel
    from helpers.replicate_parallel import install_replicate_parallel

    install_replicate_parallel()

import torch  # noqa: E402
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from hf_resumable.integrations.accelerate import ResumableAccelerator  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--model-dir", required=True, type=Path)
    for name in ("dp-replicate", "dp-shard", "tp", "cp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--replicate-shim", action="store_true",
                        help="the test-only ReplicateParallel of tests/helpers/replicate_parallel.py")
    return parser.parse_args()


def make_rows(count: int = 48, length: int = 12) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(3, fx.VOCAB, (length,), generator=generator) for _ in range(count)]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    return {"input_ids": ids, "labels": ids.clone()}


def load_model(accelerator: ResumableAccelerator, options: argparse.Namespace) -> torch.nn.Module:
    """The tiny Llama, tensor parallel over the accelerator's ``tp`` mesh when ``--tp`` is larger than 1.

    Tensor parallel alone: transformers' ``tp_plan="auto"``. Beside data parallel, transformers 5 cannot split over
    a sub-mesh (``from_pretrained`` ignores ``device_mesh`` and builds a mesh of every process), so the worker splits
    the loaded model itself with torch's ``parallelize_module`` on ``accelerator.torch_device_mesh["tp"]``: the
    attention and MLP projections column- then row-wise, as transformers 4's plan did; the embeddings, norms and
    head stay plain parameters, which accelerate's FSDP2 preparation makes ``Replicate()`` DTensors.
    """
    if options.tp == 1:
        return LlamaForCausalLM.from_pretrained(options.model_dir)
    mesh = accelerator.torch_device_mesh
    if options.dp_shard * options.dp_replicate == 1:
        return LlamaForCausalLM.from_pretrained(options.model_dir, tp_plan="auto", device_mesh=mesh)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = LlamaForCausalLM.from_pretrained(options.model_dir)
    plan = {}
    for index in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{index}"
        plan.update({f"{prefix}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        plan.update({f"{prefix}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")})
        plan.update({f"{prefix}.self_attn.o_proj": RowwiseParallel(), f"{prefix}.mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh["tp"], plan)


def main() -> int:
    options = parse_args()
    output = options.output_dir
    output.mkdir(parents=True, exist_ok=True)
    fx.hold_inside_save()
    config = ParallelismConfig(dp_replicate_size=options.dp_replicate, dp_shard_size=options.dp_shard,
                               tp_size=options.tp, cp_size=options.cp)
    fsdp = None
    if config.dp_shard_enabled or config.cp_enabled:
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT",
            cpu_ram_efficient_loading=False, sync_module_states=False)
    accelerator = ResumableAccelerator(parallelism_config=config, fsdp_plugin=fsdp, elastic=options.elastic,
                                       gradient_accumulation_steps=options.accumulation,
                                       checkpoint_dir=output / "checkpoints", handle_preemption=False)
    model = load_model(accelerator, options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader = accelerator.prepare_resumable_dataloader(make_rows(), collate_fn=collate, batch_size=2, seed=0)
    if options.elastic:
        return train_elastic(accelerator, model, optimizer, loader, options)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state()
    with (output / f"losses-rank{fx.RANK}.jsonl").open("a") as log:
        for batch in loader:  # one epoch holds more steps than max_steps
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            digest = hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]
            log.write(json.dumps({"step": accelerator.global_step, "loss": loss.item().hex(), "batch": digest})
                      + "\n")
            log.flush()
            accelerator.save_state()
            fx.hold_after_save(accelerator.global_step)
            if accelerator.global_step >= options.max_steps:
                break
    return finish(accelerator, model, optimizer, output)


def finish(accelerator: ResumableAccelerator, model: torch.nn.Module, optimizer: object, output: Path) -> int:
    accelerator.end_training()
    final = output / f"final-rank{fx.RANK}.safetensors"
    fx.dump_local_state(accelerator.unwrap_model(model), optimizer.optimizer, final)
    del model, optimizer, accelerator
    torch.distributed.destroy_process_group()
    return 0


def train_elastic(accelerator: ResumableAccelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  loader: object, options: argparse.Namespace) -> int:
    """``--elastic``: accumulate's loop over the loader, one log line per optimizer step and rank."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.25 * step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state()
    losses, batches = [], []
    with (options.output_dir / f"losses-rank{fx.RANK}.jsonl").open("a") as log:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            batches.append(hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16])
            if not accelerator.sync_gradients:
                continue
            mean = float(accelerator.reduce(torch.tensor(sum(losses) / len(losses), dtype=torch.float64),
                                            reduction="mean"))
            log.write(json.dumps({"step": accelerator.global_step, "loss": mean, "lr": scheduler.get_last_lr()[0],
                                  "batches": batches}) + "\n")
            log.flush()
            losses, batches = [], []
            accelerator.save_state()
            fx.hold_after_save(accelerator.global_step)
            if accelerator.global_step >= options.max_steps:
                break
    return finish(accelerator, model, optimizer, options.output_dir)


if __name__ == "__main__":
    sys.exit(main())
