"""The ``trainer`` backend of the demo: the same model, data and schedule, trained by ``ResumableTrainer``.

Restarting with the same command calls ``train(resume_from_checkpoint=True)``, which resumes from the
newest checkpoint under ``DIR/checkpoints`` that verifies. Losses are logged every step through a
callback into the same ``losses.jsonl`` as the plain-loop backend (:mod:`hf_resumable.demo.train`),
so :func:`hf_resumable.demo.compare_runs` reads both the same way.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import Any

import torch
from transformers import TrainerCallback

from ._common import (
    CHECKPOINTS_DIR,
    FINAL_FILE,
    LOSSES_FILE,
    RESUMES_FILE,
    DemoConfig,
    append_json,
    build_model,
    load_corpus,
    truncate_log,
    weights_sha256,
)

logger = logging.getLogger(__name__)

__all__ = ["train_with_trainer"]


class _Samples(torch.utils.data.Dataset):
    """Fixed-length byte samples as causal-LM examples (labels = inputs; the model shifts them)."""

    def __init__(self, samples: torch.Tensor) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.samples[index], "labels": self.samples[index]}


class _LossLog(TrainerCallback):
    """Writes every logged training loss to ``losses.jsonl``; trims it on resume; optionally self-kills."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # By now the Trainer has loaded the checkpoint's state: global_step is the resume point.
        truncate_log(self.config.output / LOSSES_FILE, state.global_step)
        if state.global_step > 0:
            append_json(self.config.output / RESUMES_FILE,
                        {"from_step": state.global_step, "checkpoint": f"checkpoint-{state.global_step}"})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        loss = float(logs["loss"])
        append_json(self.config.output / LOSSES_FILE, {"step": state.global_step, "loss": loss,
                                                       "loss_hex": float.hex(loss), "lr": logs.get("learning_rate")})
        if self.config.kill_at is not None and state.global_step == self.config.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def train_with_trainer(config: DemoConfig) -> str:
    """Train with ``ResumableTrainer`` (resuming when a checkpoint exists); return the final weights' sha256.

    Raises:
        ImportError: if ``hf_resumable.integrations.trainer`` cannot be imported.
    """
    from transformers import TrainingArguments

    from ..integrations.trainer import ResumableTrainer

    config.output.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # identical reduction order in every process
    args = TrainingArguments(
        output_dir=str(config.output / CHECKPOINTS_DIR), per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.accumulation, max_steps=config.max_steps, learning_rate=3e-3,
        weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=max(1, config.max_steps // 10),
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=config.save_every,
        save_total_limit=2, seed=config.seed, report_to=[], disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, dataloader_drop_last=True)
    trainer = ResumableTrainer(model=build_model(config.seed, config.block_size), args=args,
                               train_dataset=_Samples(load_corpus(config.block_size)), callbacks=[_LossLog(config)])
    trainer.train(resume_from_checkpoint=True)
    digest = weights_sha256(trainer.accelerator.unwrap_model(trainer.model))
    (config.output / FINAL_FILE).write_text(json.dumps({"steps": config.max_steps, "weights_sha256": digest}) + "\n")
    return digest
