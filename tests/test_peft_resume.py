"""Runs whose base is frozen, killed with SIGKILL and restarted with the same command, end bit-identical to the
uninterrupted run, while their checkpoints hold only the trainable part (the base is recorded, not stored):

* LoRA (dropout 0.1 in the adapter) on GPT-2 and on Llama (with ``modules_to_save=["lm_head"]``);
* a full fine-tune of GPT-2 with the input embedding (tied to the LM head) frozen;
* LoRA on a bitsandbytes 4-bit (nf4) Llama base, on CPU;
* TRL's ``SFTTrainer`` with ``peft_config`` (through ``make_resumable``).

Each run is a separate process (tests/trainer_scripts/train_peft.py, train_family.py). The base model is written
once with ``save_pretrained`` and every process loads it with ``from_pretrained``. A restart with another base is
refused before the first step and leaves the checkpoint untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import read_manifest, verify_checkpoint
from hf_resumable.constants import FROZEN_RECORD_FILE, MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE
from hf_resumable.format.safetensors_io import STR_TO_DTYPE

from helpers.trainer_runs import KILLED, _env, _resumed_from, assert_identical
from helpers.zygote import Popen as spawn

SCRIPTS = Path(__file__).parent / "trainer_scripts"
sys.path.insert(0, str(SCRIPTS))
from train_tiny import build_model  # noqa: E402 - the tiny GPT-2 / Llama (with dropout) of the trainer scripts

CONFIGS = {
    "gpt2_lora": ["--model", "gpt2", "--mode", "lora"],
    "llama_lora": ["--model", "llama", "--mode", "lora"],
    "gpt2_frozen_embedding": ["--model", "gpt2", "--mode", "frozen_embedding"],
    "llama_qlora4": ["--model", "llama", "--mode", "qlora4"],
}
_REFERENCES: dict[str, subprocess.Popen] = {}


def _start(output_dir: Path, options: list[str], *, script: str = "train_peft.py", **kill: int) -> subprocess.Popen:
    output_dir.mkdir(parents=True, exist_ok=True)
    log = open(output_dir.parent / f"{output_dir.name}.log", "ab")
    return spawn([sys.executable, str(SCRIPTS / script), "--output-dir", str(output_dir), *options],
                            env=_env(**kill), stdout=log, stderr=subprocess.STDOUT)


def _wait(process: subprocess.Popen, output_dir: Path, expected: int) -> str:
    code = process.wait(timeout=600)
    log = (output_dir.parent / f"{output_dir.name}.log").read_text(errors="replace")
    assert code == expected, f"exit code {code}, expected {expected}; log tail:\n{log[-3000:]}"
    return log


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for kind in ("gpt2", "llama"):
        out[kind] = root / kind
        build_model(kind).save_pretrained(out[kind])
    other = build_model("gpt2")
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight.mul_(1.01)  # one tensor of the base differs
    other.save_pretrained(root / "gpt2-other")
    out["gpt2-other"] = root / "gpt2-other"
    return out


def _options(name: str, bases: dict[str, Path]) -> list[str]:
    return [*CONFIGS[name], "--base-dir", str(bases[CONFIGS[name][1]])]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the uninterrupted runs go; each test starts its own (in the background, see ``_begin_reference``)."""
    root = tmp_path_factory.mktemp("peft-references")
    yield root
    for process in _REFERENCES.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def _begin_reference(root: Path, name: str, options: list[str], script: str = "train_peft.py") -> None:
    """Start the uninterrupted run of ``name`` now, so that it runs while the test kills and restarts its own."""
    if name not in _REFERENCES:
        _REFERENCES[name] = _start(root / name, options, script=script)


def _reference(root: Path, name: str) -> Path:
    process = _REFERENCES[name]
    if process.returncode is None:
        _wait(process, root / name, 0)
    return root / name


def _assert_base_not_stored(checkpoint: Path, *, peft: bool, from_pretrained: bool = True) -> None:
    """The checkpoint holds the trainable part only, far smaller than the frozen base it records."""
    assert verify_checkpoint(checkpoint, full=True).ok
    files = read_manifest(checkpoint).files
    assert MODEL_INDEX_FILE not in files and "model.safetensors" not in files
    assert {TRAINABLE_INDEX_FILE, FROZEN_RECORD_FILE} <= set(files)
    record = json.loads((checkpoint / FROZEN_RECORD_FILE).read_text())
    frozen = sum(torch.empty(t["shape"], dtype=STR_TO_DTYPE[t["dtype"]]).nbytes for t in record["tensors"].values())
    index = json.loads((checkpoint / TRAINABLE_INDEX_FILE).read_text())
    renamed = index["metadata"].get("hf_resumable_renamed", {})
    stored_names = {renamed.get(name, name) for name in index["weight_map"]}
    assert frozen > 0 and not stored_names & set(record["tensors"])
    if from_pretrained:  # provenance recorded
        assert Path(record["source"]["name_or_path"]).is_dir() and record["source"]["kind"] == "local"
    if peft:  # the adapter (and modules_to_save) only
        assert index["metadata"]["total_size"] < frozen, (index["metadata"]["total_size"], frozen)
        assert "adapter_model.safetensors" in files and "config.json" not in files
    else:
        assert "transformer.wte.weight" in record["tensors"] and "lm_head.weight" in record["tied"]


@pytest.mark.slow
@pytest.mark.parametrize("name, kill", [
    ("gpt2_lora", {"kill_mid_step": 3}),             # inside step 4, mid accumulation window; then another base
    # LoRA + modules_to_save (a trainable copy of lm_head)
    pytest.param("llama_lora", {"kill_after_save": 2}, marks=pytest.mark.extended),
    pytest.param("gpt2_frozen_embedding", {"kill_after_save": 3}, marks=pytest.mark.extended),
    ("llama_qlora4", {"kill_mid_step": 2}),          # bitsandbytes nf4 base on CPU
])
def test_frozen_base_runs_killed_and_restarted_are_bit_identical(references: Path, bases: dict[str, Path],
                                                                 tmp_path: Path, name: str, kill: dict) -> None:
    _begin_reference(references, name, _options(name, bases))
    run = tmp_path / "run"
    _wait(_start(run, _options(name, bases), **kill), run, KILLED)
    step = kill.get("kill_after_save", kill.get("kill_mid_step"))
    _assert_base_not_stored(run / f"checkpoint-{step}", peft=name != "gpt2_frozen_embedding")
    if name == "gpt2_lora":
        _restart_with_another_base_is_refused(run, bases, step)
    _wait(_start(run, _options(name, bases)), run, 0)
    assert _resumed_from(run).endswith(f"checkpoint-{step}")
    assert_identical(_reference(references, name), run)


@pytest.mark.extended  # test_trainer_family's sft_peft case kills and restarts the same run in make test
def test_sft_trainer_with_peft_config_killed_and_restarted(references: Path, tmp_path: Path) -> None:
    _begin_reference(references, "sft_peft", ["--trainer", "sft_peft"], script="train_family.py")
    run = tmp_path / "run"
    _wait(_start(run, ["--trainer", "sft_peft"], script="train_family.py", kill_after_save=3), run, KILLED)
    _assert_base_not_stored(run / "checkpoint-3", peft=True, from_pretrained=False)  # TRL gets a model object
    _wait(_start(run, ["--trainer", "sft_peft"], script="train_family.py"), run, 0)
    assert _resumed_from(run).endswith("checkpoint-3")
    assert_identical(_reference(references, "sft_peft"), run)


def _restart_with_another_base_is_refused(run: Path, bases: dict[str, Path], step: int) -> None:
    """A restart whose base differs in one tensor stops before the first step and leaves the checkpoints alone."""
    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    before = (run / f"checkpoint-{step}" / "manifest.json").read_bytes()
    log = _wait(_start(run, [*CONFIGS["gpt2_lora"], "--base-dir", str(bases["gpt2-other"])]), run, 1)
    assert "BaseMismatchError" in log and "transformer.h.0.mlp.c_fc.weight: its bytes differ" in log
    assert str(bases["gpt2"]) in log  # the message names the base the checkpoint was trained with
    assert sorted(p.name for p in run.glob("checkpoint-*")) == checkpoints
    assert (run / f"checkpoint-{step}" / "manifest.json").read_bytes() == before
