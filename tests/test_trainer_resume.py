"""The interrupt grid: runs killed with SIGKILL (or sent SIGTERM) and restarted with the same command
end bit-identical to the run that was never interrupted (every logged loss, every weight, every
optimizer tensor).

Each run is a separate process (tests/trainer_scripts/train_tiny.py); the process kills itself at a
deterministic point chosen by environment variables. One uninterrupted reference run per
configuration is shared by the scenarios of that configuration, and started in the background while
the interrupted run trains (two cores).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hf_resumable.preemption import PREEMPTION_EXIT_CODE

from helpers.trainer_runs import (
    CONFIGS,
    KILLED,
    _resumed_from,
    _run,
    _start,
    _wait,
    assert_identical,
)

_REFERENCES: dict[str, subprocess.Popen] = {}


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
