"""Elastic runs (a world-size change between launches): the workers of tests/scripts/elastic_*_worker.py launched at
any world size (:func:`launch`), the samples each step and epoch trained on, and :func:`assert_same_run`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env, run_torchrun

WORKER = REPO_ROOT / "tests" / "scripts" / "elastic_trainer_worker.py"


TIMEOUT = 300


RTOL = 1e-5


def launch(output: Path, *, nproc: int, max_steps: int = 4, kill_after: int | None = None,
           dropout: float = 0.1, accumulation: int | None = None, expect_kill: bool = False,
           expect_fail: bool = False, worker: Path = WORKER, extra: tuple[str, ...] = (),
           torchrun: bool = False) -> str:
    """``worker`` at world size ``nproc`` (torchrun for 2+ or with ``torchrun``, else plain python); its output."""
    args = [str(output), "--max-steps", str(max_steps), "--dropout", str(dropout), *extra]
    args += [] if accumulation is None else ["--accumulation", str(accumulation)]
    args += [] if kill_after is None else ["--kill-after", str(kill_after)]
    if nproc == 1 and not torchrun:
        done = zygote.run([sys.executable, str(worker), *args], env=child_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
        out = done.stdout + done.stderr
        killed = done.returncode == -9
    else:
        done = run_torchrun(worker, args, env=child_env(), timeout=TIMEOUT, nproc=nproc)
        out = done.stdout
        killed = done.returncode != 0 and "SIGKILL" in out
    if expect_fail:
        assert done.returncode not in (0, -9) and not killed, out[-5000:]
    else:
        assert killed if expect_kill else done.returncode == 0, out[-5000:]
    return out


def samples_per_step(run: Path) -> dict[int, Counter]:
    """``{step: Counter(sample indices)}`` over every rank and every launch of ``run``. A padding batch (a rank without
    a sample in an epoch's last, shorter step trains on the step's first samples with weight zero) is recorded by the
    Trainer worker like any (it records what was collated), so a sample recorded on two ranks of one step is counted
    once: each step's samples are a set (the accelerate worker records the micro-batches it trains, no padding)."""
    steps: dict[int, set] = {}
    for path in run.glob("samples-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], set()).update(record["indices"])
    return {step: Counter(indices) for step, indices in steps.items()}


def samples_per_epoch(run: Path, steps_per_epoch: int) -> list[Counter]:
    """The samples every epoch trained on (each step's once, see :func:`samples_per_step`)."""
    epochs: dict[int, Counter] = {}
    for step, samples in samples_per_step(run).items():
        epochs.setdefault((step - 1) // steps_per_epoch, Counter()).update(samples)
    return [epochs[epoch] for epoch in sorted(epochs)]


def logged_losses(run: Path) -> dict[int, float]:
    """``{step: loss}``: the Trainer's log history, or the accelerate worker's ``losses.jsonl`` (every launch)."""
    if (run / "losses.jsonl").exists():
        return {record["step"]: record["loss"] for record in map(json.loads, (run / "losses.jsonl").open())}
    history = json.loads((run / "result.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def assert_same_run(reference: Path, run: Path, *, steps: int, rtol: float = RTOL) -> None:
    expected, got = samples_per_step(reference), samples_per_step(run)
    assert sorted(expected) == list(range(1, steps + 1)) and got == expected
    losses, resumed = logged_losses(reference), logged_losses(run)
    assert sorted(resumed) == sorted(losses) == list(range(1, steps + 1))
    for step, loss in losses.items():
        assert resumed[step] == pytest.approx(loss, rel=rtol), step
    final, ref = load_file(run / "final.safetensors"), load_file(reference / "final.safetensors")
    assert list(final) == list(ref)
    for name, tensor in ref.items():
        for part, (a, b) in _with_true_gradient(name, final[name], tensor).items():
            error = float((a - b).norm() / b.norm().clamp_min(1e-12))
            assert error <= rtol, (part, error)


def steps_of_rank(run: Path, rank: int) -> list[int]:
    """The optimizer steps rank ``rank`` trained in (it did not exist in the 1-process launches)."""
    path = run / f"samples-rank{rank}.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _with_true_gradient(name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The parts of a parameter whose true gradient is not exactly zero. GPT-2's fused ``c_attn.bias`` holds the
    query, key and value biases; the key bias cancels in the softmax (its gradient is 0 up to rounding, which Adam
    scales up to full-size steps), so it is exempt, as the guarantee says."""
    if not name.endswith("attn.c_attn.bias"):
        return {name: (a, b)}
    query_a, _, value_a = a.chunk(3)
    query_b, _, value_b = b.chunk(3)
    return {f"{name}[query]": (query_a, query_b), f"{name}[value]": (value_a, value_b)}
