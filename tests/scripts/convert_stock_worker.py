"""One rank of a STOCK run (no hf_resumable) that writes the checkpoints ``hf-resumable convert`` imports, started by
tests/test_convert_engines.py (2 gloo ranks on CPU, torchrun).

Usage:

* ``torchrun --nproc-per-node 2 convert_stock_worker.py --output-dir DIR --engine deepspeed [--zero-stage 2]``: the
  stock ``transformers.Trainer`` with ``deepspeed=`` (ZeRO-1/2, a torch AdamW), the model, data and arguments of
  ``fsdp_trainer_worker.py``; it saves every step (``checkpoint-N/global_stepN/...``) and stops after
  ``--stop-after`` steps (default ``--max-steps``, which sets the learning-rate schedule).
* ``... --engine fsdp``: the stock ``accelerate.Accelerator`` with FSDP2 and ``SHARDED_STATE_DICT``, the loop of
  ``fsdp_accelerate_worker.py``; ``save_state(DIR/stock)`` after ``--max-steps`` (``pytorch_model_fsdp_0/``,
  ``optimizer_0/``: ``.distcp`` files and a pickled ``.metadata``) after ``--stop-after`` steps.

After the last save every rank writes ``stock-rank{r}.safetensors``: its parameter pieces and optimizer state as it
holds them (``engine_fixtures.dump_local_state``), and ``stock-rank{r}.json``: the learning rate and step counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS / "trainer_scripts"), str(TESTS / "scripts")]

from helpers import engine_fixtures as fx  # noqa: E402

fx.install_cpu_engines()  # before TrainingArguments / Accelerator build accelerate's state

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


def stop_after() -> int | None:
    """``--stop-after N`` (taken off the command line before the shared options are parsed): stop after step N's
    save, with the learning-rate schedule of ``--max-steps``."""
    if "--stop-after" not in sys.argv:
        return None
    at = sys.argv.index("--stop-after")
    value = int(sys.argv[at + 1])
    del sys.argv[at:at + 2]
    return value


class DumpAtSave(TrainerCallback):
    """After the last save: this rank's state as it holds it (the converted checkpoint must resume to exactly it)."""

    def __init__(self, output: Path, last: int) -> None:
        self.output, self.last, self.trainer = output, last, None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step != self.last:
            return
        control.should_training_stop = True
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        fx.dump_local_state(model, trainer.optimizer.optimizer, self.output / f"stock-rank{fx.RANK}.safetensors")
        engine = trainer.model_wrapped
        info = {"lr": trainer.lr_scheduler.get_last_lr(), "global_step": state.global_step,
                "engine_global_steps": int(engine.global_steps), "engine_global_samples": int(engine.global_samples)}
        (self.output / f"stock-rank{fx.RANK}.json").write_text(json.dumps(info))


def run_trainer(options, last: int) -> None:
    from train_tiny import build_data, build_tokenizer

    transformers.logging.set_verbosity_error()
    output = options.output_dir
    tokenizer = build_tokenizer()
    train, collator = build_data("lm", tokenizer, 44)
    args = TrainingArguments(
        output_dir=str(output), per_device_train_batch_size=4, max_steps=options.max_steps, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, logging_steps=1, save_strategy="steps",
        save_steps=1, save_total_limit=2, seed=42, report_to=[], disable_tqdm=True,
        deepspeed=fx.deepspeed_config(options.zero_stage))
    dump = DumpAtSave(output, last)
    trainer = Trainer(model=fx.build_model(), args=args, train_dataset=train, data_collator=collator,
                      processing_class=tokenizer, callbacks=[dump])
    dump.trainer = trainer
    trainer.train()


def run_accelerate(options, last: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_accelerate_worker import collate, make_rows
    from transformers import get_linear_schedule_with_warmup

    output = options.output_dir
    output.mkdir(parents=True, exist_ok=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = fx.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, options.max_steps)
    loader = torch.utils.data.DataLoader(make_rows(), collate_fn=collate, batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    step = 0
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step >= last:
            break
    accelerator.save_state(str(output / "stock"))
    fx.dump_local_state(accelerator.unwrap_model(model), optimizer.optimizer,
                        output / f"stock-rank{fx.RANK}.safetensors")
    info = {"lr": scheduler.get_last_lr(), "global_step": step}
    (output / f"stock-rank{fx.RANK}.json").write_text(json.dumps(info))
    accelerator.end_training()


def main() -> int:
    last = stop_after()
    options = fx.parse_worker_args()
    last = options.max_steps if last is None else last
    try:
        run_trainer(options, last) if options.engine == "deepspeed" else run_accelerate(options, last)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
