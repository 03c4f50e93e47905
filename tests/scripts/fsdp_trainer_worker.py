"""One rank of ``ResumableTrainer`` under FSDP or DeepSpeed (2 gloo ranks on CPU, torchrun), started by
tests/test_engines.py.

Usage: ``torchrun --nproc-per-node 2 fsdp_trainer_worker.py --output-dir DIR [--version 2] [--state-dict-type T]``,
or ``... --engine deepspeed [--zero-stage 2]``.
The same command trains uninterrupted, is held after a save (``HFR_HOLD_AFTER_SAVE=k``, then SIGKILLed by the test)
and resumes (``resume_from_checkpoint=True``). At the end every rank writes ``final-rank{r}.safetensors`` (its
parameter pieces and optimizer state) and ``result-rank{r}.json`` (log history without wall-clock fields).
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS / "trainer_scripts")]

from helpers import engine_fixtures as fx  # noqa: E402

if fx.requested_device() == "cpu":
    fx.install_cpu_engines()  # before TrainingArguments builds accelerate's state

import torch  # noqa: E402
import transformers  # noqa: E402
from train_tiny import build_data, build_tokenizer  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from hf_resumable.integrations.trainer import ResumableTrainer  # noqa: E402


class HoldAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        fx.hold_after_save(state.global_step)


def engine_arguments(options) -> dict:
    if options.engine == "deepspeed":
        return {"deepspeed": fx.deepspeed_config(options.zero_stage)}
    return fsdp_arguments(options.version, options.state_dict_type)


def fsdp_arguments(version: int, state_dict_type: str) -> dict:
    config = {"version": version, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": state_dict_type,
              "cpu_ram_efficient_loading": False}
    if version == 1:
        config["sync_module_states"] = False  # FSDP1 broadcasts from a CUDA device otherwise
    return {"fsdp": True, "fsdp_config": config}


def main() -> int:
    options = fx.parse_worker_args()
    transformers.logging.set_verbosity_error()
    output = options.output_dir
    tokenizer = build_tokenizer()
    train, collator = build_data("lm", tokenizer, 44)
    args = TrainingArguments(
        output_dir=str(output), per_device_train_batch_size=4, max_steps=options.max_steps, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, logging_steps=1, save_strategy="steps",
        save_steps=1, save_total_limit=2, seed=42, report_to=[], disable_tqdm=True,
        **engine_arguments(options))
    trainer = ResumableTrainer(model=fx.build_model(), args=args, train_dataset=train, data_collator=collator,
                               processing_class=tokenizer, callbacks=[HoldAfterSave()])
    try:
        trainer.train(resume_from_checkpoint=True)
        fsdp1 = options.engine == "fsdp" and options.version == 1  # FSDP1's state dicts are read from its root
        model = trainer.model if fsdp1 else trainer.accelerator.unwrap_model(trainer.model)
        fx.dump_local_state(model, trainer.optimizer.optimizer, output / f"final-rank{fx.RANK}.safetensors")
        fx.write_trainer_result(trainer, output)
    finally:
        del trainer
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
