"""The test zygote (tests/helpers/zygote.py) behaves like a fresh ``python`` process where the suite relies on it.

Every kill/restart test starts its processes through it, so what they prove holds only if a forked child is
indistinguishable from ``subprocess.Popen([sys.executable, ...])`` in what they observe: its own pid that SIGKILL
ends with -9, exit codes, output to files and pipes, the environment, cwd and argv given, atexit handlers and
non-daemon threads at exit, fresh random seeds, and a hash seed that differs between two consecutive processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import zygote

pytestmark = pytest.mark.skipif(not zygote._enabled(), reason="HF_RESUMABLE_TEST_ZYGOTE=0 turns the zygote off")

PROBE = """
import json, os, sys, random
import numpy, torch
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                  "extra": os.environ.get("HFR_PROBE"), "path0": sys.path[0], "name": __name__,
                  "hash": hash("hf_resumable"), "torch_seed": torch.initial_seed(),
                  "numpy": int(numpy.random.randint(0, 2**31)), "random": random.random(),
                  "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0)}))
"""


@pytest.fixture(autouse=True, scope="module")
def _warm():
    """The zygotes these tests fork from, started up front (``eager``: no plain subprocess first): this process's
    environment takes two (the hash seeds alternate), a pinned hash seed one."""
    envs = (dict(os.environ), dict(os.environ), {**os.environ, "PYTHONHASHSEED": "0"})
    # Started together (they import at the same time), from this thread: a zygote dies with the thread that started it.
    started = [zygote._zygote_for(env, eager=True, wait=False) for env in envs]
    assert all(z is not None and z.usable() for z in started)


@pytest.mark.slow
def test_an_environment_seen_once_gets_a_plain_subprocess():
    once = zygote.Popen([sys.executable, "-c", "pass"], env={**os.environ, "HF_HOME": "/nonexistent-once"})
    assert type(once) is subprocess.Popen
    assert once.wait(timeout=120) == 0


def _probe(tmp_path: Path, *args: str, **env: str) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = zygote.run([sys.executable, str(script), *args], env={**os.environ, **env}, cwd=tmp_path,
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow  # starts a zygote
def test_child_is_forked_and_sees_its_argv_env_and_cwd(tmp_path: Path):
    first = _probe(tmp_path, "a", "--b", RANK="3", HFR_PROBE="x")
    assert first["argv"] == [str(tmp_path / "probe.py"), "a", "--b"]
    assert (first["cwd"], first["path0"], first["name"]) == (str(tmp_path), str(tmp_path), "__main__")
    assert (first["rank"], first["extra"]) == ("3", "x")
    assert first["ppid"] != os.getpid(), "not forked by a zygote: the zygote is not in use"
    assert first["pgid"] not in (os.getpgid(0), os.getpgid(first["ppid"])), "signals to its group reach others"


@pytest.mark.slow
def test_consecutive_children_differ_in_every_seed_a_fresh_interpreter_draws(tmp_path: Path):
    first, second = _probe(tmp_path), _probe(tmp_path)
    for key in ("hash", "torch_seed", "numpy", "random"):
        assert first[key] != second[key], key
    pinned = [_probe(tmp_path, PYTHONHASHSEED="0")["hash"] for _ in range(2)]
    assert pinned[0] == pinned[1] == _fresh_hash(tmp_path)


def _fresh_hash(tmp_path: Path) -> int:
    code = "print(hash('hf_resumable'))"
    return int(subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "0"},
                              capture_output=True, text=True, check=True).stdout)


@pytest.mark.slow
def test_sigkill_exit_codes_and_files(tmp_path: Path):
    log = tmp_path / "log"
    script = tmp_path / "s.py"
    script.write_text("import sys, time\nprint('started', flush=True)\nsys.stderr.write('err\\n')\n"
                      "time.sleep(float(sys.argv[1]))\nsys.exit(int(sys.argv[2]))\n")
    with open(log, "wb") as out:
        quick = zygote.Popen([sys.executable, str(script), "0", "7"], stdout=out, stderr=subprocess.STDOUT)
        assert isinstance(quick, zygote.Popen)
        assert quick.wait(timeout=120) == 7
        slow = zygote.Popen([sys.executable, str(script), "600", "0"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while log.read_text().count("started") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(timeout=0.2)
        os.kill(slow.pid, signal.SIGKILL)
        assert slow.wait(timeout=30) == -signal.SIGKILL
    assert log.read_text().count("started") == 2 and "err" in log.read_text()


@pytest.mark.slow
def test_normal_interpreter_exit_runs_atexit_and_joins_threads(tmp_path: Path):
    script = tmp_path / "s.py"
    script.write_text("import atexit, threading, time\natexit.register(lambda: print('atexit', flush=True))\n"
                      "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()\n"
                      "raise ValueError('boom')\n")
    done = zygote.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout.split() == ["thread", "atexit"]
    assert "ValueError: boom" in done.stderr


@pytest.mark.slow
def test_sigterm_reaches_the_default_handler_and_module_runs(tmp_path: Path):
    script = tmp_path / "s.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = zygote.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.stdout.close()
    module = zygote.run([sys.executable, "-m", "hf_resumable", "--version"], capture_output=True, text=True,
                        timeout=120)
    assert module.returncode == 0 and module.stdout.strip()


@pytest.mark.slow
def test_what_it_cannot_run_is_a_plain_subprocess():
    for args in ([sys.executable, "-X", "dev", "-c", "pass"], ["true"], f"{sys.executable} -c pass"):
        proc = zygote.Popen(args, shell=isinstance(args, str))
        assert type(proc) is subprocess.Popen
        assert proc.wait(timeout=120) == 0


TORCHRUN_WORKER = """
import json, os, sys, time
preloaded = "transformers" in sys.modules  # a fresh interpreter has imported nothing yet
marker = sys.argv[1] + ".printed"
if os.environ["RANK"] == "1":  # exits once rank 0 has printed
    while not os.path.exists(marker):
        time.sleep(0.05)
    sys.exit(int(os.environ.get("HFR_EXIT", "0")))
print(json.dumps({"pid": os.getpid(), "preloaded": preloaded, "argv": sys.argv[1:]}), flush=True)
open(marker, "w").close()
time.sleep(600)
"""


def _torchrun(script: Path, env: dict[str, str]) -> subprocess.Popen:
    from helpers.distributed_launch import child_env, free_port

    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script), str(script)]
    return subprocess.Popen(command, env=zygote.torchrun_env(child_env(env)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _first_record(proc: subprocess.Popen) -> dict:
    """The worker's JSON line (torchrun's own log lines share the pipe)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("the worker printed nothing")


@pytest.mark.slow
def test_torchrun_workers_are_forked_and_die_with_the_killed_tree(tmp_path):
    import psutil

    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    proc = _torchrun(script, {})
    try:
        first = _first_record(proc)
        assert first["preloaded"] and first["argv"] == [str(script)]
        # what the kill tests do: SIGKILL torchrun's group and every process in its tree
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert first["pid"] not in [child.pid for child in tree]  # a zygote's child, not torchrun's
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            child.kill()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while psutil.pid_exists(first["pid"]) and psutil.Process(first["pid"]).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the forked worker outlived its client"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.extended  # the kill tests see torchrun report their SIGKILLed workers in make test
@pytest.mark.parametrize("status, reported", [("3", "exitcode: 3"), ("-9", "Signal 9 (SIGKILL)")])
def test_a_torchrun_worker_s_exit_status_reaches_torchrun(tmp_path, status, reported):
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER.replace("sys.exit(int(os.environ.get(\"HFR_EXIT\", \"0\")))",
                                              "code = int(os.environ.get('HFR_EXIT', '0'))\n    "
                                              "os.kill(os.getpid(), -code) if code < 0 else sys.exit(code)"))
    proc = _torchrun(script, {"HFR_EXIT": status})  # rank 1 fails: torchrun stops rank 0 and fails the job
    try:
        assert _first_record(proc)["preloaded"]
        assert proc.wait(timeout=300) != 0
        assert reported in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
