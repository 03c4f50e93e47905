"""The piece half of ``save_checkpoint`` (:func:`saves_pieces` is the one rule for its layout) and the model and
optimizer part of every ``OpenedCheckpoint.load_into``: a rank's pieces captured and planned inside the commit, read
back at any world size (each rank only the slices it needs, every byte checked; a regular checkpoint's files are
whole pieces). The files are in docs/format.md#a-checkpoint-of-per-rank-pieces;
nothing is pickled (coordination is JSON). See docs/architecture.md#loading for the steps of a load.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ..._tuning import Prefault
from ...constants import (
    FROZEN_RECORD_FILE,
    MODEL_INDEX_FILE,
    OPTIMIZER_INDEX_FILE,
    OPTIMIZER_STATE_PREFIX,
    SINGLE_MODEL_FILE,
    STATE_KEY_OPTIMIZER,
    TRAINING_STATE_FILE,
)
from ...distributed import agreed_reads, all_gather_json, checkpoint_group, is_distributed
from ...errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError
from ...format._jsonio import json_bytes
from ...format.sharding import build_index
from .._types import IndexSpec, Payload, TensorFile
from ..background._step_gate import gated_optimizer, step_gate
from ..commit._replicas import plan_replica_writers, split_replicas
from ..state._model import TIED_KEY, find_aliases, load_state_dict_reason, load_through_state_dict
from ..state._model_files import single_file_metadata
from ..state._optimizer import (
    OptimizerLoadPlan,
    apply_optimizer_state,
    decode_optimizer_state,
    flatten_optimizer_state,
    parameter_names,
    plan_optimizer_load,
)
from ..state._validate import check_optimizer_document, check_step_value
from ._dtensor import is_dtensor
from ._frozen import FrozenRecord, base_not_stored, check_frozen_base, forget_fingerprints, split_frozen_sharded
from ._partitioned import (
    MasterWeights,
    is_partitioned,
    load_partitioned_state,
    master_weight_names,
    omitted_weights,
    partitioned_state,
    partitioned_views,
    reshard_partitions,
    state_parameters,
)
from ._piece_layout import (
    LAYOUT_FILE,
    LAYOUT_KEY_MODEL,
    LAYOUT_KEY_OPTIMIZER,
    LAYOUT_KEY_OPTIMIZER_DOC,
    SECTION_PIECES,
    TENSOR_MASTER,
    TENSOR_VIEW,
    LocalState,
    check_coverage,
    check_storable,
    collect_local_state,
    copy_fingerprints,
    layout_document,
    local_tensors,
    piece_file,
    piece_report,
    piece_tensor_file,
    pieces_to_stage,
    plain_sizes,
    plan_hf_weights,
    section_from_reports,
    stamp_layout_version,
    whole_tensor_section,
)
from ._piece_reader import (
    PieceReader,
    Section,
    check_fits,
    fill_state,
    layout_from_regular,
    parse_layout,
    read_section,
)
from ._placements import check_copies_agree
from ._sharded_tensors import as_dtensors, into_sharded_tensors, optimizer_as_dtensors, optimizer_into_sharded_tensors

if TYPE_CHECKING:  # the reader fills objects through this module (load_pieces_into)
    from .._reader import OpenedCheckpoint, _Reader

logger = logging.getLogger(__name__)

LAYOUTS = ("auto", "hf", "pieces")  # save_checkpoint(layout=...): see saves_pieces

__all__ = ["ShardedOptimizerState", "capture_pieces", "load_pieces_into", "read_layout", "saves_pieces",
           "section_reader"]


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def _device(model: torch.nn.Module) -> torch.device:
    return next(iter(model.parameters()), torch.empty(0)).device


def _model_state(model: torch.nn.Module, originals: dict[str, Any] | None = None, *,
                 partitioned: bool | None = None, parameters: Mapping[str, Any] | None = None
                 ) -> dict[str, torch.Tensor]:
    """FQN-keyed weights as this rank holds them: DTensor pieces (FSDP2; FSDP1's ``ShardedTensor`` re-wrapped, the
    originals kept in ``originals``), ZeRO-3's partitions as pieces, plain tensors otherwise. ``partitioned``:
    :func:`is_partitioned` of ``model``, if known."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options())
    if is_partitioned(model) if partitioned is None else partitioned:
        return partitioned_state(model, state, parameters=parameters)
    return as_dtensors(state, device=_device(model), originals=originals)


@runtime_checkable
class ShardedOptimizerState(Protocol):
    """An optimizer whose state an engine already splits across ranks (DeepSpeed ZeRO's flat partitions), passed as
    ``optimizer=`` instead of the torch optimizer. ``sharded_state_dict()`` returns ``{"state": {name: {key: DTensor
    piece or value}}, "param_groups": [...]}`` (groups list names), saved as FSDP2 optimizer state; ``init_state()``
    creates state to load into; ``load_sharded_state_dict(state)`` installs it. ``checkpoint_class`` is recorded
    (and checked on load) as the optimizer's class.

    Example:

    ```python
    >>> from hf_resumable.integrations._deepspeed import checkpoint_optimizer
    >>> zero = checkpoint_optimizer(engine.optimizer)  # a ZeRO-1/2 engine's optimizer  # doctest: +SKIP
    >>> isinstance(zero, ShardedOptimizerState)  # doctest: +SKIP
    True
    >>> save_checkpoint("out/checkpoint-10", model=engine.module, optimizer=zero, step=10)  # doctest: +SKIP
    ```
    """

    checkpoint_class: str
    param_groups: list[dict[str, Any]]
    state: Any

    def sharded_state_dict(self) -> dict[str, Any]: ...

    def init_state(self) -> None: ...

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None: ...


def _class_name(optimizer: Any) -> str:
    """The optimizer class a checkpoint records."""
    if isinstance(optimizer, ShardedOptimizerState):
        return optimizer.checkpoint_class
    return type(optimizer).__qualname__


def engine_pieces(model: Any, optimizer: Any = None) -> bool:
    """Whether an engine splits ``model`` or ``optimizer`` across ranks: DTensor parameters, FSDP1 wrappers, ZeRO-3
    partitions, or a :class:`ShardedOptimizerState` (ZeRO-1/2)."""
    if isinstance(optimizer, ShardedOptimizerState):
        return True
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return (is_partitioned(model) or any(is_dtensor(p) for p in model.parameters())
            or any(isinstance(module, FullyShardedDataParallel) for module in model.modules()))


def saves_pieces(model: Any, optimizer: Any, layout: str) -> bool:
    """The one rule for a save's layout: per-rank pieces when ``layout="pieces"`` or an engine splits the model or
    optimizer (with ``layout="hf"`` its weights are then gathered into HF files), else whole tensors in the HF layout.

    Raises:
        ValueError: ``layout`` is not one of ``"auto"``, ``"hf"``, ``"pieces"``, or ``"pieces"`` for a state dict.

    Example:

    ```python
    >>> import torch
    >>> saves_pieces(torch.nn.Linear(2, 2), None, "auto"), saves_pieces(torch.nn.Linear(2, 2), None, "pieces")
    (False, True)
    ```
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}.")
    if layout == "pieces" and not isinstance(model, torch.nn.Module):
        raise ValueError("layout='pieces' needs model= to be a torch.nn.Module (a state dict is stored whole, in the "
                         "HF layout); pass the module, or layout='auto'.")
    return layout == "pieces" or engine_pieces(model, optimizer)


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FQN-keyed optimizer state, without side effects on an optimizer that has not stepped yet
    (``get_optimizer_state_dict`` initializes one with a zero-lr step, which would start AdamW's step count at 1)."""
    if isinstance(optimizer, ShardedOptimizerState):
        return optimizer.sharded_state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    state = get_optimizer_state_dict(model, optimizer, options=_options())
    if fresh and optimizer.state:
        optimizer.state.clear()
        state = {"state": {}, "param_groups": state["param_groups"]}
    return optimizer_as_dtensors(state, device=_device(model))  # FSDP1: its ShardedTensors as DTensor pieces


def _add_hf_weights(payload: Payload, weights: Mapping[str, torch.Tensor], local: LocalState, *, rank: int,
                    world_size: int, max_shard_size: int | str) -> dict[str, Any]:
    """Add the HF shard files this rank owns (whole tensors, gathered) and, on rank 0, their index."""
    sizes = {name: weights[name].numel() * weights[name].element_size() for name in local.tensors}
    plan, owner = plan_hf_weights(sizes, world_size=world_size, max_shard_size=max_shard_size)
    files, mine = plan.name_to_filename, {}
    for name, tensor in weights.items():  # in the same order on every rank: full_tensor() is a collective
        if name in files:
            full = tensor.full_tensor() if is_dtensor(tensor) else tensor
            if owner[files[name]] == rank:
                mine.setdefault(files[name], []).append((name, full.detach()))
    single = plan.filenames == [SINGLE_MODEL_FILE]  # one model.safetensors (tied record in its header), no index
    for filename in plan.filenames:
        if filename in mine:
            metadata = single_file_metadata(local.tied) if single else {"format": "pt"}
            payload.tensor_files.append(TensorFile(filename, mine[filename], metadata))
    if rank == 0 and not single:
        index = build_index(plan, metadata={TIED_KEY: local.tied, "format": "pt"})  # written with every shard's record
        payload.indexes.append(IndexSpec(MODEL_INDEX_FILE, index["weight_map"], index["metadata"]))
    return whole_tensor_section(plan.filename_to_names, local.tensors, local.tied)


@dataclass
class _Pieces:
    """This rank's share of a save in pieces: captured on the training loop's time (:func:`capture_pieces`), planned
    inside the commit (:meth:`prepare`, step 2, on an async save's thread), its layout built from every rank's report
    (:meth:`finalize`, the same bytes on every rank). An async save decides ``omitted`` in :meth:`prepare`.
    """

    states: dict[str, tuple[Mapping[str, torch.Tensor], dict[str, str]]]  # kind -> (FQN-keyed state, its aliases)
    staging: dict[str, TensorFile]  # kind -> the local pieces an async save copies (empty for a blocking save)
    layout: dict[str, Any]  # the layout's fixed entries (the hf_weights model section, the optimizer document)
    rank: int
    world_size: int
    views: dict[str, list[int]] = field(default_factory=dict)  # ZeRO-3: each weight's own shape (stored flattened)
    masters: dict[str, str] = field(default_factory=dict)  # ZeRO: weight -> the parameter whose masters give it
    omitted: set[str] = field(default_factory=set)  # ZeRO: weights whose pieces this rank does not write
    deferred: Any = None  # ZeRO, async: the optimizer whose masters prepare() checks, its steps held meanwhile
    live: dict[str, torch.Tensor] = field(default_factory=dict)  # ...and the local weights, copied if they differ
    release: Any = None  # opens the held steps (idempotent)
    owners: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> {plain tensor: the rank writing it}
    described: dict[str, dict[str, Any]] = field(default_factory=dict)
    copies: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> copy_fingerprints of its state

    def _check_deferred(self) -> dict[str, torch.Tensor]:
        """An async save's check of the weights against their masters, on the saver's thread while the optimizer's
        steps wait: the weights not given by the masters are copied now (live until the steps resume)."""
        try:
            self.omitted = omitted_weights(self.masters, self.deferred, group=checkpoint_group())
            return {name: tensor.clone() for name, tensor in self.live.items() if name not in self.omitted}
        finally:
            self.release()

    def prepare(self, payload: Payload) -> dict[str, Any]:
        """Add this rank's piece files to ``payload``; return its report (JSON: files, boxes, aliases)."""
        reports = {}
        late = self._check_deferred() if self.deferred is not None else {}
        for kind, (state, tied) in self.states.items():
            relpath = piece_file(kind, self.rank, self.world_size)
            staged = dict(self.staging[kind].tensors) if kind in self.staging else None
            if staged is not None and kind == LAYOUT_KEY_MODEL:
                staged.update(late)
            model = kind == LAYOUT_KEY_MODEL
            local = collect_local_state(state, rank=self.rank, tied=tied, staged=staged,
                                        owners=self.owners.get(kind), omit=self.omitted if model else ())
            if model:
                for key, values in ((TENSOR_VIEW, self.views), (TENSOR_MASTER, self.masters)):
                    for name, value in values.items():
                        if name in local.tensors:
                            local.tensors[name][key] = value
            tensor_file = piece_tensor_file(relpath, local)
            if tensor_file is not None:
                payload.tensor_files.append(tensor_file)
            self.described[kind] = local.tensors
            reports[kind] = piece_report(relpath, local, self.copies.get(kind))
        return reports

    def finalize(self, reports: list[Mapping[str, Any]]) -> dict[str, bytes]:
        """``sharded_layout.json`` from every rank's report (pure: the same bytes on every rank)."""
        layout = layout_document(world_size=self.world_size, model=self.layout.get(LAYOUT_KEY_MODEL), optimizer=None,
                                 optimizer_document=self.layout.get(LAYOUT_KEY_OPTIMIZER_DOC))
        for kind in self.states:
            check_copies_agree([report[kind] for report in reports], source=f"{LAYOUT_FILE} ({kind})")
            layout[kind] = section_from_reports(self.described[kind], [report[kind] for report in reports])
            check_coverage(layout[kind], source=f"{LAYOUT_FILE} ({kind})")
        # Compact: the layout names every piece of every rank, and the C encoder (no indent) is fast.
        return {LAYOUT_FILE: json_bytes(stamp_layout_version(layout), indent=None)}


@torch.no_grad()  # the weights come with keep_vars (live parameters): the gathers of hf_weights record no graph
def capture_pieces(payload: Payload, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    rank: int, world_size: int, hf_weights: bool, max_shard_size: int | str, standalone: bool,
                    stage: bool) -> _Pieces:
    """What must happen on the training loop's time: the state-dict walks, the checks that raise now, the
    collectives (the frozen record's gather; ``hf_weights``' gathers) and, with ``stage``, the pieces to copy."""
    partitioned = is_partitioned(model)
    parameters = state_parameters(model) if partitioned else None  # ZeRO-3: one walk, shared by the steps below
    weights = _model_state(model, partitioned=partitioned, parameters=parameters)
    states: dict[str, tuple[Mapping[str, torch.Tensor], dict[str, str]]] = {}
    layout: dict[str, Any] = {}
    local = local_tensors(weights)
    # This rank's view: a rank whose piece is empty cannot see a tie (it writes nothing for it); the layout unites
    # every rank's.
    tied = find_aliases(local)
    if hf_weights:
        # The HF files and their index name every alias: every rank must know every tie (one gather).
        tied = {alias: kept for report in all_gather_json(tied) for alias, kept in report.items()}
        described = collect_local_state(weights, rank=rank, tied=tied)
        layout[LAYOUT_KEY_MODEL] = _add_hf_weights(payload, weights, described, rank=rank, world_size=world_size,
                                                   max_shard_size=max_shard_size)
    else:
        if not standalone:  # frozen parameters are recorded, not stored (a collective when there are any)
            weights, tied, record = split_frozen_sharded(model, weights, tied, rank=rank)
            if record is not None:
                payload.blobs[FROZEN_RECORD_FILE] = record
        check_storable(weights)
        states[LAYOUT_KEY_MODEL] = (weights, tied)
    if optimizer is not None:
        tensors, layout[LAYOUT_KEY_OPTIMIZER_DOC] = flatten_optimizer_state(_optimizer_state(model, optimizer),
                                                                            _class_name(optimizer))
        check_storable(tensors)
        states[LAYOUT_KEY_OPTIMIZER] = (tensors, {})
    masters, omitted, deferred = {}, set(), {}
    if optimizer is not None and LAYOUT_KEY_MODEL in states:  # ZeRO: weights the saved master weights give
        masters = master_weight_names(model, states[LAYOUT_KEY_MODEL][0], optimizer, parameters=parameters)
        held = gated_optimizer(optimizer) if stage else None
        if held is not None and masters:
            # checked on the saver's thread (not staged; copied there if they differ), the next step held meanwhile
            omitted = set(masters)
            deferred = {"deferred": optimizer, "live": {name: local[name] for name in masters},
                        "release": step_gate(held).hold()}
        elif held is None:
            omitted = omitted_weights(masters, optimizer)
    owners = {kind: plan_replica_writers(plain_sizes({name: tensor for name, tensor in state.items()
                                                      if name not in omitted}, tied),
                                         world_size, split=world_size > 1 and split_replicas())
              for kind, (state, tied) in states.items()}
    staging = {}
    if stage:
        staging = {kind: TensorFile(piece_file(kind, rank, world_size), pieces_to_stage(
            state, tied, rank=rank, local=local if kind == LAYOUT_KEY_MODEL else None, owners=owners[kind],
            omit=omitted if kind == LAYOUT_KEY_MODEL else ()))
            for kind, (state, tied) in states.items()}
    views = partitioned_views(model, parameters=parameters) if partitioned else {}
    copies = {kind: copy_fingerprints(state, tied) for kind, (state, tied) in states.items()}
    return _Pieces(states, staging, layout, rank, world_size, views, masters, omitted, owners=owners, copies=copies,
                   **deferred)


def read_layout(opened: OpenedCheckpoint) -> dict[str, Any]:
    """The piece layout, or the one implied by a regular checkpoint's indexes (whole tensors, one writer; a trainable
    part's tensors under the names in its files)."""
    reader = opened._reader
    if LAYOUT_FILE in reader.manifest.files:
        return parse_layout(reader.json(LAYOUT_FILE), source=str(reader.path / LAYOUT_FILE))
    in_file = {state: file for file, state in _renamed(opened).items()}
    tied = {in_file.get(alias, alias): in_file.get(kept, kept) for alias, kept in opened._tied.items()}
    optimizer = reader.index(OPTIMIZER_INDEX_FILE) if OPTIMIZER_INDEX_FILE in reader.manifest.files else None
    return layout_from_regular(opened._model_index, optimizer, reader.report.headers, tied=tied,
                               world_size=reader.manifest.world_size,
                               optimizer_document=opened._document.get(STATE_KEY_OPTIMIZER))


def _renamed(opened: OpenedCheckpoint) -> dict[str, str]:
    """Name in the checkpoint's files -> state-dict name, where a trainable part renamed it (PEFT)."""
    return opened._trainable.renamed if opened._trainable is not None else {}


def section_reader(reader: _Reader, layout: Mapping[str, Any], section: Section) -> PieceReader:
    """A reader of ``section``'s pieces, and of the master weights of its weights described with ``"master"``."""
    source = str(reader.path)
    masters = MasterWeights(reader, layout, source=source) if section.masters else None
    return PieceReader(reader, section, source=source, masters=masters)


def _whole_process(model: Any, optimizer: Any = None) -> bool:
    """One process and plain torch objects: read straight into the live tensors (under torch.distributed every rank
    reads into new tensors first, so that no rank applies what another failed to read; an engine's state dict may be
    a copy)."""
    return not is_distributed() and not engine_pieces(model, optimizer)


def _load_model(opened: OpenedCheckpoint, layout: Mapping[str, Any], model: torch.nn.Module, *, strict: bool) -> None:
    reader, source = opened._reader, str(opened.path)
    if layout.get(LAYOUT_KEY_MODEL) is None:
        raise IncompleteCheckpointError(f"{opened.path}: no model weights were saved; load without model=.")
    section = read_section(reader, layout, LAYOUT_KEY_MODEL)
    in_place = _whole_process(model)
    if in_place:
        reason = load_state_dict_reason(model, model.state_dict(keep_vars=True))
        if reason is not None:  # the model's own load_state_dict decides keys and shapes, as upstream
            _load_through_own(opened, layout, section, model, strict=strict, reason=reason)
            return
    renamed = _renamed(opened)
    originals: dict[str, Any] = {}  # FSDP1: the ShardedTensors its load reads, filled from the pieces
    if in_place and LAYOUT_FILE not in opened.manifest.files:  # the model's own names, as in its HF weight files
        current = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    else:  # torch's names (a wrapper's prefixes removed), as pieces are saved
        current = _model_state(model, originals)
    frozen = _check_frozen(opened, current, strict=strict)
    in_file = {state: file for file, state in renamed.items()}
    current = {in_file.get(name, name): tensor for name, tensor in current.items() if name not in frozen}
    names = check_fits(current, section, strict=strict, source=source, what="model")
    with agreed_reads(source), section_reader(reader, layout, section) as pieces:  # every rank's reads, then apply
        filled = fill_state(current, pieces, names, in_place=in_place)
    if in_place:
        forget_fingerprints(current.values())  # written without a version bump: cached fingerprints are stale
    filled = {renamed.get(name, name): tensor for name, tensor in filled.items()
              if not in_place or tensor is not current[name]}
    if is_partitioned(model):  # ZeRO-3: the pieces go into the partitions; keys were matched above
        buffers = load_partitioned_state(model, filled)
        if buffers:
            model.load_state_dict(buffers, strict=False)  # strict=False: the parameters are loaded already
    elif in_place:
        if filled:  # another dtype, a view: through the model's own load (keys were matched above)
            _set_model_state(model, filled, strict=False)
    else:
        _set_model_state(model, into_sharded_tensors(filled, originals), strict=strict and not frozen)


def _set_model_state(model: torch.nn.Module, state: Mapping[str, Any], *, strict: bool) -> None:
    """torch's ``set_model_state_dict`` (imported here: a plain load in one process rarely needs it)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=strict))


def _load_through_own(opened: OpenedCheckpoint, layout: Mapping[str, Any], section: Section, model: torch.nn.Module,
                      *, strict: bool, reason: str) -> None:
    """Every stored weight read whole, then given to the model's own ``load_state_dict`` (put back if it raises)."""
    targets = model.state_dict(keep_vars=True)
    covered = _check_frozen(opened, targets, strict=strict)  # recorded, not stored: checked, left as they are
    with section_reader(opened._reader, layout, section) as pieces:
        tensors = pieces.read_all()
    renamed = _renamed(opened)
    tied = {renamed.get(alias, alias): renamed.get(kept, kept) for alias, kept in section.tied.items()}
    load_through_state_dict(model, {renamed.get(n, n): t for n, t in tensors.items()}, tied, strict=strict,
                            source=str(opened.path), reason=reason, covered=covered)


def _check_frozen(opened: OpenedCheckpoint, current: Mapping[str, torch.Tensor], *, strict: bool) -> set[str]:
    """The live frozen tensors checked against the checkpoint's record (a trainable part's: whole tensors; a piece
    record's: a collective), if any; returns the names it covers."""
    reader, source = opened._reader, str(opened.path)
    if opened._trainable is not None:
        return check_frozen_base(opened._trainable.record, current, full=reader.report.full, strict=strict,
                                 source=source)
    if FROZEN_RECORD_FILE not in reader.manifest.files:
        return set()
    record = FrozenRecord.from_json(reader.json(FROZEN_RECORD_FILE), source=str(reader.path / FROZEN_RECORD_FILE))
    return check_frozen_base(record, current, full=reader.report.full, strict=strict, source=source, pieces=True)


def _plan_optimizer(opened: OpenedCheckpoint, layout: Mapping[str, Any], model: torch.nn.Module | None,
                    optimizer: torch.optim.Optimizer) -> OptimizerLoadPlan | None:
    """Before anything is written: a torch optimizer whose parameters are named as saved is checked against the
    checkpoint (hyper-parameters, shapes, ``step`` values read by offset) and its state allocated, existing state
    of the final kind reused. ``None``: the engine's own state dict gives the state to fill, after the weights.

    Raises:
        ValueError: ``optimizer`` of an engine without ``model`` (its state is matched by parameter name).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    document = layout[LAYOUT_KEY_OPTIMIZER_DOC]  # present and of this class (_check_optimizer_document)
    if not isinstance(optimizer, ShardedOptimizerState):
        names = parameter_names(model, optimizer)
        saved = {name for group in document["param_groups"] for name in group["params"]}
        # The model's own names: a wrapper that renames (DDP's ``module.``, compile) or FSDP1 takes torch's path.
        if model is None or (set(names) == saved and not any(isinstance(module, FullyShardedDataParallel)
                                                              for module in model.modules())):
            section = read_section(opened._reader, layout, LAYOUT_KEY_OPTIMIZER)
            stored = {name: (section.dtypes[name], section.shapes[name]) for name in section.dtypes}
            plan = plan_optimizer_load(optimizer, names, document, stored, source=_optimizer_source(opened),
                                       in_place=_whole_process(model, optimizer))
            _check_steps(opened, {name: next(iter(section.pieces[name])) for name in plan.steps})
            return plan
    if model is None:
        raise ValueError(f"{opened.path}: loading optimizer state needs model= to match it by parameter name.")
    return None


def _check_steps(opened: OpenedCheckpoint, steps: Mapping[str, str]) -> None:
    """The optimizer's step counts (name -> its file), read by offset: a negative or non-integral step would only fail
    inside the optimizer's next step. A bad value in a file whose bytes changed is reported as that change."""
    for name, value in opened._reader.peek(steps).items():
        try:
            check_step_value(value, field=f"{steps[name]}: {name}", source=str(opened.path))
        except CorruptCheckpointError:
            opened._reader.tensors(steps[name])  # hash-checked while it streams (verify="quick")
            raise


def _load_planned_optimizer(opened: OpenedCheckpoint, layout: Mapping[str, Any], model: torch.nn.Module | None,
                            optimizer: torch.optim.Optimizer, plan: OptimizerLoadPlan) -> None:
    """Read the planned state (into the targets where they are plain CPU tensors of the stored dtype; into reused
    state tensors by copy otherwise) and install it through the optimizer's own ``load_state_dict``."""
    reader, source = opened._reader, str(opened.path)
    section = read_section(reader, layout, LAYOUT_KEY_OPTIMIZER)
    names = list(plan.targets)
    with agreed_reads(source), PieceReader(reader, section, source=source) as pieces:
        tensors = fill_state(plan.targets, pieces, names, in_place=_whole_process(model, optimizer))
        tensors.update({name: pieces.read_full(name) for name in section.dtypes if name not in plan.targets})
    for name in names:
        target = plan.targets[name]
        if tensors[name] is not target and name not in plan.new:
            tensors[name] = target.copy_(tensors[name])
    apply_optimizer_state(optimizer, plan, tensors, layout[LAYOUT_KEY_OPTIMIZER_DOC], source=_optimizer_source(opened))


def _prefault_new_state(plan: OptimizerLoadPlan | None) -> Prefault:
    """A helper that faults in the optimizer state the plan allocated (its contiguous CPU tensors) from the start of
    the load (the weights are read first), by name: the order of a file's tensors of one dtype."""
    new = [plan.targets[name] for name in sorted(plan.new)] if plan is not None else []
    return Prefault.start([(tensor.data_ptr(), tensor.numel() * tensor.element_size()) for tensor in new
                           if tensor.device.type == "cpu" and tensor.is_contiguous()])


def _load_param_groups_only(model: torch.nn.Module, optimizer: torch.optim.Optimizer, document: Mapping[str, Any],
                            *, source: str) -> None:
    """The saved optimizer had not stepped yet: restore its hyper-parameters and leave its state empty."""
    current = _optimizer_state(model, optimizer)
    optimizer.state.clear()
    groups = decode_optimizer_state({}, document, current["param_groups"], source=source)["param_groups"]
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _load_resharded_partitions(reader: _Reader, section: Section, document: Mapping[str, Any],
                               optimizer: ShardedOptimizerState) -> None:
    """An engine's flat optimizer partitions saved at another world size: this rank's are cut again from every
    saved rank's pieces (:func:`~hf_resumable.checkpoint.pieces._partitioned.reshard_partitions`), then loaded."""
    source = str(reader.path)
    optimizer.init_state()  # the partitions' state must exist to be filled (a no-op once the optimizer stepped)
    current = optimizer.sharded_state_dict()
    with agreed_reads(source), PieceReader(reader, section, source=source) as pieces:
        filled, renamed = reshard_partitions(current, document, pieces, source=source)
    optimizer.load_sharded_state_dict(decode_optimizer_state(filled, renamed, current["param_groups"], source=source))
    logger.info("Cut %d optimizer partition(s) of this rank from %d saved one(s) (another world size).",
                len(current["state"]), len(document["non_tensor_state"]))


def _load_optimizer(reader: _Reader, layout: Mapping[str, Any], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, *, reshard: bool = False) -> None:
    """An engine's optimizer (or one whose parameters are named otherwise), from the state its engine gives."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    source = str(reader.path)
    document = layout[LAYOUT_KEY_OPTIMIZER_DOC]  # present and of this class (_check_optimizer_document)
    section = read_section(reader, layout, LAYOUT_KEY_OPTIMIZER)
    if not document["non_tensor_state"] and not any(n.startswith(OPTIMIZER_STATE_PREFIX) for n in section.dtypes):
        _load_param_groups_only(model, optimizer, document, source=source)
        return
    own_pieces = isinstance(optimizer, ShardedOptimizerState)
    originals: dict[str, Any] = {}  # FSDP1: the ShardedTensors its load reads, filled from the pieces
    if own_pieces:
        current = optimizer.sharded_state_dict()
        saved = {name for group in document["param_groups"] for name in group["params"]}
        if reshard and saved != set(current["state"]):  # saved at another world size (ZeRO's names hold it)
            _load_resharded_partitions(reader, section, document, optimizer)
            return
        # the live state is created first (init_state) only if the checkpoint holds state it lacks: a checkpoint
        # saved before the first step holds the master weights alone
        if set(section.dtypes) - set(flatten_optimizer_state(current, _class_name(optimizer))[0]):
            optimizer.init_state()
            current = optimizer.sharded_state_dict()
    else:  # FSDP1's flat parameters, or parameters named otherwise: torch's templates
        current = get_optimizer_state_dict(model, optimizer, options=_options())  # initializes an empty optimizer
        current = optimizer_as_dtensors(current, device=_device(model), originals=originals)
    current_tensors, _ = flatten_optimizer_state(current, _class_name(optimizer))
    names = check_fits(current_tensors, section, strict=True, source=source, what="optimizer")
    with agreed_reads(source), PieceReader(reader, section, source=source) as pieces:  # before the apply's collectives
        filled = fill_state(current_tensors, pieces, names)
    state = decode_optimizer_state(filled, document, current["param_groups"], source=source)
    if own_pieces:
        optimizer.load_sharded_state_dict(state)
    else:
        state = optimizer_into_sharded_tensors(state, originals)
        set_optimizer_state_dict(model, optimizer, state, options=_options())


def load_pieces_into(opened: OpenedCheckpoint, *, model: torch.nn.Module | None,
                     optimizer: torch.optim.Optimizer | None, strict: bool) -> None:
    """The model and optimizer part of ``OpenedCheckpoint.load_into``, for every layout (a regular checkpoint's files
    are whole pieces) and any sharding: each rank reads the slices of the stored pieces that overlap what it holds,
    at any world size. A collective: the ranks agree that every read succeeded before any live object is filled.

    Raises:
        ValueError: an engine's ``optimizer`` without ``model`` (its state is matched by parameter name).
        As ``load_into``; a rank whose reads failed raises `CorruptCheckpointError` after the others learned of it
        (before anything is applied), and they raise `CorruptOnAnotherRankError`.
    """
    # 1. The layout; optimizer state of another kind refused, a plain optimizer's planned, before anything is written.
    if opened._trainable is not None and engine_pieces(model, optimizer):  # its whole-tensor base, against pieces
        wanted = "resharded loading needs every weight (load_checkpoint checks its base against the model instead)"
        if (error := base_not_stored(opened.path, wanted=wanted)) is not None:
            raise error
    layout = read_layout(opened)
    plan = None
    if optimizer is not None:
        _check_optimizer_document(opened, layout, optimizer)
        plan = _plan_optimizer(opened, layout, model, optimizer)
    # 2. Every file the load reads is still the one verification checked, before a byte of any is used.
    parts = [key for key, obj in ((LAYOUT_KEY_MODEL, model), (LAYOUT_KEY_OPTIMIZER, optimizer)) if obj is not None]
    for file in {file for key in parts if layout.get(key) for file in layout[key][SECTION_PIECES]}:
        opened._reader.report.check_unchanged(file)
    # 3. Weights (keys matched by the one key matcher, then the pieces read), then optimizer state (an engine builds
    #    its templates from the loaded parameters); the optimizer state allocated by the plan is faulted in meanwhile.
    try:
        with _prefault_new_state(plan):
            if model is not None:
                _load_model(opened, layout, model, strict=strict)
            if plan is not None:
                _load_planned_optimizer(opened, layout, model, optimizer, plan)
            elif optimizer is not None:
                _load_optimizer(opened._reader, layout, model, optimizer, reshard=opened.reshard)
    finally:
        opened._reader.release()  # the verified bytes kept for this load are used (or will be read again, checked)


def _optimizer_source(opened: OpenedCheckpoint) -> str:
    """The file that holds the optimizer document, for messages."""
    name = LAYOUT_FILE if LAYOUT_FILE in opened.manifest.files else TRAINING_STATE_FILE
    return str(opened.path / name)


def _check_optimizer_document(opened: OpenedCheckpoint, layout: Mapping[str, Any],
                              optimizer: torch.optim.Optimizer) -> None:
    """The layout's optimizer document is well formed and of the live optimizer's class (before any load)."""
    document = layout.get(LAYOUT_KEY_OPTIMIZER_DOC)
    if document is None or layout.get(LAYOUT_KEY_OPTIMIZER) is None:
        raise IncompleteCheckpointError(f"{opened.path}: no optimizer state was saved; load without optimizer=.")
    check_optimizer_document(document, source=_optimizer_source(opened))
    if document["class"] != _class_name(optimizer):
        raise CheckpointMismatchError(f"{opened.path}: optimizer was {document['class']}, now "
                                      f"{_class_name(optimizer)}; build the same optimizer class to resume.")
    if len(document["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointMismatchError(f"{opened.path}: {len(document['param_groups'])} param group(s) saved, the "
                                      f"optimizer has {len(optimizer.param_groups)}; build it with the same groups.")
