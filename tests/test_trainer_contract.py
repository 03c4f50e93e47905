"""ResumableTrainer refuses, before the first step, what would otherwise fail or resume inexactly hours later.

In-process (no kill needed: nothing is trained). Each case checks the error type, that the message names
the fix, that no step ran and no checkpoint was written, and that ``allow_inexact_resume=True`` trains anyway.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState

from hf_resumable.errors import InexactResumeError, UnsupportedStateError
from hf_resumable.integrations.trainer import ResumableTrainer

sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
import train_tiny  # noqa: E402


class _Steps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def _trainer(output_dir: Path, data=None, *, callbacks=(), allow_inexact_resume: bool = False,
             **arguments) -> tuple[ResumableTrainer, _Steps]:
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=2, save_steps=1,
                    logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, learning_rate=1e-3)
    settings.update(arguments)
    steps = _Steps()
    data = data if data is not None else datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(16)})
    collator = DataCollatorForLanguageModeling(train_tiny.build_tokenizer(), mlm=False)
    trainer = ResumableTrainer(model=train_tiny.build_model("gpt2"), args=TrainingArguments(**settings),
                               train_dataset=data, data_collator=collator, callbacks=[steps, *callbacks],
                               allow_inexact_resume=allow_inexact_resume)
    return trainer, steps


class _PlainStream(torch.utils.data.IterableDataset):
    """A torch IterableDataset without state_dict()/load_state_dict()."""

    def __iter__(self):
        for row in train_tiny.token_rows(40):
            yield {"input_ids": row}


def _refused(trainer: ResumableTrainer, steps: _Steps, output_dir: Path, error: type, *patterns: str) -> None:
    with pytest.raises(error) as caught:
        trainer.train()
    for pattern in patterns:
        assert pattern in str(caught.value), str(caught.value)
    assert "Nothing was trained" in str(caught.value)
    assert steps.steps == 0
    assert not list(output_dir.glob("checkpoint-*"))


def test_a_stream_without_state_dict_is_refused_at_train_start(tmp_path: Path) -> None:
    trainer, steps = _trainer(tmp_path, _PlainStream())
    _refused(trainer, steps, tmp_path, InexactResumeError, "_PlainStream", "state_dict()", "datasets.IterableDataset",
             "allow_inexact_resume=True")


@pytest.mark.slow
def test_a_stream_without_state_dict_trains_when_inexact_resume_is_allowed(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    trainer, steps = _trainer(tmp_path, _PlainStream(), allow_inexact_resume=True)
    with caplog.at_level(logging.WARNING, logger="hf_resumable"):
        trainer.train()
    assert steps.steps == 2 and (tmp_path / "checkpoint-2" / "manifest.json").is_file()
    assert any("NOT continue bit for bit" in r.getMessage() for r in caplog.records)
    # the restart re-reads the stream from its start to skip what was trained (stock behaviour), with a WARNING
    again, _ = _trainer(tmp_path, _PlainStream(), allow_inexact_resume=True, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="hf_resumable"):
        assert again.train(resume_from_checkpoint=True).global_step == 3
    assert any("read again and dropped" in r.getMessage() for r in caplog.records)


def test_save_only_model_is_refused_at_train_start(tmp_path: Path) -> None:
    trainer, steps = _trainer(tmp_path, save_only_model=True)
    _refused(trainer, steps, tmp_path, InexactResumeError, "save_only_model=True", "save_only_model=False")


def test_save_only_model_without_saving_is_not_refused(tmp_path: Path) -> None:
    trainer, steps = _trainer(tmp_path, save_only_model=True, save_strategy="no")
    trainer.train()
    assert steps.steps == 2


def test_an_unsupported_sampling_strategy_is_refused_at_train_start(tmp_path: Path) -> None:
    trainer, steps = _trainer(tmp_path, train_sampling_strategy="batch_rebalance")
    _refused(trainer, steps, tmp_path, InexactResumeError, "train_sampling_strategy='batch_rebalance'")


class _Unserializable(TrainerCallback, ExportableState):
    def state(self) -> dict:
        return {"args": {}, "attributes": {"started": object()}}


def test_a_callback_state_that_cannot_be_saved_is_refused_at_train_start(tmp_path: Path) -> None:
    trainer, steps = _trainer(tmp_path, callbacks=[_Unserializable()])
    _refused(trainer, steps, tmp_path, UnsupportedStateError, "_Unserializable.state()")
