"""benchmarks/gpu_check.sh between GPU windows: its dry run goes through the whole flow on the CPU and writes every
section of the results file with its figures, so that the GPU window is not spent on a script that rotted.

The planning and parsing helpers of benchmarks/gpu_check.py are checked on fixed text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers.distributed_launch import REPO_ROOT, child_env

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_figures_are_read_from_the_benchmarks_lines():
    gpu_check = _driver()
    assert gpu_check.ratio_after("x\nsplit / single writer: 0.57x the time (lower is better)",
                                 "split / single writer:") == 0.57
    assert gpu_check.ratio_after("step-time inflation while written 1.04x with the writer at lower priority",
                                 "step-time inflation while written") == 1.04
    assert gpu_check.ratio_after("nothing here", "split / single writer:") is None
    split = gpu_check._parse_split("split / single writer: 0.72x the time", REPO_ROOT)
    assert split["split_over_single_writer"] == 0.72 and split["met"] is False


def test_the_gpu_plan_runs_on_cuda_and_the_dry_run_on_the_cpu(tmp_path):
    gpu_check = _driver()
    full = {step.section: step for step in gpu_check.plan_steps(dry_run=False, work=tmp_path)}
    dry = {step.section: step for step in gpu_check.plan_steps(dry_run=True, work=tmp_path)}
    assert list(full) == list(dry) == list(gpu_check.SECTIONS[1:])
    assert "cuda" in full["checkpoint"].command and "cpu" in dry["checkpoint"].command
    assert all(step.env.get("CUDA_VISIBLE_DEVICES") == "" for step in dry.values())
    assert all("CUDA_VISIBLE_DEVICES" not in step.env for step in full.values())
    assert sum(step.timeout_s for step in full.values()) <= 480  # the whole check fits the window's 8 minutes
    assert full["gpu_tier"].env["HF_RESUMABLE_TEST_ZYGOTE"] == "0"


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
    env = child_env({"PYTHON": sys.executable})
    env.pop("HFR_GPU_TESTS_DEVICE", None)
    done = subprocess.run([str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=570)
    records = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    by_section = {record["section"]: record for record in records}
    failed = {r["section"]: r.get("output_tail", "")[-1500:] for r in records if r.get("status") not in (None, "ok")}
    assert done.returncode == 0 and not failed, f"{done.stdout}\n{done.stderr[-3000:]}\n{failed}"
    gpu_check = _driver()
    assert [r["section"] for r in records] == [*gpu_check.SECTIONS, "summary"]
    assert by_section["environment"]["figures"]["dry_run"] is True
    tier = by_section["gpu_tier"]["figures"]
    assert tier["tests"] >= 13 and tier["skipped"] == tier["tests"], tier
    assert any("needs a CUDA device" in reason for reason in tier["skip_reasons"]), tier
    table = by_section["checkpoint"]["figures"]["table"]
    assert "raw write + fsync (limit)" in table and any(label.startswith("hf_resumable resume") for label in table)
    streamed = by_section["streamed_generation"]["figures"]
    assert streamed["identical"] is True and streamed["cold_read_bytes_per_s"] > 0
    for side in ("accelerate", "streamed"):
        assert streamed["regimes"]["warm"][side]["read_bound_fraction"] > 0
    assert len(by_section["step_overhead"]["figures"]) == 2
    assert by_section["split_replicas"]["figures"]["split_over_single_writer"] > 0
    assert by_section["background_save_inflation"]["figures"]["step_time_inflation"] > 0
    assert set(by_section["summary"]["statuses"].values()) == {"ok"} and os.path.isdir(tmp_path)
