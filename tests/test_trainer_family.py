"""The Trainer family through ``make_resumable``: TRL's SFTTrainer (with and without ``peft_config``),
DPOTrainer and GRPOTrainer, and transformers' Seq2SeqTrainer with ``predict_with_generate`` evaluation,
killed with SIGKILL and restarted with the same command, end bit-identical to the uninterrupted run:
every logged metric (TRL's ``num_tokens``, ``entropy``, ``mean_token_accuracy``, DPO's reward metrics, generated-token
evaluation metrics), the final weights and the optimizer state.

Each run is a separate process (tests/trainer_scripts/train_family.py); checkpoints every step, metrics
logged every 2 steps, so the checkpoint of an odd step holds metrics TRL has collected but not logged yet.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import zygote
from helpers.trainer_runs import KILLED, _env, _load, _resumed_from, assert_identical

pytest.importorskip("trl", reason="trl is a test dependency (setup.cfg [test])")

SCRIPT = Path(__file__).parent / "trainer_scripts" / "train_family.py"
TRAINERS = ("sft", "sft_peft", "dpo", "grpo", "seq2seq")
_REFERENCES: dict[str, subprocess.Popen] = {}


def _start(output_dir: Path, trainer: str, **kill: int) -> subprocess.Popen:
    output_dir.mkdir(parents=True, exist_ok=True)
    log = open(output_dir.parent / f"{output_dir.name}.log", "ab")
    return zygote.Popen([sys.executable, str(SCRIPT), "--output-dir", str(output_dir), "--trainer", trainer],
                            env=_env(**kill), stdout=log, stderr=subprocess.STDOUT)


def _wait(process: subprocess.Popen, output_dir: Path, expected: int) -> None:
    code = process.wait(timeout=600)
    log = (output_dir.parent / f"{output_dir.name}.log").read_text(errors="replace")
    assert code == expected, f"exit code {code}, expected {expected}; log tail:\n{log[-3000:]}"


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the uninterrupted runs go; each test starts its own in the background, beside its kill/restart."""
    root = tmp_path_factory.mktemp("family-references")
    yield root
    for process in _REFERENCES.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def _begin_reference(root: Path, trainer: str) -> None:
    if trainer not in _REFERENCES:
        _REFERENCES[trainer] = _start(root / trainer, trainer)


def _reference(root: Path, trainer: str) -> Path:
    _begin_reference(root, trainer)
    process = _REFERENCES[trainer]
    if process.returncode is None:
        _wait(process, root / trainer, 0)
    return root / trainer


@pytest.mark.slow
@pytest.mark.parametrize("trainer, kill", [
    ("sft", {"kill_after_save": 3}),        # between two logs: TRL's pending metrics are in the checkpoint
    ("sft_peft", {"kill_mid_step": 2}),     # inside step 3 (after its first micro-batch); LoRA adapters
    pytest.param("dpo", {"kill_after_save": 3}, marks=pytest.mark.extended),
    # sampled completions: generation draws from the restored RNG
    pytest.param("grpo", {"kill_after_save": 3}, marks=pytest.mark.extended),
    # after the generate-based evaluation of step 2
    pytest.param("seq2seq", {"kill_after_save": 3}, marks=pytest.mark.extended),
], ids=TRAINERS)
def test_killed_and_restarted_is_bit_identical(references: Path, tmp_path: Path, trainer: str,
                                               kill: dict[str, int]) -> None:
    _begin_reference(references, trainer)
    run = tmp_path / "run"
    _wait(_start(run, trainer, **kill), run, KILLED)
    _wait(_start(run, trainer), run, 0)
    reference = _reference(references, trainer)
    assert _resumed_from(run).endswith(f"checkpoint-{kill.get('kill_after_save', kill.get('kill_mid_step'))}")
    assert_identical(reference, run)
    logged = {key for entry in _load(run)[0]["log_history"] for key in entry}
    expected = {"sft": {"num_tokens", "entropy", "mean_token_accuracy"},
                "sft_peft": {"num_tokens", "mean_token_accuracy"},
                "dpo": {"rewards/chosen", "rewards/margins", "rewards/accuracies"},
                "grpo": {"reward", "reward_std", "num_tokens", "completions/mean_length"},
                "seq2seq": {"eval_token_accuracy", "eval_loss"}}[trainer]
    assert expected <= logged, f"the comparison covers {sorted(expected - logged)} only if they are logged"
    if trainer.startswith("sft"):
        assert (run / "README.md").is_file()  # SFTTrainer's own _save_checkpoint extra (the model card) still runs


def test_make_resumable_keeps_the_subclass_and_takes_the_options() -> None:
    import transformers
    from trl import SFTTrainer

    from hf_resumable.integrations.trainer import ResumableTrainer, make_resumable

    resumable = make_resumable(SFTTrainer)
    assert resumable is make_resumable(SFTTrainer) and resumable.__name__ == "ResumableSFTTrainer"
    order = resumable.__mro__
    assert order.index(SFTTrainer) < order.index(ResumableTrainer) < order.index(transformers.Trainer)
    assert resumable._save_checkpoint is SFTTrainer._save_checkpoint  # SFT's override first, ours via super()
    seq2seq = make_resumable(transformers.Seq2SeqTrainer, state_attributes=("_gen_kwargs",))
    assert "_gen_kwargs" in seq2seq.resumable_state_attributes
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        make_resumable(dict)
