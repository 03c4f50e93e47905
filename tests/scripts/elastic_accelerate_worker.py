"""``ResumableAccelerator(..., elastic=True)`` training a tiny GPT-2, launched with ``torchrun`` (any
``--nproc-per-node``) or plain ``python``: the same command line at every world size.

Usage: ``elastic_accelerate_worker.py OUTPUT_DIR [--max-steps N] [--kill-after K] [--dropout P] [--engine
{ddp,fsdp,deepspeed,zero1,zero3}] [--stream] [--mean-loss] [--direct]`` (``fsdp``: accelerate's FSDP2 plugin,
``deepspeed``: ZeRO-2, ``zero1``/``zero3``: ZeRO-1/3, all on gloo CPU ranks through tests/helpers/engine_fixtures.py's
shim, launched with torchrun at every world size; ``--stream``: the rows as a shuffled ``datasets`` stream with a
random ``.map`` crop, given to ``prepare_resumable_dataloader`` as is; ``--plain-loader``: the data in a plain
``DataLoader`` passed to ``accelerator.prepare`` instead).

The loop is accelerate's token-exact recipe (``accumulation_windows`` + ``backward(loss_sum,
num_items_in_batch=window.num_items)``) with a linear warmup/decay schedule prepared by accelerate; ``--mean-loss``:
``backward`` of each micro-batch's token-mean loss instead; ``--direct``: that loss in a loop that iterates the loader
itself inside ``accelerator.accumulate`` (no windows, no padding flag but the loader's ``is_padding``). After each
optimizer step every rank appends the samples it trained on to ``OUTPUT_DIR/samples-rank<r>.jsonl`` and rank 0 appends
the step's global token-mean loss and learning rate to ``OUTPUT_DIR/losses.jsonl``; a checkpoint is saved every step.
``--kill-after K``: every rank SIGKILLs itself right after checkpoint K is saved. At the end rank 0 writes
``OUTPUT_DIR/final.safetensors`` (the model's parameters) and ``OUTPUT_DIR/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import get_linear_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_resumable import ResumableAccelerator  # noqa: E402

from helpers import engine_fixtures as fx  # noqa: E402
from helpers.elastic_data import CropRows, collate_indexed, crop_stream  # noqa: E402
from helpers.tiny_models import tiny_gpt2  # noqa: E402


def count_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def loss_sum(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def engine_options(engine: str) -> dict:
    """The accelerator's keyword arguments of ``engine`` (the CPU shim installed first for FSDP2 and ZeRO-2)."""
    if engine == "ddp":
        return {"cpu": True}
    fx.install_cpu_engines()
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if engine in ("deepspeed", "zero1", "zero3"):
        stage = {"zero1": 1, "zero3": 3}.get(engine, 2)  # accumulation: the accelerator's
        config = {**fx.deepspeed_config(stage, batch_size=2), "gradient_accumulation_steps": "auto"}
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=config)}
    return {"fsdp_plugin": FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False, sync_module_states=False)}


class StepEnd:
    """What the worker records of each optimizer step: the samples each rank trained (the ``"index"`` of its
    micro-batches that are not padding, not what was collated since the last step: a prepared stream collates the next
    step's first micro-batch before this step ends), the step's global token-mean loss over those micro-batches, a
    checkpoint, and the SIGKILL of ``--kill-after``."""

    def __init__(self, accelerator: ResumableAccelerator, scheduler: object, options: argparse.Namespace) -> None:
        self.accelerator, self.scheduler, self.options = accelerator, scheduler, options
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.tokens = torch.zeros((), dtype=torch.float64)
        self.indices: list[int] = []  # samples of the micro-batches trained since the last step

    def add(self, loss_sum: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor) -> None:
        self.loss_sum += loss_sum.detach().double()
        self.tokens += tokens.double()
        self.indices += indices.tolist()

    def end(self) -> bool:
        """Record the step just taken; whether the run is done."""
        accelerator, out = self.accelerator, self.options.output_dir
        step, rank = accelerator.global_step, accelerator.process_index
        with (out / f"samples-rank{rank}.jsonl").open("a") as record:
            record.write(json.dumps({"step": step, "indices": self.indices}) + "\n")
        self.indices = []
        total = float(accelerator.reduce(self.loss_sum, reduction="sum") / accelerator.reduce(self.tokens, "sum"))
        self.loss_sum.zero_()
        self.tokens.zero_()
        if rank == 0:
            with (out / "losses.jsonl").open("a") as record:
                record.write(json.dumps({"step": step, "loss": total, "lr": self.scheduler.get_last_lr()[0]}) + "\n")
        accelerator.save_state()
        if step == self.options.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return step >= self.options.max_steps


def train(accelerator: ResumableAccelerator, model: torch.nn.Module, optimizer: object, scheduler: object,
          batch: dict, step: StepEnd, *, mean: bool, padding: bool, num_items: int | None = None) -> None:
    """One micro-batch: its token-sum loss with the window's item count, or (``mean``) its token-mean loss."""
    with accelerator.accumulate(model):
        loss, tokens = loss_sum(model, batch), count_tokens(batch)
        if mean:
            accelerator.backward(loss / tokens)
        else:
            accelerator.backward(loss, num_items_in_batch=num_items)
        if not padding:  # a stand-in of the epoch's last step: trained with weight zero
            step.add(loss, tokens, batch["index"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2's DTensors gathered: collective, every rank calls it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().contiguous()
            for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--num-samples", type=int, help="rows (default 24 map-style, 40 in a stream); not a multiple "
                        "of the global batch: every epoch ends with a shorter optimizer step")
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--engine", choices=("ddp", "fsdp", "deepspeed", "zero1", "zero3"), default="ddp")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--plain-loader", action="store_true")
    parser.add_argument("--mean-loss", action="store_true")
    parser.add_argument("--direct", action="store_true")
    options = parser.parse_args()
    out = options.output_dir
    # the script's own settings: 2 ranks x 2 micro-batches of 2 = a global batch of 8; 24 samples = 3 steps/epoch
    accelerator = ResumableAccelerator(gradient_accumulation_steps=2, checkpoint_dir=out / "checkpoints",
                                       elastic=True, **engine_options(options.engine))
    rank = accelerator.process_index
    out.mkdir(parents=True, exist_ok=True)
    # a stream: 5 global batches of 8 per pass
    data = crop_stream(options.num_samples or 40) if options.stream else CropRows(options.num_samples or 24)
    if options.plain_loader:
        loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate_indexed))
    else:
        loader = accelerator.prepare_resumable_dataloader(data, collate_fn=collate_indexed, batch_size=2, seed=5)
    model = tiny_gpt2(resid_pdrop=options.dropout, embd_pdrop=options.dropout, attn_pdrop=options.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # in scheduler steps, which accelerate takes num_processes of per optimizer step (2 at the first launch)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=16)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loaded = accelerator.load_state()
    model.train()
    step = StepEnd(accelerator, scheduler, options)
    while accelerator.global_step < options.max_steps:
        if options.direct:  # the loader iterated as is: its elastic batches weigh themselves in backward
            for batch in loader:
                train(accelerator, model, optimizer, scheduler, batch, step, mean=True, padding=loader.is_padding)
                if accelerator.sync_gradients and step.end():
                    break
            continue
        for window in accelerator.accumulation_windows(loader, count_items=count_tokens):
            for batch in window:
                train(accelerator, model, optimizer, scheduler, batch, step, mean=options.mean_loss,
                      padding=window.is_padding, num_items=window.num_items)
            if step.end():
                break
    accelerator.wait_for_everyone()
    parameters = full_parameters(accelerator.unwrap_model(model))
    if rank == 0:
        save_file(parameters, str(out / "final.safetensors"))
        (out / "result.json").write_text(json.dumps({
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
            "distributed_type": str(accelerator.distributed_type),
            "resumed_from": None if loaded is None else str(loaded.path)}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
