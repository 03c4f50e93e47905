"""What transformers' own trainer tests check, held by ResumableTrainer.

Ported from ``tests/trainer/test_trainer_checkpointing.py``, ``test_trainer_resume.py`` and
``test_trainer_callback.py`` of transformers (same scenarios and assertions, written for this suite: a
tiny regression model, in-process), apart from what ResumableTrainer changes on purpose: checkpoint file
names (no ``optimizer.pt``/``scheduler.pt``/``rng_state.pth``/``training_args.bin``: no pickle), a resume
whose batch size or accumulation changed (``ConfigDriftError``), and ``resume_from_checkpoint=True`` in an
empty ``output_dir`` (a fresh start). docs/trainer.md lists every difference.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from unittest.mock import patch

import pytest
from transformers import (
    EarlyStoppingCallback,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
    default_data_collator,
)
from transformers.trainer_callback import ExportableState

from hf_resumable.checkpoint import load_checkpoint, read_manifest
from hf_resumable.errors import CheckpointNotFoundError, ConfigDriftError
from hf_resumable.integrations.trainer import ResumableTrainer

from helpers.trainers import (
    RegressionConfig,
    RegressionDataset,
    RegressionModel,
    RegressionPreTrainedModel,
    _checkpoints,
    _evaluate_with,
    regression_trainer,
)


def _params(trainer: Trainer) -> tuple[float, float]:
    return trainer.model.a.item(), trainer.model.b.item()


def assert_same_trainer_state(state: dict, state1: dict) -> None:
    """transformers' check_trainer_state_are_the_same: all of TrainerState, log history but wall-clock fields."""
    state, state1 = dict(state), dict(state1)
    history, history1 = state.pop("log_history"), state1.pop("log_history")
    assert state == state1
    skip = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
    assert len(history) == len(history1)
    for log, log1 in zip(history, history1):
        assert {k: v for k, v in log.items() if k not in skip} == {k: v for k, v in log1.items() if k not in skip}


# ---- resume (TrainerResumeTrainingTest) ----

@pytest.mark.slow
@pytest.mark.parametrize("pretrained", [True, False], ids=["PreTrainedModel", "nn.Module"])
def test_can_resume_training(tmp_path: Path, pretrained: bool) -> None:
    kwargs = dict(train_len=128, save_steps=5, learning_rate=0.1, logging_steps=5, pretrained=pretrained)
    trainer = regression_trainer(tmp_path, **kwargs)
    trainer.train()
    params, state = _params(trainer), dataclasses.asdict(trainer.state)
    assert (tmp_path / "checkpoint-5" / "model.safetensors").is_file()  # PreTrainedModel or not, as stock saves it
    for checkpoint in ("checkpoint-5", "checkpoint-15"):  # mid-epoch, and after an epoch boundary
        resumed = regression_trainer(tmp_path, **kwargs)
        resumed.train(resume_from_checkpoint=str(tmp_path / checkpoint))
        assert _params(resumed) == params
        assert_same_trainer_state(state, dataclasses.asdict(resumed.state))


def test_resume_from_a_bogus_checkpoint_fails_like_stock(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at") as err:
        regression_trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-15-bogus"))
    assert isinstance(err.value, CheckpointNotFoundError)


def test_resume_true_in_an_empty_output_dir_starts_fresh(tmp_path: Path) -> None:
    """Stock raises "No valid checkpoint found"; the same command must work before and after a crash here."""
    trainer = regression_trainer(tmp_path, max_steps=2)
    assert trainer.train(resume_from_checkpoint=True).global_step == 2 and trainer.resumed_from is None


def test_training_with_resume_from_checkpoint_false(tmp_path: Path) -> None:
    regression_trainer(tmp_path, max_steps=3, save_steps=5).train(resume_from_checkpoint=False)


@pytest.mark.slow
def test_resume_training_with_gradient_accumulation(tmp_path: Path) -> None:
    kwargs = dict(train_len=128, gradient_accumulation_steps=2, per_device_train_batch_size=4, save_steps=5,
                  learning_rate=0.1)
    trainer = regression_trainer(tmp_path, **kwargs)
    trainer.train()
    resumed = regression_trainer(tmp_path, **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert _params(resumed) == _params(trainer)
    assert_same_trainer_state(dataclasses.asdict(trainer.state), dataclasses.asdict(resumed.state))


@pytest.mark.slow
def test_resume_training_with_frozen_params(tmp_path: Path) -> None:
    kwargs = dict(train_len=128, per_device_train_batch_size=4, save_steps=5, learning_rate=0.1)
    trainer = regression_trainer(tmp_path, **kwargs)
    trainer.model.a.requires_grad_(False)
    trainer.train()
    resumed = regression_trainer(tmp_path, **kwargs)
    resumed.model.a.requires_grad_(False)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert not resumed.model.a.requires_grad
    assert _params(resumed) == _params(trainer)
    assert_same_trainer_state(dataclasses.asdict(trainer.state), dataclasses.asdict(resumed.state))


def test_resume_with_another_batch_size_is_refused_not_silently_different(tmp_path: Path) -> None:
    """Stock resumes with the new batch size (its test_resume_training_with_different_batch_size); the run would
    then not continue the checkpoint's, so ResumableTrainer refuses unless allow_config_drift=True."""
    regression_trainer(tmp_path, max_steps=2, save_steps=1, per_device_train_batch_size=2).train()
    with pytest.raises(ConfigDriftError, match="per_device_train_batch_size: 2 -> 4"):
        regression_trainer(tmp_path, max_steps=4, save_steps=1, per_device_train_batch_size=4).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    drifted = regression_trainer(tmp_path, max_steps=4, save_steps=1, per_device_train_batch_size=4,
                                 trainer_class=_drift_allowed)
    drifted.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert drifted._train_batch_size == 4  # the new batch size is the one used, as in stock


def _drift_allowed(**kwargs) -> ResumableTrainer:
    return ResumableTrainer(allow_config_drift=True, **kwargs)


def test_compare_trainer_and_checkpoint_args_logging(tmp_path: Path) -> None:
    regression_trainer(tmp_path, train_len=128, eval_steps=5, save_steps=5, learning_rate=0.1).train()
    resumed = regression_trainer(tmp_path, train_len=128, eval_steps=10, save_steps=10, learning_rate=0.1)
    with patch("transformers.trainer_utils.logger.warning_once") as warn:
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    text = " ".join(str(call.args[0]) for call in warn.call_args_list)
    assert "save_steps: 10 (from args) != 5 (from trainer_state.json)" in text
    assert "eval_steps: 10 (from args) != 5 (from trainer_state.json)" in text


def test_resume_from_interrupted_training_into_another_output_dir(tmp_path: Path) -> None:
    """Port of test_resume_from_interrupted_training: the first run stops at max_steps=2, the second, in another
    output_dir and without max_steps, resumes from its checkpoint-2 and finishes the epoch."""
    first = regression_trainer(tmp_path / "initial", train_len=100, per_device_train_batch_size=2,
                               gradient_accumulation_steps=3, save_steps=1, max_steps=2, num_train_epochs=1)
    first.train()
    assert (tmp_path / "initial" / "checkpoint-2").is_dir()
    resumed = regression_trainer(tmp_path / "resumed", train_len=100, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=3, save_steps=1, num_train_epochs=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "initial" / "checkpoint-2"))
    steps_per_epoch = -(-100 // (2 * 3))
    assert resumed.state.global_step == steps_per_epoch
    final = tmp_path / "resumed" / f"checkpoint-{steps_per_epoch}"
    assert read_manifest(final).step == steps_per_epoch
    model = RegressionPreTrainedModel.from_pretrained(final)  # the weights load the HF way
    assert model.a.item() == resumed.model.a.item()


def test_resume_batch_order(tmp_path: Path) -> None:
    """Port of test_resume_batch_order: the samples seen after resuming from checkpoint-6 (inside epoch 1) are the
    ones the uninterrupted run saw. The model records what it sees (in a Python list: a growing buffer would need
    load_state_dict semantics for a shape change, which the core load path does not offer yet)."""

    class Recording(RegressionModel):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def forward(self, input_x, labels=None):
            self.seen += [round(float(v) * 1e6) for v in input_x]
            return super().forward(input_x, labels)

    def run(output_dir: Path, checkpoint: str | None) -> list[int]:
        args = TrainingArguments(str(output_dir), seed=42, learning_rate=0.1, per_device_train_batch_size=2,
                                 save_steps=1, num_train_epochs=3, optim="sgd", report_to=[], use_cpu=True,
                                 disable_tqdm=True)
        trainer = ResumableTrainer(model=Recording(), args=args, train_dataset=RegressionDataset(10))
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer.model.seen

    baseline = run(tmp_path / "baseline", None)
    resumed = run(tmp_path / "resume", str(tmp_path / "baseline" / "checkpoint-6"))
    assert len(baseline) == 30 and resumed == baseline[6 * 2:]


# ---- checkpoints, rotation, best model (TrainerCheckpointRotationTest, TrainerBestModelTest) ----


def test_save_checkpoints_and_trainer_state(tmp_path: Path) -> None:
    trainer = regression_trainer(tmp_path, save_steps=5, logging_steps=5)
    trainer.train()
    total = trainer.state.global_step
    assert _checkpoints(tmp_path) == list(range(5, total, 5)) + [total]
    state = TrainerState.load_from_json(str(tmp_path / f"checkpoint-{total}" / "trainer_state.json"))
    assert state.global_step == total and state.log_history == trainer.state.log_history[:-1]  # but the train summary
    # stock's check_saved_checkpoints, less the pickle files: the weights where upstream tools look for them
    for step in _checkpoints(tmp_path):
        for name in ("model.safetensors", "trainer_state.json", "config.json"):
            assert (tmp_path / f"checkpoint-{step}" / name).is_file(), (step, name)


def test_checkpoint_rotation(tmp_path: Path) -> None:
    trainer = regression_trainer(tmp_path / "plain", save_steps=5, save_total_limit=2)
    trainer.train()
    total = trainer.state.global_step
    assert _checkpoints(tmp_path / "plain") == [total - total % 5 if total % 5 else total - 5, total]
    best = regression_trainer(tmp_path / "best", save_steps=5, eval_steps=5, eval_strategy="steps",
                              load_best_model_at_end=True, save_total_limit=2)
    best.train()
    kept = _checkpoints(tmp_path / "best")
    best_step = int(Path(best.state.best_model_checkpoint).name.split("-")[1])
    assert best_step in kept and best.state.global_step in kept and len(kept) <= 3


def test_save_total_limit_1_keeps_only_the_best_checkpoint(tmp_path: Path) -> None:
    """Case 5 of test_best_model_checkpoint_behavior: best metric at step 1, save_total_limit=1."""
    trainer = regression_trainer(tmp_path, eval_strategy="steps", eval_steps=1, save_steps=1, max_steps=3,
                                 metric_for_best_model="accuracy", greater_is_better=True, save_total_limit=1)
    with patch.object(trainer, "_evaluate", side_effect=_evaluate_with([0.9, 0.8, 0.7])):
        trainer.train()
    assert trainer.state.best_metric == 0.9 and trainer.state.best_global_step == 1
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["checkpoint-1"]


def test_best_model_checkpoint_is_none_without_a_saved_best_step(tmp_path: Path) -> None:
    """Case 6: evaluation every 3 steps, saves every 2: the best step (3) has no checkpoint."""
    trainer = regression_trainer(tmp_path, eval_strategy="steps", eval_steps=3, save_steps=2, max_steps=6,
                                 metric_for_best_model="accuracy", greater_is_better=True)
    with patch.object(trainer, "_evaluate", side_effect=_evaluate_with([0.9, 0.8, 0.7])):
        trainer.train()
    assert trainer.state.best_global_step == 3 and trainer.state.best_model_checkpoint is None
    assert _checkpoints(tmp_path) == [2, 4, 6]


@pytest.mark.parametrize("pretrained", [True, False], ids=["PreTrainedModel", "nn.Module"])
def test_load_best_model_at_end(tmp_path: Path, pretrained: bool) -> None:
    trainer = regression_trainer(tmp_path, learning_rate=0.1, eval_steps=5, eval_strategy="steps", save_steps=5,
                                 load_best_model_at_end=True, pretrained=pretrained)
    trainer.train()
    losses = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    best_step = min(losses, key=losses.get)
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_step}")
    model = RegressionPreTrainedModel(RegressionConfig()) if pretrained else RegressionModel()
    load_checkpoint(tmp_path / f"checkpoint-{best_step}", model=model, restore_rng=False)
    assert _params(trainer) == (model.a.item(), model.b.item())
    assert trainer.evaluate()["eval_loss"] == losses[best_step]


def test_collator_tokenizer_is_saved_when_there_is_no_processing_class(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
    import train_tiny

    class FakeCollator:
        def __init__(self) -> None:
            self.tokenizer = train_tiny.build_tokenizer()
            self.tokenizer.add_tokens(["<NEW_TOKEN1>", "<NEW_TOKEN2>"])

        def __call__(self, features, return_tensors="pt"):
            return default_data_collator(features, return_tensors)

    trainer = regression_trainer(tmp_path, max_steps=1, save_steps=1)
    trainer.data_collator = FakeCollator()
    trainer.train()
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tmp_path / "checkpoint-1")) == len(trainer.data_collator.tokenizer)


# ---- callbacks (test_trainer_callback.py) ----

class EventRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")
            return lambda *args, **kwargs: events.append(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("arguments", [
    {}, {"logging_steps": 5}, {"save_steps": 5}, {"eval_steps": 5, "eval_strategy": "steps"},
    {"eval_strategy": "epoch"}, {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
], ids=["default", "log-5", "save-5", "eval-5", "eval-epoch", "mixed"])
def test_event_flow_is_the_stock_one(tmp_path: Path, arguments: dict) -> None:
    """Exactly the callback events, in the order, the stock Trainer sends (test_event_flow's configurations)."""
    flows = []
    for trainer_class in (Trainer, ResumableTrainer):
        recorder = EventRecorder()
        trainer = regression_trainer(tmp_path / trainer_class.__name__, callbacks=[recorder],
                                     trainer_class=trainer_class, max_steps=16, **arguments)
        trainer.train()
        flows.append(recorder.events)
    assert flows[1] == flows[0]


def test_default_callbacks_are_the_stock_ones(tmp_path: Path) -> None:
    names = [[type(cb).__name__ for cb in regression_trainer(tmp_path, trainer_class=cls).callback_handler.callbacks]
             for cls in (Trainer, ResumableTrainer)]
    assert names[1] == names[0]


class StatefulTestCallback(TrainerCallback, ExportableState):
    def __init__(self, my_value: str = "default") -> None:
        self.my_value = my_value

    def state(self) -> dict:
        return {"args": {"my_value": self.my_value}, "attributes": {}}


_EVAL_AND_SAVE = dict(load_best_model_at_end=True, save_strategy="steps", eval_strategy="steps", save_steps=2,
                      eval_steps=2, max_steps=2)


def test_early_stopping_state_persists_by_default(tmp_path: Path) -> None:
    """test_early_stopping_state_persists, without restore_callback_states_from_checkpoint=True."""
    regression_trainer(tmp_path, callbacks=[EarlyStoppingCallback(5, 0.2)], **_EVAL_AND_SAVE).train()
    trainer = regression_trainer(tmp_path, callbacks=[EarlyStoppingCallback()], **_EVAL_AND_SAVE)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    restored = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback)]
    assert [(cb.early_stopping_patience, cb.early_stopping_threshold) for cb in restored] == [(5, 0.2)]


def test_multiple_instances_of_the_same_stateful_callback(tmp_path: Path) -> None:
    regression_trainer(tmp_path, callbacks=[StatefulTestCallback("first"), StatefulTestCallback("second")],
                       **_EVAL_AND_SAVE).train()
    trainer = regression_trainer(tmp_path, callbacks=[StatefulTestCallback(), StatefulTestCallback()],
                                 **_EVAL_AND_SAVE)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    restored = [cb.my_value for cb in trainer.callback_handler.callbacks if isinstance(cb, StatefulTestCallback)]
    assert restored == ["first", "second"]


def test_missing_stateful_callback_warning(tmp_path: Path) -> None:
    regression_trainer(tmp_path, callbacks=[EarlyStoppingCallback()], **_EVAL_AND_SAVE).train()
    arguments = {k: v for k, v in _EVAL_AND_SAVE.items() if k != "load_best_model_at_end"}
    trainer = regression_trainer(tmp_path, **arguments)
    with patch("transformers.trainer.logger.warning") as warn:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert any("EarlyStoppingCallback" in str(call.args[0]) for call in warn.call_args_list)


def test_trainer_control_state_persists(tmp_path: Path) -> None:
    regression_trainer(tmp_path, max_steps=2, save_steps=2).train()
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["TrainerControl"]["args"]["should_training_stop"] is True
    trainer = regression_trainer(tmp_path, max_steps=2)
    trainer.state = TrainerState.load_from_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    trainer._load_callback_state()
    assert trainer.control.should_training_stop


def test_no_pickle_files_in_checkpoints(tmp_path: Path) -> None:
    """The deliberate difference: optimizer, scheduler, RNG and arguments are stored without pickle."""
    regression_trainer(tmp_path, max_steps=2, save_steps=2).train()
    names = {p.name for p in (tmp_path / "checkpoint-2").rglob("*") if p.is_file()}
    assert not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "scaler.pt"}
    assert {"trainer_state.json", "config.json", "manifest.json"} <= names
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".pt", ".pth", ".bin"))]
