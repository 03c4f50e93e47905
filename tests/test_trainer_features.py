"""ResumableTrainer in-process: upstream-internals contract, checkpoint discovery, config drift, and
token-exact gradient accumulation through the wrapper."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

from hf_resumable.errors import CheckpointNotFoundError, ConfigDriftError
from hf_resumable.integrations.trainer import ResumableTrainer, check_trainer_internals

from helpers.trainers import _trainer

sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
import train_tiny  # noqa: E402  (tiny models, tokenizer and data shared with the subprocess grid)


def test_trainer_internals_we_rely_on_are_unchanged() -> None:
    """Fails loudly when a transformers upgrade changes an internal ResumableTrainer overrides or patches."""
    assert check_trainer_internals() == []


def test_either_way_of_skipping_on_resume_is_accepted_and_neither_is_refused(monkeypatch) -> None:
    """transformers < 5.25 calls ``skip_first_batches`` in ``_run_epoch``; 5.25 calls ``get_resumed_dataloader``,
    whose default calls it. Whichever is installed, the other form must be accepted too, and a third refused."""
    import inspect

    from transformers import Trainer

    from hf_resumable.integrations import trainer as integration

    real = inspect.getsource
    run_epoch = real(Trainer._run_epoch)
    forms = ("skip_first_batches(train_dataloader, steps_trained_in_current_epoch)",
             "self.get_resumed_dataloader(train_dataloader, steps_trained_in_current_epoch)")
    installed = next(form for form in forms if form in run_epoch)
    for form, expected in ((forms[0], []), (forms[1], []), ("my_skip(train_dataloader)", ["_run_epoch"])):
        source = run_epoch.replace(installed, form)
        monkeypatch.setattr(integration.inspect, "getsource",
                            lambda obj, source=source: source if obj is Trainer._run_epoch else real(obj))
        problems = integration.check_trainer_internals()
        assert [p.split()[0].removeprefix("Trainer.") for p in problems] == expected, problems
    if hasattr(Trainer, "get_resumed_dataloader"):  # its body must still reach skip_first_batches
        monkeypatch.setattr(integration.inspect, "getsource",
                            lambda obj: "return other(dataloader)" if obj is Trainer.get_resumed_dataloader
                            else real(obj))
        assert any("get_resumed_dataloader" in p for p in integration.check_trainer_internals())


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("trained")
    _trainer(output).train()
    assert (output / "checkpoint-2" / "manifest.json").is_file()
    return output


def test_resume_true_starts_fresh_when_there_is_no_checkpoint(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_steps=1)
    output = trainer.train(resume_from_checkpoint="auto")
    assert trainer.resumed_from is None and output.global_step == 1


def test_resume_from_a_path_that_does_not_exist_raises_what_stock_raises(tmp_path: Path) -> None:
    """Trainer raises ValueError("Can't find a valid checkpoint at <path>"); ours is also a CheckpointNotFoundError."""
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"Can't find a valid checkpoint at .*nope.*no such directory") as err:
        _trainer(tmp_path).train(resume_from_checkpoint=str(missing))
    assert isinstance(err.value, CheckpointNotFoundError) and isinstance(err.value, FileNotFoundError)
    assert not any(tmp_path.iterdir()), "nothing may be written before the error"


def test_resume_from_a_foreign_directory_names_the_converter(tmp_path: Path) -> None:
    foreign = tmp_path / "checkpoint-3"
    foreign.mkdir()
    (foreign / "weights.npz").write_bytes(b"not ours")
    with pytest.raises(ValueError, match=r"Can't find a valid checkpoint at .*checkpoint-3.*hf-resumable convert"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(foreign))
    assert (foreign / "weights.npz").read_bytes() == b"not ours"


def _copy(trained_dir: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(trained_dir / "checkpoint-2", tmp_path / "checkpoint-2")
    return tmp_path


@pytest.mark.parametrize(
    "change, field",
    [({"ga": 2}, "gradient_accumulation_steps"), ({"batch": 2}, "per_device_train_batch_size"),
     ({"seed": 7}, "seed"), ({"samples": 20}, "dataset_length")],
)
def test_config_drift_raises_a_typed_error_naming_the_field(trained_dir: Path, tmp_path: Path, change: dict,
                                                            field: str) -> None:
    trainer = _trainer(_copy(trained_dir, tmp_path), max_steps=3, **change)
    with pytest.raises(ConfigDriftError, match=field):
        trainer.train(resume_from_checkpoint=True)


def test_changed_data_with_the_same_length_is_caught_by_the_fingerprint(trained_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(_copy(trained_dir, tmp_path), max_steps=3)
    trainer.train_dataset = datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(24, seed=5)})
    with pytest.raises(ConfigDriftError, match="dataset_fingerprint") as err:
        trainer.train(resume_from_checkpoint=True)
    assert "dataset_length" not in str(err.value)


def test_world_size_drift_is_caught(trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(_copy(trained_dir, tmp_path), max_steps=3)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ConfigDriftError, match=r"world_size: 1 -> 2"):
        trainer.train(resume_from_checkpoint=True)


def test_every_changed_field_is_named_at_once(trained_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(_copy(trained_dir, tmp_path), max_steps=3, ga=2, seed=7)
    with pytest.raises(ConfigDriftError, match="gradient_accumulation_steps.*seed"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.slow
def test_opting_in_to_drift_warns_and_continues(trained_dir: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(_copy(trained_dir, tmp_path), max_steps=3, batch=2, allow_config_drift=True)
    with caplog.at_level(logging.WARNING, logger="hf_resumable"):
        output = trainer.train(resume_from_checkpoint=True)
    assert output.global_step == 3 and trainer.resumed_from.name == "checkpoint-2"
    assert any("per_device_train_batch_size: 4 -> 2" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


class _GradRecorder(TrainerCallback):
    """Records the accumulated gradient right before every optimizer step."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self.model: torch.nn.Module | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None]))


def _accumulated_grads(tmp_path: Path, *, ga: int, batch: int) -> list[torch.Tensor]:
    tokenizer = train_tiny.build_tokenizer()
    model = train_tiny.build_model("gpt2")
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    # 20 variable-length sequences -> optimizer steps of 8, 8 and 4 samples (a short last window).
    data = datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(20, min_len=3, max_len=24)})
    args = TrainingArguments(output_dir=str(tmp_path / f"ga{ga}"), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=ga, num_train_epochs=1, max_grad_norm=0.0,
                             train_sampling_strategy="sequential", save_strategy="no", report_to=[],
                             disable_tqdm=True, use_cpu=True, learning_rate=1e-3)
    recorder = _GradRecorder()
    trainer = ResumableTrainer(model=model, args=args, train_dataset=data, callbacks=[recorder],
                               data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    return recorder.grads


@pytest.mark.slow
def test_gradient_accumulation_is_token_exact(tmp_path: Path) -> None:
    """GA=4 x batch 2 equals GA=1 x batch 8 (padded causal-LM batches, num_items_in_batch path)."""
    small = _accumulated_grads(tmp_path, ga=4, batch=2)
    big = _accumulated_grads(tmp_path, ga=1, batch=8)
    assert len(small) == len(big) == 3
    for step, (a, b) in enumerate(zip(small, big)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"optimizer step {step}")
    # The case only tests something if micro-batches of a window hold different numbers of label tokens
    # (otherwise mean-of-means would be exact too).
    lengths = [len(row) for row in train_tiny.token_rows(20, min_len=3, max_len=24)]
    tokens_per_micro_batch = [sum(n - 1 for n in lengths[i : i + 2]) for i in range(0, 8, 2)]
    assert len(set(tokens_per_micro_batch)) > 1


def test_preemption_handler_only_flags_and_restores_the_previous_handler() -> None:
    import os
    import signal
    import threading

    from hf_resumable.preemption import PREEMPTION_EXIT_CODE, PreemptionHandler

    assert PREEMPTION_EXIT_CODE == 128 + signal.SIGTERM
    previous = signal.getsignal(signal.SIGTERM)
    handler = PreemptionHandler()
    with handler:
        assert not handler.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.requested and handler.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous
    # Off the main thread nothing is installed (and nothing raises).
    other = PreemptionHandler()
    thread = threading.Thread(target=other.install)
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_sigterm_with_exit_disabled_returns_after_the_checkpoint(tmp_path: Path) -> None:
    import os
    import signal

    class SendSigterm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(tmp_path, max_steps=5, exit_on_preemption=False, callbacks=[SendSigterm()])
    output = trainer.train()
    assert trainer.preempted and output.global_step == 2
    assert (tmp_path / "checkpoint-2" / "manifest.json").is_file()
    assert signal.getsignal(signal.SIGTERM) != trainer._preemption._handle  # handler removed after train()


@pytest.mark.parametrize("resume", ["path", True])
def test_a_resume_opens_and_verifies_the_checkpoint_once(trained_dir: Path, tmp_path: Path, resume,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issues 14 and 17: the Trainer resumes through one open_checkpoint, with the one verification that found the
    checkpoint (discovery's for ``True``, the check of the given path otherwise): every file of the checkpoint is
    opened once and hashed once (all are small here: verification hashes them and the open uses its bytes)."""
    import collections
    import os

    import hf_resumable.checkpoint._reader as reader
    import hf_resumable.checkpoint.api as api
    import hf_resumable.checkpoint.discovery as discovery
    import hf_resumable.checkpoint.verify as verify_module
    import hf_resumable.integrations._trainer_restore as trainer_restore
    from hf_resumable.checkpoint import OpenedCheckpoint, read_manifest

    output_dir = _copy(trained_dir, tmp_path)
    checkpoint = output_dir / "checkpoint-2"
    files = sorted(read_manifest(checkpoint).files)
    verified, opened, opens, hashed, hashed_on_read = [], [], [], [], []
    verify, open_ = verify_module.verify_checkpoint, OpenedCheckpoint.open.__func__
    for module in (api, discovery, trainer_restore):
        monkeypatch.setattr(module, "verify_checkpoint", lambda *a, **k: verified.append(a[0]) or verify(*a, **k))
    monkeypatch.setattr(OpenedCheckpoint, "open",
                        classmethod(lambda cls, *a, **k: opened.append(a[0]) or open_(cls, *a, **k)))
    record_of, read_files, real_open = verify_module.record_of, reader.read_files, os.open
    monkeypatch.setattr(verify_module, "record_of",
                        lambda data, **kw: hashed.append(len(data)) or record_of(data, **kw))
    monkeypatch.setattr(reader, "record_of",
                        lambda data, **kw: hashed_on_read.append(len(data)) or record_of(data, **kw))
    monkeypatch.setattr(reader, "read_files", lambda reads, **kw: hashed_on_read.extend(
        r.path.name for r in reads if r.expected is not None) or read_files(reads, **kw))
    base, resuming = os.path.realpath(checkpoint) + os.sep, [True]
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (
        opens.append(os.path.relpath(os.path.realpath(path), base))
        if resuming[0] and os.path.realpath(path).startswith(base) else None) or real_open(path, *a, **k))

    class FirstStep(TrainerCallback):  # the resume is over once the first resumed step has run
        def on_step_end(self, args, state, control, **kwargs):
            resuming[0] = False

    trainer = _trainer(output_dir, max_steps=3, callbacks=[FirstStep()])
    output = trainer.train(resume_from_checkpoint=str(checkpoint) if resume == "path" else True)
    assert output.global_step == 3 and trainer.resumed_from.name == "checkpoint-2"
    assert [Path(p).name for p in opened] == ["checkpoint-2"], opened
    assert [Path(p).name for p in verified] == ["checkpoint-2"], verified
    reads = collections.Counter(opens)
    assert reads == collections.Counter(files + ["manifest.json", ".durability"]), reads  # the record: read once
    assert len(hashed) == len(files) and hashed_on_read == [], (hashed, hashed_on_read)