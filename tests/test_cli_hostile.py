"""The CLI on hostile input: one error line, a non-zero exit, never a traceback, never a hang."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import Manifest, read_manifest, save_checkpoint

from helpers import zygote

pytestmark = pytest.mark.timeout(120)


def _cli_in_process(*args: str, capsys) -> subprocess.CompletedProcess:
    """``hf-resumable ARGS`` through the CLI's own entry point, in this process: the same code as the console script
    without an interpreter's start (the entry point itself is tested in test_cli.py); an uncaught exception, which a
    real run would print as a traceback, fails the test here."""
    from hf_resumable.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["hf-resumable", *args], code, out, err)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "hf_resumable", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


def _assert_one_error_line(result: subprocess.CompletedProcess, command: str) -> None:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"hf-resumable {command}: error:") or f"hf-resumable {command}" in last, result.stderr


def _checkpoint(path: Path) -> Path:
    save_checkpoint(path, model=torch.nn.Linear(3, 3), step=1)
    return path


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_convert_of_a_pickle_bomb_is_one_line_and_never_executes(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    stock = tmp_path / "stock" / "checkpoint-4"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).save_pretrained(stock)
    marker = tmp_path / "pwned"
    (stock / "optimizer.pt").write_bytes(pickle.dumps(_Evil(marker)))
    result = _cli_in_process("convert", str(stock), "--output", str(tmp_path / "out"), capsys=capsys)
    _assert_one_error_line(result, "convert")
    assert "optimizer.pt" in result.stderr and "weights_only=True" in result.stderr
    assert not marker.exists(), "the pickle's payload ran"
    assert not (tmp_path / "out").exists()


def test_convert_raises_typed_errors_for_refused_and_broken_pickles(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_resumable.conversions.stock import convert_trainer_checkpoint
    from hf_resumable.errors import CorruptCheckpointError, UnsafePickleError

    stock = tmp_path / "stock" / "checkpoint-4"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).save_pretrained(stock)
    marker = tmp_path / "pwned"
    (stock / "optimizer.pt").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafePickleError, match="optimizer.pt") as refused:
        convert_trainer_checkpoint(stock, tmp_path / "out")
    assert isinstance(refused.value, pickle.UnpicklingError)  # the type torch.load itself raises
    assert not marker.exists() and not (tmp_path / "out").exists()
    torch.save({"state": {}, "param_groups": []}, stock / "optimizer.pt")
    (stock / "optimizer.pt").write_bytes((stock / "optimizer.pt").read_bytes()[:40])  # truncated
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt"):
        convert_trainer_checkpoint(stock, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_deeply_nested_manifest_is_one_line(tmp_path, command, capsys):
    ckpt = _checkpoint(tmp_path / "checkpoint-1")
    (ckpt / "manifest.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    result = _cli_in_process(command, str(ckpt), capsys=capsys)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    assert "nested deeper" in result.stderr + result.stdout


@pytest.mark.parametrize("content", [b"9" * 5000, b"[" * 100_000 + b"]" * 100_000],
                         ids=["5000-digit-integer", "deeply-nested"])
def test_inspect_of_an_unreadable_training_state_fails_naming_it(tmp_path, content, capsys):
    """The state file replaced and the manifest resealed (so its hash matches): inspect used to exit 0."""
    from hf_resumable.format.safetensors_io import hash_file

    ckpt = _checkpoint(tmp_path / "checkpoint-1")
    (ckpt / "training_state.json").write_bytes(content)
    manifest = read_manifest(ckpt)
    files = {name: hash_file(ckpt / name) for name in manifest.files}
    (ckpt / "manifest.json").write_bytes(Manifest(files=files, step=manifest.step).to_json())
    result = _cli_in_process("inspect", str(ckpt), capsys=capsys)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    problems = [line for line in (result.stdout + result.stderr).splitlines() if "training_state.json" in line]
    assert len(problems) == 1, result.stdout + result.stderr
    assert str(ckpt / "training_state.json") in problems[0]
    assert "5000 digits" in problems[0] or "nested deeper" in problems[0], problems[0]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_fifo_manifest_does_not_hang_the_cli(tmp_path, command):
    ckpt = _checkpoint(tmp_path / "checkpoint-1")
    (ckpt / "manifest.json").unlink()
    os.mkfifo(ckpt / "manifest.json")
    result = _cli(command, str(ckpt), cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    assert "FIFO" in result.stderr + result.stdout


@pytest.mark.parametrize("target", ["missing", "file"])
def test_verify_of_a_path_that_is_not_a_checkpoint_is_one_line(tmp_path, target, capsys):
    path = tmp_path / "x"
    if target == "file":
        path.write_text("hello")
    _assert_one_error_line(_cli_in_process("verify", str(path), capsys=capsys), "verify")


@pytest.mark.slow
def test_a_fifo_given_as_the_checkpoint_path_does_not_hang(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for command in ("verify", "inspect"):
        result = _cli(command, str(fifo), cwd=tmp_path)
        assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
