"""``hf-resumable check``: prove that a user's own training command resumes bit for bit, or say where it does not.

The command runs once uninterrupted with the per-step trace on (:mod:`hf_resumable.trace`), then once per kill point,
killed there and rerun until it exits with 0; :mod:`._compare` compares every interrupted run's trace with the
reference's, per optimizer step and rank. See docs/check.md.

Example:

```python
>>> from hf_resumable.check import CheckOptions, run_check
>>> command = ["python", "train.py", "--output_dir", "{out}"]
>>> report = run_check(command, options=CheckOptions(kills=3))  # doctest: +SKIP
>>> report.exact, report.summary()  # doctest: +SKIP
(True, 'EXACT: 3 interrupted runs ...')
```
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._compare import Comparison, Difference, compare_traces, likely_cause
from ._runner import CheckOptions, KillPoint, RunOutcome, plan_kill_points, run_interrupted, run_reference

logger = logging.getLogger(__name__)

__all__ = ["CheckOptions", "CheckReport", "KillPoint", "Difference", "compare_traces", "run_check"]


@dataclass(frozen=True)
class CheckReport:
    """What ``run_check`` found.

    Args:
        command (`tuple[str, ...]`): the command as given (with ``{out}``).
        steps (`int`): optimizer steps of the reference run.
        ranks (`int`): processes that wrote a trace.
        runs (`tuple[RunOutcome, ...]`): the interrupted runs.
        comparisons (`tuple[Comparison, ...]`): one per run.
        workdir (`Path`): where the runs' outputs and traces are (removed after an exact check).
    """

    command: tuple[str, ...]
    steps: int
    ranks: int
    runs: tuple[RunOutcome, ...]
    comparisons: tuple[Comparison, ...]
    workdir: Path
    compared: dict[str, int] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return all(c.exact for c in self.comparisons) and not any(run.failure for run in self.runs)

    def _first_failure(self) -> tuple[RunOutcome, Comparison] | None:
        for run, comparison in zip(self.runs, self.comparisons):
            if run.failure or not comparison.exact:
                return run, comparison
        return None

    def summary(self) -> str:
        """``EXACT ...`` or ``DIVERGES at optimizer step K ...`` / ``FAILS ...``, with the kill points."""
        lines = []
        for index, (run, comparison) in enumerate(zip(self.runs, self.comparisons), start=1):
            resumed = (f"resumed from step {', '.join(map(str, run.resumed_from))}" if run.resumed_from
                       else "started over (no checkpoint before the kill)")
            verdict = "fails" if run.failure else "exact" if comparison.exact else "diverges"
            lines.append(f"  run {index}: {run.kill_point.describe()}; {resumed}; "
                         f"{len(run.launches)} launches; {verdict}")
        failing = self._first_failure()
        if failing is None:
            compared = ", ".join(f"{count} {what}" for what, count in self.compared.items() if count)
            head = (f"EXACT: {len(self.runs)} interrupted run(s) match the uninterrupted one bit for bit "
                    f"({self.steps} optimizer steps, {self.ranks} rank(s); per run: {compared}).")
            return "\n".join([head, *lines])
        run, comparison = failing
        index = self.runs.index(run) + 1
        if comparison.first is None:
            head = f"FAILS: run {index} ({run.kill_point.describe()}) did not finish: {run.failure}"
            return "\n".join([head, *lines])
        first = comparison.first
        also = sorted({d.category for d in comparison.at_first_step()} - {first.category})
        head = [f"DIVERGES at optimizer step {first.step} (rank {first.rank}), run {index} "
                f"({run.kill_point.describe()}):",
                f"  first difference: {first.describe()}"]
        if also:
            head.append(f"  also different at that step: {', '.join(also)}")
        head.append(f"  likely cause: {likely_cause(comparison)}")
        if run.failure:  # what stopped it (e.g. an error the resumed launch raised) says more than any guess
            head.append(f"  then it did not finish: {_last_line(run.failure)}")
        head.append(f"  {len(comparison.differences)} difference(s) in all; outputs and traces: {self.workdir}")
        return "\n".join([*head, *lines])

    def to_dict(self) -> dict[str, Any]:
        failing = self._first_failure()
        return {
            "result": "EXACT" if failing is None else "FAILS" if failing[1].first is None else "DIVERGES",
            "command": list(self.command), "steps": self.steps, "ranks": self.ranks, "workdir": str(self.workdir),
            "compared_per_run": self.compared,
            "runs": [{"kill_point": run.kill_point.to_dict(), "launches": [one.to_dict() for one in run.launches],
                      "resumed_from": run.resumed_from, "failure": run.failure, "exact": c.exact,
                      "compared_records": c.compared, "likely_cause": likely_cause(c) or None,
                      "differences": [d.to_dict() for d in c.differences[:50]]}
                     for run, c in zip(self.runs, self.comparisons)],
        }

    def write_json(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _last_line(text: str, *, limit: int = 600) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else text[:limit]


def _what_is_compared(reference: list[dict[str, Any]]) -> dict[str, int]:
    kinds = Counter(record["kind"] for record in reference)
    return {"batches": kinds["batch"], "forward passes (the RNG state before each)": kinds["forward"],
            "optimizer updates (learning rate, weights, optimizer state)": kinds["update"],
            "model inputs": kinds["inputs"], "losses": kinds["loss"], "logged metric entries": kinds["log"],
            "printed or logged lines with numbers": kinds["print"], "checkpoint loads": kinds["resume"],
            "final weights and optimizer state": kinds["final"]}


def run_check(command: Sequence[str], *, options: CheckOptions | None = None,
              workdir: str | os.PathLike | None = None) -> CheckReport:
    """Run ``command`` uninterrupted, then killed and rerun at ``options.kills`` points; compare the runs.

    Args:
        command (`Sequence[str]`): the training command; ``{out}`` in an argument becomes a fresh directory per run
            (the same one for every launch of one run, so that it resumes).
        options (`CheckOptions`, *optional*): kill points, seed, timeout.
        workdir (`str` or `os.PathLike`, *optional*): where the runs go (default: a new temporary directory,
            removed when the check is exact).

    Returns:
        `CheckReport`

    Raises:
        CheckLaunchError: if the command fails without a kill, times out, or trains without hf_resumable.
        ValueError: for an empty command.
    """
    if not command:
        raise ValueError("No command to check: give it after `--`, e.g. hf-resumable check -- python train.py")
    options = options or CheckOptions()
    temporary = workdir is None
    root = Path(tempfile.mkdtemp(prefix="hf_resumable-check-") if temporary else workdir)
    # 1. The reference.
    reference = run_reference(command, root / "reference", timeout=options.timeout)
    # 2. The kill points, then one interrupted run per point.
    points = plan_kill_points(reference, kills=options.kills, seed=options.seed)
    ranks = len({r.get("rank", 0) for r in reference})
    runs, comparisons = [], []
    for index, point in enumerate(points, start=1):
        logger.info("run %d: %s", index, point.describe())
        run = run_interrupted(command, root / f"run-{index}", point, options=options, ranks=ranks)
        runs.append(run)
        # 3. The comparison.
        comparisons.append(compare_traces(reference, run.records))
    report = CheckReport(command=tuple(command), steps=comparisons[0].steps if comparisons else 0,
                         ranks=ranks, runs=tuple(runs),
                         comparisons=tuple(comparisons), workdir=root, compared=_what_is_compared(reference))
    if report.exact and temporary:
        shutil.rmtree(root, ignore_errors=True)
    return report
