"""The processes of ``hf-resumable check``: launch the command, kill it where its trace says, rerun it until it ends.

Each launch runs in a session of its own with ``HF_RESUMABLE_TRACE`` set. A kill never depends on timing: the
kill point is an event of the trace (:mod:`hf_resumable.trace`). For a SIGKILL the process parks itself at that
event (``HF_RESUMABLE_TRACE_STOP``) and is killed there, with every process it started: its own process group and
the groups of its descendants (``torchrun`` starts each worker in a session of its own, so killing torchrun's group
alone would leave the workers running). A SIGTERM goes, when the event is seen, to the processes that write the
trace (the training processes, never their DataLoader workers: see :mod:`hf_resumable.preemption`).

Linux only (descendants are found in ``/proc``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckLaunchError
from ..trace import ATTEMPT_ENV, OUT_ENV, STOP_ENV, TRACE_ENV, read_trace

logger = logging.getLogger(__name__)

__all__ = ["CheckOptions", "KillPoint", "Launch", "plan_kill_points", "run_reference", "run_interrupted"]

OUT_PLACEHOLDER = "{out}"
_POLL_S = 0.05  # how often a waiting check looks at the trace files and the process (not a timing assumption)
_TAIL_LINES = 40


@dataclass(frozen=True, kw_only=True)
class CheckOptions:
    """Options of :func:`~hf_resumable.check.run_check`.

    Args:
        kills (`int`, *optional*, defaults to 3): interrupted runs, one per kill point; kinds rotate through a kill
            at a random optimizer step (mid-accumulation when there are micro-batches), inside a save, and SIGTERM.
        seed (`int`, *optional*, defaults to 0): chooses the kill points (the same seed, the same points).
        timeout (`float`, *optional*): seconds one launch may run before it is killed and the check fails.
        max_restarts (`int`, *optional*, defaults to 3): launches after a kill before the check gives up.
    """

    kills: int = 3
    seed: int = 0
    timeout: float | None = None
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.kills < 1:
            raise ValueError(f"kills={self.kills}: the check needs at least one interrupted run (--kills 1 or more).")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout={self.timeout}: give a positive number of seconds, or none.")
        if self.max_restarts < 1:
            raise ValueError(f"max_restarts={self.max_restarts}: at least one rerun is needed after a kill.")


@dataclass(frozen=True)
class KillPoint:
    """Where an interrupted run is killed.

    Args:
        kind (`str`): ``"step"`` (SIGKILL at a batch or after an optimizer step), ``"save"`` (SIGKILL inside the
            ``save``-th save, after its files are written and before its commit) or ``"sigterm"``.
        event (`str`): the trace event (``batch:K:M``, ``update:K``, ``save:N``).
        step (`int`, *optional*): the optimizer step it falls in.
    """

    kind: str
    event: str
    step: int | None

    def describe(self) -> str:
        parts = self.event.split(":")
        if parts[0] == "save":
            where = f"inside save #{parts[1]}" + (f" (step {self.step})" if self.step is not None else "")
        elif parts[0] == "batch":
            where = f"at optimizer step {parts[1]}, micro-batch {parts[2]}"
        else:
            where = f"right after optimizer step {parts[1]}"
        return f"{'SIGTERM' if self.kind == 'sigterm' else 'SIGKILL'} {where}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "event": self.event, "step": self.step, "description": self.describe()}


@dataclass
class Launch:
    """One launch of the command: its number, how it ended, and what it printed last."""

    attempt: int
    returncode: int | None = None
    killed: str | None = None  # the event it was killed at
    output_tail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "returncode": self.returncode, "killed_at": self.killed}


@dataclass
class RunOutcome:
    """An interrupted run: its kill point, launches and trace (or why it could not finish)."""

    kill_point: KillPoint
    launches: list[Launch] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    failure: str | None = None  # the run did not finish after the kill

    @property
    def resumed_from(self) -> list[int]:
        return sorted({r["step"] for r in self.records if r["kind"] == "resume" and r.get("rank", 0) == 0})


# ------------------------------------------------------------------------------------------------ planning (pure)
def plan_kill_points(reference: Sequence[Mapping[str, Any]], *, kills: int, seed: int) -> list[KillPoint]:
    """Kill points drawn (by ``seed``) from what the reference run did: its optimizer steps and saves.

    Kinds rotate: a random optimizer step, inside a save (a step kill if the run saves nothing), SIGTERM.

    Example:

    ```python
    >>> ref = [{"kind": "update", "rank": 0, "step": s} for s in (1, 2, 3)] + [{"kind": "save", "rank": 0,
    ...        "index": 1, "step": 2}]
    >>> [p.kind for p in plan_kill_points(ref, kills=3, seed=0)]
    ['step', 'save', 'sigterm']
    ```
    """
    rank0 = [r for r in reference if r.get("rank", 0) == 0]
    steps = sorted({r["step"] for r in rank0 if r["kind"] == "update"})
    if not steps:
        raise CheckLaunchError("The reference run made no optimizer step that hf_resumable could see, so there is "
                               "nothing to kill. Train with torch.optim optimizers (ResumableTrainer, "
                               "ResumableAccelerator or save_checkpoint/load_checkpoint).")
    micro = {}
    for record in rank0:
        if record["kind"] == "batch":
            micro[record["step"]] = max(micro.get(record["step"], 0), record["micro"] + 1)
    saves = [(r["index"], r.get("step")) for r in rank0 if r["kind"] == "save"]
    rng = random.Random(seed)
    # a kill before the first checkpoint has nothing to resume from: kill after it when there is one
    first_save = min((step for _n, step in saves if step is not None), default=None)
    candidates = [s for s in steps if first_save is not None and s > first_save] or steps[1:] or steps
    points = []
    for index in range(kills):
        kind = ("step", "save", "sigterm")[index % 3]
        if kind == "save" and saves:
            number, step = rng.choice(saves[1:] or saves)  # a later save: an earlier checkpoint to resume from
            points.append(KillPoint("save", f"save:{number}", step))
            continue
        kind = "sigterm" if kind == "sigterm" else "step"
        step = rng.choice(candidates)
        event = f"batch:{step}:{rng.randrange(micro[step])}" if micro.get(step) else f"update:{step}"
        points.append(KillPoint(kind, event, step))
    return points


def _matches(record: Mapping[str, Any], event: str) -> bool:
    parts = event.split(":")
    if record["kind"] != parts[0]:
        return False
    if parts[0] == "batch":
        return record["step"] == int(parts[1]) and record["micro"] == int(parts[2])
    if parts[0] == "save":
        return record["index"] == int(parts[1])
    return record["step"] == int(parts[1])


# ------------------------------------------------------------------------------------------------ processes
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and the groups of all its descendants (torchrun's workers)."""
    groups = {pid}
    for child in _descendants(pid):
        try:
            groups.add(os.getpgid(child))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class _Process:
    """One launch: the child in a session of its own, its output file, and a reader of its trace."""

    def __init__(self, command: Sequence[str], *, out: Path, trace: Path, attempt: int, stop: str | None,
                 log: Path, timeout: float | None) -> None:
        env = {**os.environ, TRACE_ENV: str(trace), ATTEMPT_ENV: str(attempt), OUT_ENV: str(out)}
        env.pop(STOP_ENV, None)
        if stop is not None:
            env[STOP_ENV] = stop
        argv = [arg.replace(OUT_PLACEHOLDER, str(out)) for arg in command]
        self.log = log
        self._trace, self._offsets = trace, {}
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.launch = Launch(attempt)
        try:
            with open(log, "ab") as output:
                self.proc = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            raise CheckLaunchError(f"Cannot start {argv[0]!r}: {err}. Check the command after `--`.") from err

    def new_records(self) -> list[dict[str, Any]]:
        """Records written since the last call (complete lines only)."""
        import json

        found = []
        for path in sorted(self._trace.glob("rank-*.jsonl")):
            with open(path, "rb") as handle:
                handle.seek(self._offsets.get(path, 0))
                data = handle.read()
            complete = data[:data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            found.extend(json.loads(line) for line in complete.splitlines() if line.strip())
        return found

    def wait_for(self, predicate: Callable[[Mapping[str, Any]], bool] | None) -> Mapping[str, Any] | None:
        """The first new record for which ``predicate`` holds, or None once the process has ended."""
        while True:
            ended = self.proc.poll() is not None
            for record in self.new_records():
                if predicate is not None and predicate(record):
                    return record
            if ended:
                self.launch.returncode = self.proc.returncode
                self.launch.output_tail = tail(self.log)
                return None
            if self._deadline is not None and time.monotonic() > self._deadline:
                self.kill()
                raise CheckLaunchError(f"Launch {self.launch.attempt} ran past --timeout and was killed. Its last "
                                       f"output ({self.log}):\n{tail(self.log)}")
            time.sleep(_POLL_S)

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()
        self.launch.returncode = self.proc.returncode

    def terminate_trainers(self, pids: set[int]) -> None:
        """SIGTERM to the training processes (those writing the trace), as a scheduler's preemption notice."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def tail(log: Path, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of a launch's output."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def run_reference(command: Sequence[str], directory: Path, *, timeout: float | None) -> list[dict[str, Any]]:
    """Run the command once, uninterrupted; its trace.

    Raises:
        CheckLaunchError: if it fails, times out or writes no trace (with its last output).
    """
    directory.mkdir(parents=True)
    process = _Process(command, out=directory / "out", trace=directory / "trace", attempt=0, stop=None,
                       log=directory / "output.log", timeout=timeout)
    process.wait_for(None)
    if process.launch.returncode != 0:
        raise CheckLaunchError(f"The command failed without a kill (exit code {process.launch.returncode}); fix it "
                               f"first. Its last output ({process.log}):\n{process.launch.output_tail}")
    records = read_trace(directory / "trace")
    if not records:
        raise CheckLaunchError("The command ran but wrote no trace: it does not train through hf_resumable "
                               "(ResumableTrainer, make_resumable, ResumableAccelerator, or save_checkpoint/"
                               f"load_checkpoint and the library's data loaders). Its last output:\n"
                               f"{process.launch.output_tail}")
    return records


def run_interrupted(command: Sequence[str], directory: Path, point: KillPoint, *, options: CheckOptions,
                    ranks: int = 1) -> RunOutcome:
    """Run the command, kill it at ``point``, rerun it until it exits with 0; its trace (every launch).

    ``ranks``: processes that write a trace (a SIGTERM goes to each of them).
    """
    directory.mkdir(parents=True)
    outcome = RunOutcome(point)
    kwargs = dict(out=directory / "out", trace=directory / "trace", log=directory / "output.log",
                  timeout=options.timeout)
    # 1. The launch that is killed: parked at the event for a SIGKILL, signalled when it is seen for a SIGTERM.
    first = _Process(command, attempt=0, stop=None if point.kind == "sigterm" else point.event, **kwargs)
    outcome.launches.append(first.launch)
    trainers: dict[int, int] = {}  # rank -> pid of the process writing its trace
    seen = [False]

    def at_point(record: Mapping[str, Any]) -> bool:
        if "pid" in record:
            trainers[record.get("rank", 0)] = record["pid"]
        if point.kind != "sigterm":
            return record["kind"] == "stop"
        seen[0] = seen[0] or _matches(record, point.event)
        return seen[0] and len(trainers) >= ranks  # every rank gets the notice, as from a scheduler

    if first.wait_for(at_point) is not None:
        first.launch.killed = point.event
        if point.kind == "sigterm":
            first.terminate_trainers(set(trainers.values()))
            first.wait_for(None)
            kill_tree(first.proc.pid)  # anything left of the job (e.g. torchrun's agent after its workers exited)
        else:
            first.kill()
        first.launch.output_tail = tail(first.log)
    elif first.launch.returncode != 0:
        raise CheckLaunchError(f"The command failed before the kill point ({point.describe()}) with exit code "
                               f"{first.launch.returncode}. Its last output ({first.log}):\n"
                               f"{first.launch.output_tail}")
    else:  # it finished without reaching the kill point: the comparison shows how it differs
        outcome.records = read_trace(directory / "trace")
        return outcome
    # 2. The same command again until it finishes.
    for attempt in range(1, options.max_restarts + 1):
        process = _Process(command, attempt=attempt, stop=None, **kwargs)
        outcome.launches.append(process.launch)
        process.wait_for(None)
        if process.launch.returncode == 0:
            break
        if process.launch.returncode != 143:  # 143: it was preempted again (SIGTERM from elsewhere); rerun
            outcome.failure = (f"after the kill ({point.describe()}), launch {attempt} exited with code "
                               f"{process.launch.returncode}. Its last output ({process.log}):\n"
                               f"{process.launch.output_tail}")
            break
    else:
        outcome.failure = f"the command did not finish in {options.max_restarts} launches after the kill"
    outcome.records = read_trace(directory / "trace")
    return outcome
