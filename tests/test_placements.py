"""Pieces of any DTensor placement (checkpoint/pieces/_placements.py): the pure box-and-writer plan, checked over every
coordinate of fake meshes, and a real 2x2 (dp_shard x tp) job on 4 gloo ranks saved, loaded at the same layout and
resharded 4 -> 2 -> 1 bit for bit (tests/scripts/placements_worker.py).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hf_resumable.checkpoint.pieces._piece_layout import check_coverage
from hf_resumable.checkpoint.pieces._placements import MeshView, check_copies_agree, check_tiling, plan_piece
from hf_resumable.errors import CheckpointMismatchError, HfResumableError, UnsupportedStateError

from helpers.distributed_launch import launch_ranks

WORKER = Path(__file__).parent / "scripts" / "placements_worker.py"


def every_rank(shape, placements, mesh_shape, *, copies=1, name="w"):
    """``plan_piece`` of every rank: each coordinate of the mesh in each of its copies."""
    return [plan_piece(shape, placements, MeshView(mesh_shape, coordinate, copies, copy), name=name)
            for copy in range(copies) for coordinate in itertools.product(*(range(n) for n in mesh_shape))]


def written_elements(plans, shape) -> torch.Tensor:
    """How many times each element of the tensor is written, over the plans of every rank."""
    counts = torch.zeros(shape, dtype=torch.int64)
    for plan in plans:
        if plan.writes:
            counts[tuple(slice(o, o + n) for o, n in zip(plan.offset, plan.shape))] += 1
    return counts


LAYOUTS = [
    # (global shape, placements, mesh shape, copies of the mesh)
    ((8, 6), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2), 1),  # FSDP2 over a colwise TP weight
    ((10, 3), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2), 1),  # the same, rows split unevenly (3 + 2)
    ((4, 6), (Replicate(), _StridedShard(1, split_factor=2), Shard(1)), (2, 2, 2), 1),  # HSDP x TP, rowwise
    ((6, 8), (Shard(0), Shard(1)), (2, 2), 1),
    ((4, 7), (Shard(1), Shard(1)), (2, 2), 1),  # two mesh dims split one tensor dim, unevenly
    ((7, 4), (Shard(0), Replicate()), (2, 2), 1),  # split over dp_shard, replicated over tp
    ((5,), (Replicate(), Replicate()), (2, 2), 1),
    ((6,), (Shard(0),), (2,), 2),  # an RMSNorm on the dp_shard sub-mesh of dp_shard x tp
    ((9, 3), (Replicate(), Shard(0), Shard(1)), (2, 2, 2), 1),  # HSDP x TP on 8 ranks
    ((3,), (Shard(0),), (4,), 1),  # fewer rows than ranks: one rank holds nothing
    ((), (Replicate(),), (2,), 3),
]


@pytest.mark.parametrize("shape, placements, mesh_shape, copies", LAYOUTS)
def test_every_element_is_written_exactly_once(shape, placements, mesh_shape, copies):
    plans = every_rank(shape, placements, mesh_shape, copies=copies)
    assert torch.equal(written_elements(plans, shape), torch.ones(shape, dtype=torch.int64))
    holders = Counter((p.offset, p.shape) for p in plans if math.prod(p.shape))
    for plan in plans:  # every rank holding a box agrees how many hold it, and one of them writes it
        if math.prod(plan.shape):
            assert plan.holders == holders[(plan.offset, plan.shape)]


def test_boxes_are_the_slices_torch_distributes():
    """The FSDP2-over-TP strided layout: rank (dp, tp) holds chunk dp of chunk tp of dim 0."""
    plans = every_rank((8, 6), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2))
    assert [(p.offset, p.shape) for p in plans] == [((0, 0), (2, 6)), ((4, 0), (2, 6)), ((2, 0), (2, 6)),
                                                    ((6, 0), (2, 6))]
    plans = every_rank((4, 7), (Shard(1), Shard(1)), (2, 2))
    assert [(p.offset, p.shape) for p in plans] == [((0, 0), (4, 2)), ((0, 2), (4, 2)), ((0, 4), (4, 2)),
                                                    ((0, 6), (4, 1))]


def test_replicated_pieces_are_written_by_many_ranks_not_rank_0():
    """A model's replicated tensors (20 names held by 4 ranks: 2 replicated mesh coordinates x 2 copies) are
    written by every one of the 4 holders, each piece by exactly one."""
    writers: Counter[tuple[int, int]] = Counter()
    for i in range(20):
        plans = every_rank((4,), (Shard(0), Replicate()), (2, 2), copies=2, name=f"layers.{i}.norm.weight")
        assert sum(p.writes for p in plans) == 2  # two distinct boxes
        for index, plan in enumerate(plans):  # index: copy * 4 + 2 * (sharded coordinate) + replicated coordinate
            writers[(index // 4, index % 2)] += plan.writes  # which of a box's four holders
    assert set(writers) == {(0, 0), (0, 1), (1, 0), (1, 1)} and min(writers.values()) >= 3, writers


def test_partial_placements_are_refused_naming_the_tensor():
    with pytest.raises(UnsupportedStateError, match="'layers.0.mlp'.*Partial.*redistribute") as caught:
        plan_piece((4,), (Shard(0), Partial()), MeshView((2, 2), (0, 0)), name="layers.0.mlp")
    assert isinstance(caught.value, (HfResumableError, TypeError))


def test_strided_pieces_that_are_not_boxes_are_refused():
    # Shard(0) then _StridedShard(0, 2): rank (0, 0) holds rows {0, 2} of 8, not a box
    with pytest.raises(UnsupportedStateError, match="'w'.*dimension 0 .*not one contiguous range"):
        check_tiling((8,), (Shard(0), _StridedShard(0, split_factor=2)), (2, 2), name="w")
    with pytest.raises(UnsupportedStateError):
        plan_piece((8,), (Shard(0), _StridedShard(0, split_factor=2)), MeshView((2, 2), (1, 1)), name="w")


def test_mesh_views_are_validated():
    with pytest.raises(ValueError, match="not in a mesh"):
        MeshView((2, 2), (0, 2))
    with pytest.raises(ValueError, match="copy 2"):
        MeshView((2,), (0,), copies=2, copy=2)
    with pytest.raises(ValueError, match="placement"):
        plan_piece((4,), (Shard(0),), MeshView((2, 2), (0, 0)), name="w")


def test_copies_of_a_piece_must_agree():
    def report(sample):
        return {"copies": {"norm": {"offset": [3], "sample": sample}, "bias": {"offset": [0], "sample": "b"}}}

    check_copies_agree([report("a"), report("a"), {"file": None}], source="x")  # a rank holding no copies
    with pytest.raises(CheckpointMismatchError, match=r"x: the copies of 1 tensor\(s\).*\['norm'\].*gradients"):
        check_copies_agree([report("a"), report("c")], source="x")


def test_coverage_refuses_one_piece_written_twice():
    """Two ranks that both write the same half (and nobody the other half) add up to the right element count: the
    check still refuses it."""
    section = {"tensors": {"w": {"dtype": "F32", "shape": [4]}},
               "pieces": {"a": {"w": {"offset": [0], "shape": [2]}}, "b": {"w": {"offset": [0], "shape": [2]}}}}
    with pytest.raises(CheckpointMismatchError, match=r"do not cover them exactly once \(\['w'\]\)"):
        check_coverage(section, source="sharded_layout.json (model)")


def _launch(args: list[str], world_size: int) -> None:
    results = launch_ranks([str(WORKER), *args], world_size=world_size, timeout=400)
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)


@pytest.mark.distributed
def test_dp_shard_x_tp_dtensors_save_load_and_reshard_4_2_1(tmp_path):
    _launch(["save", str(tmp_path)], 4)
    for rank in range(4):  # the same layout: every rank's pieces, weights and AdamW moments, bit for bit
        result = json.loads((tmp_path / f"result-rank{rank}.json").read_text())
        assert result["problems"] == []
        # copies of a sub-mesh that differ: no copy is chosen silently, the save is refused on every rank
        assert "the copies of 1 tensor(s) held by several ranks differ (['norm'])" in result["diverged"]
        assert result["diverged"].startswith("CheckpointMismatchError" if rank == 0 else "RuntimeError")
    assert not (tmp_path / "diverged-0" / "manifest.json").exists()
    layout = json.loads((tmp_path / "checkpoint-2" / "sharded_layout.json").read_text())
    files = {Path(f).name: set(pieces) for f, pieces in layout["model"]["pieces"].items()}
    writers_of = {name: [f for f, names in files.items() if name in names] for name in ("norm", "tpnorm", "bias")}
    assert len(writers_of["norm"]) == len(writers_of["tpnorm"]) == 2 and len(writers_of["bias"]) == 1
    assert len({f for fs in writers_of.values() for f in fs}) > 1, writers_of  # not all on one rank
    _launch(["load", str(tmp_path), "checkpoint-2", "resaved-2"], 2)
    assert all(json.loads((tmp_path / f"load-2-rank{r}.json").read_text()) == {"problems": []} for r in range(2))
    _launch(["load", str(tmp_path), "resaved-2"], 1)
    assert json.loads((tmp_path / "load-1-rank0.json").read_text()) == {"problems": []}
