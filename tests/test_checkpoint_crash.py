"""A process saving in a loop is SIGKILLed at random moments; the latest valid checkpoint always loads."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import find_latest_checkpoint, load_checkpoint, read_manifest, verify_checkpoint
from hf_resumable.checkpoint.commit._durability import is_durable

from helpers.distributed_launch import child_env
from helpers.zygote import Popen as spawn

SCRIPT = Path(__file__).parent / "scripts" / "save_loop.py"
sys.path.insert(0, str(SCRIPT.parent))
from save_loop import weights  # noqa: E402

TRIALS = 8


def _read_until(child: subprocess.Popen, prefix: bytes) -> None:
    for line in child.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"the saving child exited (rc {child.wait()}) before printing {prefix!r}")


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_an_invalid_latest(tmp_path):
    rng = random.Random(1234)
    env = child_env()
    seen_steps = []
    leftovers = 0
    for trial in range(TRIALS):
        child = spawn([sys.executable, str(SCRIPT), str(tmp_path)], stdout=subprocess.PIPE, env=env)
        assert child.stdout.readline().strip() == b"ready"
        # Events, not the machine's speed: wait for a commit in this run, then kill at a random moment of the
        # next save (right after it starts, or a little later); a slow machine only widens the window.
        _read_until(child, b"committed ")
        _read_until(child, b"saving ")
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert child.returncode == -signal.SIGKILL
        # inside a save: its temp dir is left, or it had committed and its deferred fsyncs had not finished
        leftovers += sum(p.name.startswith(".tmp-") or (p.name.startswith("checkpoint-") and not is_durable(p))
                         for p in tmp_path.iterdir())

        latest = find_latest_checkpoint(tmp_path)
        if latest is None:
            assert not seen_steps, f"trial {trial}: a checkpoint existed before and none is found now"
            continue
        report = verify_checkpoint(latest, full=True)
        assert report.ok, report.summary()
        step = read_manifest(latest).step
        assert not seen_steps or step >= seen_steps[-1], (trial, step, seen_steps)
        seen_steps.append(step)
        module = torch.nn.Module()
        for name, value in weights(step).items():
            module.register_buffer(name.replace(".", "_"), torch.zeros_like(value))
        state = {name.replace(".", "_"): value for name, value in weights(step).items()}
        loaded = load_checkpoint(latest, model=_Renamed(module), restore_rng=False)
        assert loaded.training_state == {"global_step": step}
        for name, value in state.items():
            assert torch.equal(getattr(module, name), value), (trial, step, name)
    assert len(seen_steps) == TRIALS, seen_steps
    assert leftovers > 0, "no kill ever landed inside a save; the test would prove nothing"


class _Renamed(torch.nn.Module):
    """Exposes ``layerN_weight`` buffers under the checkpoint's ``layerN.weight`` names."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        for i in range(8):
            layer = torch.nn.Module()
            layer.register_buffer("weight", getattr(inner, f"layer{i}_weight"))
            self.add_module(f"layer{i}", layer)
