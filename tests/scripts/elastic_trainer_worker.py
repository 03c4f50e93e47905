"""``ResumableTrainer(..., elastic=True)`` on a tiny GPT-2, launched with ``torchrun`` (any ``--nproc-per-node``) or
plain ``python``: the same command line at every world size, as a user would relaunch it.

Usage: ``elastic_trainer_worker.py OUTPUT_DIR [--max-steps N] [--kill-after K] [--dropout P] [--accumulation A]
[--no-elastic] [--stream]`` (``--no-elastic``: the baseline, ``allow_config_drift=True`` instead of ``elastic=True``;
``--stream``: the rows as a shuffled ``datasets`` stream, 40 of them; ``--engine fsdp`` / ``deepspeed``: FSDP2 / ZeRO-2
on gloo CPU ranks through tests/helpers/engine_fixtures.py's shim, launched with torchrun at every world size).

* The data set has variable-length rows and a per-sample random crop that draws from torch's global generator;
  the collator records the index of every row it collates.
* After each optimizer step every rank appends ``{"step": k, "indices": [...]}`` (the samples its micro-batches of
  step ``k`` trained on) to ``OUTPUT_DIR/samples-rank<r>.jsonl``.
* ``--kill-after K``: every rank SIGKILLs itself right after checkpoint-K has committed (blocking saves).
* At the end rank 0 writes ``OUTPUT_DIR/result.json`` (the log history, the gradient accumulation in effect) and
  ``OUTPUT_DIR/final.safetensors`` (the model's parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from safetensors.torch import save_file
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_resumable import ResumableTrainer  # noqa: E402

from helpers import engine_fixtures as fx  # noqa: E402
from helpers.elastic_data import FETCHED, CropRows, collate, crop_stream  # noqa: E402
from helpers.tiny_models import tiny_gpt2  # noqa: E402


class Recorder(TrainerCallback):
    """Append the samples of every optimizer step; SIGKILL this process after checkpoint ``kill_after``."""

    def __init__(self, path: Path, kill_after: int | None) -> None:
        self.path, self.kill_after = path, kill_after

    def on_step_end(self, args, state, control, **kwargs):
        with self.path.open("a") as out:
            out.write(json.dumps({"step": state.global_step, "indices": FETCHED}) + "\n")
        FETCHED.clear()

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--num-samples", type=int, help="rows (default 24 map-style, 40 in a stream); not a multiple "
                        "of the global batch: every epoch ends with a shorter optimizer step")
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--no-elastic", action="store_true", help="the baseline: elastic=False, allow_config_drift")
    parser.add_argument("--stream", action="store_true", help="a datasets stream instead of the map-style rows")
    parser.add_argument("--engine", choices=("ddp", "fsdp", "deepspeed"), default="ddp")
    options = parser.parse_args()
    engine = {"use_cpu": True}
    if options.engine != "ddp":
        fx.install_cpu_engines()  # before TrainingArguments builds accelerate's state
    if options.engine == "deepspeed":
        engine = {"deepspeed": fx.deepspeed_config(2)}
    elif options.engine == "fsdp":
        engine = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                "state_dict_type": "SHARDED_STATE_DICT",
                                                "cpu_ram_efficient_loading": False}}
    rank = int(os.environ.get("RANK", "0"))
    # the script's own settings: 2 ranks x 2 micro-batches of 2 = a global batch of 8; 24 samples = 3 steps/epoch
    args = TrainingArguments(
        output_dir=str(options.output_dir), per_device_train_batch_size=2,
        gradient_accumulation_steps=options.accumulation,
        max_steps=options.max_steps, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, save_steps=1, save_strategy="steps", seed=5, report_to=[],
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, **engine)
    model = tiny_gpt2(resid_pdrop=options.dropout, embd_pdrop=options.dropout, attn_pdrop=options.dropout)
    data = crop_stream(options.num_samples or 40) if options.stream else CropRows(options.num_samples or 24)
    trainer = ResumableTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                               elastic=not options.no_elastic, allow_config_drift=options.no_elastic,
                               save_async=False,
                               callbacks=[Recorder(options.output_dir / f"samples-rank{rank}.jsonl",
                                                   options.kill_after)])
    trainer.train(resume_from_checkpoint=True)
    # every parameter whole (FSDP2's DTensors gathered: collective, every rank)
    state = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().contiguous()
             for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    if rank == 0:
        (options.output_dir / "result.json").write_text(json.dumps({
            "log_history": trainer.state.log_history,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "resumed_from": None if trainer.resumed_from is None else str(trainer.resumed_from)}))
        save_file(state, str(options.output_dir / "final.safetensors"))


if __name__ == "__main__":
    main()
