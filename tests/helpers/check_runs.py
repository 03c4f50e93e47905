"""Runs of ``hf-resumable check`` on a script, as a user launches it (tests of check under every front door)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import zygote
from helpers.distributed_launch import child_env

REPO = Path(__file__).resolve().parents[2]


def _check(tmp_path, *args, kills=1, seed=0):
    report = tmp_path / "report.json"
    env = child_env()
    # The launches come from a test zygote (tests/helpers/zygote.py) that has imported torch and transformers once: a
    # script run as ``python script.py`` gets its client as the interpreter, and torchrun's workers get it as
    # PYTHON_EXEC. torchrun itself stays a real child of check, so that check's kill reaches its whole tree.
    env = zygote.torchrun_env(env)
    args = [str(a) for a in args]
    if args[:3] != [sys.executable, "-m", "torch.distributed.run"] and args[0] == sys.executable:
        args[0] = env.get("PYTHON_EXEC", sys.executable)
    command = [sys.executable, "-m", "hf_resumable", "check", "--kills", str(kills), "--seed", str(seed),
               "--timeout", "600", "--json", str(report), "--", *args]
    done = zygote.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    data = json.loads(report.read_text()) if report.exists() else None
    return done, data
