"""Switching from the stock ``transformers.Trainer``: its checkpoints in ``output_dir`` are continued from,
never trained over, never deleted.

``train(resume_from_checkpoint=True)`` where the newest checkpoint was written by the stock Trainer
converts it on the fly (``weights_only=True`` pickle reads, with the converter's WARNING) and continues
from its step; that one resume is not bit-exact (and says so), but every checkpoint the run writes from
then on resumes bit for bit. A run that would save over a stock (or any foreign) ``checkpoint-N`` is
refused when ``train`` starts, naming ``hf-resumable convert``.

The stock run and the runs killed with SIGKILL are separate processes (tests/trainer_scripts/train_tiny.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hf_resumable.checkpoint import read_manifest

from helpers.trainer_runs import KILLED, _load, _resumed_from, _run, assert_identical, snapshot

OPTIONS = ["--model", "gpt2", "--data", "lm", "--max-steps", "6", "--save-total-limit", "2"]
STOCK_STEPS = 3


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock Trainer, killed right after saving checkpoint-3 (save_total_limit=2 keeps checkpoint-2 and -3)."""
    output = tmp_path_factory.mktemp("stock") / "run"
    _run(output, OPTIONS + ["--stock", "--no-resume"], expected=KILLED, kill_after_save=STOCK_STEPS)
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert (output / "checkpoint-3" / "optimizer.pt").is_file()
    assert not (output / "checkpoint-3" / "manifest.json").exists()
    return output


@pytest.fixture(scope="module")
def continued(stock_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ResumableTrainer, same command: continues from the stock checkpoint-3 to step 6, uninterrupted."""
    output = tmp_path_factory.mktemp("continued") / "run"
    shutil.copytree(stock_run, output)
    stock_files = snapshot(output / "checkpoint-3")
    _run(output, OPTIONS)
    assert snapshot(output / "checkpoint-3") == stock_files, "the stock checkpoint was modified"
    return output


@pytest.mark.slow
def test_resume_true_continues_from_the_newest_stock_checkpoint(continued: Path) -> None:
    result, _ = _load(continued)
    assert _resumed_from(continued).endswith(f"checkpoint-{STOCK_STEPS}")
    assert result["global_step"] == 6
    assert [e["step"] for e in result["log_history"] if "loss" in e] == list(range(1, 7))  # stock 1-3, ours 4-6
    # retention (save_total_limit=2) removed only hf_resumable checkpoints: the stock ones are all still there
    names = sorted(p.name for p in continued.glob("checkpoint-*"))
    assert names == ["checkpoint-2", "checkpoint-3", "checkpoint-5", "checkpoint-6"]
    assert read_manifest(continued / "checkpoint-6").step == 6
    assert not (continued / ".hf-resumable-converted").exists()  # the converted copy is dropped after the first save
    log = (continued.parent / "run.log").read_text()
    assert "NOT bit-exact" in log and "weights_only=True" in log


@pytest.mark.slow
def test_checkpoints_written_after_the_stock_resume_resume_bit_for_bit(stock_run: Path, continued: Path,
                                                                       tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(stock_run, run)
    _run(run, OPTIONS, expected=KILLED, kill_after_save=5)
    _run(run, OPTIONS)
    assert _resumed_from(run).endswith("checkpoint-5")
    assert_identical(continued, run)


@pytest.mark.slow
def test_a_fresh_run_over_stock_checkpoints_is_refused_before_training(stock_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(stock_run, run)
    before = snapshot(run)
    _run(run, OPTIONS + ["--no-resume"], expected=1)
    log = (tmp_path / "run.log").read_text()
    assert "CheckpointExistsError" in log and "checkpoint-3 (transformers.Trainer)" in log, log[-3000:]
    assert "hf-resumable convert" in log and "Nothing was trained" in log
    assert snapshot(run) == before


@pytest.mark.slow  # its fixture trains a stock run
def test_resuming_an_older_stock_checkpoint_below_a_newer_one_is_refused(stock_run: Path, tmp_path: Path) -> None:
    """Resuming checkpoint-2 would save checkpoint-3, which the stock Trainer wrote: refused at train start."""
    from helpers.trainers import _trainer

    run = tmp_path / "run"
    shutil.copytree(stock_run, run)
    before = snapshot(run)
    from hf_resumable.errors import CheckpointExistsError

    with pytest.raises(CheckpointExistsError, match=r"checkpoint-3 \(transformers.Trainer\)") as err:
        _trainer(run, max_steps=6, samples=44).train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert isinstance(err.value, FileExistsError)
    assert {k: v for k, v in snapshot(run).items() if not k.startswith(".hf-resumable-converted")} == before


def test_end_of_training_deletion_spares_foreign_checkpoints(tmp_path: Path) -> None:
    """save_total_limit=1 with a best checkpoint: Trainer._finalize_training deletes every other checkpoint-N,
    a stock one included; ResumableTrainer deletes only its own."""
    from unittest.mock import patch

    from helpers.trainers import _evaluate_with, regression_trainer

    stock = tmp_path / "checkpoint-99"  # beyond this run's steps: no collision, so the run is not refused
    stock.mkdir()
    (stock / "trainer_state.json").write_text("{}")
    (stock / "model.safetensors").write_bytes(b"stock weights")
    trainer = regression_trainer(tmp_path, eval_strategy="steps", eval_steps=1, save_steps=1, max_steps=3,
                                 metric_for_best_model="accuracy", greater_is_better=True, save_total_limit=1)
    with patch.object(trainer, "_evaluate", side_effect=_evaluate_with([0.9, 0.8, 0.7])):
        trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-99"]
    assert (stock / "model.safetensors").read_bytes() == b"stock weights"
