"""Run accelerate's own checkpointing tests against ResumableAccelerator, with stock accelerate as the control.

The installed accelerate version's source distribution is downloaded from the package index (it ships
``tests/``; nothing of it is kept in this repository). From it, ``tests/test_state_checkpointing.py`` and the
checkpoint-related tests of ``tests/test_accelerator.py`` (see :data:`SELECTION`) are run twice on CPU:

* **control**: unchanged, against stock ``accelerate.Accelerator``;
* **resumable**: the same files with one line changed, the import of ``Accelerator``, which becomes
  ``from hf_resumable import ResumableAccelerator as Accelerator``. No assertion is edited.

Every case must pass in the control (otherwise the environment is broken and the run says so) and in the
resumable run, except the cases listed in :data:`EXPECTED_FAILURES` with their reason (docs/accelerate.md lists them
too). A listed case that starts passing is reported, so the list stays true.

With ``--control auto`` (what ``make test`` runs) the control runs only when the resumable run has a case that is
not passed or skipped: a clean resumable run needs no control to be judged, and a failing one is then told apart
from a broken environment. ``--control always`` (``make test-upstream``) runs both, side by side.

Usage::

    python tests/upstream/run_accelerate_upstream.py [--control always|auto] [--work-dir DIR] [--sdist-dir DIR]
        [--keep]

Exit status: 0 if everything is as expected, 1 if not, 2 if the control itself fails or the sources cannot be
fetched.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# file -> (line to replace, replacement): the one-line import change of a drop-in user.
SUBSTITUTIONS = {
    "test_state_checkpointing.py": ("from accelerate import Accelerator\n",
                                    "from hf_resumable import ResumableAccelerator as Accelerator\n"),
    "test_accelerator.py": ("from accelerate.accelerator import Accelerator\n",
                            "from hf_resumable import ResumableAccelerator as Accelerator\n"),
}
# pytest -k expression per file: every test of the checkpointing file; in test_accelerator.py the tests that
# save or load state, use save/load hooks, prepare or pickle data loaders, or use the stateful data loader.
SELECTION = {
    "test_state_checkpointing.py": None,
    "test_accelerator.py": ("save_load_model or stateful_dataloader or nested_hook or can_pickle_dataloader "
                            "or prepared_objects_are_referenced"),
}
# Cases expected to fail with ResumableAccelerator, and why (kept in sync with docs/accelerate.md).
EXPECTED_FAILURES: dict[str, str] = {}
# accelerate's tests spawn DataLoader workers and train tiny models: one thread each is fastest on small machines.
CHILD_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
             "ACCELERATE_USE_CPU": "true", "TOKENIZERS_PARALLELISM": "false"}


def installed_version() -> str:
    return importlib.metadata.version("accelerate")


def fetch_sdist(version: str, directory: Path) -> Path:
    """The accelerate ``version`` sdist in ``directory``, downloaded with pip if it is not there yet."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"accelerate-{version}.tar.gz"
    if not (directory / name).exists():
        command = [sys.executable, "-m", "pip", "download", f"accelerate=={version}", "--no-binary", ":all:",
                   "--no-deps", "--disable-pip-version-check", "-d", str(directory)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not download accelerate=={version}'s sdist:\n{done.stdout}\n{done.stderr}")
    if not (directory / name).exists():
        raise RuntimeError(f"pip downloaded {sorted(p.name for p in directory.iterdir())}, not {name}.")
    return directory / name


def extract_tests(sdist: Path, version: str, into: Path) -> dict[str, str]:
    """The selected test files' text, from the sdist."""
    texts = {}
    with tarfile.open(sdist) as archive:
        for name in SUBSTITUTIONS:
            member = archive.extractfile(f"accelerate-{version}/tests/{name}")
            if member is None:
                raise RuntimeError(f"{sdist} has no tests/{name}.")
            texts[name] = member.read().decode()
    into.mkdir(parents=True, exist_ok=True)
    return texts


def substitute(name: str, text: str) -> str:
    """The file with its ``Accelerator`` import replaced, and nothing else.

    Raises:
        RuntimeError: the import line is not there exactly once (upstream changed: review the selection).
    """
    old, new = SUBSTITUTIONS[name]
    if text.count(old) != 1:
        raise RuntimeError(f"{name}: expected the line {old.strip()!r} exactly once, found {text.count(old)}.")
    return text.replace(old, new)


def write_suite(directory: Path, texts: dict[str, str], *, resumable: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / name).write_text(substitute(name, text) if resumable else text)


def pytest_command(directory: Path, name: str, junit: Path) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
               str(directory), f"--junitxml={junit}", str(directory / name)]
    if SELECTION[name]:
        command += ["-k", SELECTION[name]]
    return command


def outcomes(junit: Path) -> dict[str, str]:
    """``file::Class::test`` -> passed / failed / error / skipped, from a JUnit XML report."""
    result = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        key = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        file = case.get("classname", "").split(".")[0]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "skipped"
        result[f"{file}.py::{key}"] = outcome
    return result


Outcomes = dict[str, tuple[dict[str, str], str]]  # suite -> (case -> outcome, output tail)


def run_suites(work: Path, suites: tuple[str, ...] = ("control", "resumable")) -> Outcomes:
    """Run ``suites`` (concurrently); return their outcomes and output tails."""
    env = {**os.environ, **CHILD_ENV,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for suite in suites:
        directory = work / suite
        logs = []
        for name in SUBSTITUTIONS:
            junit = directory / f"{name}.xml"
            log = (directory / f"{name}.log").open("w")
            procs[(suite, name)] = (subprocess.Popen(pytest_command(directory, name, junit), cwd=directory, env=env,
                                                     stdout=log, stderr=subprocess.STDOUT), junit, log)
            logs.append(log)
    results: Outcomes = {suite: ({}, "") for suite in suites}
    for (suite, name), (proc, junit, log) in procs.items():
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        text = Path(log.name).read_text()
        found = outcomes(junit) if junit.exists() else {f"{name}::<collection>": "error"}
        merged, tails = results[suite]
        results[suite] = ({**merged, **found}, tails + f"\n--- {suite} {name} (exit {proc.returncode}) ---\n"
                          + text[-6000:])
    return results


def clean(resumable: dict[str, str]) -> bool:
    """Every case passed or was skipped, and the expected failures failed: nothing for a control to explain."""
    def as_expected(case: str, outcome: str) -> bool:
        return outcome == "skipped" or (outcome == "passed") != (case in EXPECTED_FAILURES)

    return bool(resumable) and all(as_expected(case, outcome) for case, outcome in resumable.items())


def compare(control: dict[str, str], resumable: dict[str, str]) -> tuple[list[str], list[str]]:
    """(problems, notes): what is wrong, and what is as expected but worth saying."""
    problems, notes = [], []
    broken = sorted(case for case, outcome in control.items() if outcome in ("failed", "error"))
    if broken:
        problems.append(f"control (stock accelerate) fails {broken}: the environment is broken")
    for case in sorted(set(control) | set(resumable)):
        want, got = control.get(case, "missing"), resumable.get(case, "missing")
        expected = EXPECTED_FAILURES.get(case)
        if want == "skipped":
            if got != "skipped":
                problems.append(f"{case}: skipped in the control but {got} with ResumableAccelerator")
            continue
        if got == "passed" and expected:
            problems.append(f"{case}: passes now; remove it from EXPECTED_FAILURES (and docs/accelerate.md)")
        elif got != "passed" and not expected:
            problems.append(f"{case}: {got} with ResumableAccelerator (passes with stock accelerate)")
        elif got != "passed":
            notes.append(f"{case}: {got}, expected: {expected}")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where the suites run (default: a temporary directory)")
    parser.add_argument("--sdist-dir", type=Path, default=REPO_ROOT / "build" / "upstream",
                        help="download cache for the sdist (default: build/upstream)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--control", choices=("always", "auto"), default="always",
                        help="run stock accelerate's control always, or only if the resumable run is not clean")
    args = parser.parse_args(argv)
    started = time.monotonic()
    version = installed_version()
    try:
        sdist = fetch_sdist(version, args.sdist_dir)
        work = args.work_dir or Path(tempfile.mkdtemp(prefix="accelerate-upstream-"))
        texts = extract_tests(sdist, version, work)
        write_suite(work / "control", texts, resumable=False)
        write_suite(work / "resumable", texts, resumable=True)
    except RuntimeError as error:
        print(f"upstream: {error}", file=sys.stderr)
        return 2
    if args.control == "always":
        results = run_suites(work)
    else:
        results = run_suites(work, ("resumable",))
        if clean(results["resumable"][0]):  # judged without a control: every case as expected
            results["control"] = ({case: "skipped" if outcome == "skipped" else "passed"
                                   for case, outcome in results["resumable"][0].items()}, "")
        else:
            results["control"] = run_suites(work, ("control",))["control"]
    (control, control_log), (resumable, resumable_log) = results["control"], results["resumable"]
    problems, notes = compare(control, resumable)
    counts = {suite: {o: sum(1 for v in outcome.values() if v == o) for o in ("passed", "failed", "error", "skipped")}
              for suite, (outcome, _) in results.items()}
    print(f"accelerate {version} upstream tests ({time.monotonic() - started:.0f} s, work dir {work})")
    for suite in ("control", "resumable"):
        if suite == "control" and not results["control"][1]:
            print("  control  : not run (the resumable run was clean; --control always runs it)")
            continue
        print(f"  {suite:9s}: " + ", ".join(f"{n} {o}" for o, n in counts[suite].items()))
    for note in notes:
        print(f"  expected: {note}")
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    if problems:
        print(control_log + resumable_log)
    if not args.keep and args.work_dir is None and not problems:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if any(outcome in ("failed", "error") for outcome in control.values()):
        return 2
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
