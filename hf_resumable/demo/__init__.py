"""``hf-resumable demo``: train, SIGKILL at a random step, restart with the same command, prove nothing changed.

A reference run and a run killed at a random step (then restarted with the same command line) train side by side
(:mod:`hf_resumable.demo.train`); :func:`compare_runs` checks every per-step loss and the final weights bit for bit.
See docs/cli.md (``demo``).

Example:

```python
>>> from hf_resumable.demo import run_demo
>>> report = run_demo("demo-output", max_steps=30)  # doctest: +SKIP
>>> report.comparison.ok  # doctest: +SKIP
True
```
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ._common import CHECKPOINTS_DIR, FINAL_FILE, LOSSES_FILE, RESUMES_FILE
from .train import resolve_backend

logger = logging.getLogger(__name__)

__all__ = ["RunRecord", "StepRow", "RunComparison", "DemoReport", "load_run", "compare_runs", "format_comparison",
           "plot_losses", "run_demo"]

PLOT_FILE = "loss_curves.png"
REPORT_FILE = "demo_report.json"
_POLL_SECONDS = 0.005


@dataclass(frozen=True)
class RunRecord:
    """What one training run produced.

    Args:
        losses (`dict[int, float]`): optimizer step -> loss.
        weights_sha256 (`str`, *optional*): hash of the final weights (``None`` if the run did not finish).
        resumed_from (`list[int]`): steps of the checkpoints the run resumed from.
    """

    losses: dict[int, float]
    weights_sha256: str | None = None
    resumed_from: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepRow:
    """One row of the comparison table."""

    step: int
    reference: float | None
    resumed: float | None

    @property
    def equal(self) -> bool:
        """Bitwise equality (``nan`` equals ``nan``; a missing side never equals)."""
        if self.reference is None or self.resumed is None:
            return False
        if math.isnan(self.reference) and math.isnan(self.resumed):
            return True
        return float.hex(self.reference) == float.hex(self.resumed)


@dataclass(frozen=True)
class RunComparison:
    """Result of :func:`compare_runs`.

    Args:
        rows (`list[StepRow]`): every step either run logged, in order.
        reference_sha256 / resumed_sha256 (`str`, *optional*): final weight hashes.
        problems (`list[str]`): one line per difference; empty when the runs are identical.
    """

    rows: list[StepRow]
    reference_sha256: str | None
    resumed_sha256: str | None
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def load_run(directory: str | os.PathLike) -> RunRecord:
    """Read a demo run directory (losses, final weight hash, resumes).

    Raises:
        FileNotFoundError: if the directory has no loss log.
    """
    directory = Path(directory)
    losses = {}
    for line in (directory / LOSSES_FILE).read_text(encoding="utf-8").splitlines():
        if line.strip():
            entry = json.loads(line)
            losses[int(entry["step"])] = float.fromhex(entry["loss_hex"])
    final = directory / FINAL_FILE
    digest = json.loads(final.read_text())["weights_sha256"] if final.exists() else None
    resumes = directory / RESUMES_FILE
    resumed_from = [json.loads(line)["from_step"] for line in resumes.read_text().splitlines() if line.strip()] \
        if resumes.exists() else []
    return RunRecord(losses, digest, resumed_from)


def compare_runs(reference: RunRecord, resumed: RunRecord) -> RunComparison:
    """Compare two runs step by step, bit for bit, and their final weights. Pure: no IO.

    Example:

    ```python
    >>> a = RunRecord({1: 2.5, 2: 2.25}, "ab")
    >>> compare_runs(a, a).ok
    True
    >>> compare_runs(a, RunRecord({1: 2.5, 2: 2.2500001}, "ab")).problems
    ['step 2: loss 2.25 (uninterrupted) != 2.2500001 (resumed)']
    ```
    """
    steps = sorted(set(reference.losses) | set(resumed.losses))
    rows = [StepRow(s, reference.losses.get(s), resumed.losses.get(s)) for s in steps]
    problems = []
    for row in rows:
        if row.reference is None or row.resumed is None:
            side = "uninterrupted" if row.reference is None else "resumed"
            problems.append(f"step {row.step}: missing from the {side} run")
        elif not row.equal:
            problems.append(f"step {row.step}: loss {row.reference!r} (uninterrupted) != {row.resumed!r} (resumed)")
    if not steps:
        problems.append("no steps were logged")
    if reference.weights_sha256 is None or resumed.weights_sha256 is None:
        problems.append("a run did not finish (no final weights hash)")
    elif reference.weights_sha256 != resumed.weights_sha256:
        problems.append(f"final weights differ: {reference.weights_sha256} != {resumed.weights_sha256}")
    return RunComparison(rows, reference.weights_sha256, resumed.weights_sha256, problems)


def format_comparison(comparison: RunComparison, *, kill_step: int | None = None,
                      resumed_from: list[int] = ()) -> str:
    """The per-step table, the final hashes and the verdict, as text."""
    lines = []
    if kill_step is not None:
        resumed = ", ".join(f"checkpoint-{s}" for s in resumed_from) or "scratch (no checkpoint yet)"
        lines += [f"SIGKILL after step {kill_step}; the same command restarted it and it resumed from {resumed}.", ""]
    lines += [f"{'step':>5}  {'uninterrupted':>22}  {'killed + resumed':>22}  same", "-" * 62]
    for row in comparison.rows:
        notes = [f"first step after resuming from checkpoint-{row.step - 1}"] if row.step - 1 in resumed_from else []
        if row.step == kill_step:
            notes.append("last step logged before the SIGKILL")
        note = f"   <- {'; '.join(notes)}" if notes else ""
        lines.append(f"{row.step:>5}  {_fmt(row.reference):>22}  {_fmt(row.resumed):>22}  "
                     f"{'yes' if row.equal else 'NO'}{note}")
    lines += ["", f"final weights sha256, uninterrupted:    {comparison.reference_sha256}",
              f"final weights sha256, killed + resumed: {comparison.resumed_sha256}", ""]
    if comparison.ok:
        lines.append(f"IDENTICAL: all {len(comparison.rows)} losses and the final weights match bit for bit.")
    else:
        lines.append(f"MISMATCH ({len(comparison.problems)}):")
        lines += [f"  {p}" for p in comparison.problems]
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else repr(value)


def plot_losses(reference: RunRecord, resumed: RunRecord, path: str | os.PathLike, *,
                kill_step: int | None = None) -> Path | None:
    """Plot both loss curves to a PNG; returns ``None`` (with a WARNING) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping the loss plot (pip install matplotlib).")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ref_steps = sorted(reference.losses)
    res_steps = sorted(resumed.losses)
    ax.plot(ref_steps, [reference.losses[s] for s in ref_steps], lw=3, alpha=0.45, label="uninterrupted")
    ax.plot(res_steps, [resumed.losses[s] for s in res_steps], "k.--", lw=1, ms=4, label="killed + resumed")
    if kill_step is not None:
        ax.axvline(kill_step, color="red", ls=":", label=f"SIGKILL (step {kill_step})")
    for step in resumed.resumed_from:
        ax.axvline(step, color="green", ls="-.", lw=1, label=f"resumed from checkpoint-{step}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("hf_resumable: uninterrupted vs killed-and-resumed training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------------------------- orchestration
@dataclass
class DemoReport:
    """Outcome of :func:`run_demo`."""

    output: Path
    kill_step: int
    comparison: RunComparison
    reference: RunRecord
    resumed: RunRecord
    plot: Path | None
    seconds: float
    backend: str = "loop"

    def to_dict(self) -> dict:
        return {"ok": self.comparison.ok, "backend": self.backend, "kill_step": self.kill_step,
                "resumed_from": self.resumed.resumed_from,
                "problems": self.comparison.problems, "reference_sha256": self.comparison.reference_sha256,
                "resumed_sha256": self.comparison.resumed_sha256, "plot": str(self.plot) if self.plot else None,
                "seconds": round(self.seconds, 2),
                "losses": [{"step": r.step, "uninterrupted": r.reference, "resumed": r.resumed}
                           for r in self.comparison.rows]}


def _train_command(run_dir: Path, *, max_steps: int, seed: int, save_every: int, backend: str) -> list[str]:
    return [sys.executable, "-m", "hf_resumable.demo.train", "--output", str(run_dir), "--max-steps", str(max_steps),
            "--seed", str(seed), "--save-every", str(save_every), "--backend", backend]


class _Progress:
    """A tqdm bar over the steps both runs have logged (re-run steps count again), or nothing."""

    def __init__(self, logs: list[Path], total: int, enabled: bool) -> None:
        self.logs = logs
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="training (both runs)", unit="step", leave=False)

    def update(self) -> None:
        if self.bar is None:
            return
        done = min(self.bar.total, sum(_logged_steps(log) for log in self.logs))
        if done != self.bar.n:  # refresh only on progress: no flood of lines when stderr is not a terminal
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _logged_steps(log: Path) -> int:
    try:
        return log.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _kill_when(process: subprocess.Popen, log: Path, step: int, progress: _Progress) -> int:
    """SIGKILL ``process`` as soon as its loss log has ``step`` lines; return the steps it had logged by then.

    Raises:
        RuntimeError: if the process exits before reaching ``step``.
    """
    while _logged_steps(log) < step:
        if process.poll() is not None:
            raise RuntimeError(f"the training process exited with {process.returncode} before step {step}; "
                               f"see {log.parent}/train.log")
        progress.update()
        time.sleep(_POLL_SECONDS)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return _logged_steps(log)


def _finish(process: subprocess.Popen, what: str, log_path: Path, progress: _Progress) -> None:
    while process.poll() is None:
        progress.update()
        time.sleep(0.1)
    if process.returncode != 0:
        raise RuntimeError(f"the {what} training run failed with exit code {process.returncode}; see {log_path}")


def _start(command: list[str], log_path: Path, env: Mapping[str, str]) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env))


def run_demo(output: str | os.PathLike, *, max_steps: int = 40, save_every: int = 5, seed: int = 1234,
             kill_step: int | None = None, backend: str = "auto", plot: bool = True,
             progress: bool = False) -> DemoReport:
    """Run the kill-and-resume demo in ``output`` and compare the runs.

    1. Start the reference run and the victim run side by side (two processes).
    2. SIGKILL the victim when its log reaches ``kill_step`` (default: random, after the first checkpoint).
    3. Restart the victim with the same command; it resumes from its newest valid checkpoint.
    4. Compare losses and final weights with :func:`compare_runs`, and plot both curves.

    Args:
        output (`str` or `os.PathLike`): demo directory (must not hold an earlier demo's runs).
        max_steps (`int`, *optional*, defaults to 40): optimizer steps per run.
        save_every (`int`, *optional*, defaults to 5): checkpoint interval in steps.
        seed (`int`, *optional*, defaults to 1234): training seed (same for both runs).
        kill_step (`int`, *optional*): step at which to kill (default: drawn at random).
        backend (`str`, *optional*, defaults to `"auto"`): ``"trainer"`` (``ResumableTrainer``), ``"loop"``
            (plain torch loop) or ``"auto"`` (the trainer when its integration imports).
        plot (`bool`, *optional*, defaults to `True`): write ``loss_curves.png``.
        progress (`bool`, *optional*, defaults to `False`): show a tqdm progress bar.

    Returns:
        [`DemoReport`]: ``report.comparison.ok`` is the verdict.

    Raises:
        FileExistsError: if ``output`` already holds demo runs.
        ValueError: if ``max_steps`` leaves no room to kill after a checkpoint.
        RuntimeError: if a training process fails.

    Example:

    ```python
    >>> report = run_demo("demo-output", max_steps=20, save_every=4, backend="loop")  # doctest: +SKIP
    >>> print(format_comparison(report.comparison, kill_step=report.kill_step))  # doctest: +SKIP
    ```
    """
    started = time.perf_counter()
    output = Path(output)
    if (output / "reference").exists() or (output / "resumed").exists():
        raise FileExistsError(f"{output} already holds demo runs; pass an empty or new directory.")
    if max_steps < save_every + 2:
        raise ValueError(f"max_steps must be at least save_every + 2 = {save_every + 2}, got {max_steps}.")
    kill_step = kill_step or random.SystemRandom().randint(save_every + 1, max_steps - 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}
    reference_dir, victim_dir = output / "reference", output / "resumed"
    backend = resolve_backend(backend)
    options = {"max_steps": max_steps, "seed": seed, "save_every": save_every, "backend": backend}
    logger.info("starting the uninterrupted run and the run to be killed at step %d", kill_step)
    reference = _start(_train_command(reference_dir, **options), reference_dir / "train.log", env)
    victim = _start(_train_command(victim_dir, **options), victim_dir / "train.log", env)
    processes = [reference, victim]
    bar = _Progress([reference_dir / LOSSES_FILE, victim_dir / LOSSES_FILE], 2 * max_steps, progress)
    try:
        kill_step = _kill_when(victim, victim_dir / LOSSES_FILE, kill_step, bar)
        logger.info("killed the run after step %d (exit %s); restarting it with the same command", kill_step,
                    victim.returncode)
        processes.append(_start(_train_command(victim_dir, **options), victim_dir / "train.log", env))
        _finish(processes[-1], "resumed", victim_dir / "train.log", bar)
        _finish(reference, "uninterrupted", reference_dir / "train.log", bar)
    finally:
        bar.close()
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    ref_record, res_record = load_run(reference_dir), load_run(victim_dir)
    comparison = compare_runs(ref_record, res_record)
    plot_path = plot_losses(ref_record, res_record, output / PLOT_FILE, kill_step=kill_step) if plot else None
    report = DemoReport(output, kill_step, comparison, ref_record, res_record, plot_path,
                        time.perf_counter() - started, backend)
    (output / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


__all__ += ["PLOT_FILE", "REPORT_FILE", "CHECKPOINTS_DIR"]
