"""The interrupt grid: runs killed with SIGKILL (or sent SIGTERM) and restarted with the same command
end bit-identical to the run that was never interrupted (every logged loss, every weight, every
optimizer tensor).

Each run is a separate process (tests/trainer_scripts/train_tiny.py); the process kills itself at a
deterministic point chosen by environment variables. One uninterrupted reference run per
configuration is shared by the scenarios of that configuration, and started in the background while
the interrupted run trains (two cores).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_resumable.preemption import PREEMPTION_EXIT_CODE

import zygote

SCRIPT = Path(__file__).parent / "trainer_scripts" / "train_tiny.py"
KILLED = -signal.SIGKILL

# name -> command-line options of train_tiny.py. Data sets: 44 samples, batch 4 -> 11 batches per epoch.
CONFIGS = {
    # GPT-2 with dropout, GA 1, main-process loading.
    "gpt2_ga1": ["--model", "gpt2", "--data", "lm", "--ga", "1", "--epochs", "1"],
    # GA 3 over 11 batches: windows 3,3,3,2 (an epoch that is not a multiple of GA); 2 workers; 2 epochs.
    "gpt2_ga3_w2": ["--model", "gpt2", "--data", "lm", "--ga", "3", "--workers", "2", "--epochs", "2"],
    # BERT + DataCollatorForLanguageModeling masking (torch global RNG in the collator).
    "bert_mlm": ["--model", "bert", "--data", "mlm", "--ga", "2", "--epochs", "1.5"],
    # BERT + whole-word masking, 2 workers.
    "bert_wwm_w2": ["--model", "bert", "--data", "wwm", "--ga", "2", "--workers", "2", "--epochs", "1"],
    # Llama + datasets set_transform drawing from python random and numpy + a custom collator drawing from torch.
    "llama_transform_w2": ["--model", "llama", "--data", "lm_transform", "--ga", "2", "--workers", "2",
                           "--epochs", "1"],
    # torch Dataset.__getitem__ drawing from numpy and torch.
    "gpt2_torch_dataset": ["--model", "gpt2", "--data", "torch_random", "--ga", "1", "--epochs", "1"],
    # Streaming datasets.IterableDataset (4 shards) with a random .map, resumed from its state_dict.
    "stream_w0": ["--model", "gpt2", "--data", "stream", "--samples", "80", "--ga", "2", "--max-steps", "8"],
    "stream_w2": ["--model", "gpt2", "--data", "stream", "--samples", "80", "--ga", "2", "--max-steps", "8",
                  "--workers", "2"],
    # The same with a shuffle buffer (ds.shuffle(seed, buffer_size=16)): hf_resumable's buffer, saved with its
    # content, replaces datasets' (per-worker buffers with 2 workers).
    "stream_shuffle_w0": ["--model", "gpt2", "--data", "stream_shuffle", "--samples", "80", "--ga", "2",
                          "--max-steps", "8"],
    "stream_shuffle_w2": ["--model", "gpt2", "--data", "stream_shuffle", "--samples", "80", "--ga", "2",
                          "--max-steps", "8", "--workers", "2"],
    # DataCollatorForLanguageModeling(seed=123): the collator's own generator, created lazily per worker.
    "bert_mlm_seeded_w2": ["--model", "bert", "--data", "mlm_seeded", "--ga", "2", "--workers", "2", "--epochs", "1"],
    # A custom collator drawing from its own numpy Generator attribute.
    "gpt2_private_rng": ["--model", "gpt2", "--data", "private_rng", "--epochs", "1"],
    # train_sampling_strategy="group_by_length" (lengths 5-20), 2 epochs, GA 2.
    "gpt2_group_by_length": ["--model", "gpt2", "--data", "lm", "--sampling", "group_by_length", "--ga", "2",
                             "--epochs", "2"],
    # A user Trainer subclass (make_resumable) whose _get_train_sampler is a WeightedRandomSampler, 2 epochs.
    "gpt2_user_sampler": ["--model", "gpt2", "--data", "lm", "--weighted-sampler", "--ga", "2", "--epochs", "2"],
    # PEFT LoRA adapters + evaluation every 2 steps + load_best_model_at_end + save_total_limit=2.
    "gpt2_lora_eval": ["--model", "gpt2", "--data", "lm", "--lora", "--eval", "--save-steps", "2",
                       "--save-total-limit", "2", "--epochs", "1"],
}

_REFERENCES: dict[str, subprocess.Popen] = {}


def _env(**kill: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFR_")}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update({f"HFR_{name.upper()}": str(step) for name, step in kill.items()})
    return env


def _start(output_dir: Path, options: list[str], **kill: int) -> subprocess.Popen:
    output_dir.mkdir(parents=True, exist_ok=True)
    log = open(output_dir.parent / f"{output_dir.name}.log", "ab")
    return zygote.Popen([sys.executable, str(SCRIPT), "--output-dir", str(output_dir), *options],
                            env=_env(**kill), stdout=log, stderr=subprocess.STDOUT)


def _wait(process: subprocess.Popen, output_dir: Path, expected: int) -> None:
    code = process.wait(timeout=300)
    log = (output_dir.parent / f"{output_dir.name}.log").read_text(errors="replace")
    assert code == expected, f"exit code {code}, expected {expected}; log tail:\n{log[-3000:]}"


def _run(output_dir: Path, options: list[str], *, expected: int = 0, **kill: int) -> None:
    _wait(_start(output_dir, options, **kill), output_dir, expected)


@pytest.fixture(scope="module")
def reference_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("references")


def _reference(root: Path, name: str) -> Path:
    """Start (once) the uninterrupted run of a configuration; return its output directory."""
    output = root / name
    if name not in _REFERENCES:
        _REFERENCES[name] = _start(output, CONFIGS[name])
    return output


def _finish_reference(root: Path, name: str) -> Path:
    output = root / name
    process = _REFERENCES[name]
    if process.returncode is None:
        _wait(process, output, 0)
    assert process.returncode == 0
    return output


def _load(output_dir: Path, suffix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    return (json.loads((output_dir / f"result{suffix}.json").read_text()),
            load_file(str(output_dir / f"final{suffix}.safetensors")))


def assert_identical(reference: Path, resumed: Path, *, suffix: str = "") -> None:
    """Bitwise equality of logged history, final weights and optimizer state (``suffix``: ``-rank1``... of a rank)."""
    ref_result, ref_tensors = _load(reference, suffix)
    got_result, got_tensors = _load(resumed, suffix)
    assert got_result["global_step"] == ref_result["global_step"]
    assert got_result["lr"] == ref_result["lr"]
    assert got_result["train_output"] == ref_result["train_output"]  # TrainOutput, wall-clock fields removed
    ref_log, got_log = ref_result["log_history"], got_result["log_history"]
    assert [e.get("step") for e in got_log] == [e.get("step") for e in ref_log]
    for ref_entry, got_entry in zip(ref_log, got_log):
        # compared as JSON text: floats exactly (repr round-trips), and a NaN (a grad norm of a step that an fp16
        # GradScaler skipped) equal to a NaN
        assert json.dumps(got_entry, sort_keys=True) == json.dumps(ref_entry, sort_keys=True), (
            f"log entry differs at step {ref_entry.get('step')}")
    assert sorted(got_tensors) == sorted(ref_tensors)
    assert any(k.startswith("optim/") for k in ref_tensors), "optimizer state missing from the dump"
    different = [k for k in ref_tensors if not torch.equal(ref_tensors[k], got_tensors[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _resumed_from(output_dir: Path) -> str | None:
    return json.loads((output_dir / "result.json").read_text()).get("resumed_from")


SIGTERM_EXIT = PREEMPTION_EXIT_CODE


_EXTENDED = pytest.mark.extended  # further cases of a guarantee a make-test case already proves (make test-all)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, interruptions",
    [
        # inside the very first step before any checkpoint exists (restart starts fresh), then right after
        # the first checkpoint, then SIGTERM at step 5 (finishes step 6, saves, exits 143): three restarts
        pytest.param("gpt2_ga1", [({"kill_mid_step": 0}, KILLED), ({"kill_after_save": 1}, KILLED),
                                  ({"sigterm_at": 5}, SIGTERM_EXIT)], id="gpt2-first-step-fresh-sigterm"),
        # exact end of epoch 1 (step 4 of 4), then resuming the resumed run and killing it mid-window
        pytest.param("gpt2_ga3_w2", [({"kill_after_save": 4}, KILLED), ({"kill_mid_step": 5}, KILLED)],
                     id="gpt2-epoch-end-then-again-workers", marks=_EXTENDED),
        # mid-epoch, inside an accumulation window (MLM masking in the collator)
        pytest.param("bert_mlm", [({"kill_mid_step": 3}, KILLED)], id="bert-mlm-mid-window", marks=_EXTENDED),
        pytest.param("bert_wwm_w2", [({"kill_after_save": 2}, KILLED)], id="bert-wwm-workers", marks=_EXTENDED),
        pytest.param("llama_transform_w2", [({"kill_after_save": 3}, KILLED)], id="llama-transform-workers"),
        pytest.param("gpt2_torch_dataset", [({"kill_mid_step": 4}, KILLED)], id="torch-dataset-mid-step",
                     marks=_EXTENDED),
        pytest.param("stream_w0", [({"kill_mid_step": 3}, KILLED)], id="streaming-mid-step", marks=_EXTENDED),
        pytest.param("stream_w2", [({"kill_after_save": 5}, KILLED)], id="streaming-workers", marks=_EXTENDED),
        pytest.param("stream_shuffle_w0", [({"kill_mid_step": 3}, KILLED)], id="streaming-shuffle-buffer",
                     marks=_EXTENDED),
        pytest.param("stream_shuffle_w2", [({"kill_after_save": 5}, KILLED)], id="streaming-shuffle-buffer-workers"),
        pytest.param("gpt2_lora_eval", [({"kill_after_save": 6}, KILLED)], id="lora-eval-best-retention",
                     marks=_EXTENDED),
        pytest.param("bert_mlm_seeded_w2", [({"kill_mid_step": 3}, KILLED)], id="seeded-collator-workers"),
        pytest.param("gpt2_private_rng", [({"kill_after_save": 4}, KILLED)], id="collator-private-generator"),
        pytest.param("gpt2_group_by_length", [({"kill_after_save": 7}, KILLED)], id="group-by-length-second-epoch",
                     marks=_EXTENDED),
        pytest.param("gpt2_user_sampler", [({"kill_mid_step": 8}, KILLED)], id="user-subclass-custom-sampler"),
    ],
)
def test_interrupted_and_restarted_is_bit_identical(reference_root: Path, tmp_path: Path, config: str,
                                                    interruptions: list[tuple[dict[str, int], int]]) -> None:
    _reference(reference_root, config)
    run = tmp_path / "run"
    for kill, expected in interruptions:
        _run(run, CONFIGS[config], expected=expected, **kill)
        if "sigterm_at" in kill:  # the preemption checkpoint is the step after the signal
            assert (run / f"checkpoint-{kill['sigterm_at'] + 1}" / "manifest.json").is_file()
    _run(run, CONFIGS[config])
    assert_identical(_finish_reference(reference_root, config), run)
    last = interruptions[-1][0]
    if "kill_after_save" in last:
        assert _resumed_from(run).endswith(f"checkpoint-{last['kill_after_save']}")
    if "sigterm_at" in last:
        assert _resumed_from(run).endswith(f"checkpoint-{last['sigterm_at'] + 1}")
    if "--save-total-limit" in CONFIGS[config]:  # 2 newest + the best one at most
        assert len(list(run.glob("checkpoint-*"))) <= 3


@pytest.mark.slow
def test_restart_skips_corrupt_and_partial_checkpoints(reference_root: Path, tmp_path: Path) -> None:
    """Killed after checkpoint-7 of 8 (the step before the last); checkpoint-7 is then corrupted and a
    partial checkpoint-8 (no manifest) appears. hf_resumable never writes such a directory (saves commit by
    rename), so it is someone else's: the restart refuses to train into it before the first step. Once it is
    moved away, the restart resumes from checkpoint-6 (skipping the corrupt 7) and still ends identical."""
    config = "gpt2_ga3_w2"
    _reference(reference_root, config)
    run = tmp_path / "run"
    _run(run, CONFIGS[config], expected=KILLED, kill_after_save=7)
    shard = next((run / "checkpoint-7").glob("model*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64])
    partial = run / "checkpoint-8"
    shutil.copytree(run / "checkpoint-6", partial)
    (partial / "manifest.json").unlink()
    _run(run, CONFIGS[config], expected=1)
    log = (tmp_path / "run.log").read_text()
    assert "CheckpointExistsError" in log and "checkpoint-8 (another tool)" in log and "Nothing was trained" in log
    assert "Skipping" in log and "checkpoint-7" in log  # the corrupt one was recognised and passed over
    shutil.move(str(partial), str(tmp_path / "moved-away"))
    _run(run, CONFIGS[config])
    assert _resumed_from(run).endswith("checkpoint-6")
    assert_identical(_finish_reference(reference_root, config), run)
