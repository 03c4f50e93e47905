"""FSDP and DeepSpeed ZeRO checkpoints resume at another world size when opened with ``elastic=True``.

* Pure: a flat partition's map (:class:`~hf_resumable.checkpoint.pieces._partitioned.PartitionMap`, ZeRO-1/2 ``flat``
and
  ZeRO-3 ``strided``) says which parameter elements each rank holds; :func:`plan_partition_copies` cuts the partitions
  of one world size out of those of another, for any sizes (checked against a direct cut, integers only).
* Engines (gloo ranks on CPU, ``tests/scripts/ds_elastic_worker.py``): a run trained 2 steps at 2 ranks is saved with
  ``save_checkpoint``; a fresh engine (other weights) at 1 rank is refused the checkpoint without
  ``elastic`` (``ConfigDriftError``) and loads it with ``reshard=True`` (``open_checkpoint`` then
  ``OpenedCheckpoint.load_into``, what the integrations call), then saves it at 1 rank; a fresh engine at 2 ranks loads
  that. Every leg's whole
  weights, fp32 master weights, Adam moments and step counts, gathered by the engine's own functions
  (``deepspeed.utils.safe_get_full_*``, full state dicts for FSDP), are bitwise the saved run's.
* Export of the fp32 master weights: a 2-rank ZeRO-3 run in bf16 exports (``export_model(master_weights=True)``, one
  process) DeepSpeed's own full fp32 master weights bit for bit, and without the option its bf16 weights; a checkpoint
  without ZeRO partitions is refused.
* FSDP1 with ``use_orig_params=False`` and with ``NO_SHARD``: a fresh engine at the same world size loads weights
  and optimizer state bit for bit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint.pieces._partitioned import (
    MAP_FLAT,
    MAP_STRIDED,
    PartitionMap,
    Segment,
    plan_partition_copies,
    saved_partition_maps,
)
from hf_resumable.errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError

from helpers.distributed_launch import child_env, run_torchrun
from helpers.engine_fixtures import read_local_state

WORKER = Path(__file__).parent / "scripts" / "ds_elastic_worker.py"


# ------------------------------------------------------------------ pure: partition maps


def _zero_map(kind: str, numels: list[int], world_size: int, *, align: int = 1) -> PartitionMap:
    """The map DeepSpeed's layout gives ``numels`` at ``world_size`` (ZeRO-1/2: end to end, each parameter aligned to
    ``align`` elements, the whole padded to a multiple of the world size; ZeRO-3: ``ceil(numel / world_size)`` of
    each parameter per rank)."""
    params, offset = [], 0
    for i, numel in enumerate(numels):
        chunk = numel if kind == MAP_FLAT else -(-numel // world_size)
        params.append((f"p{i}", numel, offset, chunk))
        offset += (numel + (-numel) % align) if kind == MAP_FLAT else chunk
    size = -(-offset // world_size) if kind == MAP_FLAT else offset
    return PartitionMap(kind, world_size, size, tuple(params))


def _partition(partition_map: PartitionMap, rank: int, values: dict[str, list[int]]) -> list[int]:
    """Rank ``rank``'s partition of ``values`` (per-parameter element lists), padding as -1."""
    out = [-1] * partition_map.size
    for segment in partition_map.segments(rank):
        out[segment.offset:segment.offset + segment.length] = values[segment.fqn][
            segment.start:segment.start + segment.length]
    return out


@pytest.mark.parametrize("kind", [MAP_FLAT, MAP_STRIDED])
def test_partitions_of_one_world_size_are_cut_from_those_of_another(kind):
    rng = random.Random(0)
    for _ in range(40):
        numels = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        values = {f"p{i}": [100 * i + j for j in range(n)] for i, n in enumerate(numels)}
        saved_at, loaded_at = rng.randint(1, 4), rng.randint(1, 4)
        saved = _zero_map(kind, numels, saved_at, align=rng.choice([1, 4]))
        stored = {rank: _partition(saved, rank, values) for rank in range(saved_at)}
        flat = [x for rank in range(saved_at) for x in stored[rank]]  # the saved global flat tensor
        wanted_map = _zero_map(kind, numels, loaded_at)
        for rank in range(loaded_at):
            out = [-1] * wanted_map.size
            for copy in plan_partition_copies(wanted_map.segments(rank), {"z.g0": saved}, source="x"):
                out[copy.offset:copy.offset + copy.length] = flat[copy.position:copy.position + copy.length]
            assert out == _partition(wanted_map, rank, values), (numels, saved_at, loaded_at, rank)


def test_a_parameter_the_saved_partitions_lack_is_named():
    saved = {"z.g0": PartitionMap(MAP_FLAT, 2, 2, (("a", 3, 0, 3),))}
    with pytest.raises(CheckpointMismatchError, match=r"b \[0, 2\)"):
        plan_partition_copies([Segment("a", 0, 3, 0), Segment("b", 0, 2, 3)], saved, source="x")


def test_partition_maps_are_validated():
    good = PartitionMap(MAP_STRIDED, 2, 3, (("a", 5, 0, 3),))
    assert PartitionMap.from_json(json.loads(json.dumps(good.to_json())), source="x") == good
    for bad in ({**good.to_json(), "kind": "other"}, {**good.to_json(), "params": [["a", -1, 0, 3]]},
                {"kind": MAP_FLAT}):
        with pytest.raises(CorruptCheckpointError, match="partition map"):
            PartitionMap.from_json(bad, source="x")
    with pytest.raises(IncompleteCheckpointError, match="record no partition map"):
        saved_partition_maps({"non_tensor_state": {"zero2.group0": {}}}, source="x")


# ------------------------------------------------------------------ engines: 2 -> 1 -> 2 ranks


def _run(nproc: int, engine: str, *args: str) -> None:
    done = run_torchrun(WORKER, ["--engine", engine, *args], env=child_env(), timeout=420, nproc=nproc)
    assert done.returncode == 0, done.stdout[-5000:]


def _assert_same(saved: Path, loaded: Path, *, refused: bool = True) -> None:
    want, got = read_local_state(saved), read_local_state(loaded)
    assert sorted(got) == sorted(want) and any("exp_avg_sq" in name for name in want)
    different = [name for name in want if want[name].shape != got[name].shape or not torch.equal(want[name],
                                                                                                got[name])]
    assert not different, different[:5]
    # another world size is refused without elastic=True; the same one is not
    assert json.loads(loaded.with_suffix(".json").read_text()) == {"refused": refused}


_EXTENDED = pytest.mark.extended


_MORE_ENGINES = ("fsdp2", "zero3", "zero1", "fsdp1", "fsdp1-flat")  # make test-all


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", *(pytest.param(e, marks=_EXTENDED) for e in _MORE_ENGINES)])
def test_an_engine_checkpoint_resumes_at_another_world_size_when_elastic(tmp_path, engine):
    _run(2, engine, "--train", "--checkpoint", str(tmp_path / "at2"), "--dump", str(tmp_path / "saved.safetensors"))
    _run(1, engine, "--load", "--checkpoint", str(tmp_path / "at2"), "--dump", str(tmp_path / "at1.safetensors"),
         "--save", str(tmp_path / "at1"))
    _assert_same(tmp_path / "saved.safetensors", tmp_path / "at1.safetensors")
    _run(2, engine, "--load", "--checkpoint", str(tmp_path / "at1"), "--dump", str(tmp_path / "back.safetensors"))
    _assert_same(tmp_path / "saved.safetensors", tmp_path / "back.safetensors")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("engine", ["fsdp1-flat", "fsdp1-noshard"])
def test_fsdp1_flat_parameters_and_no_shard_resume_exactly(tmp_path, engine):
    """FSDP1 with ``use_orig_params=False`` (the optimizer over flat parameters) and with ``NO_SHARD`` (rank 0 writes
    whole tensors): a fresh engine at the same world size loads weights and optimizer state bit for bit."""
    _run(2, engine, "--train", "--checkpoint", str(tmp_path / "at2"), "--dump", str(tmp_path / "saved.safetensors"))
    _run(2, engine, "--load", "--checkpoint", str(tmp_path / "at2"), "--dump", str(tmp_path / "loaded.safetensors"))
    _assert_same(tmp_path / "saved.safetensors", tmp_path / "loaded.safetensors", refused=False)


# ------------------------------------------------------------------ export of the fp32 master weights


def test_master_weights_of_a_checkpoint_without_zero_partitions_are_refused(tmp_path):
    from hf_resumable import save_checkpoint
    from hf_resumable.conversions.export import export_model

    from helpers.engine_fixtures import build_model

    model = build_model()
    save_checkpoint(tmp_path / "checkpoint-1", model=model, optimizer=torch.optim.AdamW(model.parameters()), step=1)
    with pytest.raises(IncompleteCheckpointError, match="no DeepSpeed ZeRO optimizer partitions"):
        export_model(tmp_path / "checkpoint-1", tmp_path / "out", master_weights=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_export_writes_the_fp32_master_weights(tmp_path):
    from safetensors.torch import load_file

    from hf_resumable.conversions.export import export_model

    _run(2, "zero3", "--bf16", "--train", "--checkpoint", str(tmp_path / "at2"), "--dump",
         str(tmp_path / "saved.safetensors"))
    saved = read_local_state(tmp_path / "saved.safetensors")
    export_model(tmp_path / "at2", tmp_path / "masters", master_weights=True)
    export_model(tmp_path / "at2", tmp_path / "weights")
    masters = load_file(tmp_path / "masters" / "model.safetensors")
    weights = load_file(tmp_path / "weights" / "model.safetensors")
    names = [key.split("/")[1] for key in saved if key.endswith("/fp32")]
    assert "transformer.wte.weight" in masters and all(name in masters for name in names if name != "lm_head.weight")
    for name in masters:
        assert masters[name].dtype == torch.float32 and weights[name].dtype == torch.bfloat16, name
        assert torch.equal(masters[name], saved[f"optim/{name}/fp32"].view(masters[name].shape)), name
        assert torch.equal(weights[name], saved[f"model/{name}"]), name
    assert any(not torch.equal(masters[name], weights[name].float()) for name in masters)
