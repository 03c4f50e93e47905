"""Start and stop real ``torch.distributed`` process groups (gloo, CPU) from a test.

Each rank is a plain subprocess with the environment ``torchrun`` would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), so the test owns
every pid: it can wait for them, and SIGKILL whatever is still running after the timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import zygote

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["RankResult", "free_port", "launch_ranks", "child_env", "shared_env", "run_torchrun", "kill_torchrun_after"]


@dataclass
class RankResult:
    """What one rank did: its exit status (negative = killed by that signal), output, and whether we killed it."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    killed_by_timeout: bool

    def describe(self) -> str:
        return (f"rank {self.rank}: rc={self.returncode} killed_by_timeout={self.killed_by_timeout}\n"
                f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-5000:]}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shared_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` as every test process gets it: the repository importable, one thread, unbuffered output.

    tests/conftest.py applies it to the pytest process's own environment, which every process a test starts inherits.
    """
    env = dict(env)
    path = env.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), path])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test environment (:func:`shared_env`) with ``extra``."""
    return {**shared_env(os.environ), **(extra or {})}


def launch_ranks(argv: list[str], *, world_size: int, timeout: float,
                 env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``python argv...`` once per rank as a gloo process group; kill survivors after ``timeout`` s.

    Args:
        argv: script and arguments (the interpreter is ``sys.executable``).
        world_size: number of ranks.
        timeout: seconds to wait for all ranks together; ranks still running then get SIGKILL.
        env: extra environment variables for every rank.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = child_env({**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                              "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        # Files, not pipes: a rank blocked on a full pipe while we wait for another would look like a hang.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((zygote.Popen([sys.executable, *argv], env=rank_env, stdout=out, stderr=err,
                                       cwd=REPO_ROOT), out, err))
    deadline = time.monotonic() + timeout
    results = []
    for rank, (proc, out, err) in enumerate(procs):
        killed = False
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = True
        out.seek(0)
        err.seek(0)
        results.append(RankResult(rank, proc.returncode, out.read(), err.read(), killed))
        out.close()
        err.close()
    return results


def run_torchrun(script: str | Path, args: list[str], *, env: dict[str, str], timeout: float,
                 nproc: int = 2, torchrun_args: list[str] = (), forked: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N script args`` on 127.0.0.1 with a free port, in its own session.

    torchrun starts each worker in a session of its own, so on timeout the whole process tree is collected
    first and then SIGKILLed, and the test fails with the job's output. ``forked``: the workers come from a test
    zygote (tests/helpers/zygote.py); ``False`` starts each as a fresh interpreter, as torchrun itself would.
    """
    import contextlib

    import psutil
    import pytest

    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), *torchrun_args, str(script), *args]
    proc = subprocess.Popen(command, env=zygote.torchrun_env(env) if forked else env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        try:  # a worker forked by a test zygote dies with its client, a moment later; never wait forever
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.stdout.close()
            out = "(its output stayed open: a process outside torchrun's tree held it)"
        pytest.fail(f"torchrun did not finish within {timeout} s:\n{out[-5000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def kill_torchrun_after(script: str | Path, args: list[str], *, marker: Path, env: dict[str, str], log: Path,
                        nproc: int = 2, timeout: float = 300) -> int:
    """``torchrun --nproc-per-node N script args`` (forked workers, as :func:`run_torchrun`), SIGKILLed as a whole once
    ``marker`` exists (e.g. a checkpoint's manifest, renamed into place when it commits); returns its exit status.
    Its output goes to ``log``; the test fails, with that output, if the job ends or ``timeout`` passes first."""
    import contextlib

    import psutil
    import pytest

    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=zygote.torchrun_env(env))
        try:
            deadline = time.monotonic() + timeout
            while not marker.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{marker} did not appear while the job ran:\n{log.read_text()[-5000:]}")
                time.sleep(0.05)
        finally:  # SIGKILL the agent's process group and every worker (torchrun starts each in its own session)
            tree = psutil.Process(proc.pid).children(recursive=True)
            os.killpg(proc.pid, signal.SIGKILL)
            for child in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.wait()
    return proc.returncode
