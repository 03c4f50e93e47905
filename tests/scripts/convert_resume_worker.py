"""One rank of a run resuming from a CONVERTED stock checkpoint, started by tests/test_convert_engines.py (2 gloo
ranks on CPU, torchrun).

Usage:

* ``torchrun --nproc-per-node 2 convert_resume_worker.py --output-dir DIR --engine deepspeed --zero-stage 2
  --resume CHECKPOINT``: ``ResumableTrainer`` under DeepSpeed, the model, data and arguments of
  ``fsdp_trainer_worker.py``;
* ``... --engine fsdp --resume CHECKPOINT``: ``ResumableAccelerator`` with FSDP2 (``allow_inexact_resume=True``: the
  stock checkpoint has no data position), the loop of ``fsdp_accelerate_worker.py``.

Right after the checkpoint is loaded every rank writes ``resumed-rank{r}.safetensors`` (its weights or their pieces,
the optimizer state it holds, as ``engine_fixtures.dump_local_state``) and ``resumed-rank{r}.json`` (learning rate,
step counters); then it trains to ``--max-steps``, saving every step, and writes ``result-rank{r}.json``.
"""

from __future__ import annotations

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
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from hf_resumable.integrations.trainer import ResumableTrainer  # noqa: E402


class DumpAfterLoad(TrainerCallback):
    def __init__(self, output: Path) -> None:
        self.output, self.trainer = output, None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        fx.dump_local_state(model, trainer.optimizer.optimizer, self.output / f"resumed-rank{fx.RANK}.safetensors")
        engine = trainer.model_wrapped
        info = {"lr": trainer.lr_scheduler.get_last_lr(), "global_step": state.global_step,
                "engine_global_steps": int(engine.global_steps), "engine_global_samples": int(engine.global_samples)}
        (self.output / f"resumed-rank{fx.RANK}.json").write_text(json.dumps(info))


def run_accelerate(options, resume: str) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_accelerate_worker import collate, make_rows
    from transformers import get_linear_schedule_with_warmup

    from hf_resumable.integrations.accelerate import ResumableAccelerator

    output = options.output_dir
    output.mkdir(parents=True, exist_ok=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
    accelerator = ResumableAccelerator(fsdp_plugin=plugin, checkpoint_dir=output / "checkpoints",
                                       handle_preemption=False, allow_inexact_resume=True)
    model = fx.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, options.max_steps)
    loader = accelerator.prepare_resumable_dataloader(make_rows(), collate_fn=collate, batch_size=4, seed=0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state(resume)
    fx.dump_local_state(accelerator.unwrap_model(model), optimizer.optimizer,
                        output / f"resumed-rank{fx.RANK}.safetensors")
    info = {"lr": scheduler.get_last_lr(), "global_step": accelerator.global_step}
    (output / f"resumed-rank{fx.RANK}.json").write_text(json.dumps(info))
    steps = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.save_state()
        steps.append(accelerator.global_step)
        if accelerator.global_step >= options.max_steps:
            break
    accelerator.end_training()
    (output / f"result-rank{fx.RANK}.json").write_text(json.dumps({"steps": steps}))
    del model, optimizer, accelerator


def main() -> int:
    at = sys.argv.index("--resume")
    resume = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    options = fx.parse_worker_args()
    if options.engine == "fsdp":
        try:
            run_accelerate(options, resume)
        finally:
            torch.distributed.destroy_process_group()
        return 0
    transformers.logging.set_verbosity_error()
    output = options.output_dir
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    train, collator = build_data("lm", tokenizer, 44)
    args = TrainingArguments(
        output_dir=str(output), per_device_train_batch_size=4, max_steps=options.max_steps, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, logging_steps=1, save_strategy="steps",
        save_steps=1, save_total_limit=2, seed=42, report_to=[], disable_tqdm=True,
        deepspeed=fx.deepspeed_config(options.zero_stage))
    dump = DumpAfterLoad(output)
    trainer = ResumableTrainer(model=fx.build_model(), args=args, train_dataset=train, data_collator=collator,
                               processing_class=tokenizer, callbacks=[dump])
    dump.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=resume)
        fx.write_trainer_result(trainer, output)
    finally:
        del trainer
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
