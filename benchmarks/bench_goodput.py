"""Goodput under preemption, end to end: the stock transformers.Trainer against ResumableTrainer, each killed on the
same seeded schedule and restarted with the same command until its run completes.

The job: a Llama-shaped ``LlamaForCausalLM`` (``transformers.LlamaConfig``, untied embeddings) trained with AdamW on
a ``datasets.Dataset`` of token ids built in the process, a step of about 0.5-1 s on a 2-core VM and a checkpoint
(weights + AdamW state) of about 0.64 GB. Every run is its own process, started by this script; a killed run is
started again with the same command until it has trained ``--steps`` optimizer steps.

Schedules (seeded by ``--seed``; the same intervals for every system): ``--kills`` preemptions, each a drawn time
after the attempt's first training step ended (exponential with mean ``--mtbf`` seconds, clipped to 0.5x-2x of it;
by default the mean is a fifth of the job's training time, so that every scheduled preemption lands before the job
is done), then the run is left to finish. A restart's whole cost (imports included) is paid before the next draw.

* **SIGKILL**: no notice. Stock saves every ``save_steps`` set to its best for the schedule: the Young/Daly
  optimum from its save cost ``C`` measured in a calibration run (``--stock-intervals`` adds multiples of it, the
  best one is reported). ResumableTrainer picks its own interval (``mean_time_between_failures=M``: it measures
  its save cost and step time and applies the same rule), blocking and with background saves
  (``--fixed-intervals`` adds background runs at fixed intervals, to compare with the automatic one).
* **SIGTERM**: a notice of ``--notice`` seconds, then SIGKILL. Stock runs with ``enable_jit_checkpoint=True`` (its
  preemption checkpoint: a 3 s timer, then a save on the training thread at the next step boundary) and no periodic
  saves (its best, given the notice); ResumableTrainer is told the notice (``preemption_notice=N``, as stock knows it
  through its timer): it checkpoints the step it is in (in the background), trains on while another step and a final
  save fit in the time left, then saves and exits with 143, or finishes the job if it ends first; no periodic saves.

Per system: goodput (the uninterrupted wall time of the stock Trainer without checkpoints, over the total wall time
of all attempts); time lost per preemption (the total wall time minus this run's own uninterrupted estimate: the
first attempt's start-up plus steps x its median step without a save, neither holding one nor overlapping a
background write, plus the last attempt's end after its last line, the interpreter's teardown; divided by the
preemptions), broken down into the work redone (from the end of the step the next
attempt resumed after, to the preemption), the restart (process start to
the end of the first resumed step, minus one step), split into the interpreter's start, the imports (torch,
transformers, datasets; and hf_resumable for ours), building the model, dataset and Trainer, loading the checkpoint
(up to ``on_train_begin``) and the first step's extra (the data position restored, warm-up), the saves' cost to the
loop (each save's stall plus the extra time of the steps that overlap a background write), the SIGTERM exit (from
the signal, or the step saved after it, to the process's end) and the rest (slower steps, drift); and whether the
final weights equal the uninterrupted run's of the same trainer bit for bit (sha256 of every parameter). With
preemptions far apart the work redone and the saves dominate, and ours/stock tends to ``sqrt(C_ours / C_stock)``
(the Young/Daly loss per failure is about ``sqrt(2 C M)``); with preemptions close together the restart, the same
fixed cost for both trainers, dominates and the ratio tends to 1. A last summary line sets the two apart.

From an uninterrupted background-save run: the step-time inflation while a background save is written (mean time
of the steps that overlap the write, from the end of the save call, over the mean step without a save), the stall
(from the end of a step to the end of the save call) and a save's whole cost to the loop (the stall plus the extra
time of the steps that overlap the write), the time from the save call to the commit (the write's own duration, which
a lower priority lengthens: under SIGKILL a checkpoint counts only once committed), and where the training thread's
time per step went, without a write and while one is written: its own CPU (memory bandwidth shared with the copy,
hashing and page-cache copies), waiting for a core (schedstat's run-queue time) and the optimizer step waiting at the
step gate for the staging copy. ``--inflation-pairs N`` runs N pairs instead, with the save's background threads at
their lower CPU priority and without it (``HF_RESUMABLE_WRITER_PRIORITY=0``), alternated (an ablation, not a target);
``--inflation-only`` runs only these (no stock run, no preemption): the fast loop for work on the background save.

The machine may be shared: every process runs under ``nice``; ``--repeats`` runs each preempted system that many
times and reports medians.

Usage:
    python benchmarks/bench_goodput.py --quick                 # the preset: 30 steps, 2 preemptions of each kind
    python benchmarks/bench_goodput.py --quick --inflation-pairs 2  # and the writer-priority ablation
    python benchmarks/bench_goodput.py --quick --inflation-only --inflation-pairs 3  # that ablation alone (~5 min)
    python benchmarks/bench_goodput.py --quick --only SIGTERM
    python benchmarks/bench_goodput.py --tiny                  # smoke test: a tiny model
    python benchmarks/bench_goodput.py --steps 200 --mtbf 60 --kills 4 --repeats 3 --stock-intervals 0.5 1 2 \\
        --fixed-intervals 1 10 --inflation-pairs 3

The last line printed is ``lost per preemption, ours/stock: SIGKILL <ratio>, SIGTERM <ratio>`` (ours: the better of
ResumableTrainer's blocking and background runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import drop_caches  # noqa: E402,F401  (shared helpers; the page cache is left warm here)

MODELS = {  # name -> (hidden, intermediate, layers, heads, vocab, sequence length, batch)
    "quick": (768, 2048, 4, 12, 16000, 32, 2),
    "tiny": (64, 128, 2, 4, 1000, 32, 4),
}
SUPERVISED = "ours background, auto, under hf-resumable run"
THREADS = 1  # torch threads per training process (--threads); the same for every system
STARTUP_GRACE_S = 600.0  # an attempt that neither ends nor is killed within this is a hang


# ----------------------------------------------------------------------------------------------- the training child
def _child(spec: dict) -> None:
    """One training process: build the job, resume if there is a checkpoint, train, log every step as JSON lines."""
    log = open(spec["log"], "a", buffering=1)  # noqa: SIM115  (line-buffered: a SIGKILL loses at most one line)
    lock = threading.Lock()  # the writer's thread emits the commits

    def emit(**event) -> None:
        line = json.dumps({"t": time.time(), **event}) + "\n"
        with lock:
            log.write(line)

    emit(event="started", pid=os.getpid())  # the interpreter is up (and this script's own standard-library imports)
    import datasets
    import numpy as np
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    if spec["system"] != "stock":
        from hf_resumable import ResumableTrainer
        from hf_resumable._tuning import WRITER_PRIORITY_ENV
        from hf_resumable.checkpoint.api import background_saver

        if spec.get("writer_nice") is not None:  # the paired inflation comparison: the writer's priority off or on
            os.environ[WRITER_PRIORITY_ENV] = "0" if spec["writer_nice"] == 0 else "1"
        from hf_resumable.integrations import _trainer_state as resumable_trainer  # where the Trainer retains

        retention = resumable_trainer.apply_retention

        def timed_retention(*args, **kwargs):  # after a commit, on the training thread: part of a save's cost
            began = time.time()
            try:
                return retention(*args, **kwargs)
            finally:
                emit(event="retention", seconds=time.time() - began)

        resumable_trainer.apply_retention = timed_retention
    emit(event="imported")
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    hidden, inter, layers, heads, vocab, seq, batch = MODELS[spec["model"]]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                         max_position_embeddings=seq, tie_word_embeddings=False))
    rows = np.random.default_rng(0).integers(0, vocab, size=(batch * spec["steps"] + batch, seq))
    train = datasets.Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()}).with_format("torch")
    interval = spec.get("save_steps")
    args = TrainingArguments(
        output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=batch, learning_rate=1e-4,
        save_strategy="steps" if (interval or spec.get("mtbf")) else "no", save_steps=interval or 10**9,
        save_total_limit=2, logging_steps=10**9, report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
        enable_jit_checkpoint=bool(spec.get("jit")), dataloader_num_workers=0)

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # checkpoint loaded (weights, optimizer)
            emit(event="train_begin", step=state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            busy = spec["system"] != "stock" and background_saver().in_flight
            emit(event="step", step=state.global_step, writing=bool(busy), **_thread_times())

        def on_save(self, args, state, control, **kwargs):  # the save call returned (background: staged)
            busy = spec["system"] != "stock" and background_saver().in_flight
            emit(event="save", step=state.global_step, writing=bool(busy))
            if busy:  # when the write commits (emitted from the writer's thread)
                step = state.global_step
                background_saver().future.add_done_callback(lambda _: emit(event="committed", step=step))

    if spec["system"] == "stock":
        last = transformers.trainer_utils.get_last_checkpoint(spec["out"]) if os.path.isdir(spec["out"]) else None
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[Probe()])
        emit(event="built", resume=last)
        trainer.train(resume_from_checkpoint=last)
    else:
        options = {"mean_time_between_failures": spec["mtbf"]} if spec.get("mtbf") else {}
        if spec.get("notice"):
            options["preemption_notice"] = spec["notice"]
        trainer = ResumableTrainer(model=model, args=args, train_dataset=train, callbacks=[Probe()],
                                   save_async=spec["system"] == "background", **options)
        emit(event="built", resume=None)
        trainer.train(resume_from_checkpoint=True)
    if trainer.state.global_step >= spec["steps"]:
        import hashlib

        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        emit(event="done", digest=digest.hexdigest())


def _thread_times() -> dict:
    """The calling thread's CPU time and its time waiting for a core (Linux's schedstat), and the time optimizer
    steps waited for a background save's copy (``StepGate.waited``), each cumulative in seconds; ``{}`` where
    unavailable. Called on the training thread at every step's end: a step's difference splits its time into its
    own CPU, the run queue, the gate and the rest."""
    times = {}
    try:
        with open("/proc/thread-self/schedstat") as stat:
            run_ns, wait_ns = (int(v) for v in stat.read().split()[:2])
        times = {"cpu": run_ns / 1e9, "queued": wait_ns / 1e9}
    except (OSError, ValueError):
        pass
    gates = sys.modules.get("hf_resumable.checkpoint.background._step_gate")
    if gates is not None:
        times["gate"] = sum(gate.waited for gate in list(gates._GATES.values()))
    return times


# ------------------------------------------------------------------------------------------------- the driver side
def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a killed process
            pass
    return events


def _first_step_time(log: Path, since: float) -> float | None:
    """When this attempt's first training step ended (the events log), or ``None`` if none has yet."""
    return next((e["t"] for e in _events(log) if e["event"] == "step" and e["t"] >= since), None)


def _job_done(events: list[dict], start: float, steps: int) -> bool:
    """Whether the attempt that started at ``start`` has trained its last step (it is then not preempted: what is
    left is this script's own digest)."""
    return any(e["t"] >= start and (e["event"] == "done" or (e["event"] == "step" and e["step"] >= steps))
               for e in events)


def _run_dir(root: Path, name: str, spec: dict) -> tuple[dict, Path, Path]:
    """A fresh directory for system ``name``: the spec with its paths, its output directory and its events log."""
    out, log = root / name / "out", root / name / "events.jsonl"
    shutil.rmtree(root / name, ignore_errors=True)
    out.mkdir(parents=True)
    return {**spec, "name": name, "out": str(out), "log": str(log)}, out, log


def _wait_to_preempt(process: subprocess.Popen, log: Path, start: float, kill_at: float, steps: int) -> bool:
    """Wait until ``kill_at`` seconds after the attempt's first step (``True``: preempt now), or until it exits.
    An attempt that has trained its last step is not preempted: what is left is this script's own digest."""
    trained = None
    while time.time() < start + STARTUP_GRACE_S:
        if trained is None:
            trained = _first_step_time(log, start)
        deadline = time.time() + 0.2 if trained is None else trained + kill_at
        try:
            process.wait(timeout=max(0.0, deadline - time.time()))
            return False
        except subprocess.TimeoutExpired:
            if trained is not None and time.time() >= trained + kill_at:
                if not _job_done(_events(log), start, steps):
                    return True
                process.wait()  # a run that has finished its job is not preempted on its way out
                return False
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"an attempt did not train within {STARTUP_GRACE_S:.0f} s; see {log.with_suffix('.stderr')}")


def _attempt(spec: dict, *, kill_at: float | None, signal_kind: str, notice: float) -> dict:
    """Start the child once; preempt it ``kill_at`` seconds after its first training step ended (SIGKILL, or
    SIGTERM then SIGKILL after ``notice``), so that every scheduled preemption lands while it trains. Returns the
    attempt's spawn time, end time, kill time, exit code and whether it was preempted."""
    env = _child_env()
    command = ["nice", "-n", "10", sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    start = time.time()
    stderr = open(Path(spec["log"]).with_suffix(".stderr"), "ab")  # noqa: SIM115
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    preempted, killed = False, None
    if kill_at is None:
        try:
            process.wait(timeout=STARTUP_GRACE_S * 4)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise RuntimeError(f"{spec['name']}: an attempt hung; see {stderr.name}") from None
    elif _wait_to_preempt(process, Path(spec["log"]), start, kill_at, spec["steps"]):
        preempted, killed = True, time.time()
        if signal_kind == "SIGTERM":
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=notice)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        else:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    stderr.close()
    return {"start": start, "end": time.time(), "killed": killed, "rc": process.returncode, "preempted": preempted}


# What `hf-resumable run --preimport` has the standby import for the supervised system: the child's imports are made
# inside `_child` (this script is also the driver), so they are not leading imports the standby would find itself.
PREIMPORT = ("datasets", "numpy", "torch", "transformers", "transformers.trainer",
             "transformers.models.llama.modeling_llama", "hf_resumable.integrations.trainer")


def run_supervised(name: str, spec: dict, *, intervals: list[float], root: Path) -> dict:
    """Run ``spec`` under ``hf-resumable run`` (warm restarts from a standby interpreter) to completion, SIGKILLing
    the training process (not the supervisor: the machine survives, the process dies) on the schedule; each worker
    life is an attempt, which starts when the previous one was killed."""
    spec, _, log = _run_dir(root, name, spec)
    command = ["nice", "-n", "10", sys.executable, "-m", "hf_resumable", "run", "--max-restarts",
               str(len(intervals) + 3), "--preimport", *PREIMPORT, "--", sys.executable, os.path.abspath(__file__),
               "--child", json.dumps(spec)]
    stderr = open(log.with_suffix(".stderr"), "ab")  # noqa: SIM115
    start = time.time()
    process = subprocess.Popen(command, env=_child_env(), stdout=subprocess.DEVNULL, stderr=stderr,
                               start_new_session=True)
    attempts = []
    try:
        for kill_at in intervals:
            pid = _preempt_worker(process, log, start, kill_at, spec["steps"])
            if pid is None:
                break
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
            attempts.append({"start": start, "end": killed, "killed": killed, "rc": -9, "preempted": True})
            start = killed
        process.wait(timeout=STARTUP_GRACE_S * 4)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        stderr.close()
    attempts.append({"start": start, "end": time.time(), "killed": None, "rc": process.returncode,
                     "preempted": False})
    return _summarize(name, attempts, _events(log), [])


def _preempt_worker(supervisor: subprocess.Popen, log: Path, start: float, kill_at: float, steps: int) -> int | None:
    """The pid of the training process to kill ``kill_at`` seconds after its first step (this attempt's), or
    ``None`` if the run ends first."""
    deadline = start + STARTUP_GRACE_S
    while time.time() < deadline:
        if supervisor.poll() is not None:
            return None
        events = [e for e in _events(log) if e["t"] >= start]
        if _job_done(events, start, steps):
            return None
        begun = next((e for e in events if e["event"] == "started"), None)
        trained = next((e["t"] for e in events if e["event"] == "step"), None)
        if begun is not None and trained is not None and time.time() >= trained + kill_at:
            return begun["pid"]
        time.sleep(0.02)
    raise RuntimeError(f"an attempt did not train within {STARTUP_GRACE_S:.0f} s; see {log.with_suffix('.stderr')}")


def _child_env() -> dict[str, str]:
    """The children's environment: bytecode caches written and used, as for an installed package (a
    ``PYTHONDONTWRITEBYTECODE`` here would recompile hf_resumable's modules at every restart, and not the
    site-packages' ones, which pip compiled)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(THREADS)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _drop_newest_checkpoint(out: str) -> str | None:
    """What a stock user does when a restart fails on a partial checkpoint: delete the newest one by hand."""
    found = sorted((p for p in Path(out).glob("checkpoint-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    if not found:
        return None
    shutil.rmtree(found[-1])
    return found[-1].name


def run_system(name: str, spec: dict, *, intervals: list[float], signal_kind: str, notice: float, root: Path) -> dict:
    """Run ``spec`` to completion under the schedule; every attempt is the same command."""
    spec, out, log = _run_dir(root, name, spec)
    attempts, fixes, pending = [], [], list(intervals)
    while True:
        kill_at = pending.pop(0) if pending else None
        attempt = _attempt(spec, kill_at=kill_at, signal_kind=signal_kind, notice=notice)
        attempts.append(attempt)
        if any(e["event"] == "done" for e in _events(log)):
            break
        if not attempt["preempted"] and kill_at is not None:  # the preemption scheduled for it is still to come
            pending.insert(0, kill_at)
        if not attempt["preempted"] and attempt["rc"] not in (0, 143):  # failed on its own: a partial checkpoint
            fixes.append(_drop_newest_checkpoint(str(out)))
            if len(fixes) > 5:
                raise RuntimeError(f"{name}: keeps failing; see {log.with_suffix('.stderr')}:\n"
                                   + log.with_suffix(".stderr").read_text()[-3000:])
    return _summarize(name, attempts, _events(log), fixes)


def _in(events: list[dict], attempt: dict, kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind and attempt["start"] <= e["t"] <= attempt["end"]]


def _clean_step_time(events: list[dict]) -> float:
    """The median step without a save: neither holding a save nor overlapping a background write (a run that saves
    often would otherwise count its saves' slowdown as its own speed, and hide it from the time lost)."""
    durations, previous, saved = [], None, False
    for event in events:
        if event["event"] == "started":
            previous, saved = None, False
        elif event["event"] in ("save", "retention"):  # (a step that deleted an old checkpoint is not clean)
            saved = True
        elif event["event"] == "step":
            if (previous is not None and event["step"] == previous["step"] + 1 and not saved
                    and not previous["writing"] and not event["writing"]):
                durations.append(event["t"] - previous["t"])
            previous, saved = event, False
    return statistics.median(durations) if durations else float("nan")


def _summarize(name: str, attempts: list[dict], events: list[dict], fixes: list) -> dict:
    """Wall time, and where each preemption's time went: the work redone (from the end of the step the next attempt
    resumed after, to the preemption), the restart (process start to the end of its first step, minus one step:
    imports, building the model and Trainer, loading the checkpoint and the first step's extra cost), the exit (from
    the SIGTERM, or the end of the step saved after it, to the process's end) and the rest (saves, slower steps):
    ``lost`` = total wall time - (the first attempt's start-up + steps x the median step of this run without a
    save + the job's end after its last line, which an uninterrupted run pays too), divided by the preemptions."""
    steps = [e for e in events if e["event"] == "step"]
    step_time = _clean_step_time(events)
    parts: dict[str, list[float]] = {"redone": [], "restart": [], "interpreter": [], "imports": [], "build": [],
                                     "load": [], "first_step": [], "exit": []}
    for index, attempt in enumerate(attempts):
        # the next attempt that trained (a stock restart that failed on a partial checkpoint is part of the restart)
        following = next((a for a in attempts[index + 1:] if _in(events, a, "step")), None)
        mine = _in(events, attempt, "step")
        if not attempt["preempted"] or not mine or following is None:
            continue
        next_steps, restarted = _in(events, following, "step"), attempts[index + 1]["start"]
        resumed_after = next_steps[0]["step"] - 1
        kept = next((e["t"] for e in mine if e["step"] == resumed_after), mine[0]["t"] - step_time)
        # After a SIGTERM the steps up to the one saved are kept: the exit counts from the later of the two.
        parts["redone"].append(max(0.0, attempt["killed"] - kept))
        parts["exit"].append(attempt["end"] - max(attempt["killed"], kept))
        marks = {kind: next(iter(_in(events, following, kind)), {}).get("t", math.nan)
                 for kind in ("started", "imported", "built", "train_begin")}
        parts["restart"].append(next_steps[0]["t"] - restarted - step_time)
        parts["interpreter"].append(marks["started"] - following["start"])
        parts["imports"].append(marks["imported"] - marks["started"])
        parts["build"].append(marks["built"] - marks["imported"])
        parts["load"].append(marks["train_begin"] - marks["built"])
        parts["first_step"].append(next_steps[0]["t"] - marks["train_begin"] - step_time)
    first = _in(events, attempts[0], "step")
    startup = first[0]["t"] - attempts[0]["start"] - step_time if first else math.nan
    trained = max((e["step"] for e in steps), default=0)
    wall = attempts[-1]["end"] - attempts[0]["start"]
    preemptions = sum(a["preempted"] for a in attempts)
    done = next((e for e in events if e["event"] == "done"), {})
    # The job's end after its last line (the interpreter's teardown, 1.3-1.7 s for a transformers process): an
    # uninterrupted run pays it too, so it is not time lost to a preemption.
    last = attempts[-1]
    teardown = last["end"] - done["t"] if done and last["start"] <= done["t"] <= last["end"] else 0.0
    lost = (wall - startup - trained * step_time - teardown) / preemptions if preemptions else math.nan
    # a save after the SIGTERM (the preemption checkpoint) is part of the exit, not of the saves' cost to the loop
    periodic = [e for e in events if e["event"] != "save" or not any(
        a["killed"] is not None and a["killed"] <= e["t"] <= a["end"] for a in attempts)]
    parts["save_cost"] = [_step_costs(periodic, step_time)["all_saves"] / preemptions] if preemptions else []
    return {"name": name, "wall": wall, "preemptions": preemptions, "attempts": len(attempts),
            "saves": sum(e["event"] == "save" for e in events), "step_time": step_time, "startup": startup,
            "teardown": teardown,
            "lost": lost, **{k: statistics.fmean(v) if v else math.nan for k, v in parts.items()},
            "digest": done.get("digest"), "partial_checkpoints_removed": [f for f in fixes if f]}


def _step_costs(events: list[dict], reference: float = math.nan) -> dict:
    """From an uninterrupted run with saves: the median step without a save; each save's stall (from the end of the
    step it follows to the end of the save call: staging, and the wait for the previous write if it is still in
    flight); for background saves the steps that overlap the write (from the end of the save call or of the
    previous step while the write is in flight, to the end of the step; the first one is the step right after the
    save) and the whole cost of a save to the loop (the stall plus the extra time of those steps, plus ours' deletion
    of the oldest checkpoint once it has committed, ``retention``, which runs on the training thread after a later
    step: taken out of that step, and out of the stall when a save follows; stock's rotation is inside its stall)."""
    clean, stalls, during, costs, retentions = [], [], [], [], []
    parts: dict[str, dict[str, list[float]]] = {"clean": {}, "during": {}}  # per step: cpu, queued, gate
    previous, in_flight, cost, last_step, retained = None, False, None, None, 0.0
    for event in events:
        if event["event"] == "retention":
            retained += event["seconds"]
            retentions.append(event["seconds"])
            if cost is not None:
                cost[2] += event["seconds"]
            continue
        if event["event"] == "step":
            if last_step is not None and event["step"] == last_step["step"] + 1:
                kind = "during" if (in_flight or event["writing"]) else "clean" if last_step["step"] >= 2 else None
                for key in ("cpu", "queued", "gate") if kind else ():
                    if key in event and key in last_step:
                        parts[kind].setdefault(key, []).append(event[key] - last_step[key])
            last_step = event
        if event["event"] == "started":  # a new attempt: nothing carries over from the killed one
            previous, in_flight, cost, last_step, retained = None, False, None, None, 0.0
        elif event["event"] == "save" and previous is not None:
            stalls.append(event["t"] - previous["t"] - retained)
            cost = [stalls[-1], [], 0.0]
            costs.append(cost)
            previous, in_flight, retained = event, event.get("writing", False), 0.0  # a background write starts now
        elif event["event"] == "step":
            if previous is not None and (in_flight or event["writing"]):
                during.append(event["t"] - previous["t"] - retained)
                if cost is not None:
                    cost[1].append(during[-1])
            elif previous is not None and previous["event"] == "step" and previous["step"] >= 2:
                clean.append(event["t"] - previous["t"] - retained)  # (the first steps warm up)
            previous, in_flight, retained = event, event["writing"], 0.0
    # (a run whose every step after the warm-up overlaps a write has no clean step of its own: ``reference``)
    step = statistics.median(clean) if clean else reference
    called = {e["step"]: e["t"] for e in events if e["event"] == "save" and e.get("writing")}
    writes = [e["t"] - called[e["step"]] for e in events if e["event"] == "committed" and e["step"] in called]
    mean = statistics.fmean(clean) if clean else reference
    return {"step": step, "clean_mean": mean,
            "save_cost": statistics.median(stalls) if stalls else float("nan"),
            "during_mean": statistics.fmean(during) if during else float("nan"), "during_n": len(during),
            "per_save": statistics.median(stall + sum(d - mean for d in steps) + kept
                                          for stall, steps, kept in costs) if costs else float("nan"),
            "all_saves": sum(stall + sum(d - mean for d in steps) + kept for stall, steps, kept in costs),
            "retention": statistics.median(retentions) if retentions else 0.0,
            "write": statistics.median(writes) if writes else float("nan"),
            "split": {kind: {key: statistics.fmean(v) for key, v in split.items()} for kind, split in parts.items()}}


def _schedule(seed: int, mtbf: float, kills: int) -> list[float]:
    rng = random.Random(seed)
    return [min(2 * mtbf, max(0.5 * mtbf, rng.expovariate(1.0 / mtbf))) for _ in range(kills)]


def _options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the preset (the defaults: 30 steps, 2 preemptions)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test of the script")
    parser.add_argument("--steps", type=int, help="optimizer steps of the job (default 30)")
    parser.add_argument("--mtbf", type=float,
                        help="mean seconds from an attempt's first step to its preemption (default: a quarter of the "
                             "uninterrupted run's training time, so that every preemption lands)")
    parser.add_argument("--kills", type=int, help="preemptions per schedule (default 2)")
    parser.add_argument("--notice", type=float, default=30.0,
                        help="seconds from SIGTERM to SIGKILL (default 30, Kubernetes' default grace period)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each preempted system (medians)")
    parser.add_argument("--inflation-pairs", type=int, default=0,
                        help="uninterrupted background-save runs with the writer's lower priority and without it, "
                             "alternated: the step-time inflation of each, median (default 0: one run, the default "
                             "priority only; the comparison is an ablation, not a target)")
    parser.add_argument("--inflation-only", action="store_true",
                        help="only the uninterrupted background-save run(s) (with --inflation-pairs, the ablation): "
                             "the step-time inflation, stall and write time, no stock run and no preemption")
    parser.add_argument("--stock-intervals", type=float, nargs="+", default=[1.0],
                        help="stock save_steps as multiples of its Young/Daly optimum; the best is reported")
    parser.add_argument("--fixed-intervals", type=int, nargs="*", default=[],
                        help="also run background saves every N steps (SIGKILL schedule), against the automatic one")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch (OpenMP) threads per training process, the same for every system (default 1: on "
                             "a shared 2-core VM, spinning OpenMP threads make a step 10x slower under load)")
    parser.add_argument("--only", choices=["SIGKILL", "SIGTERM"], help="run one schedule only")
    parser.add_argument("--no-supervised", action="store_true",
                        help=f"skip the SIGKILL system '{SUPERVISED}' (the training process killed, restarted warm "
                             f"by the supervisor)")
    parser.add_argument("--out", help="working directory (default: a temporary one, removed at the end)")
    options = parser.parse_args(argv)
    options.model = "tiny" if options.tiny else "quick"
    options.steps = options.steps or 30
    options.kills = options.kills or 2
    return options


def _what_the_ratio_is(ours: dict, stock: dict) -> str:
    """SIGKILL: the restart, a fixed cost common to both trainers, against what the save interval drives (the work
    redone and the saves' cost to the loop), each per preemption."""
    sides = (("ours", ours), ("stock", stock))
    driven = {side: split["redone"] + split["save_cost"] for side, split in sides}
    other = {side: split["lost"] - split["restart"] - driven[side] for side, split in sides}
    return (f"SIGKILL per preemption: restart ours {ours['restart']:.1f} s, stock {stock['restart']:.1f} s (of which "
            f"imports {ours['imports']:.1f} s and {stock['imports']:.1f} s); what the interval drives (work redone + "
            f"saves' cost to the loop) ours {driven['ours']:.1f} s, stock {driven['stock']:.1f} s (alone "
            f"{_ratio(driven['ours'], driven['stock'])}); other ours {other['ours']:.1f} s, stock "
            f"{other['stock']:.1f} s.")


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def _ratio(ours: float, stock: float) -> str:
    return f"{ours / stock:.2f}" if stock > 0 and not math.isnan(ours) else "n/a"


def _uninterrupted(root: Path, base: dict, calibrate: int, pairs: int) -> tuple[dict, dict, dict, dict]:
    """The references, uninterrupted: stock without checkpoints (the goodput baseline, stock's final weights), a
    short stock run that measures its save cost, and ours with background saves every ``calibrate`` steps (final
    weights; the inflation and stall), ``pairs`` times with the writer's lower priority and without it, alternated
    so that both see the same load. Returns the baseline, ours' reference and the step costs of stock and ours."""
    once = {"intervals": [], "signal_kind": "SIGKILL", "notice": 0, "root": root}
    baseline = run_system("stock-uninterrupted", {**base, "system": "stock"}, **once)
    run_system("stock-calibration", {**base, "system": "stock", "steps": 2 * calibrate, "save_steps": calibrate},
               **once)
    stock_costs = _step_costs(_events(root / "stock-calibration" / "events.jsonl"))
    ours_ref, costs = _background_runs(root, base, calibrate, pairs)
    return baseline, ours_ref, stock_costs, costs


def _background_runs(root: Path, base: dict, calibrate: int, pairs: int) -> tuple[dict, dict]:
    """Ours uninterrupted with background saves every ``calibrate`` steps (``pairs`` times with the writer's lower
    priority and without it, alternated; once with the lower priority for ``pairs=0``): the first run, and the step
    costs of each kind."""
    once = {"intervals": [], "signal_kind": "SIGKILL", "notice": 0, "root": root}
    costs: dict[str, list[dict]] = {"lowered": [], "normal": []}
    ours_ref = None
    for pair in range(max(1, pairs)):
        for label, nice in (("lowered", None), ("normal", 0))[:1 if pairs == 0 else 2]:
            name = f"ours-uninterrupted-{label}-{pair}"
            result = run_system(name, {**base, "system": "background", "save_steps": calibrate, "writer_nice": nice},
                                **once)
            ours_ref = ours_ref or result
            costs[label].append(_step_costs(_events(root / name / "events.jsonl")))
    return ours_ref, costs


def _inflation(costs: list[dict]) -> float:
    return statistics.median(c["during_mean"] / c["clean_mean"] for c in costs) if costs else math.nan


def _print_inflation(bg: dict[str, list[dict]], calibrate: int, stock_save: float) -> tuple[float, float, dict]:
    """Print the background-save line; returns the inflation with the lower priority and without, and the per-save
    costs."""
    lowered, normal = _inflation(bg["lowered"]), _inflation(bg["normal"])
    per_save = {label: statistics.median(c["per_save"] for c in runs) if runs else math.nan
                for label, runs in bg.items()}
    stall = statistics.median(c["save_cost"] for c in bg["lowered"])
    write = {label: statistics.median(c["write"] for c in runs) if runs else math.nan for label, runs in bg.items()}
    retention = statistics.median(c["retention"] for c in bg["lowered"])
    print(f"\nBackground save ({calibrate}-step interval, uninterrupted, {len(bg['lowered'])} pair(s), medians): "
          f"step-time inflation while written {lowered:.2f}x with the writer at lower priority, {normal:.2f}x "
          f"without; a save's whole cost to the loop {per_save['lowered']:.2f} s and {per_save['normal']:.2f} s; "
          f"stall {stall:.2f} s over a {bg['lowered'][0]['step']:.3f} s step; from the save call to the commit "
          f"{write['lowered']:.2f} s and {write['normal']:.2f} s; deleting the oldest checkpoint after a commit (on "
          f"the training thread, counted in the save's cost) {retention:.2f} s; stock save {stock_save:.2f} s.",
          flush=True)
    for label, runs in bg.items():
        split = {kind: {key: statistics.median(r["split"][kind].get(key, math.nan) for r in runs)
                        for key in ("cpu", "queued", "gate")} for kind in ("clean", "during")} if runs else None
        if split:
            print(f"  {label}: the training thread per step without a write / while one is written (the first step "
                  f"after the call includes its staging): its CPU {split['clean']['cpu']:.3f} / "
                  f"{split['during']['cpu']:.3f} s, waiting for a core {split['clean']['queued']:.3f} / "
                  f"{split['during']['queued']:.3f} s, at the step gate {split['during']['gate']:.3f} s", flush=True)
    return lowered, normal, per_save


def main(argv: list[str] | None = None) -> None:
    global THREADS
    options = _options(argv)
    THREADS = options.threads
    if options.child:
        _child(json.loads(options.child))
        return
    root = Path(options.out or tempfile.mkdtemp(prefix="bench_goodput_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        _measure(options, root)
    finally:  # a failed run too: a --quick run leaves up to 20 GB of checkpoints there
        if options.out is None:
            shutil.rmtree(root, ignore_errors=True)


def _measure(options: argparse.Namespace, root: Path) -> None:
    """The references, the schedules and the tables, in ``root``."""
    base = {"model": options.model, "steps": options.steps}
    started, load = time.time(), _load()
    print(f"# goodput: {options.model} job, {options.steps} steps, {options.kills} preemptions per schedule, "
          f"notice {options.notice:.0f} s, seed {options.seed}", flush=True)

    # 1. Uninterrupted references.
    calibrate = max(4, options.steps // 6)
    if options.inflation_only:
        _, bg = _background_runs(root, base, calibrate, options.inflation_pairs)
        _print_inflation(bg, calibrate, math.nan)
        print(f"load average {load} at the start, {_load()} at the end; {(time.time() - started) / 60:.1f} min")
        return
    baseline, ours_ref, stock_costs, bg = _uninterrupted(root, base, calibrate, options.inflation_pairs)
    # By default a preemption comes on average after a fifth of the job's training time (at most 2/5 of it), so
    # that every scheduled preemption lands before the job is done.
    mtbf = options.mtbf or options.steps * baseline["step_time"] / 5

    from hf_resumable.integrations._interval import plan_save_interval

    stock_plan = plan_save_interval(save_cost_s=max(stock_costs["save_cost"], 1e-3), step_time_s=stock_costs["step"],
                                    mean_time_between_failures_s=mtbf)
    print(f"preemptions {mtbf:.1f} s after an attempt's first step on average; stock save: "
          f"{stock_costs['save_cost']:.2f} s, step {stock_costs['step']:.3f} s -> Young/Daly save_steps="
          f"{stock_plan.steps}", flush=True)

    # 2. The schedules, the same intervals for every system.
    results: dict[str, dict[str, list[dict]]] = {"SIGKILL": {}, "SIGTERM": {}}
    for repeat in range(options.repeats):
        intervals = _schedule(options.seed + repeat, mtbf, options.kills)
        systems = {"SIGKILL": {}, "SIGTERM": {}}
        for multiple in options.stock_intervals:
            steps = max(1, round(stock_plan.steps * multiple))
            systems["SIGKILL"][f"stock save_steps={steps}"] = {**base, "system": "stock", "save_steps": steps}
        systems["SIGKILL"]["ours blocking, auto"] = {**base, "system": "blocking", "mtbf": mtbf}
        systems["SIGKILL"]["ours background, auto"] = {**base, "system": "background", "mtbf": mtbf}
        if not options.no_supervised:
            systems["SIGKILL"][SUPERVISED] = {**base, "system": "background", "mtbf": mtbf, "supervised": True}
        for steps in options.fixed_intervals:
            systems["SIGKILL"][f"ours background save_steps={steps}"] = {**base, "system": "background",
                                                                         "save_steps": steps}
        systems["SIGTERM"]["stock enable_jit_checkpoint"] = {**base, "system": "stock", "jit": True}
        systems["SIGTERM"]["ours"] = {**base, "system": "background", "notice": options.notice}
        for kind, named in systems.items():
            if options.only and kind != options.only:
                continue
            for name, spec in named.items():
                slug = f"{kind}-{repeat}-" + "".join(c if c.isalnum() else "_" for c in name)
                if spec.get("supervised"):
                    result = run_supervised(slug, spec, intervals=intervals, root=root)
                else:
                    result = run_system(slug, spec, intervals=intervals, signal_kind=kind, notice=options.notice,
                                        root=root)
                reference = ours_ref if spec["system"] != "stock" else baseline
                result["exact"] = result["digest"] is not None and result["digest"] == reference["digest"]
                results[kind].setdefault(name, []).append(result)
                print(f"  {kind} {name}: wall {result['wall']:.1f} s, {result['preemptions']} preemptions, "
                      f"lost {result['lost']:.1f} s each, exact {result['exact']}", flush=True)

    # 3. The tables.
    uninterrupted = baseline["wall"]
    print(f"\nMeasured on a shared machine (nice -n 10; load average {load} at the start, {_load()} at the end), "
          f"medians of {options.repeats} run(s); total {(time.time() - started) / 60:.1f} min. Preemptions "
          f"{mtbf:.1f} s after an attempt's first step on average. Uninterrupted stock run without checkpoints: "
          f"{uninterrupted:.1f} s (a step {baseline['step_time']:.3f} s, start-up {baseline['startup']:.1f} s).\n")
    print("| schedule | system | goodput | lost per preemption (s) | work redone | restart | of which: interpreter, "
          "imports, build, load, first step's extra | saves' cost to the loop | SIGTERM to exit | other | saves | "
          "preemptions | final weights exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lost: dict[str, dict[str, float]] = {"SIGKILL": {}, "SIGTERM": {}}
    split: dict[str, dict[str, dict[str, float]]] = {"SIGKILL": {}, "SIGTERM": {}}
    for kind, named in results.items():
        for name, runs in named.items():
            med = {key: statistics.median(r[key] for r in runs)
                   for key in ("wall", "lost", "redone", "restart", "interpreter", "imports", "build", "load",
                               "first_step", "save_cost", "exit", "saves", "preemptions")}
            lost[kind][name] = med["lost"]
            split[kind][name] = med
            exit_s = med["exit"] if kind == "SIGTERM" else 0.0
            other = med["lost"] - med["redone"] - med["restart"] - med["save_cost"] - exit_s
            exact = "yes" if all(r["exact"] for r in runs) else "no"
            fixes = sum(len(r["partial_checkpoints_removed"]) for r in runs)
            note = f" ({fixes} partial checkpoint(s) deleted by hand)" if fixes else ""
            print(f"| {kind} | {name} | {uninterrupted / med['wall']:.2f} | {med['lost']:.1f} | {med['redone']:.1f} | "
                  f"{med['restart']:.1f} | {med['interpreter']:.1f}, {med['imports']:.1f}, {med['build']:.1f}, "
                  f"{med['load']:.1f}, {med['first_step']:.1f} | {med['save_cost']:.1f} | {exit_s:.1f} | "
                  f"{other:.1f} | {med['saves']:.0f} | {med['preemptions']:.0f} | {exact}{note} |")
    lowered, normal, per_save = _print_inflation(bg, calibrate, stock_costs["save_cost"])
    (root / "results.json").write_text(json.dumps({"results": results, "baseline": baseline, "lost": lost,
                                                   "inflation": {"lowered": lowered, "normal": normal},
                                                   "per_save": per_save, "bg": bg,
                                                   "stock": stock_costs, "split": split, "mtbf": mtbf},
                                                  indent=1, default=str))
    job_level = {k: v for k, v in lost["SIGKILL"].items() if k != SUPERVISED and not math.isnan(v)}
    if SUPERVISED in lost["SIGKILL"] and job_level:
        ours_job = min((v for k, v in job_level.items() if k.startswith("ours")), default=math.nan)
        stock_job = min((v for k, v in job_level.items() if k.startswith("stock")), default=math.nan)
        print(f"lost per preemption, ours/stock, SIGKILL of the whole job (the next attempt a new interpreter, as "
              f"after a machine's loss): {_ratio(ours_job, stock_job)}; of the training process only (ours "
              f"restarted by `hf-resumable run`): {_ratio(lost['SIGKILL'][SUPERVISED], stock_job)}")
    ratios = {}
    for kind in ("SIGKILL", "SIGTERM"):
        if options.only and kind != options.only:
            ratios[kind] = "n/a"
            continue
        best = {side: min((k for k, v in lost[kind].items() if k.startswith(side) and not math.isnan(v)),
                          key=lost[kind].get, default=None) for side in ("ours", "stock")}
        ours, stock = (lost[kind][best[side]] if best[side] else math.nan for side in ("ours", "stock"))
        ratios[kind] = _ratio(ours, stock)
        if kind == "SIGKILL" and None not in best.values():
            print(_what_the_ratio_is(split[kind][best["ours"]], split[kind][best["stock"]]))
    print(f"lost per preemption, ours/stock: SIGKILL {ratios['SIGKILL']}, SIGTERM {ratios['SIGTERM']}")


if __name__ == "__main__":
    main()
