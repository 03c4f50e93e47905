"""Switching in from stock multi-GPU checkpoints, and exporting per-rank checkpoints (issue #23, items 3 and 4).

* A stock ``transformers.Trainer`` + DeepSpeed ZeRO-1/2 checkpoint (``global_stepN/``), made by the real stock tools
  on 2 gloo ranks, is converted by ``hf-resumable convert``; ``ResumableTrainer(deepspeed=same config)`` at 2 ranks
  resumes from it with every rank's weights, fp32 master partitions, Adam moments and step counts bit-identical to the
  stock run's at the save, the same learning rate and engine counters, and trains on. The partition maps recorded
  from the stock files equal the live engine's, and let one rank load the 2-rank conversion with ``elastic=True``.
* A stock ``accelerate.Accelerator`` FSDP2 ``SHARDED_STATE_DICT`` ``save_state`` (``.distcp`` + ``.metadata``) is
  converted the same way; ``ResumableAccelerator`` with FSDP2 (``allow_inexact_resume=True``: no data position in
  the stock files) resumes with every rank's parameter pieces and optimizer state bit-identical.
* ``hf-resumable export`` of a 2-rank FSDP2 or ZeRO-2 checkpoint writes a directory ``from_pretrained`` loads, whose
  weights equal the ranks' pieces gathered.
* Hostile inputs: a ``.metadata`` pickle naming ``os.system`` is refused with ``UnsafePickleError`` naming the file,
  and nothing runs; chunk records outside the checkpoint are refused. The planners are tested without tensors.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_resumable.checkpoint import open_checkpoint, read_manifest, verify_checkpoint
from hf_resumable.checkpoint._types import Box
from hf_resumable.checkpoint.pieces._partitioned import read_master_weights
from hf_resumable.conversions._pickle import load_dcp_metadata
from hf_resumable.conversions.dcp import plan_dcp_pieces
from hf_resumable.conversions.deepspeed import plan_zero_boxes, plan_zero_maps
from hf_resumable.errors import CorruptCheckpointError, UnsafePickleError

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env, run_torchrun
from helpers.engine_fixtures import read_local_state

SCRIPTS = Path(__file__).parent / "scripts"
STOCK_WORKER = SCRIPTS / "convert_stock_worker.py"
RESUME_WORKER = SCRIPTS / "convert_resume_worker.py"
TRAINER_WORKER = SCRIPTS / "fsdp_trainer_worker.py"
RANKS = (0, 1)
_EXTENDED = pytest.mark.extended


def _job(worker: Path, output: Path, options: list[str]) -> None:
    done = run_torchrun(worker, ["--output-dir", str(output), *options], env=child_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-5000:]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "hf_resumable", *args], cwd=REPO_ROOT, env=child_env(),
                      capture_output=True, text=True, timeout=300)


def _convert(source: Path, output: Path) -> subprocess.CompletedProcess:
    done = _cli("convert", str(source), "--output", str(output))
    assert done.returncode == 0, done.stderr[-5000:]
    assert "NOT bit-exact" in done.stderr and "weights_only=True" in done.stderr
    assert verify_checkpoint(output, full=True).ok
    assert read_manifest(output).world_size == 2
    # nothing pickled or executable was carried over
    assert not [p for p in output.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".pkl", ".py")]
    return done


def _assert_resumed_as_saved(stock: Path, resumed: Path) -> None:
    """Every rank's state right after the load equals the stock run's at its save, bit for bit."""
    for rank in RANKS:
        want = read_local_state(stock / f"stock-rank{rank}.safetensors")
        got = read_local_state(resumed / f"resumed-rank{rank}.safetensors")
        assert sorted(got) == sorted(want) and any(name.startswith("optim/") for name in want)
        assert not [name for name in want if not torch.equal(want[name], got[name])]
        stock_info = json.loads((stock / f"stock-rank{rank}.json").read_text())
        resumed_info = json.loads((resumed / f"resumed-rank{rank}.json").read_text())
        for key in set(stock_info) & set(resumed_info):
            assert resumed_info[key] == stock_info[key], key


def _maps(layout: dict) -> dict:
    """Every ZeRO partition's recorded map in a layout's optimizer document."""
    return {name: fields.get("partition") for name, fields in layout["optimizer_document"]["non_tensor_state"].items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [pytest.param(1, marks=_EXTENDED), 2])
def test_stock_deepspeed_checkpoint_converts_and_resumes(tmp_path, stage):
    stock, resumed = tmp_path / "stock", tmp_path / "resumed"
    zero = ["--engine", "deepspeed", "--zero-stage", str(stage), "--max-steps", "5"]
    _job(STOCK_WORKER, stock, [*zero, "--stop-after", "3"])
    assert (stock / "checkpoint-3" / "global_step3" / "mp_rank_00_model_states.pt").is_file()
    converted = tmp_path / "converted" / "checkpoint-3"
    _convert(stock / "checkpoint-3", converted)
    layout = json.loads((converted / "sharded_layout.json").read_text())
    assert layout["optimizer_document"]["class"] == f"DeepSpeedZero{stage}/AdamW"
    # the partition maps recorded from the stock files assemble every parameter's fp32 master weights (in this fp32
    # run, the weights themselves), as an elastic resume or `export --master-weights` reads them
    masters = read_master_weights(open_checkpoint(converted))
    weights = load_file(converted / "sharded" / "model-rank00000-of-00002.safetensors")
    assert len(masters) > 10
    assert not [name for name in masters if not torch.equal(masters[name], weights[name].view(-1))]
    _job(RESUME_WORKER, resumed, [*zero, "--resume", str(converted)])
    _assert_resumed_as_saved(stock, resumed)
    # ... and are the maps the live engine records
    live = json.loads((resumed / "checkpoint-5" / "sharded_layout.json").read_text())
    assert _maps(layout) == _maps(live) and _maps(live)
    stock_history = json.loads((stock / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    for rank in RANKS:
        result = json.loads((resumed / f"result-rank{rank}.json").read_text())
        assert result["resumed_from"] == str(converted)
        logged = [entry for entry in result["log_history"] if "loss" in entry]
        # steps 1-3 are the stock run's history (trainer_state.json), then 4 and 5 trained after the switch
        assert [entry["step"] for entry in logged] == [1, 2, 3, 4, 5]
        assert logged[:3] == [entry for entry in stock_history if "loss" in entry]
    assert verify_checkpoint(resumed / "checkpoint-5", full=True).ok


@pytest.mark.distributed
@pytest.mark.slow
def test_stock_accelerate_fsdp_checkpoint_converts_and_resumes(tmp_path):
    stock, resumed = tmp_path / "stock", tmp_path / "resumed"
    options = ["--engine", "fsdp", "--max-steps", "8"]
    _job(STOCK_WORKER, stock, [*options, "--stop-after", "3"])
    assert (stock / "stock" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    converted = tmp_path / "converted" / "checkpoint-3"
    _convert(stock / "stock", converted)
    assert read_manifest(converted).step == 3  # from the optimizer state's step (stock accelerate records none)
    _job(RESUME_WORKER, resumed, [*options, "--resume", str(converted)])
    _assert_resumed_as_saved(stock, resumed)
    for rank in RANKS:
        assert json.loads((resumed / f"result-rank{rank}.json").read_text())["steps"] == [4, 5, 6, 7, 8]
    assert verify_checkpoint(resumed / "checkpoints" / "checkpoint-8", full=True).ok


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended
def test_a_converted_deepspeed_checkpoint_resumes_at_another_world_size_when_elastic(tmp_path):
    """The partition maps the conversion records let one rank load what two stock ranks saved: DeepSpeed's own
    gathered view (whole weights, fp32 master weights, Adam moments, step counts) equals the one after a load at the
    stock world size."""
    stock = tmp_path / "stock"
    _job(STOCK_WORKER, stock, ["--engine", "deepspeed", "--zero-stage", "2", "--max-steps", "5", "--stop-after", "3"])
    converted = tmp_path / "converted" / "checkpoint-3"
    _convert(stock / "checkpoint-3", converted)
    views = {}
    for nproc in (2, 1):
        dump = tmp_path / f"at{nproc}.safetensors"
        done = run_torchrun(SCRIPTS / "ds_elastic_worker.py", ["--engine", "zero2", "--trainer-groups", "--load",
                                                                "--checkpoint", str(converted), "--dump", str(dump)],
                            env=child_env(), timeout=420, nproc=nproc)
        assert done.returncode == 0, done.stdout[-5000:]
        views[nproc] = load_file(dump)
        assert json.loads(dump.with_suffix(".json").read_text()) == {"refused": nproc == 1}
    assert sorted(views[1]) == sorted(views[2]) and any("exp_avg_sq" in name for name in views[2])
    assert not [name for name in views[2] if not torch.equal(views[1][name], views[2][name])]


def _gathered(run: Path, engine: str) -> dict[str, torch.Tensor]:
    """The whole weights from every rank's final pieces (FSDP2 shards dim 0; ZeRO-1/2 ranks hold them whole)."""
    pieces = [read_local_state(run / f"final-rank{rank}.safetensors") for rank in RANKS]
    names = [name for name in pieces[0] if name.startswith("model/")]
    if engine == "deepspeed":
        return {name[len("model/"):]: pieces[0][name] for name in names}
    return {name[len("model/"):]: torch.cat([rank[name] for rank in pieces]) for name in names}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", pytest.param("deepspeed", marks=_EXTENDED)])
def test_export_of_a_two_rank_checkpoint_loads_with_from_pretrained(tmp_path, engine):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    _job(TRAINER_WORKER, run, ["--engine", engine, "--max-steps", "2"])
    checkpoint = run / "checkpoint-2"
    assert (checkpoint / "sharded_layout.json").is_file() and read_manifest(checkpoint).world_size == 2
    done = _cli("export", str(checkpoint), "--output", str(tmp_path / "exported"))
    assert done.returncode == 0, done.stderr[-5000:]
    exported = tmp_path / "exported"
    assert not (exported / "sharded").exists() and not (exported / "sharded_layout.json").exists()
    model = AutoModelForCausalLM.from_pretrained(exported)
    state = model.state_dict()
    want = _gathered(run, engine)
    assert len(want) > 10
    assert not [name for name, tensor in want.items() if not torch.equal(state[name], tensor)]
    assert model.lm_head.weight is model.transformer.wte.weight  # tied as transformers ties them


# ------------------------------------------------------------------ hostile inputs and pure planners


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_dcp_metadata_naming_os_system_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "stock"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    metadata = checkpoint / "pytorch_model_fsdp_0" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    torch.save({"step": 0, "random_state": (3, (0,) * 625, None), "numpy_random_seed": ("MT19937",),
                "torch_manual_seed": torch.get_rng_state()}, checkpoint / "random_states_0.pkl")
    with pytest.raises(UnsafePickleError, match=r"pytorch_model_fsdp_0/\.metadata.*os\.system|posix\.system"):
        load_dcp_metadata(metadata)
    done = _cli("convert", str(checkpoint), "--output", str(tmp_path / "out"))
    assert done.returncode != 0
    assert str(metadata) in done.stderr and "system" in done.stderr, done.stderr[-3000:]
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_deepspeed_optimizer_file_naming_os_system_is_refused(tmp_path):
    from hf_resumable.conversions._pickle import DEEPSPEED_GLOBALS, load_torch_pickle

    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": _RunsCommand(f"touch {marker}")}}, path)
    with pytest.raises(UnsafePickleError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt.*system"):
        load_torch_pickle(path, safe_globals=DEEPSPEED_GLOBALS)
    assert not marker.exists()


def test_dcp_metadata_other_than_metadata_is_refused(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CorruptCheckpointError, match="not a DCP Metadata"):
        load_dcp_metadata(path)
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        load_dcp_metadata(path)


def _metadata(relative_path: str = "__1_0.distcp"):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))]
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), chunks)
    storage = {MetadataIndex("model.w", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 0, 10),
               MetadataIndex("model.w", torch.Size([2, 0]), 0): _StorageInfo(relative_path, 7, 11)}
    return Metadata({"model.w": entry}, storage_data=storage)


def test_plan_dcp_pieces_gives_each_chunk_to_the_rank_that_wrote_it(tmp_path):
    metadata = _metadata()
    tensors, chunks, byte_keys = plan_dcp_pieces(metadata, source="x")
    assert tensors == {"model.w": (torch.float32, (4, 3))} and byte_keys == {}
    assert [(c.rank, c.file, c.box, c.offset, c.length) for c in chunks] == [
        (0, "__0_0.distcp", Box((0, 0), (2, 3)), 0, 10), (1, "__1_0.distcp", Box((2, 0), (2, 3)), 7, 11)]
    # the restricted unpickler reads back what torch's own pickling of a Metadata writes
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(metadata))
    assert plan_dcp_pieces(load_dcp_metadata(path), source="x")[1] == chunks


@pytest.mark.parametrize("relative_path", ["../__1_0.distcp", "/etc/passwd", "__1_0.distcp/../../x"])
def test_plan_dcp_pieces_refuses_records_outside_the_checkpoint(relative_path):
    with pytest.raises(CorruptCheckpointError, match="not a __<rank>_<i>.distcp file"):
        plan_dcp_pieces(_metadata(relative_path), source="x")


def test_deepspeed_names_mirror_the_integration():
    from hf_resumable.conversions import deepspeed as converter
    from hf_resumable.integrations import _deepspeed as integration

    for name in ("MASTER_KEY", "GROUP_NAME", "EXTRA_DEEPSPEED"):
        assert getattr(converter, name) == getattr(integration, name), name


def test_plan_zero_boxes():
    assert plan_zero_boxes([[6, 2], [6, 2]], source="x") == [[Box((0,), (6,)), Box((0,), (2,))],
                                                             [Box((6,), (6,)), Box((2,), (2,))]]
    with pytest.raises(CorruptCheckpointError, match="same size on every rank"):
        plan_zero_boxes([[6, 2], [5, 2]], source="x")


def test_plan_zero_maps():
    """DeepSpeed's order and paddings, as zero_to_fp32.py reads them back; what does not fit is corrupt."""
    maps = plan_zero_maps([{"a": [2, 3], "b": [5]}, {"c": [4]}], [[2, 0], [0]], [7, 2], world_size=2, source="x")
    assert [m.to_json() for m in maps] == [
        {"kind": "flat", "world_size": 2, "size": 7, "params": [["a", 6, 0, 6], ["b", 5, 8, 5]]},
        {"kind": "flat", "world_size": 2, "size": 2, "params": [["c", 4, 0, 4]]}]
    assert [(s.fqn, s.start, s.length, s.offset) for s in maps[0].segments(1)] == [("b", 0, 5, 1)]
    assert plan_zero_maps([{"a": [3]}], None, [2], world_size=2, source="x")[0].params == (("a", 3, 0, 3),)
    with pytest.raises(CorruptCheckpointError, match="more than its 2 partitions of 5"):
        plan_zero_maps([{"a": [2, 3], "b": [5]}], [[2, 0]], [5], world_size=2, source="x")
    with pytest.raises(CorruptCheckpointError, match="same groups"):
        plan_zero_maps([{"a": [2]}], [[0], [0]], [1], world_size=2, source="x")
