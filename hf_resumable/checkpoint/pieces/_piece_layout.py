"""Per-rank pieces: what each rank writes (its boxes of every tensor, or the whole plain tensors it is given), and
the layout (``sharded_layout.json``: every tensor's dtype, global shape and which file holds which box) built from
every rank's JSON report. The planners here are pure. See docs/format.md#a-checkpoint-of-per-rank-pieces.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...constants import (  # noqa: F401 - re-exported for the piece modules
    LAYOUT_FILE,
    LAYOUT_KEY_MODEL,
    LAYOUT_KEY_OPTIMIZER,
    LAYOUT_KEY_OPTIMIZER_DOC,
    LAYOUT_KEY_VERSION,
    LAYOUT_KEY_WORLD_SIZE,
    LAYOUT_VERSION,
    PIECE_FILE_PATTERN,
    PIECES_METADATA_KEY,
    SHARDED_DIR,
)
from ...errors import CheckpointMismatchError, CorruptCheckpointError, UnsupportedStateError
from ...format.safetensors_io import DTYPE_TO_STR
from ...format.sharding import ShardPlan
from .._types import Box, TensorFile, intersect_boxes
from ..state._model_files import plan_model_files
from ._dtensor import is_dtensor, local_box, local_tensor, piece_plan, writes_piece
from ._frozen import fingerprint
from ._placements import REPORT_COPIES

logger = logging.getLogger(__name__)

SECTION_TENSORS = "tensors"  # {name: {"dtype": "F32", "shape": [global shape]}}
SECTION_PIECES = "pieces"  # {file: {name: {"offset": [...], "shape": [...]}}}
SECTION_TIED = "tied"  # {dropped alias: kept name} (model only)
TENSOR_VIEW = "view"  # in a tensor's description: its own shape, when stored flattened (ZeRO-3's partitions)
# In a weight's description: the parameter whose fp32 master weights (the optimizer's flat "fp32" partitions,
# placed by their partition maps) give, cast to the weight's dtype, every element no piece stores (DeepSpeed ZeRO:
# weights equal to their masters cast are not written; layout version 2).
TENSOR_MASTER = "master"
LAYOUT_VERSION_MASTERS = 2  # the layout version a section with TENSOR_MASTER descriptions needs to be read

__all__ = ["LAYOUT_FILE", "LocalState", "plan_region_reads", "check_storable", "pieces_to_stage",
           "collect_local_state", "section_from_reports", "stamp_layout_version", "TENSOR_MASTER",
           "layout_document", "piece_file", "plan_hf_weights", "plain_sizes", "check_coverage", "copy_fingerprints"]


@dataclass(frozen=True)
class RegionRead:
    """Copy ``source`` (relative to the stored piece) of ``file`` into ``target`` (relative to the wanted box)."""

    file: str
    source: tuple[slice, ...]
    target: tuple[slice, ...]


def plan_region_reads(wanted: Box, pieces: Mapping[str, Box], *, name: str, source: str,
                      partial: bool = False) -> list[RegionRead]:
    """The slice reads that assemble ``wanted`` from stored ``pieces`` (file -> box); pure. Pieces never overlap, so
    ``wanted`` is covered exactly when the intersections add up to its size; with ``partial`` (a weight its master
    weights complete, ``TENSOR_MASTER``), the reads of whatever the pieces cover.

    Raises:
        CorruptCheckpointError: if the stored pieces do not cover ``wanted``.

    Example:

    ```python
    >>> reads = plan_region_reads(Box((1,), (2,)), {"a": Box((0,), (2,)), "b": Box((2,), (2,))}, name="w", source="x")
    >>> [(r.file, r.source, r.target) for r in reads]
    [('a', (slice(1, 2, None),), (slice(0, 1, None),)), ('b', (slice(0, 1, None),), (slice(1, 2, None),))]
    ```
    """
    reads, covered = [], 0
    for file, piece in pieces.items():
        overlap = intersect_boxes(piece, wanted)
        if overlap is None:
            continue
        reads.append(RegionRead(file, overlap.slices(piece), overlap.slices(wanted)))
        covered += overlap.numel
    if covered != wanted.numel and not partial:
        raise CorruptCheckpointError(
            f"{source}: the stored pieces of {name!r} cover {covered} of the {wanted.numel} elements of the box "
            f"at offset {list(wanted.offset)} with shape {list(wanted.shape)}. The layout is corrupt or pieces are "
            "missing; load an earlier checkpoint."
        )
    return reads


def plain_sizes(state: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, int]:
    """The size in bytes of each plain (not DTensor) tensor of ``state`` that is not a tied alias: what
    ``plan_replica_writers`` splits over the ranks (every rank holds the same ones, so every rank plans alike; under
    ZeRO-1/2 that is the whole model). :func:`check_coverage` refuses a layout in which the ranks disagreed.

    Example:

    ```python
    >>> plain_sizes({"a": torch.zeros(4), "b": torch.zeros(3, dtype=torch.float16), "c": torch.zeros(2)}, {"c": "a"})
    {'a': 16, 'b': 6}
    ```
    """
    return {name: tensor.numel() * tensor.element_size() for name, tensor in state.items()
            if name not in tied and not is_dtensor(tensor)}


@dataclass
class LocalState:
    """What one rank contributes for one kind of state (model or optimizer).

    Args:
        tensors (`dict[str, dict]`): every tensor's global ``dtype`` and ``shape`` (the same on every rank).
        pieces (`list[tuple[str, torch.Tensor, Box]]`): this rank's pieces to write.
        tied (`dict[str, str]`): aliases left out because they share a tensor with a kept name.
    """

    tensors: dict[str, dict[str, Any]]
    pieces: list[tuple[str, torch.Tensor, Box]]
    tied: dict[str, str]


def local_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every entry's local piece (detached), taken once for ``find_aliases`` and :func:`pieces_to_stage`."""
    return {name: local_tensor(tensor) for name, tensor in state.items()}


def check_storable(state: Mapping[str, torch.Tensor]) -> None:
    """Refuse what no piece file can hold, before anything is staged or written.

    Raises:
        UnsupportedStateError: for a dtype safetensors cannot store, or a ``Partial`` DTensor.
    """
    for name, tensor in state.items():
        if tensor.dtype not in DTYPE_TO_STR:
            raise UnsupportedStateError(f"{name!r}: dtype {tensor.dtype} cannot be stored in safetensors.")
        if is_dtensor(tensor):
            local_box(tensor, name=name)  # raises for Partial placements and pieces that are not boxes


def pieces_to_stage(state: Mapping[str, torch.Tensor], tied: Mapping[str, str], *, rank: int,
                    local: Mapping[str, torch.Tensor] | None = None,
                    owners: Mapping[str, int] | None = None,
                    omit: Collection[str] = ()) -> list[tuple[str, torch.Tensor]]:
    """``(name, local piece)`` of every piece :func:`collect_local_state` will write for this rank: what an async
    save copies on the training loop's time. ``local``: the :func:`local_tensors` of ``state``, if already taken."""
    local = local if local is not None else local_tensors(state)
    owners = owners or {}
    return [(name, local[name]) for name, tensor in state.items()
            if name not in tied and name not in omit and local[name].numel()
            and writes_piece(name, tensor, rank, owners.get(name, 0))]


def collect_local_state(state: Mapping[str, torch.Tensor], *, rank: int, tied: Mapping[str, str],
                        staged: Mapping[str, torch.Tensor] | None = None,
                        owners: Mapping[str, int] | None = None, omit: Collection[str] = ()) -> LocalState:
    """This rank's pieces of ``state`` (``tied`` aliases left out) and every tensor's global description.
    ``owners``: the rank that writes each plain tensor (rank 0 where unlisted); ``omit``: tensors described whose
    piece this rank does not write (weights the master weights give). ``staged`` (an async save's copies of
    :func:`pieces_to_stage`) replaces the live pieces, so that only metadata is read from ``state`` and this may run
    off the training thread.

    Raises:
        UnsupportedStateError: for an unsupported dtype or placement.
        CheckpointMismatchError: if a DTensor's local tensor does not have the shape its placement implies.
    """
    tensors: dict[str, dict[str, Any]] = {}
    pieces: list[tuple[str, torch.Tensor, Box]] = []
    owners = owners or {}
    for name, tensor in state.items():
        if name in tied:
            continue
        if tensor.dtype not in DTYPE_TO_STR:
            raise UnsupportedStateError(f"{name!r}: dtype {tensor.dtype} cannot be stored in safetensors.")
        tensors[name] = {"dtype": DTYPE_TO_STR[tensor.dtype], "shape": list(tensor.shape)}
        box = local_box(tensor, name=name)
        local = local_tensor(tensor)  # with ``staged``, only its shape is read
        if tuple(local.shape) != box.shape:
            raise CheckpointMismatchError(
                f"{name!r}: the local tensor has shape {list(local.shape)} but its placement implies "
                f"{list(box.shape)}; this sharding cannot be saved as pieces."
            )
        if box.numel and name not in omit and writes_piece(name, tensor, rank, owners.get(name, 0)):
            if staged is not None:
                if name not in staged:  # never read a live tensor off the training thread
                    raise RuntimeError(f"{name!r}: its piece was not staged; this is a bug in hf_resumable.")
                local = staged[name]
            pieces.append((name, local, box))
    return LocalState(tensors, pieces, dict(tied))


def piece_file(kind: str, rank: int, world_size: int) -> str:
    """Relative path of rank ``rank``'s piece file for ``kind`` (``"model"`` or ``"optimizer"``)."""
    return f"{SHARDED_DIR}/{PIECE_FILE_PATTERN.format(kind=kind, rank=rank, world_size=world_size)}"


def piece_tensor_file(relpath: str, local: LocalState) -> TensorFile | None:
    """The safetensors file of this rank's pieces (self-describing: boxes in the header metadata), if any."""
    if not local.pieces:
        return None
    described = {name: {**box.to_json(), "global_shape": local.tensors[name]["shape"]}
                 for name, _, box in local.pieces}
    metadata = {"format": "pt", PIECES_METADATA_KEY: json.dumps(described, sort_keys=True)}
    return TensorFile(relpath, [(name, tensor) for name, tensor, _ in local.pieces], metadata)


def layout_document(*, world_size: int, model: Mapping[str, Any] | None, optimizer: Mapping[str, Any] | None,
                    optimizer_document: Mapping[str, Any] | None) -> dict[str, Any]:
    """``sharded_layout.json``'s document at this format's version: the world size it was saved at, the model's and
    the optimizer's sections (:func:`section_from_reports`) and the optimizer's JSON document."""
    return {LAYOUT_KEY_VERSION: LAYOUT_VERSION, LAYOUT_KEY_WORLD_SIZE: world_size, LAYOUT_KEY_MODEL: model,
            LAYOUT_KEY_OPTIMIZER: optimizer, LAYOUT_KEY_OPTIMIZER_DOC: optimizer_document}


def stamp_layout_version(layout: dict[str, Any]) -> dict[str, Any]:
    """``layout`` with the lowest version that reads it: :data:`LAYOUT_VERSION_MASTERS` once a model weight is
    given by its master weights (readers that do not know it refuse the layout instead of reading a gap)."""
    model = layout.get(LAYOUT_KEY_MODEL) or {}
    if any(TENSOR_MASTER in described for described in (model.get(SECTION_TENSORS) or {}).values()):
        layout[LAYOUT_KEY_VERSION] = max(layout[LAYOUT_KEY_VERSION], LAYOUT_VERSION_MASTERS)
    return layout


def section_from_reports(tensors: Mapping[str, Mapping[str, Any]], reports: list[Mapping[str, Any]]
                         ) -> dict[str, Any]:
    """The layout section of one kind of state from every rank's :func:`piece_report` (``tensors``: one rank's
    descriptions): the ranks' ties united, every tensor but the aliases described, every rank's pieces. Pure.

    Example:

    ```python
    >>> section = section_from_reports(
    ...     {"w": {"dtype": "F32", "shape": [2]}, "v": {"dtype": "F32", "shape": [2]}},
    ...     [{"file": "a", "pieces": {"w": {"offset": [0], "shape": [2]}}, "tied": {"v": "w"}},
    ...      {"file": None, "pieces": {}, "tied": {}}])
    >>> section["tensors"], section["tied"]
    ({'w': {'dtype': 'F32', 'shape': [2]}}, {'v': 'w'})
    ```
    """
    tied = {alias: kept for report in reports for alias, kept in report["tied"].items()}
    return {SECTION_TENSORS: {name: dict(d) for name, d in tensors.items() if name not in tied},
            SECTION_PIECES: {r["file"]: r["pieces"] for r in reports if r["file"] is not None},
            SECTION_TIED: tied}


def check_coverage(section: Mapping[str, Any], *, source: str) -> None:
    """Refuse a layout section in which a tensor's pieces do not cover it exactly once (pure): the ranks disagreed
    on who writes what (plain tensors that differ between ranks, or mesh copies counted differently).

    Raises:
        CheckpointMismatchError: naming the tensors (the save commits nothing).

    Example:

    ```python
    >>> check_coverage({"tensors": {"w": {"dtype": "F32", "shape": [2]}},
    ...                 "pieces": {"a": {"w": {"offset": [0], "shape": [2]}}}}, source="x")
    ```
    """
    covered: dict[str, int] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    repeated: set[str] = set()
    for boxes in section[SECTION_PIECES].values():
        for name, box in boxes.items():
            covered[name] = covered.get(name, 0) + math.prod(box["shape"])
            key = (name, tuple(box["offset"]))
            if key in seen:  # two writers of one piece
                repeated.add(name)
            seen.add(key)
    # a weight its master weights give (TENSOR_MASTER) may lack the pieces of the ranks that derived it
    wrong = [name for name, described in section[SECTION_TENSORS].items()
             if covered.get(name, 0) != math.prod(described["shape"])
             and not (TENSOR_MASTER in described and covered.get(name, 0) < math.prod(described["shape"]))]
    wrong += sorted(repeated - set(wrong))
    if wrong:
        raise CheckpointMismatchError(
            f"{source}: the ranks' pieces of {len(wrong)} tensor(s) do not cover them exactly once ({wrong[:5]}): "
            "the ranks disagree on who writes what, e.g. plain tensors that differ between ranks. Nothing was "
            "committed. Make every rank hold the same unsharded tensors, or save with "
            "HF_RESUMABLE_SPLIT_REPLICAS=0 (rank 0 writes them).")


def piece_report(relpath: str, local: LocalState, copies: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This rank's contribution to the layout (JSON): its piece file, the boxes in it, the aliases it left out, and
    the fingerprints of the pieces it holds in several copies of a mesh (:func:`copy_fingerprints`)."""
    report = {"file": None, "pieces": {}, "tied": dict(local.tied), REPORT_COPIES: dict(copies or {})}
    if local.pieces:
        report.update(file=relpath, pieces={name: box.to_json() for name, _, box in local.pieces})
    return report


def copy_fingerprints(state: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """``{name: {"offset": [...], "sample": fingerprint}}`` of every DTensor piece this rank holds in several copies
    of a sub-mesh (e.g. sharded over ``dp_shard``, replicated over ``tp``): one copy writes it, so a save checks that
    the copies agree (``check_copies_agree``). Taken on the training loop's time, when the state is the one saved."""
    prints = {}
    for name, tensor in state.items():
        if name in tied or not is_dtensor(tensor):
            continue
        plan = piece_plan(tensor, name)
        if plan.copies > 1 and math.prod(plan.shape):
            prints[name] = {"offset": list(plan.offset),
                            "sample": fingerprint(local_tensor(tensor).contiguous(), full=False).sample}
    return prints


def plan_hf_weights(sizes: Mapping[str, int], *, world_size: int, max_shard_size: int | str
                    ) -> tuple[ShardPlan, dict[str, int]]:
    """HF weight files for whole weights (one ``model.safetensors`` when they fit in one shard), and which rank
    writes each (round robin): pure, the same on every rank.

    Example:

    ```python
    >>> plan, owner = plan_hf_weights({"a": 600, "b": 600, "c": 100}, world_size=2, max_shard_size=1000)
    >>> owner
    {'model-00001-of-00002.safetensors': 0, 'model-00002-of-00002.safetensors': 1}
    ```
    """
    plan = plan_model_files(sizes, max_shard_size=max_shard_size)
    return plan, {filename: i % world_size for i, filename in enumerate(plan.filenames)}


def whole_tensor_section(files: Mapping[str, Collection[str]], described: Mapping[str, Mapping[str, Any]],
                         tied: Mapping[str, str]) -> dict[str, Any]:
    """Layout section for the ``described`` tensors stored whole (``files``: each file's tensor names, HF shards):
    each tensor is one piece, its whole box."""
    pieces: dict[str, dict[str, Any]] = {}
    for filename, names in files.items():
        pieces[filename] = {n: Box.whole(described[n]["shape"]).to_json() for n in names}
    return {SECTION_TENSORS: dict(described), SECTION_PIECES: pieces, SECTION_TIED: dict(tied)}
