"""``hf-resumable check`` (issue #24): the trace, the comparison, the kill points, and the command end to end.

The end-to-end tests run the real CLI on real scripts: each check launches the script uninterrupted, then kills it
(SIGKILL of the whole process tree at a point the trace reports, or SIGTERM) and reruns it until it finishes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_resumable import trace
from hf_resumable.check import CheckOptions, compare_traces
from hf_resumable.check._compare import likely_cause
from hf_resumable.check._runner import plan_kill_points
from hf_resumable.cli import main

from helpers import zygote
from helpers.distributed_launch import child_env

REPO = Path(__file__).resolve().parent.parent
LOOP = REPO / "tests" / "scripts" / "check_loop.py"
SKIP_LOOP = REPO / "tests" / "scripts" / "check_accelerate_skip.py"
PLAIN_LOOP = REPO / "tests" / "scripts" / "check_plain_loop.py"


# ------------------------------------------------------------------------------------------------ pure parts
def _batch(step, micro, *, batch="b", attempt=0, rank=0):
    return {"kind": "batch", "step": step, "micro": micro, "rank": rank, "attempt": attempt,
            "batch": {"x": f"{batch}{step}.{micro}", "y": f"y{step}.{micro}"}}


def _forward(step, micro, *, rng="r", attempt=0, rank=0):
    return {"kind": "forward", "step": step, "micro": micro, "rank": rank, "attempt": attempt,
            "rng": {"torch": f"{rng}{step}.{micro}"}}


def _update(step, *, lr=None, weights=None, attempt=0, rank=0):
    return {"kind": "update", "step": step, "rank": rank, "attempt": attempt, "lr": [lr or f"lr{step}"],
            "hyper": "h", "weights": weights or f"w{step}", "optimizer": f"o{step}"}


def _resume(step, *, attempt=1, weights=None):
    return {"kind": "resume", "step": step, "rank": 0, "attempt": attempt, "hyper": "h",
            "weights": weights or f"w{step}", "optimizer": f"o{step}"}


def _reference(steps=6):
    return [r for s in range(1, steps + 1) for r in (_batch(s, 0), _batch(s, 1), _forward(s, 0), _forward(s, 1),
                                                     _update(s))]


def _interrupted(*, killed_after=4, resumed_from=2, change=None, steps=6):
    """Launch 0 runs steps 1..killed_after, launch 1 resumes from ``resumed_from`` and runs to the end."""
    first = [r for s in range(1, killed_after + 1) for r in (_batch(s, 0), _batch(s, 1), _forward(s, 0),
                                                             _forward(s, 1), _update(s))]
    second = [_resume(resumed_from)]
    for s in range(resumed_from + 1, steps + 1):
        second += [_batch(s, 0, attempt=1), _batch(s, 1, attempt=1), _forward(s, 0, attempt=1),
                   _forward(s, 1, attempt=1), _update(s, attempt=1)]
    if change is not None:
        second = [change(r) for r in second]
    return first + second


def test_identical_traces_are_exact():
    comparison = compare_traces(_reference(), _interrupted())
    assert comparison.exact and comparison.steps == 6 and comparison.compared > 18
    assert likely_cause(comparison) == ""


def test_a_batch_that_differs_after_the_resume_is_named_with_a_generator_cause():
    def change(record):
        if record["kind"] == "batch" and record["step"] >= 3:
            return {**record, "batch": {**record["batch"], "x": "other"}}
        return record

    comparison = compare_traces(_reference(), _interrupted(change=change))
    first = comparison.first
    assert (first.step, first.category, first.attempt, first.resumed_from) == (3, "batch", 1, 2)
    assert "micro-batch 0: x" in first.detail
    assert "generator the library cannot see" in likely_cause(comparison)
    assert "Check your own script" in likely_cause(comparison)


def test_a_learning_rate_that_differs_is_named_before_the_weights():
    def change(record):
        if record["kind"] == "update" and record["step"] >= 4:
            return {**record, "lr": ["0x1p-3"], "weights": "bad", "optimizer": "bad"}
        return record

    comparison = compare_traces(_reference(), _interrupted(change=change))
    assert (comparison.first.step, comparison.first.category) == (4, "lr")
    assert {d.category for d in comparison.at_first_step()} == {"lr", "weights", "optimizer"}
    assert "scheduler" in likely_cause(comparison)


def test_weights_restored_wrongly_are_named_at_the_first_resumed_step():
    comparison = compare_traces(_reference(), _interrupted(change=lambda r: {**r, "weights": "x"}
                                                           if r["kind"] == "resume" else r))
    assert (comparison.first.step, comparison.first.category) == (3, "restored-weights")


def test_a_difference_before_any_resume_means_the_script_is_not_deterministic():
    run = _interrupted()
    run[2] = {**run[2], "rng": {"torch": "different"}}
    comparison = compare_traces(_reference(), run)
    assert (comparison.first.step, comparison.first.category, comparison.first.resumed_from) == (1, "rng", None)
    assert "not deterministic" in likely_cause(comparison)


def test_a_step_the_resumed_run_never_makes_is_missing():
    run = [r for r in _interrupted() if not (r["kind"] == "update" and r["step"] == 6)]
    run = [r for r in run if not (r["kind"] in ("batch", "forward") and r["step"] == 6)]
    comparison = compare_traces(_reference(), run)
    assert (comparison.first.step, comparison.first.category) == (6, "missing")


def test_logged_metrics_are_compared_per_step_and_order():
    ref = _reference() + [{"kind": "log", "step": 2, "rank": 0, "attempt": 0, "metrics": {"loss": "0x1p-1"}}]
    run = _interrupted() + [{"kind": "log", "step": 2, "rank": 0, "attempt": 0, "metrics": {"loss": "0x1p-2"}}]
    comparison = compare_traces(ref, run)
    assert comparison.first.category == "metric" and "loss 0.5 -> 0.25" in comparison.first.detail


def test_a_batch_the_reference_used_at_another_step_is_named_as_the_data_order():
    def change(record):  # the resumed launch's loader restarted from its beginning
        if record["kind"] == "batch" and record["attempt"] == 1:
            return {**record, "batch": _batch(record["step"] - 2, record["micro"])["batch"]}
        return record

    comparison = compare_traces(_reference(), _interrupted(change=change))
    first = comparison.first
    assert (first.step, first.category) == (3, "batch")
    assert "the reference's batch of step 1, micro-batch 0" in first.detail
    assert "data position does not resume" in likely_cause(comparison)


def test_model_inputs_that_differ_after_an_equal_batch_name_a_transform_in_the_loop():
    inputs = {"kind": "inputs", "step": 3, "micro": 0, "rank": 0, "inputs": {"arg.0": "i3"}}
    run = _interrupted() + [{**inputs, "attempt": 1, "inputs": {"arg.0": "other"}}]
    comparison = compare_traces(_reference() + [{**inputs, "attempt": 0}], run)
    assert (comparison.first.step, comparison.first.category) == (3, "inputs")
    assert "a transform in the training loop" in likely_cause(comparison)


def _print(step, text, *, attempt=0):
    return {"kind": "print", "source": "stdout", "step": step, "rank": 0, "attempt": attempt, "text": text}


def test_printed_numbers_are_matched_by_template_and_numbers_that_vary_unkilled_are_skipped():
    ref = _reference() + [_print(4, "step 4 loss 0.25 port 2"), _print(4, "step 4 avg 0.5 (3.5 ms)"),
                          _print(4, "step 4 grad 7")]
    run = _interrupted() + [_print(4, "step 4 loss 0.25 port 3"),  # the killed launch: "port" always differs
                            _print(3, "resumed from step 2", attempt=1),  # only this run prints it: not compared
                            _print(4, "step 4 loss 0.25 port 9", attempt=1),
                            _print(4, "step 4 avg 0.5 (9.1 ms)", attempt=1),  # a time: never compared
                            _print(4, "step 4 grad 8", attempt=1)]
    comparison = compare_traces(ref, run)
    assert [(d.step, d.category) for d in comparison.differences] == [(4, "printed")]
    assert "'step 4 grad 7' in the reference, 'step 4 grad 8' here" in comparison.first.detail
    assert "running average" in likely_cause(comparison)


def test_final_weights_are_compared_when_steps_carry_no_digests():
    """HF_RESUMABLE_TRACE_WEIGHTS=checkpoint: the digests at exit; a launch that exits early (SIGTERM) is skipped."""
    def final(step, weights, attempt):
        return {"kind": "final", "step": step, "rank": 0, "attempt": attempt, "hyper": "h", "weights": weights,
                "optimizer": "o"}

    ref = _reference() + [final(6, "w", 0)]
    assert compare_traces(ref, _interrupted() + [final(4, "early", 0), final(6, "w", 1)]).exact
    comparison = compare_traces(ref, _interrupted() + [final(6, "other", 1)])
    assert (comparison.first.step, comparison.first.category, comparison.first.detail) == \
        (6, "weights", "at the end of training")
    assert compare_traces(ref, _interrupted()).first.category == "missing"


def test_kill_points_are_drawn_from_the_reference_by_seed():
    ref = _reference(8) + [{"kind": "save", "rank": 0, "attempt": 0, "index": 1, "step": 4}]
    points = plan_kill_points(ref, kills=4, seed=7)
    assert points == plan_kill_points(ref, kills=4, seed=7)
    assert [p.kind for p in points] == ["step", "save", "sigterm", "step"]
    assert points[1].event == "save:1"
    assert all(p.event.startswith("batch:") and 2 <= p.step <= 8 for p in points if p.kind != "save")
    assert plan_kill_points(ref, kills=6, seed=1) != plan_kill_points(ref, kills=6, seed=2)


def test_options_are_validated():
    with pytest.raises(ValueError, match="kills"):
        CheckOptions(kills=0)
    with pytest.raises(ValueError, match="timeout"):
        CheckOptions(timeout=-1)


# ------------------------------------------------------------------------------------------------ the trace
def test_without_the_variable_the_hooks_do_nothing():
    assert not trace.is_enabled()
    batches = iter([1, 2])
    assert trace.traced_batches(batches) is batches  # the loader's own iterator, untouched
    assert trace.on_save(3) is None and trace.on_load(3, None) is None and trace.on_logs([{"step": 1}]) is None


def test_digests_name_each_tensor_and_generator():
    import torch

    batch = {"input_ids": torch.arange(6).view(2, 3), "labels": [torch.ones(2), torch.zeros(2)]}
    digests = trace.digest_batch(batch)
    assert set(digests) == {"input_ids", "labels.0", "labels.1"}
    assert digests == trace.digest_batch({"input_ids": torch.arange(6).view(2, 3),
                                          "labels": [torch.ones(2), torch.zeros(2)]})
    assert trace.digest_batch({**batch, "input_ids": torch.arange(6).view(3, 2)})["input_ids"] == \
        digests["input_ids"]  # the same bytes; a reshaped batch shows in the next step's weights
    assert set(trace.digest_rng()) >= {"python", "numpy", "torch"}


@pytest.mark.slow  # about 3 s: the first optimizer step and RNG digests of the process
def test_the_tracer_records_a_plain_loaders_batch_inputs_loss_and_printed_lines_in_step_order(tmp_path, monkeypatch):
    """The hooks themselves, on a tracer of this test's own (no global hook installed)."""
    import io

    import torch

    tracer = trace._Tracer(tmp_path)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    tracer.after_step(optimizer, (), {})  # before any training forward pass (an engine's init): not a step
    tracer.pending_batch = trace.digest_batch({"x": torch.ones(2)})  # the script's DataLoader returned a batch
    with torch.enable_grad():
        tracer.before_forward(None, ())
        tracer.after_forward(None, (torch.ones(2),), {"mask": torch.zeros(1)}, None)
    with torch.no_grad():  # an evaluation forward pass: nothing recorded
        tracer.before_forward(None, ())
        tracer.after_forward(None, (torch.ones(3),), {}, None)
    tracer.on_backward(torch.tensor(0.5))
    tracer.after_step(optimizer, (), {})
    tap = trace._StdoutTap(io.StringIO(), tracer)
    tap.write("step 1 loss 0.5\nno digits here\nstep 1 ")  # the last line is not complete yet
    monkeypatch.setattr(trace, "_TRACER", tracer)
    trace.on_metrics({"loss": torch.tensor(0.25), "train_time": 3.0, "tokens": 5}, None)  # ResumableAccelerator.log
    tracer._handle.close()
    records = trace.read_trace(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [("batch", 1), ("forward", 1), ("inputs", 1), ("loss", 1),
                                                         ("update", 1), ("print", 1), ("log", 1)]
    assert records[0]["source"] == "DataLoader" and set(records[2]["inputs"]) == {"arg.0", "mask"}
    assert records[3]["metrics"] == {"loss": (0.5).hex()} and records[5]["text"] == "step 1 loss 0.5"
    assert records[6]["metrics"] == {"loss": (0.25).hex(), "tokens": "5"}  # a time is never compared


# ------------------------------------------------------------------------------------------------ end to end
def _check(tmp_path, *args, kills=1, seed=0):
    report = tmp_path / "report.json"
    env = child_env()
    # The launches come from a test zygote (tests/helpers/zygote.py) that has imported torch and transformers once: a
    # script run as ``python script.py`` gets its client as the interpreter, and torchrun's workers get it as
    # PYTHON_EXEC. torchrun itself stays a real child of check, so that check's kill reaches its whole tree.
    env = zygote.torchrun_env(env)
    args = [str(a) for a in args]
    if args[:3] != [sys.executable, "-m", "torch.distributed.run"] and args[0] == sys.executable:
        args[0] = env.get("PYTHON_EXEC", sys.executable)
    command = [sys.executable, "-m", "hf_resumable", "check", "--kills", str(kills), "--seed", str(seed),
               "--timeout", "600", "--json", str(report), "--", *args]
    done = zygote.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    data = json.loads(report.read_text()) if report.exists() else None
    return done, data


def test_usage_and_launch_errors_exit_with_2(tmp_path, capsys):
    assert main(["check"]) == 2
    assert "after `--`" in capsys.readouterr().err
    failing = [sys.executable, "-c", "import sys; print('the last words'); sys.exit(3)"]
    assert main(["check", "--kills", "1", "--", *failing]) == 2
    err = capsys.readouterr().err
    assert "failed without a kill (exit code 3)" in err and "the last words" in err
    assert main(["check", "--", sys.executable, "-c", "pass"]) == 2
    assert "wrote no trace" in capsys.readouterr().err


def test_an_exact_plain_loop_is_exact(tmp_path):
    done, report = _check(tmp_path, sys.executable, LOOP, "--output-dir", "{out}", kills=1, seed=3)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("EXACT")
    assert report["result"] == "EXACT" and [r["kill_point"]["kind"] for r in report["runs"]] == ["step"]
    killed = report["runs"][0]
    assert killed["launches"][0]["killed_at"] == killed["kill_point"]["event"]
    assert killed["launches"][0]["returncode"] == -9 and killed["launches"][-1]["returncode"] == 0
    assert 0 < killed["resumed_from"][0] < killed["kill_point"]["step"] and killed["compared_records"] > 30
    assert report["compared_per_run"]["batches"] == 24 and report["compared_per_run"]["forward passes (the RNG " \
        "state before each)"] == 24


@pytest.mark.extended
def test_an_exact_plain_loop_is_exact_at_every_kind_of_kill_point(tmp_path):
    done, report = _check(tmp_path, sys.executable, LOOP, "--output-dir", "{out}", kills=3, seed=5)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["kill_point"]["kind"] for r in report["runs"]] == ["step", "save", "sigterm"]
    assert [r["launches"][0]["returncode"] for r in report["runs"]] == [-9, -9, -15]


def test_a_collator_drawing_from_a_module_level_generator_diverges_at_the_first_resumed_step(tmp_path):
    done, report = _check(tmp_path, sys.executable, LOOP, "--output-dir", "{out}", "--collator",
                          "global-generator", seed=3)
    assert done.returncode == 1, done.stdout + done.stderr
    run = report["runs"][0]
    first = run["differences"][0]
    resumed = run["resumed_from"][0]
    assert report["result"] == "DIVERGES" and first["category"] == "batch" and first["step"] == resumed + 1
    assert f"DIVERGES at optimizer step {resumed + 1}" in done.stdout
    assert "the batch (data order or collation randomness)" in done.stdout
    assert "generator the library cannot see" in done.stdout


def test_an_unseeded_transform_in_the_scripts_own_data_loader_is_named(tmp_path):
    """A plain loop over its own torch DataLoader: the batches it yields are compared, and the first that differs."""
    done, report = _check(tmp_path, sys.executable, PLAIN_LOOP, "--output-dir", "{out}", "--transform", "unseeded",
                          seed=3)
    assert done.returncode == 1, done.stdout + done.stderr
    run = report["runs"][0]
    first, resumed = run["differences"][0], run["resumed_from"][0]
    assert (first["category"], first["step"], first["attempt"]) == ("batch", resumed + 1, 1)
    assert "of the script's DataLoader: 0, 1" in first["detail"]
    assert f"DIVERGES at optimizer step {resumed + 1}" in done.stdout and "unseeded transform" in done.stdout
    assert report["compared_per_run"]["batches"] == 16 and report["compared_per_run"]["model inputs"] == 16
    assert report["compared_per_run"]["printed or logged lines with numbers"] == 16


@pytest.mark.extended
def test_a_plain_loop_over_its_own_data_loader_is_exact_and_its_printed_running_average_is_named(tmp_path):
    done, report = _check(tmp_path, sys.executable, PLAIN_LOOP, "--output-dir", "{out}", kills=2, seed=3)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["result"] == "EXACT" and all(r["resumed_from"] for r in report["runs"])
    done, report = _check(tmp_path, sys.executable, PLAIN_LOOP, "--output-dir", "{out}", "--running-average", seed=3)
    assert done.returncode == 1, done.stdout + done.stderr
    first = report["runs"][0]["differences"][0]
    assert first["category"] == "printed" and first["step"] == report["runs"][0]["resumed_from"][0] + 1
    assert "only a printed or logged number" in done.stdout


@pytest.mark.slow
def test_a_scheduler_that_is_saved_but_not_restored_is_named(tmp_path):
    done, report = _check(tmp_path, sys.executable, LOOP, "--output-dir", "{out}", "--forget-scheduler", seed=3)
    assert done.returncode == 1, done.stdout + done.stderr
    first = report["runs"][0]["differences"][0]
    assert first["category"] == "lr" and first["step"] == report["runs"][0]["resumed_from"][0] + 2
    assert "the learning rate" in done.stdout and "scheduler" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kills", [1, pytest.param(3, marks=pytest.mark.extended)])  # 3: every kind of kill point
def test_a_resumable_trainer_script_is_exact(tmp_path, kills):
    done, report = _check(tmp_path, sys.executable, REPO / "tests" / "trainer_scripts" / "train_tiny.py",
                          "--output-dir", "{out}", "--ga", "2", "--max-steps", "8", "--save-steps", "3", kills=kills)
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = {r["kill_point"]["kind"] for r in report["runs"]}
    assert kinds == {"step", "save", "sigterm"} if kills == 3 else len(kinds) == 1
    assert all(r["resumed_from"] or r["kill_point"]["kind"] == "save" for r in report["runs"])


@pytest.mark.slow
@pytest.mark.extended  # a further trainer class; make test checks ResumableTrainer itself
def test_a_trl_trainer_made_resumable_is_exact(tmp_path):
    """TRL's SFTTrainer through make_resumable: the hooks are ResumableTrainer's, inherited."""
    done, report = _check(tmp_path, sys.executable, REPO / "tests" / "trainer_scripts" / "train_family.py",
                          "--output-dir", "{out}", "--trainer", "sft", kills=1, seed=2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["result"] == "EXACT" and report["runs"][0]["resumed_from"]


@pytest.mark.slow
def test_a_resumable_accelerator_loop_is_exact(tmp_path):
    done, report = _check(tmp_path, sys.executable, REPO / "examples" / "custom_loop.py", "--output-dir", "{out}",
                          "--epochs", "1", kills=1, seed=1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["result"] == "EXACT"


@pytest.mark.slow
@pytest.mark.parametrize("skip", ["once", "every-epoch", "by-hand"])
def test_a_stock_accelerate_resume_skip_is_judged(tmp_path, skip):
    """A stock accelerate loop's own resume skip on top of the restored position: accelerate's idiom (once) and the
    same call in every epoch are exact (the later calls skip nothing); a skip by hand is refused and named."""
    done, report = _check(tmp_path, sys.executable, SKIP_LOOP, "--output-dir", "{out}", "--skip", skip, kills=1,
                          seed=1)
    assert report["runs"][0]["resumed_from"] == [3]  # in epoch 0 of 2 (8 steps each), so a later epoch follows
    if skip != "by-hand":
        assert done.returncode == 0 and report["result"] == "EXACT", done.stdout + done.stderr
        return
    assert report["result"] != "EXACT" and "DoubleSkipError" in report["runs"][0]["failure"]
    assert "then it did not finish: hf_resumable.errors.DoubleSkipError" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.distributed
# `check` under torchrun stays in make test (the ZeRO-2 loop and the FSDP2 divergence below); the DDP loop is extended.
@pytest.mark.extended
def test_a_two_process_torchrun_loop_is_exact(tmp_path):
    from helpers.distributed_launch import free_port

    done, report = _check(tmp_path, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", free_port(), REPO / "examples" /
                          "custom_loop.py", "--output-dir", "{out}", "--epochs", "2", kills=1, seed=1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["ranks"] == 2 and report["result"] == "EXACT"
    run = report["runs"][0]
    assert run["launches"][0]["killed_at"] is not None and run["launches"][0]["returncode"] != 0
    assert run["resumed_from"] and run["launches"][-1]["returncode"] == 0


# ------------------------------------------------------------------------------------------------ DeepSpeed, FSDP2
ENGINE_WORKER = REPO / "tests" / "scripts" / "check_engine_worker.py"


def _check_engine(tmp_path, *options, kills=1, seed=1):
    """``hf-resumable check -- torchrun --nproc-per-node 2 check_engine_worker.py ...`` (2 gloo ranks on CPU)."""
    from helpers.distributed_launch import free_port

    return _check(tmp_path, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                  "127.0.0.1", "--master-port", free_port(), ENGINE_WORKER, "--output-dir", "{out}", *options,
                  kills=kills, seed=seed)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_a_deepspeed_zero_loop_under_torchrun_is_exact(tmp_path, stage):
    """ZeRO's optimizer step while it initializes its state on load is not counted as a training step."""
    done, report = _check_engine(tmp_path, "--engine", "deepspeed", "--zero-stage", str(stage))
    assert done.returncode == 0, done.stdout + done.stderr
    run = report["runs"][0]
    assert report["result"] == "EXACT" and report["ranks"] == 2 and report["steps"] == 5
    assert run["launches"][0]["killed_at"] is not None and run["resumed_from"]
    assert report["compared_per_run"]["batches"] == 10 and report["compared_per_run"]["losses"] == 10


@pytest.mark.slow
@pytest.mark.distributed
def test_an_fsdp2_loop_that_forgets_its_scheduler_diverges_at_the_learning_rate(tmp_path):
    done, report = _check_engine(tmp_path, "--engine", "fsdp", "--forget-scheduler")
    assert done.returncode == 1, done.stdout + done.stderr
    run = report["runs"][0]
    first, resumed = run["differences"][0], run["resumed_from"][0]
    assert (first["category"], first["step"]) == ("lr", resumed + 2)  # the first resumed step's lr was restored
    assert f"DIVERGES at optimizer step {resumed + 2}" in done.stdout and "scheduler" in done.stdout


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended
def test_an_fsdp2_loop_under_torchrun_is_exact(tmp_path):
    done, report = _check_engine(tmp_path, "--engine", "fsdp")  # seed 1: killed at step 3, after a committed save
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["result"] == "EXACT" and report["runs"][0]["resumed_from"]
