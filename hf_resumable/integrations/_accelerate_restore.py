"""The restore side of ``ResumableAccelerator.load_state``, as functions of the accelerator (the capture side is
:mod:`._accelerate_state`): :func:`restore_state` is the order of a resume, RNG last; :func:`resolve_checkpoint`
decides which directory an explicit ``load_state(input_dir)`` reads, or why it cannot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import LoadedCheckpoint, OpenedCheckpoint, VerifyReport, list_checkpoints, open_checkpoint
from ..checkpoint.commit import stock_accelerate_files
from ..checkpoint.state import has_model_weights
from ..constants import CHECKPOINT_DIR_RE, LAYOUT_FILE, MANIFEST_FILE, OPTIMIZER_INDEX_FILE
from ..distributed import broadcast_json
from ..errors import ConfigDriftError, IncompleteCheckpointError, InexactResumeError
from ..locations import is_remote, resolve_resume_path
from ._accelerate_elastic import KEY_ELASTIC
from ._accelerate_objects import (
    KIND_MODULE,
    SLOT_CORE,
    SLOT_EXTRA,
    Layout,
    load_optimizer,
    parameter_keys,
    require_slots,
)
from ._accelerate_paths import AUTOMATIC_CHECKPOINT_RE, CheckpointPathNotFoundError, next_iteration
from ._accelerate_state import (
    DATA_LOADERS,
    EXTRA_CUSTOM_OBJECTS,
    EXTRA_LAYOUT,
    EXTRA_MODELS,
    EXTRA_OPTIMIZERS,
    EXTRA_RUN,
    EXTRA_SCHEDULERS,
    PROGRESS_GLOBAL_STEP,
    PROGRESS_ITERATION,
    PROGRESS_MICRO_STEP,
    PROGRESS_OPTIMIZER_STEPS,
    run_settings,
    set_optimizer_step_counts,
)
from ._core import changed_settings, check_drift, inexact, restore_resumed_rng
from ._deepspeed import restore_engine_state, saved_engine_state
from ._engines import checkpoint_model
from ._fallback import agreed_load, find_agreed_checkpoint, resume_newest

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

logger = logging.getLogger(__name__)

__all__ = ["check_run_drift", "core_load_targets", "describe_missing", "layout_of_checkpoint", "load_agreed",
           "load_newest", "open_for_resume", "parse_load_options", "resolve_checkpoint", "restore_counters",
           "restore_custom_objects", "restore_extra_objects", "restore_loaders", "restore_rng", "restore_state"]


def load_newest(accelerator: ResumableAccelerator, strict: bool) -> LoadedCheckpoint | None:
    """``load_state()`` without a path: the newest checkpoint that verifies (automatic ``checkpoint_<i>`` or
    ``checkpoint-<step>``); one that fails its hashes while it is loaded, on any process, is set aside and the one
    before it loaded (:func:`~hf_resumable.integrations._fallback.resume_newest`). ``None``: no valid checkpoint."""
    pattern = (AUTOMATIC_CHECKPOINT_RE if accelerator.project_configuration.automatic_checkpoint_naming
               else CHECKPOINT_DIR_RE)
    first = find_agreed_checkpoint(accelerator.checkpoint_dir, pattern=pattern)
    loaded = resume_newest(accelerator.checkpoint_dir, lambda report: load_agreed(accelerator, Path(report.path),
                                                                                 strict, verified=report),
                           pattern=pattern, owner="ResumableAccelerator", first=first)
    if loaded is None and accelerator.is_main_process:
        logger.info("No valid checkpoint under %s; starting from scratch.", accelerator.checkpoint_dir)
    return loaded


def load_agreed(accelerator: ResumableAccelerator, path: Path, strict: bool,
                verified: VerifyReport | None = None) -> LoadedCheckpoint:
    """``load_state`` of one checkpoint; a failed hash on any process raises ``ResumeLoadError`` on all."""
    with agreed_load(path):
        return restore_state(accelerator, path, strict, verified)


def restore_state(accelerator: ResumableAccelerator, path: Path, strict: bool,
                  verified: VerifyReport | None) -> LoadedCheckpoint:
    """``load_state`` of one checkpoint into the accelerator's prepared objects, RNG last (``verified``: a
    verification already done, not repeated).

    Raises:
        ConfigDriftError / ElasticWorldSizeError / IncompleteCheckpointError / InexactResumeError: see
            ``ResumableAccelerator.load_state``.
    """
    # 1. Verify and decode once; compare the saved settings with ours before any object is touched.
    opened = open_for_resume(accelerator, path, verified)
    kept = accelerator._world_size_mode.plan_load(accelerator, path, opened.extra.get(EXTRA_RUN) or {},
                                                  opened.manifest.world_size,
                                                  saved_pieces=LAYOUT_FILE in opened.manifest.files)
    check_run_drift(accelerator, path, opened.manifest.world_size, opened.extra.get(EXTRA_RUN), elastic_kept=kept)
    layout = layout_of_checkpoint(accelerator, opened)
    # 2. accelerate's load hooks: a model they remove from the list is not loaded here.
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, str(path))
    require_slots(layout, models_to_fill=len(models), optimizers=len(accelerator._optimizers),
                  schedulers=len(accelerator._schedulers), where=str(path))
    engine = accelerator._deepspeed_engine()
    engine_state = saved_engine_state(opened.extra, where=path) if engine is not None else None
    # 3. Fill the objects (RNG excluded: it goes last).
    core_model, core_optimizer = core_load_targets(accelerator, layout, models)
    scheduler = (getattr(accelerator._schedulers[0], "scheduler", accelerator._schedulers[0])
                 if accelerator._schedulers else None)
    # FSDP2 / ZeRO: every rank reads the slices of the pieces it holds
    loaded = opened.load_into(model=core_model, optimizer=core_optimizer, scheduler=scheduler,
                              scaler=accelerator.scaler, strict=strict)
    restore_extra_objects(accelerator, path, layout, loaded.extra, models, strict=strict)
    if engine is not None:
        restore_engine_state(engine, [core_optimizer], engine_state)
    # 4. Counters and data positions, 5. registered objects, 6. RNG.
    restore_counters(accelerator, path, loaded, elastic_kept=kept)
    restore_loaders(accelerator, path, loaded.data_state)
    restore_custom_objects(accelerator, path, loaded.extra.get(EXTRA_CUSTOM_OBJECTS) or [])
    restore_rng(accelerator, path, loaded)  # last: restoring anything else may draw random numbers
    if accelerator.is_main_process:
        logger.info("Resumed from %s at step %d", path, accelerator.global_step)
    return loaded


def parse_load_options(accelerator: ResumableAccelerator, load_kwargs: dict | None, options: dict[str, Any]) -> bool:
    """``strict`` from ``load_state``'s accelerate options (``map_location`` checked, ``load_kwargs`` ignored).

    Raises:
        TypeError: an unsupported ``map_location`` or option.
    """
    options = dict(options)
    map_location = options.pop("map_location", None)
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
                        f"`'on_device'` (got {map_location!r}).")
    strict = bool(options.pop("strict", True))
    options.pop("device", None)  # safetensors' load_model option: tensors go where the parameters are
    if options:
        raise TypeError(f"load_state() got unsupported options {sorted(options)}; ResumableAccelerator accepts "
                        "strict= and map_location= (and load_kwargs, ignored).")
    if load_kwargs and not accelerator._warned.get("load_kwargs"):
        accelerator._warned["load_kwargs"] = True
        logger.warning("load_state(load_kwargs=%s): these are torch.load options; hf_resumable never unpickles, "
                       "so they are ignored.", sorted(load_kwargs))
    return strict


def open_for_resume(accelerator: ResumableAccelerator, path: Path,
                    verified: VerifyReport | None = None) -> OpenedCheckpoint:
    """The one place the resume path reads a checkpoint: verified and decoded once, no live object touched."""
    return open_checkpoint(path, verified=verified,
                           allow_inexact_resume=accelerator.resume_options.allow_inexact_resume,
                           counters=(PROGRESS_MICRO_STEP, PROGRESS_ITERATION),
                           reshard=accelerator.resume_options.elastic)  # FSDP2/ZeRO pieces: resharded


def layout_of_checkpoint(accelerator: ResumableAccelerator, peek: LoadedCheckpoint) -> Layout:
    record = peek.extra.get(EXTRA_LAYOUT)
    if record is not None:
        return Layout.from_json(record)
    files = peek.manifest.files
    return Layout.legacy(has_model=has_model_weights(files), has_optimizer=OPTIMIZER_INDEX_FILE in files,
                         has_scheduler=bool(accelerator._schedulers),
                         custom_objects=len(peek.extra.get(EXTRA_CUSTOM_OBJECTS) or []))


def check_run_drift(accelerator: ResumableAccelerator, path: Path, saved_world_size: int,
                    saved: Mapping[str, Any] | None, *,
                 elastic_kept: bool = False) -> None:
    saved = {**(saved or {}), "world_size": saved_world_size}  # the manifest's count is authoritative
    saved.setdefault(KEY_ELASTIC, False)
    changed = changed_settings(saved, run_settings(accelerator))
    changed = accelerator._world_size_mode.drift(changed, kept=elastic_kept)
    check_drift(changed, checkpoint=str(path),
                allow=accelerator.resume_options.allow_inexact_resume, option="allow_inexact_resume",
                owner="ResumableAccelerator")


def core_load_targets(accelerator: ResumableAccelerator, layout: Layout, models: list[Any]) -> tuple[Any, Any]:
    """What the checkpoint's own model and optimizer slots are loaded into."""
    model = None
    if layout.models and models:
        model = checkpoint_model(models[0], accelerator.unwrap_model(models[0])) if layout.models[0] == KIND_MODULE \
            else models[0]
    optimizer = None
    if layout.optimizers[:1] == [SLOT_CORE] and accelerator._optimizers:
        optimizer = accelerator._checkpoint_optimizers()[0]
        if model is None:
            # The optimizer's state is keyed by model 0's parameter names, so model 0 is loaded with it.
            logger.warning("A load_state pre-hook removed model 0, but optimizer 0's saved state is keyed by its "
                           "parameter names: model 0's weights are loaded from the checkpoint as well.")
            model = checkpoint_model(accelerator._models[0], accelerator.unwrap_model(accelerator._models[0]))
    return model, optimizer


def restore_extra_objects(accelerator: ResumableAccelerator, path: Path, layout: Layout, extra: Mapping[str, Any],
                          models: list[Any], *,
                           strict: bool) -> None:
    saved_models = extra.get(EXTRA_MODELS) or []
    for index, model in enumerate(models[1:], start=1):
        target = accelerator.unwrap_model(model) if layout.models[index] == KIND_MODULE else model
        target.load_state_dict(saved_models[index - 1], strict=strict)
    unwrapped = [accelerator.unwrap_model(model) for model in accelerator._models]
    saved_optimizers = extra.get(EXTRA_OPTIMIZERS) or []
    for index, (slot, optimizer) in enumerate(zip(layout.optimizers, accelerator._optimizers)):
        if slot == SLOT_EXTRA:
            inner = getattr(optimizer, "optimizer", optimizer)
            load_optimizer(inner, parameter_keys(unwrapped, inner), saved_optimizers[index],
                           where=f"{path} (optimizer {index})")
    for scheduler, state in zip(accelerator._schedulers[1:], extra.get(EXTRA_SCHEDULERS) or []):
        scheduler.load_state_dict(state)


def restore_counters(accelerator: ResumableAccelerator, path: Path, loaded: LoadedCheckpoint, *,
                     elastic_kept: bool = False) -> None:
    progress = loaded.training_state
    accelerator.global_step = int(progress.get(PROGRESS_GLOBAL_STEP, loaded.step or 0))
    # A checkpoint is on an optimizer-step boundary: accelerate's micro-step count (it syncs where the count is a
    # multiple of the accumulation) is a multiple of the saved accumulation, not of the one an elastic resume
    # changed it to, so it starts over there (a loop iterating the loader in accumulate() steps on time).
    accelerator.step = 0 if elastic_kept else int(progress.get(PROGRESS_MICRO_STEP, 0))
    set_optimizer_step_counts(accelerator, progress.get(PROGRESS_OPTIMIZER_STEPS)
                              or [accelerator.global_step] * len(accelerator._optimizers))
    if accelerator.project_configuration.automatic_checkpoint_naming:
        saved = progress.get(PROGRESS_ITERATION)
        match = AUTOMATIC_CHECKPOINT_RE.match(path.name)
        loaded_iteration = saved if saved is not None else (int(match.group(1)) if match else None)
        existing = broadcast_json([number for number, _ in list_checkpoints(
            accelerator.checkpoint_dir, pattern=AUTOMATIC_CHECKPOINT_RE)] if accelerator.is_main_process else None)
        accelerator.project_configuration.iteration = next_iteration(accelerator.save_iteration,
                                                                     loaded=loaded_iteration,
                                                              existing=existing)


def restore_loaders(accelerator: ResumableAccelerator, path: Path, data_state: Mapping[str, Any] | None) -> None:
    if not accelerator._resumable_loaders:
        return
    records = (data_state or {}).get(DATA_LOADERS)
    records = accelerator._world_size_mode.loader_records(accelerator, records)
    if records is None or len(records) != len(accelerator._resumable_loaders):
        inexact_resume(accelerator, f"{path} has no position for the {len(accelerator._resumable_loaders)} "
                                    f"prepared loader(s) of rank {accelerator.process_index}")
        return
    for index, (loader, record) in enumerate(zip(accelerator._resumable_loaders, records)):
        if record.get("saved") is False:
            inexact_resume(accelerator, f"{path} has no position for loader {index} of rank "
                                        f"{accelerator.process_index} (it could not be saved; see the WARNING of "
                                        "that save)")
            continue
        fits = loader.fits(record)
        if not fits:
            inexact_resume(accelerator, f"{path}: the saved position {dict(record)} of loader {index} does not fit "
                                        f"it ({loader.settings()} on rank {accelerator.process_index}; the data set, "
                                        "its kind, batch size, drop_last or world size changed); its epoch restarts",
                           ConfigDriftError)
        loader.load_position(record, restart_epoch=not fits)
    accelerator._resume_watch.record(accelerator._resumable_loaders)


def restore_custom_objects(accelerator: ResumableAccelerator, path: Path, states: list[Any]) -> None:
    if len(states) != len(accelerator._custom_objects):
        inexact_resume(accelerator, f"{path} holds {len(states)} registered custom object(s), "
                                    f"{len(accelerator._custom_objects)} are registered now")
        return
    for obj, state in zip(accelerator._custom_objects, states):
        obj.load_state_dict(state)


def restore_rng(accelerator: ResumableAccelerator, path: Path, loaded: LoadedCheckpoint) -> None:
    restore_resumed_rng(
        loaded.rng_state, across_world_sizes=accelerator._world_size_mode.resumes_across(),
        allow_inexact_resume=accelerator.resume_options.allow_inexact_resume,
        missing=lambda: inexact_resume(accelerator, f"{path} has no RNG state for rank {accelerator.process_index}"))


def resolve_checkpoint(accelerator: ResumableAccelerator, input_dir: str | os.PathLike) -> Path:
    """The checkpoint an explicit ``load_state(input_dir)`` loads (without one: :func:`resume_newest`)."""
    if is_remote(input_dir):  # hf://user/repo[@rev][/path] or s3://bucket/run[/checkpoint-N]
        return resolve_resume_path(input_dir, cache_dir=accelerator.checkpoint_dir / ".remote-resume",
                                   storage_options=accelerator.resume_options.storage_options)
    path = Path(os.path.expanduser(os.fspath(input_dir)))
    # The main process looks; every process raises the same error (none is left waiting in a collective).
    problem = broadcast_json(describe_missing(accelerator, path) if accelerator.is_main_process else None)
    if problem is not None:
        kind, message = problem
        raise (CheckpointPathNotFoundError if kind == "missing" else IncompleteCheckpointError)(message)
    return path


def describe_missing(accelerator: ResumableAccelerator, path: Path) -> tuple[str, str] | None:
    """``(kind, message)`` if ``path`` cannot be loaded (looks at the disk), else ``None``; kind is ``"missing"``
    or ``"foreign"`` (a stock accelerate checkpoint is named as such)."""
    if not path.exists():
        root = accelerator.checkpoint_dir if _has_root(accelerator) else "it"
        return "missing", (f"{path} does not exist. Check the path, or call load_state() without an argument to "
                           f"resume from the newest valid checkpoint under {root}.")
    if not path.is_dir():
        return "missing", f"{path} is a file, not a checkpoint directory."
    stock = stock_accelerate_files(path)
    if stock and not (path / MANIFEST_FILE).exists():
        return "foreign", (
            f"{path} was written by stock accelerate ({', '.join(stock[:4])}): its optimizer, scheduler, RNG and "
            "registered-object states are pickle files, which hf_resumable never loads (unpickling runs code). "
            "Resume it once with accelerate's own Accelerator and save it with ResumableAccelerator, or start "
            "from its model weights.")
    return None


def _has_root(accelerator: ResumableAccelerator) -> bool:
    return accelerator.resume_options.checkpoint_dir is not None or accelerator.project_dir is not None


def inexact_resume(accelerator: ResumableAccelerator, message: str,
                   error: type[InexactResumeError] = InexactResumeError) -> None:
    """A piece of the exact resume is missing: raise ``error``, or WARN under ``allow_inexact_resume``."""
    inexact(message, allow=accelerator.resume_options.allow_inexact_resume, owner="ResumableAccelerator", error=error)
