"""The capture side of ``ResumableAccelerator``'s saves: optimizer step counting, the fingerprint that proves a
checkpoint already holds the current state, and :func:`capture_state` (what ``save_state`` hands the checkpoint
writer; the restore side is :mod:`._accelerate_restore`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..checkpoint import verify_checkpoint
from ..checkpoint.pieces import is_dtensor
from ..distributed import all_gather_json, broadcast_json
from ..format.rng import capture_rng_state
from ._accelerate_elastic import KEY_ELASTIC
from ._accelerate_objects import KIND_MODULE, SLOT_CORE, encode_optimizer, parameter_keys, plan_layout
from ._accelerate_paths import HookFileConflictError, collect_hook_files, hook_file_conflicts
from ._deepspeed import EXTRA_DEEPSPEED, capture_engine_state, register_step_hook
from ._engines import checkpoint_model
from ._parallelism import KEY_PARALLELISM, layout_of

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

logger = logging.getLogger(__name__)

__all__ = ["DATA_LOADERS", "EXTRA_CUSTOM_OBJECTS", "EXTRA_LAYOUT", "EXTRA_MODELS", "EXTRA_OPTIMIZERS", "EXTRA_RUN",
           "EXTRA_SCHEDULERS", "PROGRESS_GLOBAL_STEP", "PROGRESS_ITERATION", "PROGRESS_MICRO_STEP",
           "PROGRESS_OPTIMIZER_STEPS", "StepCounts", "StepHook", "accelerator_fingerprint", "attach_step_hooks",
           "capture_state", "holds_current_state", "model_weights", "optimizer_step_counts", "run_save_hooks",
           "run_settings", "set_optimizer_step_counts", "state_fingerprint", "warn_save_options"]

# training_state keys (the progress cursor).
PROGRESS_GLOBAL_STEP = "global_step"  # completed optimizer steps (accumulation windows)
PROGRESS_MICRO_STEP = "accelerate_micro_step"  # Accelerator.step, accelerate's own micro-step counter
PROGRESS_OPTIMIZER_STEPS = "optimizer_steps"  # real steps of each prepared optimizer, in preparation order
PROGRESS_ITERATION = "project_iteration"  # ProjectConfiguration.iteration of an automatic checkpoint_<iteration>
# extra keys.
EXTRA_RUN = "accelerate_run"  # the settings a bit-exact resume depends on (see run_settings)
EXTRA_LAYOUT = "accelerate_layout"  # where each model/optimizer/scheduler went (Layout.to_json)
EXTRA_CUSTOM_OBJECTS = "custom_objects"  # state_dict() of objects passed to register_for_checkpointing
EXTRA_MODELS = "models"  # weights of saved models 1, 2, ... (model 0 is the checkpoint's model)
EXTRA_OPTIMIZERS = "optimizers"  # per optimizer: its name-keyed state, or None when it is the checkpoint's own
EXTRA_SCHEDULERS = "schedulers"  # state_dict() of schedulers 1, 2, ... (scheduler 0 is the checkpoint's own)
# data_state key: the positions of the prepared resumable loaders, in preparation order.
DATA_LOADERS = "loaders"

# Tensors up to this size are digested by content; larger ones by identity and version counter.
_CONTENT_DIGEST_BYTES = 1 << 16


class StepCounts:
    """Optimizer steps of one accelerator: ``global_step`` is the count of the most-stepped optimizer."""

    def __init__(self, global_step: int = 0) -> None:
        self.global_step = global_step


class StepHook:
    """``register_step_post_hook`` callback counting the real steps of one optimizer into ``counts`` (shared with the
    accelerator). torch calls it only when the optimizer really stepped, so accumulation micro-steps and steps a
    ``GradScaler`` skipped are not counted, however the loop is written."""

    def __init__(self, counts: StepCounts) -> None:
        self.counts = counts
        self.count = 0

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1
        self.counts.global_step = max(self.counts.global_step, self.count)


def attach_step_hooks(accelerator: ResumableAccelerator) -> None:
    """A :class:`StepHook` on every prepared optimizer that has none yet."""
    for optimizer in accelerator._optimizers:
        if getattr(optimizer, "_hf_resumable_step_hook", None) is None:
            hook = StepHook(accelerator._step_counts)
            register_step_hook(optimizer, hook)  # under ZeRO: the one over its partitions, once per step
            optimizer._hf_resumable_step_hook = hook


def optimizer_step_counts(accelerator: ResumableAccelerator) -> list[int]:
    """The real steps of each prepared optimizer, in preparation order."""
    attach_step_hooks(accelerator)
    return [optimizer._hf_resumable_step_hook.count for optimizer in accelerator._optimizers]


def set_optimizer_step_counts(accelerator: ResumableAccelerator, counts: list[int]) -> None:
    """Restore the real steps of each prepared optimizer (a resume)."""
    attach_step_hooks(accelerator)
    for optimizer, count in zip(accelerator._optimizers, counts):
        optimizer._hf_resumable_step_hook.count = int(count)



class _Digest:
    """Feeds values into one blake2b digest in a canonical, type-tagged form."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def text(self, value: str) -> None:
        data = value.encode()
        self._hash.update(len(data).to_bytes(8, "little") + data)

    def tensor(self, tensor: torch.Tensor) -> None:
        if is_dtensor(tensor):  # FSDP2: this rank's piece (every rank digests its own; the save compares them all)
            self.text(f"P{tensor.placements}")
            tensor = tensor.to_local()
        self.text(f"T{tuple(tensor.shape)}{tensor.dtype}{tensor.device}")
        if tensor.numel() * tensor.element_size() <= _CONTENT_DIGEST_BYTES and tensor.device.type != "meta":
            self._hash.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            # Identity and autograd version counter: every in-place write (optimizer step, copy_, load_state_dict)
            # bumps ``_version``; the data pointer catches a swapped storage.
            self.text(f"{id(tensor)}/{tensor.data_ptr()}/{tensor._version}")

    def value(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensor(value)
        elif isinstance(value, np.ndarray):
            self.text(f"A{value.dtype}{value.shape}")
            self._hash.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, Mapping):
            self.text(f"D{len(value)}")
            for key, item in value.items():
                self.value(key)
                self.value(item)
        elif isinstance(value, (list, tuple)):
            self.text(f"{'L' if isinstance(value, list) else 'U'}{len(value)}")
            for item in value:
                self.value(item)
        else:
            self.text(f"{type(value).__qualname__}:{value!r}")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _module_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def state_fingerprint(*, models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                      small_state: Any) -> str:
    """A digest of everything a save writes; equal digests mean nothing changed in between.

    Large tensors (parameters, buffers, optimizer state) are digested by identity and autograd version counter (every
    in-place update bumps it), ``small_state`` (JSON-like: counters, state dicts, positions) and the RNG states by
    content.

    Example:

    ```python
    >>> import torch  # doctest: +SKIP
    >>> model = torch.nn.Linear(2, 1)  # doctest: +SKIP
    >>> before = state_fingerprint(models=[model], optimizers=[], small_state={"step": 1})  # doctest: +SKIP
    >>> with torch.no_grad():  # doctest: +SKIP
    ...     model.weight.add_(1.0)
    >>> before == state_fingerprint(models=[model], optimizers=[], small_state={"step": 1})  # doctest: +SKIP
    False
    ```
    """
    digest = _Digest()
    for index, model in enumerate(models):
        digest.text(f"model{index}")
        for name, tensor in _module_tensors(model):
            digest.text(name)
            digest.tensor(tensor)
    for index, optimizer in enumerate(optimizers):
        digest.text(f"optimizer{index}")
        for group in optimizer.param_groups:
            digest.value({k: v for k, v in group.items() if k != "params"})
            digest.text(",".join(str(id(p)) for p in group["params"]))
        for param, state in optimizer.state.items():
            digest.text(str(id(param)))
            digest.value(state)
    digest.value(small_state)
    rng = capture_rng_state()
    digest.text(json.dumps(rng.python[1]) + repr(rng.python[0]) + repr(rng.python[2]))
    digest.value(list(rng.numpy))
    digest.tensor(rng.torch_cpu)
    for state in rng.cuda:
        digest.tensor(state)
    return digest.hexdigest()


def model_weights(accelerator: ResumableAccelerator) -> list[Any]:
    """accelerate's ``weights`` list for the save hooks: each prepared model's state dict (not unwrapped)."""
    return [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]


def capture_state(accelerator: ResumableAccelerator) -> dict[str, Any]:
    """The keyword arguments of :func:`~hf_resumable.save_checkpoint` for the accelerator's prepared objects, after
    running the ``save_state`` pre-hooks in a staging directory.

    Raises:
        HookFileConflictError: a pre-hook wrote a file whose name the checkpoint format uses.
    """
    originals = (model_weights(accelerator) if accelerator._save_model_state_pre_hook
                 else [None] * len(accelerator._models))
    weights = list(originals)
    hook_files = run_save_hooks(accelerator, weights)
    # FSDP1: its root
    unwrapped = [checkpoint_model(model, accelerator.unwrap_model(model)) for model in accelerator._models]
    optimizers = accelerator._checkpoint_optimizers()
    if not accelerator._save_model_state_pre_hook:
        weights = originals = list(unwrapped)  # no hook could have changed them
    layout = plan_layout(weights=weights, originals=originals, models=unwrapped, optimizers=optimizers,
                         schedulers=len(accelerator._schedulers), custom_objects=len(accelerator._custom_objects),
                         hook_files=list(hook_files), hooks_registered=bool(accelerator._save_model_state_pre_hook))
    model_slot = bool(layout.models)
    conflicts = hook_file_conflicts(hook_files, model_slot=model_slot,
                                    optimizer_slot=SLOT_CORE in layout.optimizers)
    if conflicts:
        raise HookFileConflictError(f"save_state pre-hook(s) wrote {conflicts}, which the hf_resumable checkpoint "
                                    "writes itself; write them under another name or in a subdirectory.")

    def slot_state(index: int) -> Any:
        if layout.models[index] == KIND_MODULE:  # model ``index``'s own weights, unchanged by the hooks
            return unwrapped[index] if index == 0 else unwrapped[index].state_dict()
        return weights[index]  # a state dict a hook put there, saved (and loaded) as accelerate would

    engine = accelerator._deepspeed_engine()
    extra = {EXTRA_RUN: run_settings(accelerator), EXTRA_LAYOUT: layout.to_json(),
             **({EXTRA_DEEPSPEED: capture_engine_state(engine, optimizers[:1])} if engine is not None else {}),
             EXTRA_CUSTOM_OBJECTS: [obj.state_dict() for obj in accelerator._custom_objects],
             EXTRA_MODELS: [slot_state(i) for i in range(1, len(layout.models))],
             EXTRA_OPTIMIZERS: [None if slot == SLOT_CORE else
                                encode_optimizer(opt, parameter_keys(unwrapped, opt))
                                for slot, opt in zip(layout.optimizers, optimizers)],
             EXTRA_SCHEDULERS: [scheduler.state_dict() for scheduler in accelerator._schedulers[1:]]}
    return {
        "model": slot_state(0) if model_slot else None,
        "optimizer": optimizers[0] if layout.optimizers[:1] == [SLOT_CORE] else None,
        "scheduler": (getattr(accelerator._schedulers[0], "scheduler", accelerator._schedulers[0])
                      if accelerator._schedulers else None),
        "scaler": accelerator.scaler,
        "training_state": {PROGRESS_GLOBAL_STEP: accelerator.global_step, PROGRESS_MICRO_STEP: accelerator.step,
                           PROGRESS_OPTIMIZER_STEPS: optimizer_step_counts(accelerator),
                           **({PROGRESS_ITERATION: accelerator.save_iteration}
                              if accelerator.project_configuration.automatic_checkpoint_naming else {})},
        "extra": extra,
        "extra_files": hook_files,
        "data_state": {DATA_LOADERS: [loader.position() for loader in accelerator._resumable_loaders]},
    }


def run_save_hooks(accelerator: ResumableAccelerator, weights: list[Any]) -> dict[str, bytes]:
    """Run the ``save_state`` pre-hooks with a staging directory; return the files they wrote (main process)."""
    if not accelerator._save_model_state_pre_hook:
        return {}
    with tempfile.TemporaryDirectory(prefix="hf_resumable-save-hooks-") as staging:
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(accelerator._models, weights, staging)
        files = collect_hook_files(Path(staging))
    if files and not accelerator.is_main_process:
        logger.warning("save_state pre-hooks wrote %s on process %d; only the main process's files are saved.",
                       sorted(files)[:5], accelerator.process_index)
    return files if accelerator.is_main_process else {}


def accelerator_fingerprint(accelerator: ResumableAccelerator, target: Path) -> str:
    """Digest of everything ``save_state`` writes to ``target`` (see :func:`state_fingerprint`)."""
    small = {"target": str(target), "global_step": accelerator.global_step, "micro_step": accelerator.step,
             "optimizer_steps": optimizer_step_counts(accelerator),
             "schedulers": [scheduler.state_dict() for scheduler in accelerator._schedulers],
             "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
             "custom_objects": [obj.state_dict() for obj in accelerator._custom_objects],
             "loaders": [loader.position() for loader in accelerator._resumable_loaders],
             "hooks": [id(hook) for hook in accelerator._save_model_state_pre_hook.values()]}
    engine = accelerator._deepspeed_engine()
    small["engine"] = capture_engine_state(engine, []) if engine is not None else None
    optimizers = accelerator._checkpoint_optimizers()
    return state_fingerprint(models=accelerator._models, optimizers=optimizers, small_state=small)


def run_settings(accelerator: ResumableAccelerator) -> dict[str, Any]:
    """The settings a bit-exact resume depends on (``EXTRA_RUN``), compared by ``load_state``."""
    settings = {"world_size": accelerator.num_processes,
                "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
                "loaders": [loader.settings() for loader in accelerator._resumable_loaders],
                KEY_ELASTIC: accelerator._world_size_mode.enabled}
    layout = layout_of(accelerator.parallelism_config)
    if layout is not None:  # another N-D layout on resume is drift, named by both layouts
        settings[KEY_PARALLELISM] = layout.describe()
    settings.update(accelerator._world_size_mode.recorded_settings())  # elastic: the scheduler rate
    return settings


def warn_save_options(accelerator: ResumableAccelerator, safe_serialization: bool,
                      options: Mapping[str, Any]) -> None:
    """One WARNING per accelerate ``save_state`` option that changes nothing here (pickle, DeepSpeed's own save)."""
    if not safe_serialization and not accelerator._warned.get("safe_serialization"):
        accelerator._warned["safe_serialization"] = True
        logger.warning("save_state(safe_serialization=False) asks for pickle files; hf_resumable never writes "
                       "pickle, so the checkpoint is written as safetensors and JSON anyway.")
    if options and not accelerator._warned.get("save_options"):
        accelerator._warned["save_options"] = True
        logger.warning("save_state(%s): these options configure DeepSpeed's own save_checkpoint, which "
                       "ResumableAccelerator does not use; ignored.", ", ".join(sorted(options)))


def holds_current_state(accelerator: ResumableAccelerator, target: Path, fingerprint: str | None) -> bool:
    """Whether ``target`` provably holds the current state already, on every process (collective): the checkpoint
    this accelerator committed there has ``fingerprint`` on every rank and still verifies."""
    # every rank's own state unchanged (its pieces, its RNG), and the checkpoint intact
    unchanged = all(all_gather_json(fingerprint is not None and accelerator._committed.get(target) == fingerprint))
    on_disk = accelerator.is_main_process and unchanged and verify_checkpoint(target, full=False).ok
    if broadcast_json(on_disk):
        if accelerator.is_main_process:
            logger.info("%s already holds exactly the current state (step %d); not writing it again.", target,
                        accelerator.global_step)
        return True
    return False
