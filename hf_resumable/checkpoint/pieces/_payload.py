"""Capture: live training objects -> a :class:`~hf_resumable.checkpoint._types.Payload` of files to write, no IO (so
an async save can stage its tensors and the writer never looks at the live objects again).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...constants import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    DATA_STATE_DIR,
    DATA_STATE_FILE_PATTERN,
    FORMAT_VERSION,
    FROZEN_RECORD_FILE,
    MODEL_FILE_PATTERN,
    MODEL_INDEX_FILE,
    OPTIMIZER_FILE_PATTERN,
    OPTIMIZER_INDEX_FILE,
    PICKLE_SUFFIXES,
    RENAMED_KEY,
    RNG_DIR,
    RNG_FILE_PATTERN,
    SINGLE_MODEL_FILE,
    STATE_KEY_EXTRA,
    STATE_KEY_FORMAT_VERSION,
    STATE_KEY_OPTIMIZER,
    STATE_KEY_PROGRESS,
    STATE_KEY_SCALER,
    STATE_KEY_SCHEDULER,
    STATE_TENSORS_FILE,
    TRAINABLE_FILE_PATTERN,
    TRAINABLE_INDEX_FILE,
    TRAINING_STATE_FILE,
)
from ...errors import CheckpointExistsError, UnsupportedStateError
from ...format._jsonio import json_bytes
from ...format.rng import RngState, capture_rng_state
from ...format.sharding import build_index, check_relative_name, plan_shards
from ...format.state_codec import encode_state
from .._types import IndexSpec, Payload, TensorFile
from ..state._model import TIED_KEY, dedupe_tied, find_aliases, model_state, storage_key
from ..state._model_files import plan_model_files, single_file_metadata
from ..state._optimizer import optimizer_to_tensors, parameter_names
from ._dtensor import is_dtensor
from ._frozen import base_provenance, build_record, describe_source, frozen_names

logger = logging.getLogger(__name__)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def add_sharded(payload: Payload, tensors: Mapping[str, torch.Tensor], *, pattern: str, index: str,
                max_shard_size: int | str, metadata: Mapping[str, Any]) -> None:
    """The one shard-planning path for tensors written as HF-style shards plus an index (model, optimizer, reshard,
    Hub push); the writer adds each shard's record to the index."""
    plan = plan_shards({k: _nbytes(v) for k, v in tensors.items()}, max_shard_size=max_shard_size,
                       filename_pattern=pattern)
    for filename, names in plan.filename_to_names.items():
        payload.tensor_files.append(TensorFile(filename, [(n, tensors[n]) for n in names]))
    document = build_index(plan, metadata=metadata)
    payload.indexes.append(IndexSpec(index, document["weight_map"], document["metadata"]))


def add_model_weights(payload: Payload, tensors: Mapping[str, torch.Tensor], *, tied: Mapping[str, str],
                      max_shard_size: int | str) -> None:
    """The whole model's weights (aliases already dropped): one ``model.safetensors`` with the tied record in its
    header when they fit in one shard (as ``save_pretrained`` writes them), else the HF index and shards."""
    plan = plan_model_files({k: _nbytes(v) for k, v in tensors.items()}, max_shard_size=max_shard_size)
    if plan.filenames == [SINGLE_MODEL_FILE]:
        named = [(name, tensors[name]) for name in plan.filename_to_names[SINGLE_MODEL_FILE]]
        payload.tensor_files.append(TensorFile(SINGLE_MODEL_FILE, named, single_file_metadata(tied)))
        return
    add_sharded(payload, tensors, pattern=MODEL_FILE_PATTERN, index=MODEL_INDEX_FILE, max_shard_size=max_shard_size,
                metadata={TIED_KEY: dict(tied), "format": "pt"})


def _pretrained_files(save: Callable[[str], Any]) -> dict[str, bytes]:
    """Files an object's ``save_pretrained`` writes, captured as bytes (no pickle files allowed)."""
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp)
        files = {p.relative_to(tmp).as_posix(): p.read_bytes() for p in Path(tmp).rglob("*") if p.is_file()}
    return {k: v for k, v in files.items() if not k.endswith(PICKLE_SUFFIXES)}


def capture_payload(
    *,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    training_state: Mapping[str, Any] | None,
    extra: Mapping[str, Any] | None,
    extra_files: Mapping[str, bytes | str] | None,
    data_state: Mapping[str, Any] | None,
    rng: bool | RngState,
    max_shard_size: int | str,
    processing_class: Any,
    rank: int,
    is_main: bool,
    standalone: bool = False,
    replicas: bool = False,
) -> Payload:
    """Build the payload of one rank; only the main rank carries the shared state.

    With ``replicas`` (every rank holds the same model and optimizer, as under DDP), every other rank carries the
    model's and optimizer's tensor files too, marked ``replicated``, so that the ranks can share their writing;
    otherwise only the main rank carries them. A model with frozen parameters is captured as its trainable part plus
    the frozen record (see :mod:`._frozen`) unless ``standalone``.
    """
    payload = Payload()
    reserved = set(extra_files or {})  # files the caller writes itself (accelerate's save hooks): not ours
    if replicas and not is_main:
        _capture_replicas(payload, model, optimizer, max_shard_size, standalone=standalone, reserved=reserved)
    if is_main:
        _capture_shared(payload, model, optimizer, scheduler, scaler, training_state, extra, max_shard_size,
                        standalone=standalone, reserved=reserved)
        if model is not None and isinstance(model, torch.nn.Module):
            capture_pretrained(payload, model, processing_class)
        ours = {f.relpath for f in payload.tensor_files} | {spec.relpath for spec in payload.indexes}
        for relpath, content in (extra_files or {}).items():
            check_relative_name(relpath, source="extra_files", suffix=None)
            if relpath in ours:
                raise CheckpointExistsError(
                    f"extra_files names {relpath!r}, which the checkpoint writes itself (e.g. the model's "
                    f"{SINGLE_MODEL_FILE} or its shards); nothing was written. Store that file under another name.")
            payload.blobs[relpath] = content.encode() if isinstance(content, str) else bytes(content)
    if data_state is not None:
        tensors: dict[str, torch.Tensor] = {}
        document = encode_state(dict(data_state), tensors, prefix="data_state")
        if tensors:
            raise UnsupportedStateError(
                f"data_state holds tensors ({sorted(tensors)[:3]}); the per-rank data position is stored as JSON. "
                "Convert them to lists (or base64 strings) in the loader's state_dict().")
        payload.blobs[f"{DATA_STATE_DIR}/{DATA_STATE_FILE_PATTERN.format(rank=rank)}"] = json_bytes(document)
    if rng is not False:
        payload.rng = rng if isinstance(rng, RngState) else capture_rng_state()
        payload.rng_relpath = f"{RNG_DIR}/{RNG_FILE_PATTERN.format(rank=rank)}"
    return payload


def _capture_replicas(payload: Payload, model, optimizer, max_shard_size, *, standalone: bool,
                      reserved: set[str], record: bool = False) -> dict[str, Any] | None:
    """The model's and optimizer's files (and indexes), marked ``replicated``; the optimizer's JSON document.
    ``record``: also the frozen record (only the main rank writes it)."""
    optimizer_doc = None
    if model is not None:
        capture_model(payload, model, max_shard_size=max_shard_size, standalone=standalone, reserved=reserved,
                      record=record)
    if optimizer is not None:
        names = parameter_names(model if isinstance(model, torch.nn.Module) else None, optimizer)
        opt_tensors, optimizer_doc = optimizer_to_tensors(optimizer, names)
        add_sharded(payload, opt_tensors, pattern=OPTIMIZER_FILE_PATTERN, index=OPTIMIZER_INDEX_FILE,
                    max_shard_size=max_shard_size, metadata={})
    payload.replicated = {f.relpath for f in payload.tensor_files}
    return optimizer_doc


def _capture_shared(payload: Payload, model, optimizer, scheduler, scaler, training_state, extra,
                    max_shard_size, *, standalone: bool = False, reserved: set[str] | frozenset = frozenset()) -> None:
    state_tensors: dict[str, torch.Tensor] = {}
    optimizer_doc = _capture_replicas(payload, model, optimizer, max_shard_size, standalone=standalone,
                                      reserved=set(reserved), record=True)
    document = {
        STATE_KEY_FORMAT_VERSION: FORMAT_VERSION,
        STATE_KEY_PROGRESS: encode_state(dict(training_state or {}), state_tensors, prefix="progress"),
        STATE_KEY_SCHEDULER: encode_state(scheduler.state_dict(), state_tensors, prefix="scheduler")
        if scheduler is not None else None,
        STATE_KEY_SCALER: encode_state(scaler.state_dict(), state_tensors, prefix="scaler")
        if scaler is not None else None,
        STATE_KEY_OPTIMIZER: optimizer_doc,
        STATE_KEY_EXTRA: encode_state(dict(extra or {}), state_tensors, prefix="extra"),
    }
    payload.blobs[TRAINING_STATE_FILE] = json_bytes(document)
    if state_tensors:
        payload.tensor_files.append(TensorFile(STATE_TENSORS_FILE, sorted(state_tensors.items())))


def _refuse_dtensors(state: Mapping[str, torch.Tensor]) -> None:
    """Whole-tensor files cannot hold DTensors (FSDP2, tensor parallel): each rank holds only its pieces."""
    sharded = [name for name, tensor in state.items() if is_dtensor(tensor)]
    if sharded:
        raise UnsupportedStateError(
            f"The model holds DTensor parameters ({', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''}: "
            "FSDP2 or tensor parallel), of which each rank holds only its pieces; a state dict holds no "
            "record of them. Pass the module itself as model=: save_checkpoint then has every rank write its "
            "pieces, and load_checkpoint reads them at any world size.")


def capture_model(payload: Payload, model: torch.nn.Module | Mapping[str, torch.Tensor], *,
                  max_shard_size: int | str, standalone: bool = False,
                  reserved: set[str] | frozenset = frozenset(), record: bool = True) -> None:
    """The model's files: the whole state as ``save_pretrained`` lays it out (:func:`add_model_weights`), or (frozen
    parameters, not ``standalone``) the trainable part and the frozen record; a PEFT model's adapter files in both
    cases (not those in ``reserved``). ``record=False`` leaves out the frozen record (a replica's capture: only the
    main rank writes it)."""
    state = model_state(model)
    _refuse_dtensors(state)
    tensors, tied = dedupe_tied(state)
    module = model if isinstance(model, torch.nn.Module) else None
    adapters = {relpath: named for relpath, named in adapter_tensors(module).items() if relpath not in reserved}
    frozen = set() if standalone or module is None else frozen_names(module, tensors)
    if not frozen:
        add_model_weights(payload, tensors, tied=tied, max_shard_size=max_shard_size)
        payload.tensor_files += [TensorFile(relpath, named) for relpath, named in adapters.items()]
        return
    stored = {name: t for name, t in tensors.items() if name not in frozen}
    _add_trainable(payload, stored, tied, frozen, adapters, max_shard_size=max_shard_size)
    if not record:
        return
    frozen_record = build_record({name: t for name, t in tensors.items() if name in frozen},
                                 {alias: kept for alias, kept in tied.items() if kept in frozen},
                                 base_provenance(module))
    payload.blobs[FROZEN_RECORD_FILE] = json_bytes(frozen_record.to_json())
    logger.info("Frozen base not stored: %d tensor(s), %.1f MB (%s); %d trainable tensor(s) and buffers, %.1f MB.",
                len(frozen_record.tensors), frozen_record.total_bytes / 1e6, describe_source(frozen_record.source),
                len(stored), sum(_nbytes(t) for t in stored.values()) / 1e6)


def _add_trainable(payload: Payload, stored: dict[str, torch.Tensor], tied: Mapping[str, str], frozen: set[str],
                   adapters: Mapping[str, list[tuple[str, torch.Tensor]]], *, max_shard_size: int | str) -> None:
    """The trainable part's files and index (``stored``: every tensor that is not frozen)."""
    # A PEFT adapter file whose every tensor is a stored trainable tensor holds those tensors for the checkpoint
    # too (stored once, under PEFT's names); any other adapter file is written besides.
    by_storage = {key: name for name, t in stored.items() if (key := storage_key(t)) is not None}
    renamed: dict[str, str] = {}
    in_adapters: dict[str, str] = {}
    for relpath, named in adapters.items():
        owners = [by_storage.get(storage_key(t)) for _, t in named]  # None: no bytes, no owner
        if all(owners) and not any(owner in renamed.values() for owner in owners):
            for (name, _), owner in zip(named, owners):
                renamed[name] = owner
                in_adapters[name] = relpath
        payload.tensor_files.append(TensorFile(relpath, named))
    rest = {name: t for name, t in stored.items() if name not in set(renamed.values())}
    placed: dict[str, str] = {}
    if rest:
        plan = plan_shards({k: _nbytes(v) for k, v in rest.items()}, max_shard_size=max_shard_size,
                           filename_pattern=TRAINABLE_FILE_PATTERN)
        payload.tensor_files += [TensorFile(filename, [(n, rest[n]) for n in names])
                                 for filename, names in plan.filename_to_names.items()]
        placed = plan.name_to_filename
    weight_map = dict(sorted({**placed, **in_adapters}.items()))
    metadata = {"total_size": sum(_nbytes(t) for t in stored.values()), TIED_KEY:
                {alias: kept for alias, kept in tied.items() if kept not in frozen}, RENAMED_KEY: renamed,
                "format": "pt"}
    payload.indexes.append(IndexSpec(TRAINABLE_INDEX_FILE, weight_map, metadata))


def adapter_tensors(model: torch.nn.Module | None) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """A PEFT model's adapter files as ``PeftModel.save_pretrained`` writes them: ``adapter_model.safetensors`` for
    the ``default`` adapter, ``<name>/adapter_model.safetensors`` for the others (PEFT's own state dict)."""
    peft_config = getattr(model, "peft_config", None) if model is not None else None
    if not isinstance(peft_config, Mapping) or not peft_config or not hasattr(model, "save_pretrained"):
        return {}
    from peft.utils import get_peft_model_state_dict

    files = {}
    for name in peft_config:
        state = get_peft_model_state_dict(model, adapter_name=name)
        relpath = ADAPTER_WEIGHTS_FILE if name == "default" else f"{name}/{ADAPTER_WEIGHTS_FILE}"
        check_relative_name(relpath, source="PEFT adapter name")
        named = [(key, value.detach()) for key, value in state.items()]
        aliases = find_aliases(dict(named))  # written as separate copies, as PEFT's save does (no aliases in a file)
        files[relpath] = [(key, tensor.clone() if key in aliases else tensor) for key, tensor in named]
    return files


# id(object) -> (its JSON, the files its save_pretrained wrote): a config that did not change since the last save is
# not written to a temporary directory again (saves run on the training loop's time).
_SAVED_FILES: dict[int, tuple[str, dict[str, bytes]]] = {}


def _saved_files(owner: Any, key: str | None, keep: Callable[[str], bool] = lambda relpath: True) -> dict[str, bytes]:
    """The files of ``owner.save_pretrained`` that ``keep`` accepts, reused while ``key`` (the JSON of what they
    hold; ``None``: not reused) is unchanged."""
    cached = _SAVED_FILES.get(id(owner))
    if key is not None and cached is not None and cached[0] == key:
        return cached[1]
    files = {k: v for k, v in _pretrained_files(owner.save_pretrained).items() if keep(k)}
    if key is not None:
        _SAVED_FILES[id(owner)] = (key, files)
    return files


def _config_key(config: Any) -> str | None:
    """The config's whole JSON (``use_diff=False``: no default config is built to diff against, the costly part)."""
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        return to_json(use_diff=False)
    except TypeError:  # a config class without transformers' signature
        return to_json()


def _adapter_configs(model: Any) -> dict[str, bytes]:
    """The ``adapter_config.json`` files of ``model.save_pretrained``, reused while the adapter configs are unchanged
    (so a save does not write the adapter weights to a temporary directory each time)."""
    key = json.dumps({name: config.to_dict() for name, config in model.peft_config.items()}, sort_keys=True,
                     default=str)
    return _saved_files(model, key, lambda k: k == ADAPTER_CONFIG_FILE or k.endswith(f"/{ADAPTER_CONFIG_FILE}"))


def capture_pretrained(payload: Payload, model: torch.nn.Module, processing_class: Any) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        payload.blobs.update(_saved_files(config, _config_key(config)))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "save_pretrained"):
        try:
            payload.blobs.update(_saved_files(generation_config, _config_key(generation_config)))
        except ValueError as err:  # transformers refuses to save an invalid generation config
            logger.warning("Not saving generation_config.json: %s", err)
    if isinstance(getattr(model, "peft_config", None), Mapping) and hasattr(model, "save_pretrained"):
        # PEFT models: the checkpoint doubles as a loadable adapter (adapter_model.safetensors, written by
        # capture_model, + adapter_config.json as PEFT writes it). Like PEFT's own save, a checkpoint that does not
        # store the base has no config.json, so from_pretrained(checkpoint) loads the base named in
        # adapter_config.json and the adapter on top, as it does for a stock Trainer checkpoint.
        written = {f.relpath for f in payload.tensor_files}
        if any(relpath.endswith(ADAPTER_WEIGHTS_FILE) for relpath in written):
            payload.blobs.update(_adapter_configs(model))
        else:  # the model was not captured by capture_model (sharded saves): the adapter files as PEFT writes them
            payload.blobs.update(_saved_files(model, None, lambda k: k.startswith("adapter_") or "/adapter_" in k))
        if any(spec.relpath == TRAINABLE_INDEX_FILE for spec in payload.indexes):
            payload.blobs.pop(CONFIG_FILE, None)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        payload.blobs.update(_pretrained_files(processing_class.save_pretrained))
