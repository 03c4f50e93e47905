"""Export a training checkpoint as a full model directory that ``from_pretrained`` loads.

:func:`export_model` rebuilds the whole model from the checkpoint and, for a checkpoint that stores only the
trainable part, its base (checked against the checkpoint's record of it, as a resume does). A PEFT model is written
merged (``merge_adapters=True``) or as the base plus the adapter files. Nothing from the checkpoint is executed: the
model class must be one of ``transformers``' own. See docs/peft.md#using-such-a-checkpoint and docs/multi-gpu.md.

Example:

```python
>>> from hf_resumable.conversions.export import export_model
>>> export_model("out/checkpoint-500", "exported", merge_adapters=True)  # doctest: +SKIP
PosixPath('exported')
```
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import OpenedCheckpoint, open_checkpoint
from ..constants import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    DATA_STATE_DIR,
    FROZEN_RECORD_FILE,
    GENERATION_CONFIG_FILE,
    LAYOUT_FILE,
    LAYOUT_KEY_MODEL,
    MANIFEST_FILE,
    MODEL_INDEX_FILE,
    OPTIMIZER_INDEX_FILE,
    README_FILE,
    RNG_DIR,
    SHARDED_DIR,
    STATE_TENSORS_FILE,
    TRAINABLE_INDEX_FILE,
    TRAINER_STATE_FILE,
    TRAINING_STATE_FILE,
)
from ..errors import CheckpointExistsError, HfResumableError
from ..format.safetensors_io import STR_TO_DTYPE

logger = logging.getLogger(__name__)

__all__ = ["export_model", "ExportError"]

# Checkpoint files that are training state, not part of a model directory.
_NOT_EXPORTED = (MANIFEST_FILE, LAYOUT_FILE, TRAINING_STATE_FILE, STATE_TENSORS_FILE, TRAINER_STATE_FILE,
                 FROZEN_RECORD_FILE, MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE, OPTIMIZER_INDEX_FILE, CONFIG_FILE,
                 GENERATION_CONFIG_FILE,
                 README_FILE)
_NOT_EXPORTED_DIRS = (RNG_DIR, DATA_STATE_DIR, SHARDED_DIR)


class ExportError(HfResumableError, ValueError):
    """The checkpoint cannot be exported as asked (no known base, a model class outside transformers, a merge into
    a quantized base...)."""


def export_model(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    revision: str | None = None,
    merge_adapters: bool = False,
    max_shard_size: int | str = "5GB",
    verify: str = "quick",
    master_weights: bool = False,
) -> Path:
    """Write the checkpoint's model, frozen base included, as a directory ``from_pretrained`` loads.

    Args:
        checkpoint (`str` or `os.PathLike`): a committed hf_resumable checkpoint directory.
        output (`str` or `os.PathLike`): the new model directory (must not exist, or be empty).
        base (`str` or `os.PathLike`, *optional*): the base model (a local directory or a Hub repo id); defaults to
            the one the checkpoint recorded. Its frozen parameters are checked against the checkpoint's record.
        revision (`str`, *optional*): the Hub revision of ``base``; defaults to the recorded commit (or revision).
        merge_adapters (`bool`, *optional*, defaults to `False`): merge PEFT adapters into the weights; without it
            the base weights and the adapter files are written side by side.
        max_shard_size (`int` or `str`, *optional*, defaults to `"5GB"`): shard size of the written weights.
        verify (`str`, *optional*, defaults to `"quick"`): how the checkpoint is verified, and with ``"full"`` the
            base checked byte for byte (see :func:`hf_resumable.checkpoint.open_checkpoint`).
        master_weights (`bool`, *optional*, defaults to `False`): write the fp32 master weights a DeepSpeed ZeRO-1/2/3
            checkpoint keeps in its optimizer partitions (assembled from every rank's), in float32, instead of the
            model's weights in the training dtype (bf16 / fp16 under mixed precision).

    Returns:
        `Path`: ``output``.

    Raises:
        ExportError: no base is known (pass ``base``), the model class is not one of transformers', or
            ``merge_adapters`` with a quantized base.
        BaseMismatchError: ``base`` is not the base the checkpoint was trained with.
        CheckpointExistsError: ``output`` exists and is not empty.
        IncompleteCheckpointError: ``master_weights`` for a checkpoint without ZeRO optimizer partitions.
        IncompleteCheckpointError / CorruptCheckpointError: the checkpoint does not verify.
    """
    source, target = Path(checkpoint), Path(output)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointExistsError(f"{target} exists and is not an empty directory; export into a new directory.")
    # elastic: a per-rank (FSDP2 / ZeRO) checkpoint is read whole here, in one process, whatever its world size
    opened = open_checkpoint(source, verify=verify, allow_inexact_resume=True, reshard=True)
    # 1. The model, built from the base (or from the checkpoint's own config for a standalone checkpoint).
    model = _build_model(opened, base=base, revision=revision)
    # 2. The checkpoint's state, the frozen base checked against its record first.
    _load_weights(opened, model)
    if master_weights:
        _load_master_weights(opened, model)
    # 3. Write into a fresh sibling directory, then rename it into place.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".export-{target.name}.", dir=target.parent))
    try:
        _write(model, staging, merge_adapters=merge_adapters, quantized=_is_quantized(model),
               max_shard_size=max_shard_size)
        _copy_processor_files(source, opened, staging)
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("Exported %s to %s (%s).", source, target,
                "adapters merged" if merge_adapters else "base + adapter files" if _is_peft(model) else "full model")
    return target


def _load_weights(opened: OpenedCheckpoint, model: Any) -> None:
    """Fill ``model`` (plain, one process) with the checkpoint's weights; in a per-rank checkpoint (one with
    ``sharded_layout.json``) each whole tensor is assembled from the rank pieces that cover it, with no process
    group."""
    if LAYOUT_FILE not in opened.manifest.files:
        opened.load_into(model=model, strict=True)
        return
    _as_stored(opened, model)
    # the export is not a resume: no RNG restored, so a world size other than the saving one is fine
    opened.load_into(model=model, restore_rng=False, strict=True)
    logger.info("Assembled the weights of %s from the pieces of %d rank(s).", opened.path, opened.manifest.world_size)


def _load_master_weights(opened: OpenedCheckpoint, model: Any) -> None:
    """Overwrite ``model``'s parameters, in float32, with the ZeRO checkpoint's fp32 master weights (buffers keep the
    values just loaded; DeepSpeed keeps no master copy of them).

    Raises:
        ExportError: a trainable parameter of the model has no master weights in the checkpoint, or one that does not
            fit it.
    """
    from ..checkpoint.pieces import read_master_weights

    masters = read_master_weights(opened)  # raises IncompleteCheckpointError without ZeRO partitions
    model.float()
    parameters = dict(model.named_parameters())
    unknown = sorted(set(masters) - set(parameters))
    missing = sorted(name for name, p in parameters.items() if p.requires_grad and name not in masters)
    wrong = sorted(name for name in set(masters) & set(parameters)
                   if masters[name].numel() != parameters[name].numel())
    if unknown or missing or wrong:
        raise ExportError(f"{opened.path}: the fp32 master weights do not fit the model (not in the model: "
                          f"{unknown[:5]}, without master weights: {missing[:5]}, other sizes: {wrong[:5]}); export "
                          "the model's weights (without master_weights).")
    with torch.no_grad():
        for name, flat in masters.items():
            parameters[name].copy_(flat.view(parameters[name].shape))
    logger.info("Exporting the fp32 master weights of %d parameter(s) of %s.", len(masters), opened.path)


def _as_stored(opened: OpenedCheckpoint, model: Any) -> None:
    """Give each floating parameter of ``model`` the dtype a per-rank checkpoint stores it in
    (``sharded_layout.json``): an engine may train in another dtype than the config says (DeepSpeed's bf16 casts the
    module), and the export writes the weights as trained."""
    described = (opened._reader.json(LAYOUT_FILE).get(LAYOUT_KEY_MODEL) or {}).get("tensors") or {}
    cast = 0
    for name, parameter in model.named_parameters():
        entry = described.get(name)
        dtype = STR_TO_DTYPE.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is not None and dtype.is_floating_point and parameter.is_floating_point() and \
                parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
            cast += 1
    if cast:
        logger.info("%s stores %d weight(s) in another dtype than the config builds; exported as stored.",
                    opened.path, cast)


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _is_quantized(model: Any) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "quantization_config", None) is not None


def _model_class(name: Any, *, where: str) -> type:
    import transformers

    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ExportError(f"{where}: model class {name!r:.80} is not a transformers model class; hf_resumable exports "
                          "only those (it never runs code from a checkpoint).")
    return cls


def _auto_model(config: Any, *, where: str) -> Any:
    """The model transformers' auto classes map ``config.model_type`` to (a causal LM when there is one; the
    checkpoint's weights then decide, under ``strict=True``, whether it fits). Only transformers' own classes."""
    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            model = auto.from_config(config)
        except ValueError:  # no class of that kind for this model type
            continue
        logger.warning("%s names no architecture; exporting as %s (transformers' auto class for model_type %r).",
                       where, type(model).__name__, getattr(config, "model_type", None))
        return model
    raise ExportError(f"{where}: names no architecture and transformers has no model class for model_type "
                      f"{getattr(config, 'model_type', None)!r}.")


def _build_model(opened: OpenedCheckpoint, *, base: str | os.PathLike | None, revision: str | None) -> Any:
    from transformers import AutoConfig

    trainable = opened._trainable
    path = opened.path
    if trainable is None:  # standalone: every weight is in the checkpoint; the architecture from its config.json
        if not (path / CONFIG_FILE).is_file():
            raise ExportError(f"{path}: no {CONFIG_FILE}; cannot tell which model it holds.")
        config = AutoConfig.from_pretrained(path)
        architectures = getattr(config, "architectures", None)
        if not architectures:  # a config saved by config.save_pretrained (not model.save_pretrained) names none
            return _with_adapters(_auto_model(config, where=str(path / CONFIG_FILE)), opened)
        model = _model_class(architectures[0], where=str(path / CONFIG_FILE))._from_config(config)
        return _with_adapters(model, opened)
    recorded = trainable.record.source
    name = base if base is not None else recorded.get("name_or_path")
    if not name:
        raise ExportError(f"{path}: the checkpoint does not record where its frozen base came from; pass the base "
                          "model (a directory or a Hub repo id) with base= / --base.")
    kwargs: dict[str, Any] = {"dtype": _dominant_dtype(trainable.record)}
    if base is None or revision is not None:
        kwargs["revision"] = revision or recorded.get("commit") or recorded.get("revision")
    if recorded.get("quantization"):
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig.from_dict(dict(recorded["quantization"]))
    cls = _model_class(recorded.get("model_class"), where=str(path / FROZEN_RECORD_FILE))
    model = cls.from_pretrained(str(name), **{k: v for k, v in kwargs.items() if v is not None})
    return _with_adapters(model, opened)


def _dominant_dtype(record: Any) -> torch.dtype | None:
    floats = Counter()
    for tensor in record.tensors.values():
        dtype = STR_TO_DTYPE[tensor.dtype]
        if dtype.is_floating_point:
            floats[dtype] += tensor.numel
    return floats.most_common(1)[0][0] if floats else None


def _with_adapters(model: Any, opened: OpenedCheckpoint) -> Any:
    """The model with the checkpoint's PEFT adapters attached (their weights come with ``load_into``)."""
    path = opened.path
    configs = sorted(rel for rel in opened.manifest.files if rel.endswith(ADAPTER_CONFIG_FILE))
    if ADAPTER_CONFIG_FILE not in configs:
        return model
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=False)
    for relpath in configs:
        if relpath != ADAPTER_CONFIG_FILE and (path / relpath).parent.joinpath(ADAPTER_WEIGHTS_FILE).is_file():
            name = relpath.rsplit("/", 1)[0]
            peft_model.load_adapter(str(path / name), adapter_name=name, is_trainable=False)
    return peft_model


def _write(model: Any, directory: Path, *, merge_adapters: bool, quantized: bool, max_shard_size: int | str) -> None:
    if not _is_peft(model):
        model.save_pretrained(directory, max_shard_size=max_shard_size)
        return
    if merge_adapters:
        if quantized:
            raise ExportError("Merging adapters into a quantized base would re-quantize the merged weights (lossy); "
                              "export without merging (base + adapter files), or load the base unquantized with "
                              "base= and merge there.")
        model.merge_and_unload().save_pretrained(directory, max_shard_size=max_shard_size)
        return
    model.save_pretrained(directory)  # adapter_config.json + adapter_model.safetensors (every adapter)
    (directory / README_FILE).unlink(missing_ok=True)
    model.unload().save_pretrained(directory, max_shard_size=max_shard_size)  # the base, without adapter layers


def _copy_processor_files(source: Path, opened: OpenedCheckpoint, directory: Path) -> None:
    """Tokenizer / processor files of the checkpoint (everything that is neither training state nor weights)."""
    written = set()
    for relpath in opened.manifest.files:
        name = relpath.rsplit("/", 1)[-1]
        top = relpath.split("/", 1)[0]
        if (relpath in _NOT_EXPORTED or top in _NOT_EXPORTED_DIRS or name.endswith(".safetensors")
                or name.startswith("adapter_") or (directory / relpath).exists()):
            continue
        destination = directory / relpath
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / relpath, destination)
        written.add(relpath)
    if written:
        logger.debug("Copied %s into %s", sorted(written), directory)

