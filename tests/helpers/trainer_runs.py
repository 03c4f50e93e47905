"""``tests/trainer_scripts/train_tiny.py`` run as a separate process, and the bit-for-bit comparison of its outputs.

The interrupt grid (tests/test_trainer_resume.py) and every test that kills a Trainer run and reruns the same command
(callbacks, rerun, stock, family, PEFT, async, fallback, preemption, restart, GPU) start the script with
:func:`_start` / :func:`_run` (killing itself where the ``HFR_*`` variables of :func:`_env` say), and compare the
rerun with the uninterrupted run with :func:`assert_identical`. :func:`torchrun` runs it as a 2-process DDP job.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import zygote
from helpers.distributed_launch import run_torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "trainer_scripts" / "train_tiny.py"


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


_SCRIPT_OUTPUTS = ("result.json", "final.safetensors")


def snapshot(output_dir: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``output_dir`` (hidden ones included) but the script's own result files:
    relative path -> (size, mtime_ns, sha256)."""
    entries = {}
    for path in sorted(output_dir.rglob("*")):
        rel = path.relative_to(output_dir).as_posix()
        if rel in _SCRIPT_OUTPUTS:
            continue
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        entries[rel] = (stat.st_size if path.is_file() else 0, stat.st_mtime_ns, digest)
    return entries


# ------------------------------------------------------------------ the same script as a 2-process torchrun job

# 44 samples, batch 4 per rank, 2 ranks: 6 batches per rank and epoch; GPT-2 with dropout, GA 1.
OPTIONS = ["--model", "gpt2", "--data", "lm", "--max-steps", "6"]
RANK_SUFFIXES = ("", "-rank1")


def torchrun(output_dir: Path, *, timeout: float = 180, **kill: int) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 train_tiny.py`` (the same command every time; ``kill`` sets HFR_* variables).

    The job runs in its own session; if it outlives ``timeout`` the whole tree is SIGKILLed and the test fails.
    """
    return run_torchrun(SCRIPT, ["--output-dir", str(output_dir), *OPTIONS], env=_env(**kill), timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("reference2") / "run"
    done = torchrun(output)
    assert done.returncode == 0, done.stdout[-5000:]
    return output


def _assert_every_rank_identical(reference: Path, run: Path, resumed_from: str) -> None:
    for suffix in RANK_SUFFIXES:
        assert_identical(reference, run, suffix=suffix)
        result = json.loads((run / f"result{suffix}.json").read_text())
        assert result["resumed_from"].endswith(resumed_from)
