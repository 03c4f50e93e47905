"""``hf-resumable run``: a dead attempt is started again, from a standby interpreter whose imports are done.

What a user relies on: the restarted script runs exactly as ``python script.py`` would run it (argv, ``__file__``,
``__name__``, ``sys.path[0]``, the working directory, the environment), only the leading import statements ran
ahead (never the user's own modules, never an import that follows other code), a ResumableTrainer run restarted
this way ends bit-identical to an uninterrupted one, signals stop the run instead of restarting it, and commands
that cannot be warm restart cold. Every attempt here is a real process; the kills are real SIGKILLs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_resumable.cli import main as cli_main
from hf_resumable.restart import RestartOptions, leading_imports, plan_warm_start

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- planning (pure)
@pytest.mark.parametrize("command, target, is_module, options, args", [
    (["python", "train.py"], "train.py", False, (), ()),
    (["/opt/venv/bin/python3.11", "-u", "-X", "dev", "t.py", "--lr", "1"], "t.py", False, ("-u", "-X", "dev"),
     ("--lr", "1")),
    (["python3", "-m", "trl.scripts.sft", "--config", "c.yaml"], "trl.scripts.sft", True, (), ("--config", "c.yaml")),
    (["python", "-W", "ignore", "-m", "pkg"], "pkg", True, ("-W", "ignore"), ()),
])
def test_plan_recognizes_python_commands(command, target, is_module, options, args) -> None:
    plan, why = plan_warm_start(command)
    assert why == ""
    assert (plan.target, plan.is_module, plan.options, plan.args, plan.interpreter) == (
        target, is_module, options, args, command[0])


@pytest.mark.parametrize("command, reason", [
    (["torchrun", "--nproc-per-node", "2", "train.py"], "torchrun is not a Python interpreter"),
    (["accelerate", "launch", "train.py"], "accelerate is not a Python interpreter"),
    (["python", "-c", "print(1)"], "-c"),
    (["python", "-I", "train.py"], "-I"),
    (["python", "-S", "train.py"], "-S"),
    (["python"], "no script"),
    (["python", "-m"], "no module"),
    ([], "empty"),
])
def test_plan_refuses_what_a_standby_cannot_run(command, reason) -> None:
    plan, why = plan_warm_start(command)
    assert plan is None and reason in why


def test_leading_imports_stop_at_the_first_other_statement() -> None:
    source = textwrap.dedent('''\
        """Docstring."""
        from __future__ import annotations
        import os, sys
        from transformers import Trainer as T
        from . import sibling
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        import torch
        ''')
    assert leading_imports(source) == ["import os, sys", "from transformers import Trainer as T"]
    assert leading_imports("import torch\nif True:\n    import numpy\n") == ["import torch"]
    assert leading_imports("def f(:\n") == []  # does not parse: nothing runs ahead


def test_options_are_validated_at_construction() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartOptions(max_restarts=-1)
    with pytest.raises(ValueError, match="max_restarts"):
        RestartOptions(max_restarts=True)
    with pytest.raises(ValueError, match="preimport"):
        RestartOptions(preimport=("torch; import os",))


def test_the_supervisor_starts_the_first_attempt_without_importing_torch() -> None:
    """``python -m hf_resumable run`` (and ``import hf_resumable``) import neither torch nor transformers: the
    supervisor starts the user's command about 1.5-2 s sooner, at the job's start and after a lost machine."""
    probe = ("import sys, runpy; sys.argv = ['hf-resumable', '--help']\n"
             "try:\n    runpy.run_module('hf_resumable', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "import hf_resumable.restart\n"
             "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         timeout=120).stdout  # (the repository is on PYTHONPATH: tests/conftest.py)
    assert out.strip().splitlines()[-1] == "[]", out


# ---------------------------------------------------------------------------------------------- processes
def _supervise(tmp_path: Path, command: list[str], *flags: str, env: dict[str, str] | None = None,
               wait: bool = True, cwd: Path | None = None):
    """``hf-resumable run FLAGS -- COMMAND`` in ``cwd`` (default ``tmp_path``); its output goes to tmp_path/run.log."""
    log = open(tmp_path / "run.log", "ab")  # noqa: SIM115
    full_env = {**os.environ, **(env or {})}  # the repository is on PYTHONPATH (tests/conftest.py)
    process = subprocess.Popen([sys.executable, "-m", "hf_resumable", "run", *flags, "--", *command],
                               cwd=cwd or tmp_path, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    if wait:
        process.wait(timeout=120)
    return process


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


# A package outside the script's directory (as an installed one is) that records who imported it, and when; with
# MARKER_THREAD set it starts a Python thread, which makes forking unsafe.
_MARKER = '''\
import json, os, threading, time
with open(os.environ["MARKER_LOG"], "a") as f:
    f.write(json.dumps({"module": __name__, "pid": os.getpid(), "t": time.time()}) + "\\n")
time.sleep(float(os.environ.get("MARKER_SLEEP", "0")))
if os.environ.get("MARKER_THREAD") and __name__ == "sitepkg":
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
'''

# The script: leading imports (the marker package, a local module), then a record of how it was run; its first two
# attempts SIGKILL themselves.
_SCRIPT = '''\
"""A job that dies twice."""
import json
import os
import random
import signal
import sys
import time

import sitepkg
import localmod
import venvpkg

import numpy
import torch

os.environ["SET_BY_SCRIPT"] = "1"
import latepkg

with open(os.environ["RUN_LOG"], "a") as f:
    f.write(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "t": time.time(), "argv": sys.argv, "file": __file__,
        "name": __name__, "doc": __doc__, "path0": sys.path[0], "cwd": os.getcwd(),
        "restarts": os.environ.get("HF_RESUMABLE_RESTARTS"), "warm": os.environ.get("HF_RESUMABLE_WARM"),
        "spec": repr(globals().get("__spec__")), "sigint": repr(signal.getsignal(signal.SIGINT)),
        "user_env": os.environ.get("USER_SETTING"), "random": random.random(),
        "numpy": numpy.random.random(), "torch": torch.rand(1).item(),
    }) + "\\n")
if os.environ["HF_RESUMABLE_RESTARTS"] in ("0", "1"):
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture
def job(tmp_path: Path) -> dict:
    site = tmp_path / "site"
    (site / "sitepkg").mkdir(parents=True)
    (site / "sitepkg" / "__init__.py").write_text(_MARKER)
    (site / "latepkg.py").write_text(_MARKER)
    scripts = tmp_path / "project" / "scripts"
    scripts.mkdir(parents=True)
    # an environment inside the project (uv's ./.venv): installed, so imported ahead
    venv_site = tmp_path / "project" / ".venv" / "lib" / "site-packages"
    venv_site.mkdir(parents=True)
    (venv_site / "venvpkg.py").write_text(_MARKER)
    (scripts / "localmod.py").write_text(_MARKER)
    (scripts / "job.py").write_text(_SCRIPT)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(venv_site), str(REPO)]),
           "MARKER_LOG": str(tmp_path / "imports.jsonl"), "RUN_LOG": str(tmp_path / "runs.jsonl"),
           "USER_SETTING": "kept", "MARKER_SLEEP": "0.5"}
    return {"env": env, "script": scripts / "job.py"}


@pytest.mark.slow
@pytest.mark.parametrize("forkable", [True, False], ids=["forked-by-the-standby", "standby-runs-it"])
def test_warm_restart_runs_the_script_as_python_would(tmp_path: Path, job: dict, forkable: bool) -> None:
    env = job["env"] if forkable else {**job["env"], "MARKER_THREAD": "1"}
    process = _supervise(tmp_path, [sys.executable, "scripts/job.py", "--flag", "x y"], env=env,
                         cwd=tmp_path / "project")
    log = (tmp_path / "run.log").read_text()
    assert process.returncode == 0, log
    cold, *warm = _records(tmp_path / "runs.jsonl")
    assert len(warm) == 2 and "restart 2 of 3" in log
    how = "warm: forked by the standby interpreter" if forkable else "warm: the standby interpreter runs it"
    assert log.count(how) == 2, log
    assert [(r["restarts"], r["warm"]) for r in (cold, *warm)] == [("0", None), ("1", "1"), ("2", "1")]
    assert len({r["pid"] for r in (cold, *warm)}) == 3
    for generator in ("random", "numpy", "torch"):  # each attempt's global generators seeded anew, as in a new process
        assert len({r[generator] for r in (cold, *warm)}) == 3, generator
    same = ("ppid", "argv", "file", "name", "doc", "path0", "cwd", "spec", "sigint", "user_env")
    for attempt in warm:
        assert {k: attempt[k] for k in same} == {k: cold[k] for k in same}
    assert cold["argv"] == ["scripts/job.py", "--flag", "x y"] and cold["name"] == "__main__"
    assert cold["file"] == str(job["script"]) and cold["path0"] == str(job["script"].parent)
    assert cold["ppid"] == process.pid and cold["doc"] == "A job that dies twice."

    imports = _records(tmp_path / "imports.jsonl")

    def imported(pid: int) -> dict[str, float]:
        return {r["module"]: r["t"] for r in imports if r["pid"] == pid}

    # The installed packages are imported by a standby before the attempt before it died; the user's own module and
    # the import after other code only by the attempt.
    if forkable:  # one standby imported them once; every warm attempt is a fork of it
        standbys = {r["pid"] for r in imports if r["module"] == "sitepkg"} - {r["pid"] for r in (cold, *warm)}
        assert len(standbys) == 1
        ahead = imported(standbys.pop())
        assert set(ahead) == {"sitepkg", "venvpkg"} and max(ahead.values()) < cold["t"]
        for attempt in warm:
            assert set(imported(attempt["pid"])) == {"localmod", "latepkg"}
    else:  # each warm attempt is a standby that ran it itself
        previous = cold
        for attempt in warm:
            mine = imported(attempt["pid"])
            assert set(mine) == {"sitepkg", "venvpkg", "localmod", "latepkg"}
            assert mine["sitepkg"] < previous["t"] < mine["localmod"]
            previous = attempt


@pytest.mark.slow
def test_module_commands_and_failures_in_a_warm_attempt(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(textwrap.dedent('''\
        import os, signal, sys
        print("argv0", sys.argv[0], "name", __name__, "restarts", os.environ["HF_RESUMABLE_RESTARTS"], flush=True)
        if os.environ["HF_RESUMABLE_RESTARTS"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("a bug in attempt " + os.environ["HF_RESUMABLE_RESTARTS"])
        '''))
    process = _supervise(tmp_path, [sys.executable, "-m", "pkg.job"], "--max-restarts", "2")
    log = (tmp_path / "run.log").read_text()
    assert process.returncode == 1, log  # as `python -m pkg.job` exits on an uncaught exception
    assert f"argv0 {package / 'job.py'} name __main__ restarts 0" in log
    assert "RuntimeError: a bug in attempt 1" in log and "RuntimeError: a bug in attempt 2" in log
    assert "after 2 restart(s), the most allowed" in log
    assert "a bug in attempt 3" not in log


@pytest.mark.slow
def test_signals_stop_the_run_and_the_standby(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text("import time\nopen('started', 'w').close()\ntime.sleep(60)\n")
    process = _supervise(tmp_path, [sys.executable, "sleeper.py"], wait=False)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() or len(_children(process.pid)) < 2:
        assert time.monotonic() < deadline and process.poll() is None, (tmp_path / "run.log").read_text()
        time.sleep(0.05)
    children = _children(process.pid)  # the attempt and the standby
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM  # the attempt's own status, not restarted
    for child in children:
        assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert "restart" not in (tmp_path / "run.log").read_text()


@pytest.mark.slow
def test_cold_restarts_where_no_standby_can_run(tmp_path: Path) -> None:
    command = ["sh", "-c", "echo ran >> ran.txt; test -e died || { touch died; kill -9 $$; }"]
    process = _supervise(tmp_path, command)
    log = (tmp_path / "run.log").read_text()
    assert process.returncode == 0, log
    assert (tmp_path / "ran.txt").read_text() == "ran\nran\n"
    assert "sh is not a Python interpreter" in log and "a new interpreter" in log


@pytest.mark.slow
def test_a_dead_standby_means_a_cold_restart(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent('''\
        import os, signal, time
        if not os.path.exists("died"):
            open("started", "w").close()
            while not os.path.exists("go"):
                time.sleep(0.02)
            open("died", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        open("restarted", "w").write(os.environ.get("HF_RESUMABLE_WARM", "cold"))
        '''))
    process = _supervise(tmp_path, [sys.executable, "job.py"], wait=False)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() or len(_children(process.pid)) < 2:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    standby = next(p for p in _children(process.pid) if "_standby.py" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(standby, signal.SIGKILL)
    (tmp_path / "go").touch()
    assert process.wait(timeout=60) == 0, (tmp_path / "run.log").read_text()
    assert (tmp_path / "restarted").read_text() == "cold"
    assert "the standby had exited" in (tmp_path / "run.log").read_text()


def test_cli_refuses_bad_arguments_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run"]) == 2
    assert "give the command to run" in capsys.readouterr().err
    assert cli_main(["run", "--max-restarts", "-1", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "max_restarts must be an integer >= 0" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------- the user's path
@pytest.mark.slow
def test_trainer_run_restarted_warm_is_bit_identical(tmp_path: Path) -> None:
    """A ResumableTrainer script (DataLoader workers, a random transform, GA 2) SIGKILLed right after
    checkpoint-3 and restarted by ``hf-resumable run`` from the standby ends bit-identical to an uninterrupted run."""
    from helpers.trainer_runs import CONFIGS, SCRIPT, _env, _run, assert_identical

    options = CONFIGS["llama_transform_w2"]
    reference = tmp_path / "reference"
    _run(reference, options)
    resumed = tmp_path / "resumed"
    env = dict(_env(kill_after_save=3))
    log = open(tmp_path / "supervised.log", "ab")  # noqa: SIM115
    # --max-restarts 1: no second standby after the restart (it would import torch for nothing here)
    process = subprocess.run([sys.executable, "-m", "hf_resumable", "run", "--max-restarts", "1", "--",
                              sys.executable, str(SCRIPT),
                              "--output-dir", str(resumed), *options], env=env, stdout=log,
                             stderr=subprocess.STDOUT, timeout=600)
    text = (tmp_path / "supervised.log").read_text(errors="replace")
    assert process.returncode == 0, text[-3000:]
    assert "attempt 1 ended (killed by SIGKILL): restart 1 of 1" in text
    assert "warm: forked by the standby interpreter" in text
    assert json.loads((resumed / "result.json").read_text()).get("resumed_from", "").endswith("checkpoint-3")
    assert_identical(reference, resumed)


@pytest.mark.slow
def test_orphans_of_an_attempt_are_reaped(tmp_path: Path) -> None:
    """An attempt's child that outlives it becomes the supervisor's (a child subreaper): it is reaped, not left a
    zombie, and does not hold up the restart."""
    (tmp_path / "job.py").write_text(textwrap.dedent('''\
        import os, signal, subprocess, sys
        if os.environ["HF_RESUMABLE_RESTARTS"] == "0":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
            open("orphan", "w").write(str(child.pid))
            os.kill(os.getpid(), signal.SIGKILL)
        import time
        time.sleep(2.5)  # the orphan exits meanwhile
        open("zombies", "w").write(" ".join(
            p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat")
            and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[:2] == ["Z", str(os.getppid())]))
        '''))
    process = _supervise(tmp_path, [sys.executable, "job.py"])
    assert process.returncode == 0, (tmp_path / "run.log").read_text()
    assert (tmp_path / "orphan").read_text().isdigit()
    assert (tmp_path / "zombies").read_text() == ""


def test_a_standby_refuses_to_fork_beside_a_python_thread() -> None:
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("_hfr_standby", REPO / "hf_resumable" / "restart" / "_standby.py")
    standby = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standby)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "Python thread" in standby._fork_refusal()
    finally:
        stop.set()
        thread.join()
