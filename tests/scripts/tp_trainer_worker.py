"""One rank of ``ResumableTrainer`` over a model sharded at load time by transformers (tensor parallel, optionally
with FSDP2 or HSDP beside it; gloo CPU ranks, torchrun), started by tests/test_trainer_tp.py.

Usage: ``torchrun --nproc-per-node N tp_trainer_worker.py --output-dir DIR --model-dir SEED [--tp T] [--fsdp F]
[--dp-replicate R] [--load distributed_config|tp_plan] [--max-steps K] [--elastic]``.

``--load distributed_config`` reads the tiny Llama with ``from_pretrained(distributed_config=DistributedConfig(...))``;
``--load tp_plan`` with ``tp_plan="auto"`` and hands the Trainer an accelerate ``ParallelismConfig`` (the shape of
accelerate's ``nd_parallel_trainer.py``). The same command trains uninterrupted, is held after a save
(``HFR_HOLD_AFTER_SAVE=k``, or inside the save of step k with ``HFR_HOLD_IN_SAVE=k``; then SIGKILLed by the
test) and resumes (``resume_from_checkpoint=True``). Every rank
appends ``{"step", "batch"}`` (a digest of the step's input ids) to ``batches-rank{r}.jsonl``, and at the end writes
``final-rank{r}.safetensors`` (its parameter pieces and optimizer state), ``result-rank{r}.json`` (log history) and,
from rank 0, ``final-whole.safetensors`` (every parameter and optimizer moment whole).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS / "trainer_scripts")]

from helpers import engine_fixtures as fx  # noqa: E402

fx.install_cpu_engines()  # before TrainingArguments builds accelerate's state

import torch  # noqa: E402
import transformers  # noqa: E402
from train_tiny import build_data, build_tokenizer  # noqa: E402
from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

from hf_resumable.integrations.trainer import ResumableTrainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--load", choices=("distributed_config", "tp_plan"), default="distributed_config")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--no-dropout", action="store_true", help="attention_dropout=0 (the saved model has 0.1)")
    parser.add_argument("--forget-rng", action="store_true", help="broken on purpose: a resume leaves the RNG as the "
                        "new process seeded it (for hf-resumable check)")
    return parser.parse_args()


class HoldAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        fx.hold_after_save(state.global_step)


class RecordBatches(ResumableTrainer):
    """Logs a digest of every micro-batch each rank trains on (which rank sees which samples)."""

    def training_step(self, model, inputs, *args, **kwargs):
        digest = hashlib.sha256(inputs["input_ids"].numpy().tobytes()).hexdigest()[:16]
        with (Path(self.args.output_dir) / f"batches-rank{fx.RANK}.jsonl").open("a") as log:
            log.write(json.dumps({"step": self.state.global_step + 1, "batch": digest}) + "\n")
        return super().training_step(model, inputs, *args, **kwargs)


class ForgetsRng(RecordBatches):
    """Broken on purpose (``--forget-rng``): the RNG saved in the checkpoint is never restored."""

    def _load_rng_state(self, checkpoint):
        return None


def load_model(options: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    overrides = {"attention_dropout": 0.0} if options.no_dropout else {}
    if options.load == "tp_plan":
        from accelerate import ParallelismConfig

        config = ParallelismConfig(tp_size=options.tp, dp_shard_size=options.fsdp,
                                   dp_replicate_size=options.dp_replicate)
        # as accelerate's example does: the whole mesh of the ParallelismConfig
        model = LlamaForCausalLM.from_pretrained(options.model_dir, tp_plan="auto",
                                                 device_mesh=config.build_device_mesh("cpu"), **overrides)
        return model, {"parallelism_config": config}
    config = DistributedConfig(tp_size=options.tp, fsdp_size=options.fsdp, dp_replicate_size=options.dp_replicate)
    return LlamaForCausalLM.from_pretrained(options.model_dir, distributed_config=config, **overrides), {}


def dump_whole_state(trainer: ResumableTrainer, path: Path) -> None:
    """Every parameter and optimizer moment whole, whatever the layout (DTensors gathered: collective); rank 0
    writes them to ``path``, for comparisons across layouts (``--elastic``)."""
    from safetensors.torch import save_file

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().contiguous().clone()

    model = trainer.accelerator.unwrap_model(trainer.model)
    optimizer = trainer.optimizer.optimizer
    tensors = {}
    for name, param in model.named_parameters():
        tensors[f"model/{name}"] = whole(param)
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"optim/{name}/{key}"] = whole(value)
    if fx.RANK == 0:
        save_file(tensors, str(path))


def main() -> int:
    options = parse_args()
    fx.hold_inside_save()
    transformers.logging.set_verbosity_error()
    output = options.output_dir
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    train, collator = build_data("lm", tokenizer, 64)
    model, parallel = load_model(options)
    args = TrainingArguments(
        output_dir=str(output), per_device_train_batch_size=2, gradient_accumulation_steps=options.accumulation,
        max_steps=options.max_steps, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
        weight_decay=0.01, logging_steps=1, save_strategy="steps", save_steps=1, save_total_limit=2, seed=42,
        report_to=[], disable_tqdm=True, **parallel)
    trainer_class = ForgetsRng if options.forget_rng else RecordBatches
    trainer = trainer_class(model=model, args=args, train_dataset=train, data_collator=collator,
                            processing_class=tokenizer, callbacks=[HoldAfterSave()], elastic=options.elastic)
    train_and_record(trainer, output)
    return 0


def train_and_record(trainer: ResumableTrainer, output: Path) -> None:
    """Train (resuming from the newest checkpoint), then write this rank's pieces, its log history and the whole
    state; the process group is destroyed either way."""
    try:
        trainer.train(resume_from_checkpoint=True)
        fx.dump_local_state(trainer.accelerator.unwrap_model(trainer.model), trainer.optimizer.optimizer,
                            output / f"final-rank{fx.RANK}.safetensors")
        fx.write_trainer_result(trainer, output)
        dump_whole_state(trainer, output / "final-whole.safetensors")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
