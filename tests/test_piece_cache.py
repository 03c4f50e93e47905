"""A rank's flat partition as a DTensor piece (:func:`~hf_resumable.checkpoint.pieces._partitioned.partition_piece`),
built once and reused by every save while the partition is updated in place.

* ZeRO-1/2 (a flat fp32 partition or a moment over it): the piece of one save is the next one's; a partition whose
  ``.data`` was replaced gets a new piece over its new bytes; a partition that dies takes its entry with it.
* ZeRO-3 (parameters with ``ds_tensor``, faked on a one-rank group; the real engine's test is in test_engines.py):
  :func:`partitioned_state` keys the piece by the stable ``ds_tensor``, not by the view of its valid part that
  ``held_partition`` makes anew at every call; the piece views the partition's bytes (padding cut off), a load that
  copies into the partitions keeps it, and a load or a re-partition that replaces a partition's storage rebuilds it.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_resumable.checkpoint.pieces import _partitioned
from hf_resumable.checkpoint.pieces._partitioned import load_partitioned_state, partition_piece, partitioned_state


@pytest.fixture
def one_rank_group():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()


@pytest.fixture
def built(monkeypatch):
    """Counts the DTensors built (``DTensor.from_local`` calls)."""
    from torch.distributed.tensor import DTensor

    calls = []
    original = DTensor.from_local

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(DTensor, "from_local", staticmethod(counted))
    return calls


def test_a_flat_partition_keeps_its_piece_while_it_views_the_same_bytes(one_rank_group, built):
    partition = torch.arange(6.0)
    piece = partition_piece(partition, one_rank_group)
    partition.add_(1)  # an optimizer step: in place
    assert partition_piece(partition, one_rank_group) is piece and len(built) == 1
    assert piece.shape == (6,) and torch.equal(piece.to_local(), partition)
    partition.data = torch.zeros(6)  # new bytes: a new piece over them
    replaced = partition_piece(partition, one_rank_group)
    assert replaced is not piece and len(built) == 2 and torch.equal(replaced.to_local(), torch.zeros(6))
    assert replaced.to_local().data_ptr() == partition.data_ptr()
    entries = len(_partitioned._PIECES)
    del partition, piece, replaced
    gc.collect()
    assert len(_partitioned._PIECES) == entries - 1  # it died with its partition, not kept alive by its piece


def _partitioned_model(group: object) -> torch.nn.Module:
    """A model whose weight looks like a ZeRO-3 one: empty ``data``, this rank's partition in ``ds_tensor`` (7
    elements of a 2x3 weight: one of padding), tied to a second name; the bias is not partitioned."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(3, 2, bias=False))
    weight = model[1].weight = model[0].weight  # tied: both names get the same piece
    weight.data = torch.empty(0)
    weight.ds_tensor = torch.arange(7.0)
    weight.ds_numel, weight.ds_shape, weight.ds_process_group = 6, (2, 3), group
    return model


def test_a_zero3_partition_keeps_its_piece_across_saves_and_loads(one_rank_group, built):
    model = _partitioned_model(one_rank_group)
    weight = model[0].weight
    partition = weight.ds_tensor
    state = partitioned_state(model, model.state_dict())
    piece = state["0.weight"]
    assert state["1.weight"] is piece and torch.equal(state["0.bias"], model[0].bias) and len(built) == 1
    assert piece.shape == (6,) and torch.equal(piece.to_local(), partition[:6])  # the padding cut off
    assert piece.to_local().data_ptr() == partition.data_ptr()
    # the next save: held_partition's view is new, the partition is the same: the same piece, no DTensor built
    partition.mul_(2)  # ZeRO-3's step copies the masters into the partition in place
    again = partitioned_state(model, model.state_dict())
    assert again["0.weight"] is piece and len(built) == 1 and torch.equal(piece.to_local(), partition[:6])
    # a load copies into the partition: the same piece, holding the loaded values
    load_partitioned_state(model, {"0.weight": torch.full((6,), 5.0)})
    assert partitioned_state(model, model.state_dict())["0.weight"] is piece and len(built) == 1
    assert torch.equal(piece.to_local(), torch.full((6,), 5.0))
    # a load (or DeepSpeed's re-partitioning) that replaces the partition's storage: rebuilt over the new bytes
    weight.ds_tensor.data = torch.full((7,), 9.0)
    rebuilt = partitioned_state(model, model.state_dict())["0.weight"]
    assert rebuilt is not piece and len(built) == 2 and torch.equal(rebuilt.to_local(), torch.full((6,), 9.0))
    assert rebuilt.to_local().data_ptr() == weight.ds_tensor.data_ptr()
