"""ResumableTrainer over a model transformers sharded at load time: tensor parallel, alone or beside FSDP2/HSDP
(issue 43 item 1).

* The pure rules (integrations/_trainer_parallel.py): the layout read from the model's ``DistributedConfig``, a
  process's data-parallel rank, the layouts refused before step 1, and the lifting of stock's construction-time
  refusal for the length of the constructor only.
* Real torchrun jobs of tests/scripts/tp_trainer_worker.py (gloo CPU ranks, the test-only shim of
  tests/engine_fixtures.py): SIGKILLed after a committed checkpoint, or inside a save (held right before its commit),
  and rerun with the same command, every logged loss, weight piece and optimizer tensor equals the uninterrupted
  run's; the ranks of one tensor-parallel group train on the same batches, different data-parallel ranks on
  different ones. ``DistributedConfig(tp_size=2)`` and ``tp_plan="auto"`` with a ``ParallelismConfig`` on 2 ranks,
  ``tp_size=2`` beside ``fsdp_size=2`` or ``dp_replicate_size=2`` on 4. Another layout on resume is refused before
  step 1, naming both.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainingArguments
from transformers.distributed import DistributedConfig

from hf_resumable.checkpoint import read_manifest, verify_checkpoint
from hf_resumable.errors import ConfigDriftError, UnsupportedEngineError
from hf_resumable.integrations._parallelism import ParallelLayout, data_parallel_rank
from hf_resumable.integrations._trainer_parallel import (
    check_trainer_layout,
    sharded_model_construction,
    trainer_layout,
)

from helpers.check_runs import _check
from helpers.distributed_launch import child_env, free_port, kill_torchrun_after, run_torchrun
from helpers.engine_fixtures import read_local_state
from helpers.tiny_models import tiny_llama

WORKER = Path(__file__).parent / "scripts" / "tp_trainer_worker.py"
HOLD_STEP = 2  # the job is held after checkpoint-2 committed (or inside its save), then SIGKILLed
MAX_STEPS = 4


# ------------------------------------------------------------------ pure rules


def _sharded(**sizes: int) -> SimpleNamespace:
    """What the Trainer reads of a model ``from_pretrained(distributed_config=...)`` sharded (its config's
    ``DistributedConfig`` and transformers' flag), without the process group that real sharding needs."""
    config = DistributedConfig(**sizes)
    return SimpleNamespace(is_distributed_loading_by_transformers=True,
                           config=SimpleNamespace(distributed_config=config))


def test_layout_of_a_model_sharded_at_load_time_and_its_data_ranks():
    layout = trainer_layout(_sharded(tp_size=2, dp_replicate_size=2), None)
    assert layout == ParallelLayout(dp_replicate=2, tp=2)
    assert [data_parallel_rank(layout, process_index=r, world_size=4) for r in range(4)] == [(0, 2), (0, 2),
                                                                                            (1, 2), (1, 2)]
    layout = trainer_layout(_sharded(tp_size=2, fsdp_size=2), None)
    assert layout.describe() == "dp_shard=2 x tp=2"
    assert data_parallel_rank(None, process_index=3, world_size=4) == (3, 4)  # no layout: every process a data rank
    plain = torch.nn.Linear(2, 2)
    assert trainer_layout(plain, None) is None


def test_pipeline_and_expert_parallel_are_refused_before_step_1():
    with pytest.raises(UnsupportedEngineError, match=r"DistributedConfig\(pp_size=2\): pipeline parallel") as caught:
        check_trainer_layout(_sharded(tp_size=1, pp_size=2), None)
    assert isinstance(caught.value, NotImplementedError)
    with pytest.raises(UnsupportedEngineError, match=r"ep_size=2\): expert parallel"):
        check_trainer_layout(_sharded(tp_size=2, ep_size=2), None)
    check_trainer_layout(_sharded(tp_size=2, fsdp_size=2), None)
    check_trainer_layout(torch.nn.Linear(2, 2), None)  # not sharded at load time: nothing to check


def test_context_parallel_beside_a_model_sharded_at_load_time_is_refused():
    from accelerate import ParallelismConfig

    model = _sharded(tp_size=2)
    check_trainer_layout(model, ParallelismConfig(tp_size=2))
    with pytest.raises(UnsupportedEngineError, match=r"cp=2 x tp=2 beside a model sharded at load time \(tp=2\)"):
        check_trainer_layout(model, ParallelismConfig(tp_size=2, cp_size=2))


def test_stock_refusal_is_lifted_for_the_constructor_only(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    with sharded_model_construction(_sharded(tp_size=2), args):
        assert args.save_only_model  # what Trainer.__init__'s refusal reads
    assert not args.save_only_model
    with pytest.raises(RuntimeError), sharded_model_construction(_sharded(tp_size=2), args):
        raise RuntimeError("the constructor failed")
    assert not args.save_only_model  # restored on an error too
    with sharded_model_construction(torch.nn.Linear(2, 2), args):
        assert not args.save_only_model  # a model not sharded at load time: stock's rules unchanged


def test_a_parallelism_config_the_constructor_would_replace_is_refused(tmp_path):
    from accelerate import ParallelismConfig

    args = SimpleNamespace(save_only_model=False, parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(UnsupportedEngineError, match=r"asks for dp_shard=2 x tp=2, but the model was loaded as "
                                                     r"tp=4 .*DistributedConfig\(tp_size=2, fsdp_size=2"):
        with sharded_model_construction(_sharded(tp_size=4), args):
            args.parallelism_config.tp_size, args.parallelism_config.dp_shard_size = 4, 1  # what the Trainer does
    args.parallelism_config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    with sharded_model_construction(_sharded(tp_size=2, fsdp_size=2), args):
        pass  # the same layout


# ------------------------------------------------------------------ torchrun jobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (attention dropout on) whose heads split over 2 tensor-parallel ranks, in train_tiny's vocab."""
    path = tmp_path_factory.mktemp("tp") / "seed"
    tiny_llama(seed=0, num_key_value_heads=2, vocab_size=64, attention_dropout=0.1).save_pretrained(path)
    return path


def _options(model_dir: Path, *extra: str) -> list[str]:
    return ["--model-dir", str(model_dir), "--max-steps", str(MAX_STEPS), *extra]


def _run(output: Path, options: list[str], nproc: int, **env: str) -> subprocess.CompletedProcess:
    return run_torchrun(WORKER, ["--output-dir", str(output), *options], env=child_env(env), timeout=500,
                        nproc=nproc)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, model_dir):
    """The uninterrupted run of a layout, run once for the module's tests that compare a killed run with it."""
    runs: dict[tuple[str, ...], Path] = {}

    def reference(extra: list[str], nproc: int) -> Path:
        key = (*extra, str(nproc))
        if key not in runs:
            output = tmp_path_factory.mktemp("reference") / "run"
            done = _run(output, _options(model_dir, *extra), nproc)
            assert done.returncode == 0, done.stdout[-5000:]
            runs[key] = output
        return runs[key]

    return reference


def _kill(output: Path, options: list[str], nproc: int, *, inside_save: bool) -> None:
    """Run the job held after checkpoint ``HOLD_STEP`` committed (or inside its save, right before the commit);
    then SIGKILL every process."""
    committed = output / f"checkpoint-{HOLD_STEP}" / "manifest.json"  # renamed into place: committed
    marker = output / "held-in-save" if inside_save else committed
    variable = "HFR_HOLD_IN_SAVE" if inside_save else "HFR_HOLD_AFTER_SAVE"
    returncode = kill_torchrun_after(WORKER, ["--output-dir", str(output), *options], nproc=nproc, timeout=500,
                                     marker=marker, log=output.parent / f"{output.name}-held.log",
                                     env=child_env({variable: str(HOLD_STEP)}))
    assert returncode == -signal.SIGKILL
    assert not list(output.glob("final-rank*")), "the job ran to its end before it was killed"
    if inside_save:  # every rank's files written, never committed: the resume starts from the checkpoint before
        assert not committed.exists() and list(output.glob(f".tmp-checkpoint-{HOLD_STEP}*"))
        assert verify_checkpoint(output / f"checkpoint-{HOLD_STEP - 1}", full=True).ok
    else:
        assert verify_checkpoint(committed.parent, full=True).ok
        assert read_manifest(committed.parent).world_size == nproc
        assert (committed.parent / "sharded_layout.json").is_file()  # every rank's pieces, nothing gathered


def _batches(output: Path, rank: int) -> dict[int, list[str]]:
    """The batches rank ``rank`` trained on, by step (a step trained again after the resume counts once)."""
    rows: dict[int, list[str]] = {}
    for line in (output / f"batches-rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], []).append(row["batch"])
    return rows


def _history(output: Path, rank: int) -> list[dict]:
    return json.loads((output / f"result-rank{rank}.json").read_text())["log_history"]


def _assert_resumes_bit_exact(tmp_path: Path, model_dir: Path, reference: Path, extra: list[str], nproc: int, *,
                              inside_save: bool = False) -> list[dict[int, list[str]]]:
    """A run killed at checkpoint 2 and rerun, against the uninterrupted run ``reference``: the same losses, weight
    pieces and optimizer tensors on every rank. Returns the reference's batches per rank."""
    options = _options(model_dir, *extra)
    _kill(tmp_path / "run", options, nproc, inside_save=inside_save)
    resumed = _run(tmp_path / "run", options, nproc)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    batches = []
    for rank in range(nproc):
        want, got = _history(reference, rank), _history(tmp_path / "run", rank)
        assert [row["step"] for row in want if "loss" in row] == list(range(1, MAX_STEPS + 1))
        assert got == want, rank  # every logged loss, grad norm and learning rate, as exact floats
        final, expected = (read_local_state(path / f"final-rank{rank}.safetensors")
                           for path in (tmp_path / "run", reference))
        assert sorted(final) == sorted(expected) and any(name.startswith("optim/") for name in expected)
        assert not [name for name in expected if not torch.equal(final[name], expected[name])], rank
        reference_batches = _batches(reference, rank)
        run_batches = _batches(tmp_path / "run", rank)
        assert {step: rows[-1:] for step, rows in run_batches.items()} == {
            step: rows[-1:] for step, rows in reference_batches.items()}
        batches.append(reference_batches)
    return batches


@pytest.mark.distributed
def test_distributed_config_tp2_killed_after_a_commit_resumes_bit_exact(tmp_path, model_dir, reference_run):
    batches = _assert_resumes_bit_exact(tmp_path, model_dir, reference_run(["--tp", "2"], 2), ["--tp", "2"], 2)
    assert batches[0] == batches[1]  # one tensor-parallel group: the same batches
    layout = json.loads((tmp_path / "run" / "checkpoint-4" / "sharded_layout.json").read_text())
    assert layout["model"]["pieces"]  # the DTensor pieces of both ranks, through the piece engine


@pytest.mark.distributed
@pytest.mark.parametrize("extra, nproc", [(["--tp", "2"], 2),
                                          # tp2 x fsdp2 resumes after a commit in make test; inside a save: test-all
                                          pytest.param(["--tp", "2", "--fsdp", "2"], 4, marks=pytest.mark.extended)],
                         ids=["tp2", "tp2-x-fsdp2"])
def test_killed_inside_a_save_resumes_bit_exact(tmp_path, model_dir, reference_run, extra, nproc):
    _assert_resumes_bit_exact(tmp_path, model_dir, reference_run(extra, nproc), extra, nproc, inside_save=True)


@pytest.mark.distributed
@pytest.mark.extended  # make test: test_distributed_config_tp2_killed_after_a_commit_resumes_bit_exact (same pieces)
def test_tp_plan_auto_with_a_parallelism_config_resumes_bit_exact(tmp_path, model_dir, reference_run):
    extra = ["--tp", "2", "--load", "tp_plan"]
    batches = _assert_resumes_bit_exact(tmp_path, model_dir, reference_run(extra, 2), extra, 2)
    assert batches[0] == batches[1]


@pytest.mark.distributed
def test_nd_parallel_trainer_shape_on_4_ranks_is_refused_before_step_1(tmp_path, model_dir):
    """accelerate's nd_parallel_trainer.py: ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` and ``tp_plan="auto"``
    with its mesh. transformers 5 ignores the mesh and splits tensor parallel 4 ways (stock then fails in the first
    forward pass: the heads do not split 4 ways); refused in the constructor, naming both layouts and the fix."""
    done = _run(tmp_path / "run", _options(model_dir, "--tp", "2", "--fsdp", "2", "--load", "tp_plan"), 4)
    assert done.returncode != 0 and UnsupportedEngineError.__name__ in done.stdout, done.stdout[-5000:]
    assert "asks for dp_shard=2 x tp=2, but the model was loaded as tp=4" in done.stdout
    assert "DistributedConfig(tp_size=2, fsdp_size=2, dp_replicate_size=1)" in done.stdout
    assert not (tmp_path / "run" / "batches-rank0.jsonl").exists()  # refused before step 1


@pytest.mark.distributed
def test_tp2_beside_fsdp2_on_4_ranks_resumes_bit_exact(tmp_path, model_dir, reference_run):
    extra = ["--tp", "2", "--fsdp", "2"]
    batches = _assert_resumes_bit_exact(tmp_path, model_dir, reference_run(extra, 4), extra, 4)
    assert batches[0] == batches[1] and batches[2] == batches[3]  # each tensor-parallel pair: the same batches
    assert batches[0] != batches[2]  # two data-parallel ranks: different ones


@pytest.mark.distributed
@pytest.mark.extended  # make test: test_tp2_beside_fsdp2_on_4_ranks_resumes_bit_exact (tp beside data parallel)
def test_tp2_beside_dp_replicate2_on_4_ranks_resumes_bit_exact(tmp_path, model_dir, reference_run):
    extra = ["--tp", "2", "--dp-replicate", "2"]
    batches = _assert_resumes_bit_exact(tmp_path, model_dir, reference_run(extra, 4), extra, 4)
    assert batches[0] == batches[1] and batches[2] == batches[3]
    assert batches[0] != batches[2]


@pytest.mark.distributed
def test_another_layout_on_resume_is_refused_naming_both(tmp_path, model_dir):
    _kill(tmp_path / "run", _options(model_dir, "--tp", "2"), 2, inside_save=False)
    other = _run(tmp_path / "run", _options(model_dir, "--tp", "1", "--fsdp", "2"), 2)
    assert other.returncode != 0
    assert ConfigDriftError.__name__ in other.stdout
    assert "parallelism: 'tp=2' -> 'dp_shard=2'" in other.stdout, other.stdout[-5000:]
    assert max(_batches(tmp_path / "run", 0)) == HOLD_STEP  # refused before any step of the second run


# ------------------------------------------------------------------ another layout with elastic=True

RTOL = 1e-5


def _whole(output: Path) -> dict[str, torch.Tensor]:
    return read_local_state(output / "final-whole.safetensors")


def _step_batches(output: Path, ranks: int) -> dict[int, list[str]]:
    """Every step's micro-batches over all data-parallel ranks (the ranks of a tensor-parallel group count once; a
    step trained again after a resume counts once), sorted."""
    steps: dict[int, set[str]] = {}
    for rank in range(ranks):
        path = output / f"batches-rank{rank}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                steps.setdefault(row["step"], set()).add(row["batch"])
    return {step: sorted(batches) for step, batches in steps.items()}


def _elastic_kill(output: Path, options: list[str], nproc: int, step: int) -> None:
    committed = output / f"checkpoint-{step}" / "manifest.json"
    returncode = kill_torchrun_after(WORKER, ["--output-dir", str(output), *options], nproc=nproc, timeout=500,
                                     marker=committed, log=output.parent / f"{output.name}-{step}.log",
                                     env=child_env({"HFR_HOLD_AFTER_SAVE": str(step)}))
    assert returncode == -signal.SIGKILL


@pytest.mark.distributed
@pytest.mark.slow
# make test: the tp-size change below (the same Trainer, layout change and kills), and dropout across world sizes in
# test_elastic_trainer.py
@pytest.mark.extended
def test_elastic_tp2_x_fsdp2_then_tp2_then_tp2_x_fsdp2_is_the_uninterrupted_run(tmp_path, model_dir):
    """tp2 x fsdp2 on 4 ranks (accumulation 1), killed after step 1; tp2 on 2 ranks (one data-parallel rank:
    accumulation 2, the global batch of 4 samples kept), killed after step 3; tp2 x fsdp2 on 4 ranks to the end.
    Every step trains the same micro-batches as the uninterrupted 4-rank run; losses, weights and optimizer moments
    within 1e-5."""
    wide = _options(model_dir, "--tp", "2", "--fsdp", "2", "--elastic")
    narrow = _options(model_dir, "--tp", "2", "--elastic")
    reference = _run(tmp_path / "reference", wide, 4)
    assert reference.returncode == 0, reference.stdout[-5000:]
    run = tmp_path / "run"
    _elastic_kill(run, wide, 4, step=1)
    _elastic_kill(run, narrow, 2, step=3)
    done = _run(run, wide, 4)
    assert done.returncode == 0, done.stdout[-5000:]
    assert [json.loads(line)["step"] for line in (run / "batches-rank2.jsonl").read_text().splitlines()] == [1, 4]
    _assert_same_elastic_run(tmp_path / "reference", run)


def _assert_same_elastic_run(reference: Path, run: Path) -> None:
    """Every step's micro-batches as in ``reference``; logged losses, whole weights and optimizer moments within
    ``RTOL`` (relative; L2 for tensors)."""
    assert _step_batches(run, 4) == _step_batches(reference, 4)
    want = {row["step"]: row["loss"] for row in _history(reference, 0) if "loss" in row}
    got = {row["step"]: row["loss"] for row in _history(run, 0) if "loss" in row}
    assert sorted(got) == sorted(want) == list(range(1, MAX_STEPS + 1))
    assert all(got[step] == pytest.approx(want[step], rel=RTOL) for step in want), (got, want)
    final, expected = _whole(run), _whole(reference)
    assert sorted(final) == sorted(expected) and any(name.startswith("optim/") for name in expected)
    for name, tensor in expected.items():
        error = float((final[name] - tensor).norm() / tensor.norm().clamp_min(1e-12))
        assert error <= RTOL, (name, error)


@pytest.mark.distributed
@pytest.mark.slow
def test_elastic_tp2_x_fsdp2_then_fsdp2_then_tp2_reshards_the_tensor_parallel_pieces(tmp_path, model_dir):
    """The tensor-parallel size changes too: tp2 x fsdp2 on 4 ranks (accumulation 1), killed after step 1; FSDP2
    alone on 2 ranks (tp 1: every weight resharded from 2-D pieces to FSDP's), killed after step 2; tp2 on 2 ranks
    (one data-parallel rank, accumulation 2) to the end. The same run as the uninterrupted 4-rank one within 1e-5.
    Without dropout: a tensor-parallel rank draws the masks of its own heads, so another tp size draws others."""
    wide = _options(model_dir, "--tp", "2", "--fsdp", "2", "--elastic", "--no-dropout")
    reference = _run(tmp_path / "reference", wide, 4)
    assert reference.returncode == 0, reference.stdout[-5000:]
    run = tmp_path / "run"
    _elastic_kill(run, wide, 4, step=1)
    _elastic_kill(run, _options(model_dir, "--tp", "1", "--fsdp", "2", "--elastic", "--no-dropout"), 2, step=2)
    done = _run(run, _options(model_dir, "--tp", "2", "--elastic", "--no-dropout"), 2)
    assert done.returncode == 0, done.stdout[-5000:]
    _assert_same_elastic_run(tmp_path / "reference", run)
    assert [json.loads(line)["step"] for line in (run / "batches-rank2.jsonl").read_text().splitlines()] == [1]


@pytest.mark.distributed
@pytest.mark.extended  # make test: test_another_layout_on_resume_is_refused_naming_both (the same ConfigDriftError)
def test_another_layout_without_elastic_stays_drift(tmp_path, model_dir):
    _kill(tmp_path / "run", _options(model_dir, "--tp", "2", "--fsdp", "2"), 4, inside_save=False)
    other = _run(tmp_path / "run", _options(model_dir, "--tp", "2"), 2)
    assert other.returncode != 0 and ConfigDriftError.__name__ in other.stdout, other.stdout[-5000:]
    assert "parallelism: 'dp_shard=2 x tp=2' -> 'tp=2'" in other.stdout


# ------------------------------------------------------------------ hf-resumable check under tensor parallel


def _check_tp(tmp_path: Path, model_dir: Path, *options: str):
    """``hf-resumable check -- torchrun --nproc-per-node 2 tp_trainer_worker.py ... --tp 2`` (killed once, seed 1:
    at step 3, resumed from checkpoint-2)."""
    return _check(tmp_path, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                  "127.0.0.1", "--master-port", free_port(), WORKER, "--output-dir", "{out}", "--model-dir",
                  model_dir, "--tp", "2", "--max-steps", "5", *options, kills=1, seed=1)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended  # make test: test_check.py's ZeRO-2 loop under torchrun (EXACT)
def test_check_judges_a_tensor_parallel_trainer_run_exact(tmp_path, model_dir):
    done, report = _check_tp(tmp_path, model_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["result"] == "EXACT" and report["ranks"] == 2 and report["steps"] == 5
    run = report["runs"][0]
    assert run["launches"][0]["killed_at"] is not None and run["resumed_from"]
    assert report["compared_per_run"]["batches"] == 10 and report["compared_per_run"]["losses"] == 10


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended  # make test: test_check.py's FSDP2 loop under torchrun (DIVERGES, named)
def test_check_names_the_step_and_state_of_a_broken_tensor_parallel_run(tmp_path, model_dir):
    done, report = _check_tp(tmp_path, model_dir, "--forget-rng")
    assert done.returncode == 1, done.stdout + done.stderr
    run = report["runs"][0]
    first, resumed = run["differences"][0], run["resumed_from"][0]
    assert (first["category"], first["step"]) == ("rng", resumed + 1)  # the first resumed step's forward pass
    assert {row["rank"] for row in run["differences"] if row["step"] == resumed + 1} == {0, 1}
    assert f"DIVERGES at optimizer step {resumed + 1}" in done.stdout and "RNG" in done.stdout
