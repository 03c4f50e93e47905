"""ResumableAccelerator over accelerate's N-D layouts (``ParallelismConfig``), issue 43 item 2.

* The pure rules (integrations/_parallelism.py): a process's data-parallel rank, the layout's name, and the layouts
  refused before step 1 (context/sequence parallel on the CPU; data beside tensor parallel without FSDP2; FSDP2 with
  tensor parallel where accelerate's preparation of it cannot run).
* Real torchrun jobs of tests/scripts/nd_accelerate_worker.py (gloo CPU ranks, the test-only shim of
  tests/helpers/engine_fixtures.py): SIGKILLed after a committed checkpoint and rerun with the same command, every
  logged loss, weight piece and optimizer tensor equals the uninterrupted run's; the ranks of one tensor-parallel group
  read the same batches, different data-parallel ranks different ones. dp_shard x tp (4 ranks, killed after a
  commit) runs in make test; tp (2 ranks), HSDP (4 ranks, which make test resumes in the elastic run below),
  dp_shard x tp killed inside a save, and the 8-rank dp_replicate x dp_shard x tp in the extended tier. FSDP2
  beside tensor parallel runs with the test-only ``ReplicateParallel`` of tests/helpers/replicate_parallel.py
  (accelerate 1.16 imports it from transformers, which 5.x no longer has); without it the layout is refused before
  step 1. A different layout on resume is refused before step 1, naming both.
* ``elastic=True`` (issue 43 item 4): the elastic mode counts data-parallel ranks, not processes (the pure rules of
  integrations/_accelerate_elastic.py), and a run moved between the layouts accelerate trains on gloo CPU ranks
  (tp2 on 2 ranks -> HSDP dp_replicate2 x dp_shard2 on 4 -> tp2, SIGKILLed after a commit) continues within 1e-5 of
  the uninterrupted run (losses, learning rates, weight pieces, Adam moments) with the same samples in every step.
  Per-rank pieces into a run of whole tensors are refused in load_state, naming both layouts. The extended tier adds
  dp_shard2 -> tp2, HSDP -> dp_shard2 and dp_shard2 x tp2 (4 ranks) -> tp2 (2 ranks).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import read_manifest, verify_checkpoint
from hf_resumable.errors import ConfigDriftError, UnsupportedEngineError
from hf_resumable.integrations._accelerate_elastic import (
    DataWorld,
    check_reshardable,
    elastic_changes,
    saved_data_world,
    world_size_mode,
)
from hf_resumable.integrations._accelerate_loop import ElasticBatch
from hf_resumable.integrations._core import UpstreamInternalsError
from hf_resumable.integrations._parallelism import (
    ParallelLayout,
    accelerate_tp_ready,
    check_runnable,
    data_parallel_rank,
    parse_layout,
)

from helpers.distributed_launch import child_env, kill_torchrun_after, run_torchrun
from helpers.engine_fixtures import read_local_state
from helpers.tiny_models import tiny_llama

WORKER = Path(__file__).parent / "scripts" / "nd_accelerate_worker.py"
HOLD_STEP = 2  # the job is held after checkpoint-2 committed, then SIGKILLed
MAX_STEPS = 4


# ------------------------------------------------------------------ pure rules


def test_data_rank_groups_the_ranks_of_one_tensor_parallel_group():
    layout = ParallelLayout(dp_replicate=2, dp_shard=2, tp=2)
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (layout.data_world, layout.group_size, layout.world_size) == (4, 2, 8)
    assert layout.describe() == "dp_replicate=2 x dp_shard=2 x tp=2"
    assert [ParallelLayout(dp_shard=2, cp=2).data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert ParallelLayout().describe() == "dp_replicate=1"
    with pytest.raises(ValueError, match="process 4 is not in the tp=2"):
        ParallelLayout(tp=2).data_rank(4)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelLayout(tp=0)


@pytest.mark.parametrize("name", ["cp", "sp"])
def test_context_and_sequence_parallel_are_refused_on_the_cpu_naming_the_layout(name):
    layout = ParallelLayout(dp_shard=2, **{name: 2})
    with pytest.raises(UnsupportedEngineError, match=rf"ParallelismConfig dp_shard=2 x {name}=2: .*{name}_size=2") \
            as caught:
        check_runnable(layout, device_type="cpu", fsdp2=True)
    assert isinstance(caught.value, NotImplementedError)
    check_runnable(layout, device_type="cuda", fsdp2=True)  # the GPU path takes it


def test_data_beside_tensor_parallel_without_fsdp2_is_refused():
    for layout in (ParallelLayout(dp_shard=2, tp=2), ParallelLayout(dp_replicate=2, tp=2)):
        with pytest.raises(UnsupportedEngineError, match="without an FSDP2 plugin.*drift apart"):
            check_runnable(layout, device_type="cpu", fsdp2=False)
    check_runnable(ParallelLayout(tp=2), device_type="cpu", fsdp2=False)  # tensor parallel alone
    check_runnable(ParallelLayout(dp_replicate=2, dp_shard=2), device_type="cpu", fsdp2=True)  # HSDP
    check_runnable(None, device_type="cpu", fsdp2=False)  # no ParallelismConfig


def test_fsdp2_with_tensor_parallel_is_refused_where_accelerate_cannot_prepare_it():
    layout = ParallelLayout(dp_shard=2, tp=2)
    with pytest.raises(UpstreamInternalsError, match=r"dp_shard=2 x tp=2: accelerate .*ReplicateParallel") as caught:
        check_runnable(layout, device_type="cpu", fsdp2=True, tp_ready=False)
    assert isinstance(caught.value, ImportError)
    import accelerate
    import transformers

    message = str(caught.value)
    # the two clashing releases, and both ways out
    assert f"accelerate {accelerate.__version__} " in message
    assert f"transformers {transformers.__version__} " in message
    assert "pin a transformers release that still has ReplicateParallel" in message
    assert "ResumableTrainer and a model loaded with DistributedConfig(tp_size=2, fsdp_size=2)" in message
    with pytest.raises(UpstreamInternalsError, match=r"DistributedConfig\(tp_size=2, fsdp_size=2, "
                       r"dp_replicate_size=2\)"):
        check_runnable(ParallelLayout(dp_replicate=2, dp_shard=2, tp=2), device_type="cpu", fsdp2=True,
                       tp_ready=False)
    check_runnable(layout, device_type="cpu", fsdp2=True, tp_ready=True)


def test_a_recorded_layout_reads_back_with_its_data_parallel_ranks():
    for layout in (ParallelLayout(tp=2), ParallelLayout(dp_replicate=2, dp_shard=2),
                   ParallelLayout(dp_replicate=2, dp_shard=2, tp=2), ParallelLayout()):
        assert parse_layout(layout.describe()) == layout
    for text in ("tp=2 x tp=2", "pp=2", "tp=two", ""):
        with pytest.raises(ValueError, match="is not a recorded ParallelismConfig layout"):
            parse_layout(text)
    assert data_parallel_rank(ParallelLayout(dp_replicate=2, tp=2), process_index=3, world_size=4) == (1, 2)
    assert data_parallel_rank(ParallelLayout(tp=2), process_index=1, world_size=4) == (1, 4)  # another world
    assert data_parallel_rank(None, process_index=1, world_size=2) == (1, 2)
    # a checkpoint's data-parallel ranks: from the layout it recorded, else its processes
    assert saved_data_world({"parallelism": "dp_replicate=2 x tp=2"}, 4) == DataWorld(
        processes=4, data_ranks=2, layout="dp_replicate=2 x tp=2")
    assert saved_data_world({"parallelism": "tp=2"}, 2).data_ranks == 1
    assert saved_data_world({}, 3) == DataWorld(processes=3, data_ranks=3)


def test_the_elastic_mode_counts_data_parallel_ranks_not_processes():
    # tp=2 on 2 processes: one data-parallel rank, so accelerate's scheduler is stepped once per optimizer step
    mode = world_size_mode(True, data_ranks=1)
    assert mode.recorded_settings() == {"scheduler_steps_per_optimizer_step": 1}
    # a whole micro-batch of a step of 4 (global batch 8 = 1 data rank x 4 x 2) weighs 1/4, on every process
    batch = ElasticBatch(seed=0, epoch=0, chunk=0, samples=2, step_samples=8)

    class Window:  # an accumulation window at its first of ``size`` micro-batches
        def __init__(self, size: int) -> None:
            self.slot = (0, size)

        def current(self) -> ElasticBatch:
            return batch

    loss = torch.tensor(2.0)
    assert mode.scale_loss(loss, None, window=Window(4), accumulation=4, num_processes=2).item() == 0.5
    # HSDP on 4 processes: 4 data-parallel ranks, a micro-batch of 2 in a global batch of 8 is the whole step
    assert world_size_mode(True, data_ranks=4).scale_loss(loss, None, window=Window(1), accumulation=1,
                                                          num_processes=4).item() == 2.0
    # a summed loss: its item count is summed over every process, so the factor keeps them
    assert mode.scale_loss(loss, 8, window=Window(4), accumulation=4, num_processes=2).item() == 0.5
    assert mode.resumes_across() is False  # nothing loaded yet


def test_elastic_drops_the_layout_from_drift_only_where_the_run_moves():
    changed = {"parallelism": ("tp=2", "dp_replicate=2 x dp_shard=2"), "world_size": (2, 4),
               "gradient_accumulation_steps": (4, 1)}
    assert elastic_changes(changed, kept=True) == {}
    assert elastic_changes(changed, kept=False) == changed


def test_per_rank_pieces_into_whole_tensors_are_refused_naming_both_layouts():
    tp2 = DataWorld(processes=2, data_ranks=1, layout="tp=2")
    one = DataWorld(processes=1, data_ranks=1, layout="dp_replicate=1")
    with pytest.raises(UnsupportedEngineError, match=r"ckpt holds per-rank pieces \(saved at ParallelismConfig "
                       r"tp=2, 2 process\(es\), 1 data-parallel rank\(s\)\), and this run \(ParallelismConfig "
                       r"dp_replicate=1, 1 process\(es\).*fsdp_version=2"):
        check_reshardable(tp2, one, saved_pieces=True, pieces=False, checkpoint="ckpt")
    check_reshardable(tp2, DataWorld(processes=4, data_ranks=4, layout="dp_replicate=2 x dp_shard=2"),
                      saved_pieces=True, pieces=True)  # pieces into pieces: resharded
    check_reshardable(one, tp2, saved_pieces=False, pieces=True)  # whole tensors are read into pieces


# ------------------------------------------------------------------ torchrun jobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose heads split over 2 tensor-parallel ranks."""
    path = tmp_path_factory.mktemp("nd") / "seed"
    tiny_llama(seed=0, num_key_value_heads=2).save_pretrained(path)
    return path


def _options(model_dir: Path, layout: dict[str, int]) -> list[str]:
    """The worker's options for ``layout``; FSDP2 beside tensor parallel also installs the test-only
    ``ReplicateParallel`` (tests/helpers/replicate_parallel.py) that accelerate's preparation imports."""
    shim = ["--replicate-shim"] if layout.get("tp", 1) > 1 and layout.get("dp_shard", 1) > 1 else []
    return ["--model-dir", str(model_dir), "--max-steps", str(MAX_STEPS), *shim,
            *[arg for name, size in layout.items() for arg in (f"--{name.replace('_', '-')}", str(size))]]


def _run(output: Path, options: list[str], nproc: int) -> subprocess.CompletedProcess:
    return run_torchrun(WORKER, ["--output-dir", str(output), *options], env=child_env(), timeout=500, nproc=nproc)


def _kill_after_commit(output: Path, options: list[str], nproc: int, *, inside_save: bool = False) -> Path:
    """Run the job held after checkpoint ``HOLD_STEP`` committed (or inside its save, right before the commit); then
    SIGKILL every process. Returns the checkpoint the resume starts from."""
    checkpoint = output / "checkpoints" / f"checkpoint-{HOLD_STEP}"
    committed = checkpoint / "manifest.json"  # renamed into place: committed
    variable = "HFR_HOLD_IN_SAVE" if inside_save else "HFR_HOLD_AFTER_SAVE"
    returncode = kill_torchrun_after(WORKER, ["--output-dir", str(output), *options], nproc=nproc, timeout=500,
                                     marker=output / "checkpoints" / "held-in-save" if inside_save else committed,
                                     log=output.parent / f"{output.name}-held.log",
                                     env=child_env({variable: str(HOLD_STEP)}))
    assert returncode == -signal.SIGKILL
    assert not list(output.glob("final-rank*")), "the job ran to its end before it was killed"
    if inside_save:  # every rank's files written, never committed: the resume starts from the checkpoint before
        assert not committed.exists() and list((output / "checkpoints").glob(f".tmp-checkpoint-{HOLD_STEP}*"))
        checkpoint = checkpoint.with_name(f"checkpoint-{HOLD_STEP - 1}")
    assert verify_checkpoint(checkpoint, full=True).ok and read_manifest(checkpoint).world_size == nproc
    return checkpoint


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_resumes_bit_exact(tmp_path: Path, model_dir: Path, layout: dict[str, int], *,
                              inside_save: bool = False) -> list[list[dict]]:
    """The uninterrupted run, then a run killed after checkpoint-2 (or inside its save) and rerun: the same losses,
    batches, weight pieces and optimizer tensors on every rank. Returns the reference's per-rank logs."""
    nproc = ParallelLayout(**{name: size for name, size in layout.items()}).world_size
    options = _options(model_dir, layout)
    reference = _run(tmp_path / "reference", options, nproc)
    assert reference.returncode == 0, reference.stdout[-5000:]
    checkpoint = _kill_after_commit(tmp_path / "run", options, nproc, inside_save=inside_save)
    assert (checkpoint / "sharded_layout.json").is_file()  # every rank's pieces, nothing gathered
    resumed = _run(tmp_path / "run", options, nproc)  # the same command
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    logs = []
    for rank in range(nproc):
        want = _log(tmp_path / "reference" / f"losses-rank{rank}.jsonl")
        got = _log(tmp_path / "run" / f"losses-rank{rank}.jsonl")
        # steps 1-2 before the kill, 3-4 after the resume from checkpoint-2: nothing repeated or skipped (killed
        # inside the save of step 2: step 2 trained again from checkpoint-1, the same loss on the same batch)
        assert [row["step"] for row in got] == [1, 2, *([2] if inside_save else []), *range(3, MAX_STEPS + 1)]
        if inside_save:
            assert got[1] == got[2], rank
            del got[1]
        assert got == want, rank
        final, expected = (read_local_state(path / f"final-rank{rank}.safetensors")
                           for path in (tmp_path / "run", tmp_path / "reference"))
        assert sorted(final) == sorted(expected) and any(name.startswith("optim/") for name in expected)
        assert not [name for name in expected if not torch.equal(final[name], expected[name])], rank
        logs.append(want)
    return logs


def _batches(logs: list[list[dict]], ranks: range) -> list[list[str]]:
    return [[row["batch"] for row in logs[rank]] for rank in ranks]


@pytest.mark.distributed
@pytest.mark.extended  # make test: test_dp_shard_x_tp_with_the_shim_resumes_bit_exact (tp pieces, killed after commit)
def test_tensor_parallel_killed_after_a_commit_resumes_bit_exact(tmp_path, model_dir):
    logs = _assert_resumes_bit_exact(tmp_path, model_dir, {"tp": 2})
    first, second = _batches(logs, range(2))
    assert first == second  # one tensor-parallel group: the same batches


@pytest.mark.distributed
@pytest.mark.extended  # make test: test_elastic_tp_then_hsdp_then_tp_is_the_uninterrupted_run (HSDP killed, resumed)
def test_hsdp_killed_after_a_commit_resumes_bit_exact(tmp_path, model_dir):
    logs = _assert_resumes_bit_exact(tmp_path, model_dir, {"dp_replicate": 2, "dp_shard": 2})
    batches = _batches(logs, range(4))
    assert len({tuple(b) for b in batches}) == 4  # four data-parallel ranks: four different streams
    layout = json.loads((tmp_path / "run" / "checkpoints" / "checkpoint-4" / "sharded_layout.json").read_text())
    assert all(layout["model"]["pieces"].values())  # each replica pair's pieces written by both ranks, spread


def _assert_each_box_written_once(checkpoint: Path, nproc: int) -> None:
    """Every piece of the model is in one rank's file only (a box replicated over ``tp`` has one writer), and every
    rank wrote some: the writers of replicated boxes are spread."""
    pieces = json.loads((checkpoint / "sharded_layout.json").read_text())["model"]["pieces"]
    boxes = [(name, tuple(box["offset"])) for by_name in pieces.values() for name, box in by_name.items()]
    assert len(boxes) == len(set(boxes))
    assert len(pieces) == nproc and all(pieces.values())


@pytest.mark.slow
@pytest.mark.distributed
# a kill inside a save of DTensor pieces is proven in make test by test_trainer_tp (tp2); this layout's: test-all
@pytest.mark.parametrize("inside_save", [False, pytest.param(True, marks=pytest.mark.extended)],
                         ids=["after-commit", "inside-save"])
def test_dp_shard_x_tp_with_the_shim_resumes_bit_exact(tmp_path, model_dir, inside_save):
    logs = _assert_resumes_bit_exact(tmp_path, model_dir, {"dp_shard": 2, "tp": 2}, inside_save=inside_save)
    batches = _batches(logs, range(4))
    assert batches[0] == batches[1] and batches[2] == batches[3]  # each tp pair: the same batches
    assert batches[0] != batches[2]  # two data-parallel ranks: different ones
    _assert_each_box_written_once(tmp_path / "run" / "checkpoints" / "checkpoint-4", 4)


@pytest.mark.distributed
def test_dp_shard_x_tp_without_the_shim_is_refused_before_step_1(tmp_path, model_dir):
    options = [option for option in _options(model_dir, {"dp_shard": 2, "tp": 2}) if option != "--replicate-shim"]
    done = _run(tmp_path / "run", options, 4)
    if accelerate_tp_ready():  # a stack where accelerate and transformers match: it trains as with the shim
        assert done.returncode == 0, done.stdout[-5000:]
        assert len(_log(tmp_path / "run" / "losses-rank0.jsonl")) == MAX_STEPS
        return
    assert done.returncode != 0 and "UpstreamInternalsError" in done.stdout, done.stdout[-5000:]
    assert "ParallelismConfig dp_shard=2 x tp=2: accelerate " in done.stdout
    assert not (tmp_path / "run" / "losses-rank0.jsonl").exists()  # refused before step 1


@pytest.mark.distributed
def test_another_layout_on_resume_is_refused_naming_both(tmp_path, model_dir):
    options = _options(model_dir, {"tp": 2})
    _kill_after_commit(tmp_path / "run", options, 2)
    other = run_torchrun(WORKER, ["--output-dir", str(tmp_path / "run"), *_options(model_dir, {"dp_shard": 2})],
                         env=child_env(), timeout=500, nproc=2)
    assert other.returncode != 0
    assert ConfigDriftError.__name__ in other.stdout
    assert "parallelism: 'tp=2' -> 'dp_shard=2'" in other.stdout, other.stdout[-5000:]
    log = _log(tmp_path / "run" / "losses-rank0.jsonl")
    assert [row["step"] for row in log] == [1, 2]  # refused before any step of the second run


@pytest.mark.distributed
@pytest.mark.extended
def test_dp_replicate_x_dp_shard_x_tp_on_8_ranks(tmp_path, model_dir):
    logs = _assert_resumes_bit_exact(tmp_path, model_dir, {"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    batches = _batches(logs, range(8))
    assert all(batches[2 * g] == batches[2 * g + 1] for g in range(4))  # each tp pair: the same batches
    assert len({tuple(batches[2 * g]) for g in range(4)}) == 4  # four data-parallel ranks: different ones
    _assert_each_box_written_once(tmp_path / "run" / "checkpoints" / "checkpoint-4", 8)


@pytest.mark.distributed
def test_context_parallel_is_refused_in_prepare_on_the_cpu(tmp_path, model_dir):
    done = _run(tmp_path / "run", _options(model_dir, {"cp": 2}), 2)
    assert done.returncode != 0 and "UnsupportedEngineError" in done.stdout, done.stdout[-5000:]
    assert "ParallelismConfig cp=2: context parallel (cp_size=2)" in done.stdout
    assert not (tmp_path / "run" / "losses-rank0.jsonl").exists()  # refused before step 1


# ------------------------------------------------------------------ elastic=True: another layout on resume

ELASTIC_STEPS = 6
ELASTIC_RTOL = 1e-5


def _elastic_options(model_dir: Path, layout: dict[str, int], max_steps: int, accumulation: int = 4) -> list[str]:
    # per-device batch 2 x ``accumulation`` x the first launch's data-parallel ranks: a global batch of 8 (6 steps
    # in the epoch of 48 rows); a resume keeps it whatever the command line says
    return [*_options(model_dir, layout), "--elastic", "--accumulation", str(accumulation),
            "--max-steps", str(max_steps)]


def _elastic_run(output: Path, model_dir: Path, layout: dict[str, int], max_steps: int,
                 accumulation: int = 4) -> None:
    nproc = ParallelLayout(**layout).world_size
    done = _run(output, _elastic_options(model_dir, layout, max_steps, accumulation), nproc)
    assert done.returncode == 0, done.stdout[-5000:]


def _steps(output: Path) -> dict[int, tuple[float, float, list[str]]]:
    """``{step: (loss, lr, samples)}`` of a run (its launches together), the samples over every rank that trained
    the step (a tp group's once each), the loss and learning rate as rank 0 logged them."""
    steps: dict[int, tuple[float, float, list[str]]] = {}
    for log in sorted(output.glob("losses-rank*.jsonl"), key=lambda path: int(path.stem.removeprefix("losses-rank"))):
        for row in _log(log):
            loss, lr, batches = steps.get(row["step"], (row["loss"], row["lr"], []))
            steps[row["step"]] = (loss, lr, sorted({*batches, *row["batches"]}))
    return steps


def _assert_within(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want) and any(name.startswith("optim/") for name in want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=ELASTIC_RTOL, atol=ELASTIC_RTOL * 1e-2, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
def test_elastic_tp_then_hsdp_then_tp_is_the_uninterrupted_run(tmp_path, model_dir):
    tp, hsdp = {"tp": 2}, {"dp_replicate": 2, "dp_shard": 2}
    _elastic_run(tmp_path / "reference", model_dir, tp, ELASTIC_STEPS)
    run = tmp_path / "run"
    checkpoint = _kill_after_commit(run, _elastic_options(model_dir, tp, ELASTIC_STEPS), 2)
    assert (checkpoint / "sharded_layout.json").is_file()
    _elastic_run(run, model_dir, hsdp, 4)  # 4 data-parallel ranks: accumulation 4 -> 1, the global batch kept
    assert read_manifest(run / "checkpoints" / "checkpoint-4").world_size == 4
    _elastic_run(run, model_dir, tp, ELASTIC_STEPS)  # back to 1 data-parallel rank: accumulation 1 -> 4
    want, got = _steps(tmp_path / "reference"), _steps(run)  # ranks 2 and 3 of run trained steps 3-4 only
    assert sorted(want) == sorted(got) == list(range(1, ELASTIC_STEPS + 1))
    for step in want:
        loss, lr, samples = got[step]
        assert len(want[step][2]) == 4 and samples == want[step][2], step  # the same 4 micro-batches of 2
        assert lr == pytest.approx(want[step][1], rel=1e-12), step  # the schedule stepped once per step
        assert loss == pytest.approx(want[step][0], rel=ELASTIC_RTOL), step
    assert [len(_log(run / f"losses-rank{rank}.jsonl")) for rank in range(4)] == [6, 6, 2, 2]
    for rank in range(2):  # the same tp2 layout at the end: piece by piece
        _assert_within(read_local_state(run / f"final-rank{rank}.safetensors"),
                       read_local_state(tmp_path / "reference" / f"final-rank{rank}.safetensors"))


@pytest.mark.distributed
def test_elastic_pieces_into_a_run_of_whole_tensors_are_refused_in_load_state(tmp_path, model_dir):
    run = tmp_path / "run"
    _kill_after_commit(run, _elastic_options(model_dir, {"tp": 2}, 4), 2)
    done = _run(run, _elastic_options(model_dir, {}, 4), 1)  # one process, no tensor parallel: whole tensors
    assert done.returncode != 0 and "UnsupportedEngineError" in done.stdout, done.stdout[-5000:]
    assert "holds per-rank pieces (saved at ParallelismConfig tp=2, 2 process(es)" in done.stdout
    assert [row["step"] for row in _log(run / "losses-rank0.jsonl")] == [1, 2]  # refused before any step


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.parametrize("first, second", [({"dp_shard": 2}, {"tp": 2}), ({"dp_replicate": 2, "dp_shard": 2},
                                                                            {"dp_shard": 2}),
                                           ({"dp_shard": 2, "tp": 2}, {"tp": 2})],
                         ids=["dp_shard2-to-tp2", "hsdp-to-dp_shard2", "dp_shard2xtp2-to-tp2"])
def test_elastic_layout_change_variants(tmp_path, model_dir, first, second):
    accumulation = 4 // ParallelLayout(**first).data_world  # the global batch of 8
    _elastic_run(tmp_path / "reference", model_dir, first, 4, accumulation)
    run = tmp_path / "run"
    _kill_after_commit(run, _elastic_options(model_dir, first, 4, accumulation), ParallelLayout(**first).world_size)
    _elastic_run(run, model_dir, second, 4, accumulation)
    want, got = _steps(tmp_path / "reference"), _steps(run)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step][2] == want[step][2], step
        assert got[step][0] == pytest.approx(want[step][0], rel=ELASTIC_RTOL), step
