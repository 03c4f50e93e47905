"""Changing optimization hyperparameters and resuming: every change is reported, old -> new, with the value
that takes effect and how to apply the other one (``resume_hyperparameters="arguments"``)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import datasets
import pytest
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from hf_resumable.integrations.trainer import ResumableTrainer

sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
import train_tiny  # noqa: E402

BASE = dict(learning_rate=1e-3, weight_decay=0.01, max_steps=2, warmup_steps=0, max_grad_norm=1.0,
            lr_scheduler_type="linear", adam_beta2=0.999)


def _trainer(output_dir: Path, **changes) -> ResumableTrainer:
    mode = changes.pop("resume_hyperparameters", "checkpoint")
    settings = {**BASE, **changes}
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, save_steps=2, logging_steps=1,
                             report_to=[], disable_tqdm=True, use_cpu=True, **settings)
    data = datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(24)})
    return ResumableTrainer(model=train_tiny.build_model("gpt2"), args=args, train_dataset=data,
                            data_collator=DataCollatorForLanguageModeling(train_tiny.build_tokenizer(), mlm=False),
                            resume_hyperparameters=mode)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("hparams")
    _trainer(output).train()
    return output / "checkpoint-2"


def _resume(checkpoint: Path, caplog: pytest.LogCaptureFixture, **changes) -> tuple[ResumableTrainer, str]:
    trainer = _trainer(checkpoint.parent, **changes)
    with caplog.at_level(logging.WARNING, logger="hf_resumable"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    messages = [r.getMessage() for r in caplog.records if "changed hyperparameters" in r.getMessage()]
    assert len(messages) <= 1
    return trainer, messages[0] if messages else ""


@pytest.mark.slow
def test_every_changed_hyperparameter_is_reported_with_the_value_in_effect(checkpoint_dir: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    trainer, message = _resume(checkpoint_dir, caplog, learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5,
                               warmup_steps=1, max_steps=4, lr_scheduler_type="cosine", adam_beta2=0.99)
    for expected in ("learning_rate: 0.001 -> 0.005 (0.001 is in effect", "weight_decay: 0.01 -> 0.1 (0.01 is in",
                     "adam_beta2: 0.999 -> 0.99 (0.999 is in effect", "max_grad_norm: 1.0 -> 0.5 (0.5 is in effect",
                     "warmup_steps: 0 -> 1 (1 is in effect", "max_steps: 2 -> 4 (4 is in effect",
                     "lr_scheduler_type: 'linear' -> 'cosine' ('cosine' is in effect",
                     "resume_hyperparameters='arguments'"):
        assert expected in message, message
    # what the message says is what happened: the checkpoint's learning rate, decay and beta were kept
    assert trainer.lr_scheduler.base_lrs == [1e-3, 1e-3]
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.01, 0.0]
    assert all(g["betas"][1] == 0.999 for g in trainer.optimizer.param_groups)
    assert trainer.state.global_step == 4


@pytest.mark.slow
def test_resume_hyperparameters_arguments_applies_the_new_values(checkpoint_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    trainer, message = _resume(checkpoint_dir, caplog, learning_rate=5e-3, weight_decay=0.1, adam_beta2=0.99,
                               max_steps=4, resume_hyperparameters="arguments")
    assert "learning_rate: 0.001 -> 0.005 (0.005 is in effect: written into the restored optimizer" in message
    assert trainer.lr_scheduler.base_lrs == [5e-3, 5e-3]
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]  # the no-decay group stays 0
    assert all(g["betas"][1] == 0.99 for g in trainer.optimizer.param_groups)
    # the first resumed step already trains on the new schedule: linear over 4 steps, at step 2 -> 5e-3 * 2/4
    logged = {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e}
    assert logged[3] == pytest.approx(5e-3 * 2 / 4)


def test_nothing_is_reported_when_nothing_changed(checkpoint_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, message = _resume(checkpoint_dir, caplog, max_steps=2)
    assert message == ""


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="resume_hyperparameters must be one of"):
        ResumableTrainer(model=train_tiny.build_model("gpt2"), resume_hyperparameters="newest")
