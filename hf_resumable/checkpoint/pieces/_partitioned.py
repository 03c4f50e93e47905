"""DeepSpeed ZeRO's partitions as pieces. A ZeRO-3 ``ds_tensor`` is exactly the piece a DTensor of the flattened
parameter, sharded on dim 0 over its group, holds (``torch.chunk`` sizes; the last rank's padding cut off), so it is
stored and verified as FSDP2 pieces are. ZeRO's flat optimizer partitions are pieces of one flat tensor each, with
the :class:`PartitionMap` that lets a load at another world size cut them again. Nothing here imports deepspeed:
parameters are recognised by ``ds_tensor``/``ds_numel``. See docs/format.md (DeepSpeed ZeRO).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...constants import LAYOUT_FILE, LAYOUT_KEY_OPTIMIZER, LAYOUT_KEY_OPTIMIZER_DOC, OPTIMIZER_STATE_PREFIX
from ...errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError
from .._types import Box
from ._dtensor import group_mesh, local_box

logger = logging.getLogger(__name__)

__all__ = ["is_partitioned", "partitioned_state", "partitioned_views", "load_partitioned_state", "PARTITION_KEY",
           "held_partition", "partition_piece", "state_parameters", "master_weight_names", "omitted_weights",
           "MasterWeights", "PartitionMap", "Segment", "plan_partition_copies", "reshard_partitions",
           "read_master_weights"]


def _is_partitioned_parameter(value: Any) -> bool:
    return getattr(value, "ds_tensor", None) is not None and hasattr(value, "ds_numel")


def is_partitioned(model: torch.nn.Module | None) -> bool:
    """Whether ``model``'s parameters are partitioned by DeepSpeed ZeRO-3 (``ds_tensor``)."""
    return model is not None and any(_is_partitioned_parameter(p) for p in model.parameters())


def _valid_part(partition: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
    """The elements of rank ``rank``'s flat ``partition`` below ``numel`` in the global flat tensor (the rest pads)."""
    size = partition.numel()
    return partition.detach().view(-1).narrow(0, 0, max(0, min(size, numel - rank * size)))


def held_partition(parameter: Any) -> torch.Tensor:
    """The valid part of this rank's partition (padding cut off): what ``torch.chunk`` gives this rank."""
    return _valid_part(parameter.ds_tensor, parameter.ds_numel,
                       torch.distributed.get_rank(parameter.ds_process_group))


class _CachedPiece(NamedTuple):
    partition: weakref.ref  # the partition the piece was built for (the entry goes with it)
    group: Any
    numel: int
    seen: tuple[int, torch.Size, torch.dtype, torch.device]  # its storage pointer, shape, dtype, device then
    piece: torch.Tensor


# (id(partition), id(group)) -> the piece built for it. The engines update their partitions in place (the optimizer
# steps the flat fp32 partitions and its moments; ZeRO-3 copies the masters into every ``ds_tensor``), so the piece
# built at one save views the same bytes at the next: building a DTensor per partition per save ran on the training
# loop's time. An entry dies with its partition (a load replaces the optimizer's state tensors): the piece views the
# storage through a tensor of its own, so it would otherwise keep the old bytes alive.
_PIECES: dict[tuple[int, int], _CachedPiece] = {}


def _seen(partition: torch.Tensor) -> tuple[int, torch.Size, torch.dtype, torch.device]:
    return partition.data_ptr(), partition.shape, partition.dtype, partition.device


def partition_piece(partition: torch.Tensor, group: Any, *, numel: int | None = None) -> torch.Tensor:
    """This rank's flat ``partition`` over ``group`` as its piece of the global flat tensor: a DTensor sharded on
    dim 0 viewing the partition's valid part, no copy and no communication. Cached while the partition is the same
    tensor over the same storage, shape, dtype and device (the engines update it in place).

    Args:
        partition (`torch.Tensor`): the flat partition (ZeRO-1/2: a param group's fp32 master partition or a moment
            over it; ZeRO-3: a parameter's ``ds_tensor``).
        group (`ProcessGroup`): the group the tensor is partitioned over.
        numel (`int`, *optional*): elements of the global flat tensor (default: every rank's partition end to end).
    """
    key = (id(partition), id(group))
    hit = _PIECES.get(key)
    if (hit is not None and hit.partition() is partition and hit.group is group
            and (numel is None or hit.numel == numel) and hit.seen == _seen(partition)):
        return hit.piece
    from torch.distributed.tensor import DTensor, Shard

    mesh = group_mesh(group, partition.device.type)
    total = partition.numel() * mesh.size() if numel is None else int(numel)
    local = _valid_part(partition, total, torch.distributed.get_rank(group))
    piece = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(total,), stride=(1,))
    _PIECES[key] = _CachedPiece(weakref.ref(partition, lambda _: _PIECES.pop(key, None)), group, total,
                                _seen(partition), piece)
    return piece


def _piece(parameter: Any) -> torch.Tensor:
    return partition_piece(parameter.ds_tensor, parameter.ds_process_group, numel=int(parameter.ds_numel))


def state_parameters(model: torch.nn.Module) -> dict[str, Any]:
    """``{state-dict name: parameter or buffer}``, tied names included: the walk a save makes once and gives to every
    function here that takes ``parameters`` (which otherwise walk ``model`` themselves)."""
    return dict(model.state_dict(keep_vars=True))


def partitioned_state(model: torch.nn.Module, state: Mapping[str, Any], *,
                      parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``state`` (FQN-keyed) with every partitioned parameter replaced by its piece (:func:`partition_piece`; tied
    names get the same piece, so the writer stores it once)."""
    parameters = state_parameters(model) if parameters is None else parameters
    pieces: dict[int, torch.Tensor] = {}
    result = {}
    for name, value in state.items():
        parameter = parameters.get(name)
        if _is_partitioned_parameter(parameter):
            if id(parameter) not in pieces:
                pieces[id(parameter)] = _piece(parameter)
            value = pieces[id(parameter)]
        result[name] = value
    return result


def master_weight_names(model: torch.nn.Module, state: Mapping[str, Any], optimizer: Any, *,
                        parameters: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``{name: its master's name}`` of every weight of ``state`` whose fp32 master weights ``optimizer`` (a ZeRO
    optimizer view) saves (described with ``"master"`` in the layout); empty for any other optimizer."""
    master_names = getattr(optimizer, "master_names", None)
    if master_names is None:
        return {}
    by_parameter = master_names()
    parameters = state_parameters(model) if parameters is None else parameters
    return {name: by_parameter[id(parameter)] for name in state
            if (parameter := parameters.get(name)) is not None and id(parameter) in by_parameter}


def omitted_weights(masters: Mapping[str, str], optimizer: Any, *, group: Any = None) -> set[str]:
    """The weights of ``masters`` this rank does not store: all, if they equal their masters cast, bit for bit
    (``optimizer.masters_give_weights``, a collective over ``group`` under ZeRO-1/2), else none."""
    if not masters:
        return set()
    if optimizer.masters_give_weights(group=group):
        return set(masters)
    logger.warning("A ZeRO weight differs from its fp32 master weights cast (written outside the optimizer?): it is "
                   "stored, and loads read it instead of the masters.")
    return set()


def partitioned_views(model: torch.nn.Module, *, parameters: Mapping[str, Any] | None = None) -> dict[str, list[int]]:
    """``{name: shape}`` of every partitioned parameter (tied names included), which the layout records next to the
    flattened global shape (``"view"``) so that a load into a model that is not partitioned restores it."""
    parameters = state_parameters(model) if parameters is None else parameters
    return {name: [int(x) for x in parameter.ds_shape] for name, parameter in parameters.items()
            if _is_partitioned_parameter(parameter) and hasattr(parameter, "ds_shape")}


def load_partitioned_state(model: torch.nn.Module, filled: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the pieces of ``filled`` (from :func:`partitioned_state` templates) into the partitions; return the
    entries that are not partitioned (buffers) for the caller to load.

    Parameters ZeRO-3 keeps gathered (``ds_persist``, or gathered at the time) are released and gathered again from
    the loaded partitions, as DeepSpeed does after loading its own checkpoints: a collective over their group.
    """
    parameters = state_parameters(model)
    rest, gathered = {}, {}
    for name, value in filled.items():
        parameter = parameters.get(name)
        if not _is_partitioned_parameter(parameter):
            rest[name] = value
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        with torch.no_grad():
            held_partition(parameter).copy_(local.view(-1))
        if parameter.numel():  # gathered: its full data is refreshed from the partitions below
            gathered[id(parameter)] = parameter
    if gathered:
        held = list(gathered.values())
        held[0].partition(held)
        held[0].all_gather(held)
        logger.debug("Gathered %d persistent ZeRO-3 parameters again from the loaded partitions.", len(held))
    return rest


# ------------------------------------------------------------------ flat optimizer partitions at another world size

PARTITION_KEY = "partition"  # in a flat partition's optimizer state (JSON): its partition map (PartitionMap)
MASTER_KEY = "fp32"  # in a flat partition's optimizer state: its fp32 master weights
ENGINE_CLASS_PREFIX = "DeepSpeedZero"  # the optimizer class a ZeRO checkpoint records (DeepSpeedZero<stage>/<torch>)
MAP_FLAT = "flat"  # ZeRO-1/2: the parameters laid end to end in one flat tensor, cut in equal parts per rank
MAP_STRIDED = "strided"  # ZeRO-3: each rank's partition is its chunk of every parameter, laid end to end


@dataclass(frozen=True)
class Segment:
    """``length`` elements of parameter ``fqn`` (flattened), from element ``start``, at ``offset`` in a partition."""

    fqn: str
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class PartitionMap:
    """Which elements of which parameters a flat partition holds on each rank (JSON in the checkpoint, pure here).

    Args:
        kind (`str`): ``"flat"`` (ZeRO-1/2: parameter ``i`` sits at ``offsets[i]`` of one flat tensor, rank ``r``
            holds ``[r * size, (r + 1) * size)`` of it) or ``"strided"`` (ZeRO-3: rank ``r`` holds elements
            ``[r * chunks[i], (r + 1) * chunks[i])`` of parameter ``i`` at ``offsets[i]`` of its partition).
        world_size (`int`): ranks the partition is cut over.
        size (`int`): elements of one rank's partition (padding included).
        params (`tuple`): ``(fqn, numel, offset, chunk)`` per parameter, in partition order.
    """

    kind: str
    world_size: int
    size: int
    params: tuple[tuple[str, int, int, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "world_size": self.world_size, "size": self.size,
                "params": [list(entry) for entry in self.params]}

    @classmethod
    def from_json(cls, document: Any, *, source: str) -> "PartitionMap":
        try:
            params = tuple((str(fqn), int(numel), int(offset), int(chunk))
                           for fqn, numel, offset, chunk in document["params"])
            built = cls(str(document["kind"]), int(document["world_size"]), int(document["size"]), params)
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{source}: malformed partition map ({type(err).__name__}: {err}).") from None
        if built.kind not in (MAP_FLAT, MAP_STRIDED) or built.world_size < 1 or built.size < 0 or any(
                min(entry[1:]) < 0 for entry in params):
            raise CorruptCheckpointError(f"{source}: malformed partition map {document!r:.200}.")
        return built

    def segments(self, rank: int) -> list[Segment]:
        """The parameter elements rank ``rank``'s partition holds (padding left out); pure.

        Example:

        ```python
        >>> flat = PartitionMap("flat", 2, 3, (("a", 4, 0, 4), ("b", 1, 4, 1)))
        >>> [(s.fqn, s.start, s.length, s.offset) for s in flat.segments(1)]
        [('a', 3, 1, 0), ('b', 0, 1, 1)]
        >>> strided = PartitionMap("strided", 2, 3, (("a", 4, 0, 2), ("b", 1, 2, 1)))
        >>> [(s.fqn, s.start, s.length, s.offset) for s in strided.segments(1)]
        [('a', 2, 2, 0)]
        ```
        """
        found = []
        for fqn, numel, offset, chunk in self.params:
            if self.kind == MAP_FLAT:
                low, high = max(offset, rank * self.size), min(offset + numel, (rank + 1) * self.size)
                segment = Segment(fqn, low - offset, high - low, low - rank * self.size)
            else:
                segment = Segment(fqn, rank * chunk, min(chunk, numel - rank * chunk), offset)
            if segment.length > 0:
                found.append(segment)
        return found


@dataclass(frozen=True)
class Copy:
    """Copy ``length`` elements from ``position`` of the saved flat tensor ``name`` to ``offset`` of a partition."""

    name: str
    position: int
    length: int
    offset: int


def plan_partition_copies(wanted: list[Segment], saved: Mapping[str, PartitionMap], *, source: str) -> list[Copy]:
    """The reads that fill ``wanted`` (a partition's segments at the new world size) from the saved flat partitions
    (their maps at the saved world size); pure.

    Raises:
        CheckpointMismatchError: a parameter the saved partitions do not cover entirely (all of them listed).

    Example:

    ```python
    >>> saved = {"z2.g0": PartitionMap("flat", 2, 3, (("a", 4, 0, 4), ("b", 1, 4, 1)))}
    >>> plan_partition_copies([Segment("a", 0, 4, 0), Segment("b", 0, 1, 4)], saved, source="x")
    [Copy(name='z2.g0', position=0, length=3, offset=0), Copy(name='z2.g0', position=3, length=1, offset=3), \
Copy(name='z2.g0', position=4, length=1, offset=4)]
    ```
    """
    held: dict[str, list[tuple[str, int, Segment]]] = {}
    for name, partition_map in saved.items():
        for rank in range(partition_map.world_size):
            for segment in partition_map.segments(rank):
                held.setdefault(segment.fqn, []).append((name, rank * partition_map.size, segment))
    copies, uncovered = [], []
    for segment in wanted:
        covered = 0
        for name, base, stored in held.get(segment.fqn, ()):
            low = max(segment.start, stored.start)
            high = min(segment.start + segment.length, stored.start + stored.length)
            if high > low:
                copies.append(Copy(name, base + stored.offset + low - stored.start, high - low,
                                   segment.offset + low - segment.start))
                covered += high - low
        if covered != segment.length:
            uncovered.append(f"{segment.fqn} [{segment.start}, {segment.start + segment.length})")
    if uncovered:
        raise CheckpointMismatchError(
            f"{source}: the saved optimizer partitions do not hold {len(uncovered)} parameter range(s) this rank "
            f"needs: {', '.join(uncovered[:10])}. The model or its param groups changed since the save; build them as "
            "when it was saved.")
    return copies


def read_partitioned(reader: Any, saved: Mapping[str, PartitionMap], key: str, wanted: list[Segment],
                     out: torch.Tensor, *, source: str) -> torch.Tensor:
    """Fill ``out`` (a flat partition, or a whole flattened parameter) at ``wanted`` with the saved optimizer tensor
    ``key`` (``fp32``, ``exp_avg``...) of the flat partitions ``saved``, read through ``reader``, a ``PieceReader``."""
    for copy in plan_partition_copies(wanted, saved, source=source):
        piece = reader.read_box(f"{OPTIMIZER_STATE_PREFIX}{copy.name}/{key}", Box((copy.position,), (copy.length,)))
        with torch.no_grad():
            out[copy.offset:copy.offset + copy.length].copy_(piece)
    return out


def saved_partition_maps(document: Mapping[str, Any], *, source: str) -> dict[str, PartitionMap]:
    """``{flat partition name: map}`` recorded in an optimizer document (``non_tensor_state``).

    Raises:
        IncompleteCheckpointError: a flat partition without a map (saved before hf_resumable recorded them).
    """
    maps, missing = {}, []
    for name, fields in (document.get("non_tensor_state") or {}).items():
        if isinstance(fields, Mapping) and PARTITION_KEY in fields:
            maps[name] = PartitionMap.from_json(fields[PARTITION_KEY], source=source)
        else:
            missing.append(name)
    if missing or not maps:
        raise IncompleteCheckpointError(
            f"{source}: the optimizer partitions {missing[:5]} record no partition map, so they cannot be cut for "
            "another world size. Resume at the world size that saved them.")
    return maps


def reshard_partitions(current: Mapping[str, Any], document: Mapping[str, Any], reader: Any, *,
                       source: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Cut this rank's flat optimizer partitions (``current``, a ``ShardedOptimizerState.sharded_state_dict()`` at
    the new world size) out of the saved ones (any world size; ``reader`` a ``PieceReader`` over their section).

    Returns:
        `tuple`: the filled tensors, named as ``flatten_optimizer_state`` names ``current``'s, and ``document`` with
        the current partitions' names (a partition's non-partitioned state, e.g. Adam's ``step``, is that of the saved
        partition holding its first parameter; padding keeps the live values).

    Raises:
        IncompleteCheckpointError: the saved partitions record no partition map.
        CheckpointMismatchError: the saved partitions do not cover every parameter this rank needs, or the param
            groups differ.
    """
    saved = saved_partition_maps(document, source=source)
    holder = {entry[0]: name for name, partition_map in saved.items() for entry in partition_map.params}
    stored = {name: fields for name, fields in document["non_tensor_state"].items()}
    filled: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, fields in current["state"].items():
        partition_map = PartitionMap.from_json(fields[PARTITION_KEY], source=f"{name} (live)")
        flat = next(value for value in fields.values() if hasattr(value, "to_local"))
        # this rank's place in the partition's group: where its piece starts in the global flat tensor
        wanted = partition_map.segments(local_box(flat).offset[0] // max(partition_map.size, 1))
        if not wanted:
            raise CheckpointMismatchError(f"{source}: the live partition {name!r} holds no parameter.")
        origin = holder.get(wanted[0].fqn)
        if origin is None:
            raise CheckpointMismatchError(f"{source}: no saved optimizer partition holds {wanted[0].fqn!r}.")
        for key, value in fields.items():
            if hasattr(value, "to_local"):  # a partition: cut from every saved rank's pieces
                out = value.to_local().detach().clone()
                filled[f"{OPTIMIZER_STATE_PREFIX}{name}/{key}"] = read_partitioned(reader, saved, key, wanted, out,
                                                                                   source=source)
            elif torch.is_tensor(value):  # e.g. Adam's step, stored whole
                filled[f"{OPTIMIZER_STATE_PREFIX}{name}/{key}"] = reader.read_full(
                    f"{OPTIMIZER_STATE_PREFIX}{origin}/{key}")
        scalars[name] = {**{k: v for k, v in stored[origin].items() if k != PARTITION_KEY},
                         PARTITION_KEY: fields[PARTITION_KEY]}
    if len(document["param_groups"]) != len(current["param_groups"]):
        raise CheckpointMismatchError(f"{source}: {len(document['param_groups'])} param group(s) saved, the optimizer "
                                      f"has {len(current['param_groups'])}; build it with the same groups.")
    groups = [{**saved_group, "params": list(group["params"])}
              for saved_group, group in zip(document["param_groups"], current["param_groups"])]
    return filled, {**document, "param_groups": groups, "non_tensor_state": scalars}


def read_master_weights(opened: Any) -> dict[str, torch.Tensor]:
    """``{fqn: flattened fp32 master weights}`` of every parameter a DeepSpeed ZeRO checkpoint's optimizer partitions
    hold, assembled in one process from every saving rank's pieces.

    Args:
        opened (`OpenedCheckpoint`): from :func:`~hf_resumable.checkpoint.open_checkpoint`.

    Raises:
        IncompleteCheckpointError: the checkpoint holds no ZeRO optimizer partitions (not a DeepSpeed ZeRO checkpoint,
            or saved without the optimizer), or they record no partition map.
    """
    from ._piece_reader import parse_layout

    reader, source = opened._reader, str(opened.path / LAYOUT_FILE)
    layout = parse_layout(reader.json(LAYOUT_FILE), source=source) if LAYOUT_FILE in opened.manifest.files else {}
    document = layout.get(LAYOUT_KEY_OPTIMIZER_DOC) or {}
    if layout.get(LAYOUT_KEY_OPTIMIZER) is None or not str(document.get("class", "")).startswith(ENGINE_CLASS_PREFIX):
        raise IncompleteCheckpointError(
            f"{opened.path} holds no DeepSpeed ZeRO optimizer partitions, so no fp32 master weights: only checkpoints "
            "of ZeRO-1/2/3 runs saved with their optimizer have them. Export the model's weights instead.")
    masters = MasterWeights(reader, layout, source=source)
    try:
        return {fqn: masters.read(fqn, Box((0,), (numel,)), (numel,), torch.float32)
                for partition_map in masters.maps.values() for fqn, numel, _, _ in partition_map.params}
    finally:
        masters.close()


class MasterWeights:
    """Reads the elements of weights a layout gives by their fp32 master weights (``"master"``, ZeRO-3): the
    parameter's elements in the optimizer's flat ``fp32`` partitions, saved at any world size, cast to the weight's
    dtype. ``reader``: the opened checkpoint's (its files read verified); closed by the ``PieceReader`` it is given to.

    Raises:
        IncompleteCheckpointError: the layout holds no ZeRO optimizer partitions with maps to read them from.
    """

    def __init__(self, reader: Any, layout: Mapping[str, Any], *, source: str) -> None:
        from ._piece_reader import PieceReader, read_section

        if layout.get(LAYOUT_KEY_OPTIMIZER) is None or layout.get(LAYOUT_KEY_OPTIMIZER_DOC) is None:
            raise IncompleteCheckpointError(f"{source}: weights are given by fp32 master weights, but no optimizer "
                                            "partitions were saved; the checkpoint is incomplete.")
        section = read_section(reader, layout, LAYOUT_KEY_OPTIMIZER)
        self.maps = saved_partition_maps(layout[LAYOUT_KEY_OPTIMIZER_DOC], source=source)
        self._reader = PieceReader(reader, section, source=source)
        self._source = source

    def read(self, fqn: str, box: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Elements ``box`` of a weight of global ``shape`` (ZeRO-3: flattened) from the master weights of the
        parameter ``fqn``, cast to ``dtype``."""
        if len(shape) == 1:  # the wanted elements only
            (start,), (length,) = box.offset, box.shape
            out = torch.empty(length, dtype=torch.float32)
            read_partitioned(self._reader, self.maps, MASTER_KEY, [Segment(fqn, start, length, 0)], out,
                             source=self._source)
            return out.to(dtype)
        numel = math.prod(shape)
        whole = read_partitioned(self._reader, self.maps, MASTER_KEY, [Segment(fqn, 0, numel, 0)],
                                 torch.empty(numel, dtype=torch.float32), source=self._source).view(shape)
        return whole[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape))].to(dtype)

    def close(self) -> None:
        self._reader.__exit__(None, None, None)
