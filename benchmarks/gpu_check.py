"""The GPU check in one go: the CUDA test tier, then every benchmark that needs the GPU machine, each time-boxed, every
figure appended to one results file.

GPU time comes in short windows (about 15 minutes on one H100 or H200 with 16 cores), so this runs everything in
one pass of at most ``--budget`` seconds (default 480), one step after the other:

1. ``environment``: the devices, versions, core count, and the host-to-device copy rate (pinned and pageable
   memory), the bound of any weights streamed onto the GPU.
2. ``gpu_tier``: ``pytest -m gpu tests/test_gpu.py`` (fp16/bf16 kill-and-rerun through both front doors, the
   CUDA generators, placement at load, the async save's pinned staging and side stream, NCCL and FSDP2 under
   torchrun), with its counts of passed, failed and skipped tests.
3. ``checkpoint``: benchmarks/bench_checkpoint.py with the model on the GPU: save vs raw write, the async save's
   stall vs a blocking save, resume vs raw read.
4. ``streamed_generation``: benchmarks/bench_inference.py ``--device cuda``: StreamingModel streaming onto the GPU
   vs accelerate's disk offload onto the GPU (a quarter of the weights' size as the GPU budget), each side's fraction
   of the read bound: bytes read per token x tokens/s over the storage's measured cold-read rate, and over the
   host-to-device copy rate.
5. ``step_overhead``: benchmarks/bench_resume.py ``--only lockstep``: the per-step CPU time of ResumableTrainer and
   ResumableAccelerator against the stock ones (target <= 1 %), on the machine's CPUs (what the library adds to a
   step is host work; the 16 cores keep the two sides from sharing one).
6. ``split_replicas``: benchmarks/bench_distributed.py ``--replicated`` on tmpfs: 2 ranks saving a DDP replica
   with its files split between them vs rank 0 writing all (target <= 0.6x).
7. ``background_save_inflation``: benchmarks/bench_goodput.py ``--inflation-only``: the step-time inflation while
   a background save writes (target <= 1.05x).

Each step runs in its own process group under a time limit; one that fails or hangs is recorded (its status, exit
code and the tail of its output) and the next one starts. Steps that would start after the budget is spent are
recorded as skipped. Every step appends one JSON line to ``<out>/gpu_check.jsonl`` (``section``, ``status``,
``seconds``, ``command``, ``figures``, ``output_tail``); a last ``summary`` line lists every section's status.

``--dry-run`` runs the same flow on the CPU with tiny sizes: the GPU tier skips (saying why), the benchmarks run
their CPU paths, and the results file gets every section. tests/test_gpu_check.py runs it, so that this script
cannot rot between GPU windows.

Usage:
    benchmarks/gpu_check.sh --out /tmp/gpu-results          # on the GPU machine ($OUT is the default)
    benchmarks/gpu_check.sh --dry-run --out /tmp/dry        # anywhere: the flow on the CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH = REPO_ROOT / "benchmarks"
RESULTS_FILE = "gpu_check.jsonl"
SECTIONS = ("environment", "gpu_tier", "checkpoint", "streamed_generation", "step_overhead", "split_replicas",
            "background_save_inflation")
TAIL_CHARS = 6000
# The settings a bit-exact GPU run needs (docs/limits.md); each process is a fresh interpreter on a GPU (the tests'
# zygote forks from a process that imported torch: CUDA must not be set up before a fork).
GPU_TEST_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HF_RESUMABLE_TEST_ZYGOTE": "0"}


@dataclass(frozen=True)
class Step:
    """One time-boxed step: a command, its limit, and how its figures are read from its output.

    Args:
        section (`str`): the name of its line in the results file.
        command (`list[str]`): what runs (in the repository root).
        timeout_s (`float`): seconds before its process group is killed.
        parse (`Callable[[str, Path], dict]`): its figures, from its output and the step's work directory.
        env (`dict[str, str]`): variables added to its environment.
    """

    section: str
    command: list[str]
    timeout_s: float
    parse: Callable[[str, Path], dict]
    env: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------ parsing (pure)


def markdown_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in ``text`` (separator rows left out).

    Example:

    ```python
    >>> markdown_rows("| a | b |\\n|---|---|\\n| 1 | 2 |")
    [['a', 'b'], ['1', '2']]

    ```
    """
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line[1:-1].split("|")])
    return rows


def ratio_after(text: str, label: str) -> float | None:
    """The number before ``x`` that follows ``label`` in ``text`` (the last occurrence), e.g. ``1.03`` in
    ``"inflation while written 1.03x"``."""
    found = re.findall(re.escape(label) + r"\s*([0-9]+(?:\.[0-9]+)?)x", text)
    return float(found[-1]) if found else None


def junit_counts(path: Path) -> dict:
    """Tests, failures, errors and skips of a pytest JUnit XML report, with the failed tests' names."""
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    skipped = sorted({(case.find("skipped").get("message") or "") for case in suite.iter("testcase")
                      if case.find("skipped") is not None})
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed_tests": failed, "skip_reasons": skipped}


def _parse_tier(output: str, work: Path) -> dict:
    report = work / "gpu_tier.xml"
    return junit_counts(report) if report.is_file() else {}


def _parse_checkpoint(output: str, work: Path) -> dict:
    rows = markdown_rows(output)
    table = {row[0]: row[1:] for row in rows[1:]} if rows else {}
    return {"table": table, "speed_up_over_stock": re.findall(r"speed-up over the stock pattern: (.*)", output)}


def _parse_streamed(output: str, work: Path) -> dict:
    result = work / "streamed.json"
    figures = json.loads(result.read_text()) if result.is_file() else {}
    return figures


def _parse_overhead(output: str, work: Path) -> dict:
    rows = [row for row in markdown_rows(output) if " vs " in row[0]]
    return {row[0]: {"ours": row[1], "upstream": row[2], "overhead": row[3], "interval": row[4]} for row in rows}


def _parse_split(output: str, work: Path) -> dict:
    ratio = ratio_after(output, "split / single writer:")
    return {"split_over_single_writer": ratio, "target": 0.6, "met": ratio is not None and ratio <= 0.6,
            "ceiling": ratio_after(output, "raw, 2 ranks / rank 0 alone on 2 threads:")}


def _parse_inflation(output: str, work: Path) -> dict:
    inflation = ratio_after(output, "step-time inflation while written")
    return {"step_time_inflation": inflation, "target": 1.05, "met": inflation is not None and inflation <= 1.05}


def plan_steps(*, dry_run: bool, work: Path, python: str = sys.executable) -> list[Step]:
    """Steps 2-7 (the environment is measured in this process), sized for the GPU machine or, with ``dry_run``, tiny
    and on the CPU. A pure plan: nothing runs here."""
    device = "cpu" if dry_run else "cuda"
    # only the tier's file is collected: another test module may import what the GPU machine's image lacks
    tier = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py",
            f"--junitxml={work / 'gpu_tier.xml'}"] + ([] if dry_run else ["-n", "4", "--dist", "load"])
    if dry_run:
        # each fresh interpreter costs more than the tiny work it does: one fresh-process load, not four
        checkpoint = ["--hidden", "64", "--layers", "1", "--repeats", "1", "--fresh-variants", "default"]
        streamed = ["--runs", "1", "--tokens", "3", "--hidden", "384", "--layers", "16"]
        overhead = ["--lockstep-runs", "1", "--lockstep-steps", "15"]
        split = ["--hidden", "64", "--rounds", "1", "--repeats", "1"]
        inflation = ["--tiny"]
    else:
        checkpoint = ["--repeats", "2"]
        streamed = ["--runs", "1", "--tokens", "16", "--hidden", "1024", "--layers", "16"]
        overhead = ["--lockstep-runs", "2", "--lockstep-steps", "100"]
        split = ["--rounds", "2", "--repeats", "2"]
        inflation = ["--quick"]
    tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    hide = {"CUDA_VISIBLE_DEVICES": ""} if dry_run else {}  # a dry run stays on the CPU, also on a GPU machine
    steps = [
        Step("gpu_tier", tier, 60 if dry_run else 170, _parse_tier, GPU_TEST_ENV),
        Step("checkpoint", [python, str(BENCH / "bench_checkpoint.py"), "--device", device, *checkpoint],
             90 if dry_run else 75, _parse_checkpoint),
        Step("streamed_generation", [python, str(BENCH / "bench_inference.py"), "--device", device, *streamed,
                                     "--regimes", "warm", "--json", str(work / "streamed.json")],
             90 if dry_run else 75, _parse_streamed),
        Step("step_overhead", [python, str(BENCH / "bench_resume.py"), "--only", "lockstep", *overhead],
             90 if dry_run else 50, _parse_overhead),
        Step("split_replicas", [python, str(BENCH / "bench_distributed.py"), "--replicated", "--dir", tmpfs, *split],
             90 if dry_run else 45, _parse_split),
        Step("background_save_inflation", [python, str(BENCH / "bench_goodput.py"), "--inflation-only", *inflation],
             120 if dry_run else 60, _parse_inflation),
    ]
    return [Step(step.section, step.command, step.timeout_s, step.parse, {**step.env, **hide}) for step in steps]


# ------------------------------------------------------------------ running (IO)


def environment(dry_run: bool) -> dict:
    """The machine: versions, devices, cores, and on a GPU the host-to-device copy rates."""
    import torch

    figures = {"dry_run": dry_run, "python": sys.version.split()[0], "torch": torch.__version__,
               "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
               "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if torch.cuda.is_available() else []}
    if torch.cuda.is_available():
        figures["h2d_bytes_per_s"] = {kind: _copy_rate(torch, pinned) for kind, pinned in (("pinned", True),
                                                                                         ("pageable", False))}
    return figures


def _copy_rate(torch, pinned: bool, nbytes: int = 256 << 20) -> float:
    """Bytes per second of one host-to-device copy of ``nbytes`` (the best of 3), timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=pinned)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best


def run_step(step: Step, work: Path) -> dict:
    """Run ``step`` in its own process group; kill the group at its limit. Its record for the results file."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", **step.env}
    log = work / f"{step.section}.log"
    start = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(step.command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=step.timeout_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code, status = process.wait(), "timeout"
    output = log.read_text(errors="replace")
    try:
        figures = step.parse(output, work)
    except (ValueError, KeyError, IndexError, OSError, ElementTree.ParseError) as err:
        figures = {"parse_error": f"{type(err).__name__}: {err}"}
    return {"section": step.section, "status": status, "returncode": code, "timeout_s": step.timeout_s,
            "seconds": round(time.monotonic() - start, 2), "command": step.command, "figures": figures,
            "output_tail": output[-TAIL_CHARS:]}


def append(results: Path, record: dict) -> None:
    with results.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"),
                        help="directory of the results file (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="the same flow on the CPU with tiny sizes")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("give --out DIR (or set $OUT)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.out))
    results = args.out / RESULTS_FILE
    started = time.monotonic()
    append(results, {"section": "environment", "status": "ok", "figures": environment(args.dry_run)})
    statuses = {"environment": "ok"}
    for step in plan_steps(dry_run=args.dry_run, work=work):
        left = args.budget - (time.monotonic() - started)
        if left < min(step.timeout_s, 30):
            record = {"section": step.section, "status": "skipped",
                      "reason": f"the budget of {args.budget:.0f} s is spent ({left:.0f} s left)"}
        else:
            record = run_step(Step(step.section, step.command, min(step.timeout_s, left), step.parse, step.env), work)
        append(results, record)
        statuses[step.section] = record["status"]
        print(f"{step.section}: {record['status']} ({record.get('seconds', 0):.0f} s)", flush=True)
    append(results, {"section": "summary", "statuses": statuses, "dry_run": args.dry_run,
                     "seconds": round(time.monotonic() - started, 1)})
    print(f"results: {results}")
    return 0 if all(status == "ok" for status in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
