"""What ``ResumableTrainer`` writes at a save (:func:`save_trainer_checkpoint`, its ``_save_checkpoint``) and what
follows the commit (:func:`after_commit`). The restore side is :mod:`._trainer_restore`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.trainer_callback import ExportableState

from ..checkpoint import apply_retention, save_checkpoint
from ..checkpoint.api import background_saver
from ..constants import CHECKPOINT_PREFIX, TRAINER_STATE_FILE
from ..data import dataset_fingerprint
from ..format.state import RunConfig
from ._deepspeed import EXTRA_DEEPSPEED, capture_engine_state, checkpoint_optimizer, deepspeed_engine
from ._engines import checkpoint_model
from ._parallelism import KEY_PARALLELISM
from ._trainer_data import data_position
from ._trainer_discovery import CONVERTED_DIR
from ._trainer_family import encode_attribute
from ._trainer_hparams import hyperparameter_snapshot

if TYPE_CHECKING:
    from .trainer import ResumableTrainer

logger = logging.getLogger(__name__)

__all__ = ["EXTRA_ELASTIC", "EXTRA_HYPERPARAMETERS", "EXTRA_MODEL_ONLY", "EXTRA_PARALLELISM", "EXTRA_RUN_CONFIG",
           "PROGRESS_ATTRIBUTES", "PROGRESS_LOOP", "after_commit", "conversion_to_drop", "current_run_config",
           "drop_conversion", "export_callback_states", "loop_state", "metrics_of_this_step",
           "save_trainer_checkpoint", "trainer_attributes", "update_best_checkpoint"]

# Keys of the progress record saved in training_state.json["progress"].
PROGRESS_LOOP = "trainer_loop"  # accumulators of the logging loop (exact floats)
PROGRESS_ATTRIBUTES = "trainer_attributes"  # resumable_state_attributes of a Trainer subclass (TRL counters)
# Keys of the checkpoint's extra record.
EXTRA_RUN_CONFIG = "run_config"  # RunConfig.to_dict()
EXTRA_MODEL_ONLY = "model_only"  # True when saved with save_only_model (cannot resume exactly)
EXTRA_HYPERPARAMETERS = "hyperparameters"  # _trainer_hparams.hyperparameter_snapshot()
EXTRA_ELASTIC = "elastic"  # True when written with elastic=True (the elastic sample layout)
EXTRA_PARALLELISM = KEY_PARALLELISM  # ParallelLayout.describe() of a tensor/N-D parallel run (None without one)


def save_trainer_checkpoint(trainer: ResumableTrainer, model: torch.nn.Module, trial: Any) -> None:
    """Write ``checkpoint-<global_step>`` (everything captured at this step): in the background with ``save_async``,
    except the save before a preemption exit; what follows the commit runs once it has committed."""
    # the previous background save has committed (or its failure is raised here)
    trainer._settle_saves(removals=False)
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = Path(trainer._get_output_dir(trial=trial))
    output_dir = run_dir / f"{CHECKPOINT_PREFIX}{trainer.state.global_step}"
    update_best_checkpoint(trainer, run_dir)
    export_callback_states(trainer)
    model_only = trainer.args.save_only_model
    # The SIGTERM save is blocking: the process exits right after it.
    blocking = not trainer._saves_in_background() or trainer.preempted
    unwrapped = checkpoint_model(trainer.model, trainer.accelerator.unwrap_model(trainer.model))  # FSDP1: its root
    optimizer = checkpoint_optimizer(trainer.optimizer)  # ZeRO: this rank's partitions
    engine = deepspeed_engine(trainer.model_wrapped)
    save_checkpoint(  # FSDP1/2 / ZeRO: every rank writes its pieces
        output_dir, model=unwrapped,
        optimizer=None if model_only else optimizer,
        scheduler=None if model_only else trainer.lr_scheduler,
        scaler=None if model_only else trainer.accelerator.scaler,
        step=trainer.state.global_step,
        training_state={PROGRESS_LOOP: loop_state(trainer), PROGRESS_ATTRIBUTES: trainer_attributes(trainer)},
        extra={EXTRA_RUN_CONFIG: current_run_config(trainer).to_dict(), EXTRA_MODEL_ONLY: model_only,
               EXTRA_HYPERPARAMETERS: hyperparameter_snapshot(trainer.args, max_steps=trainer.state.max_steps),
               EXTRA_ELASTIC: trainer._world_size_mode.enabled,
               EXTRA_PARALLELISM: None if trainer._layout() is None else trainer._layout().describe(),
               **({EXTRA_DEEPSPEED: capture_engine_state(engine, [optimizer])} if engine is not None else {})},
        extra_files={TRAINER_STATE_FILE: json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True)},
        data_state=data_position(trainer), rng=not model_only, metrics=metrics_of_this_step(trainer),
        # as Trainer._save: without a processing_class, the collator's tokenizer is saved
        processing_class=trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None), overwrite=True,
        standalone=trainer.resume_options.standalone_checkpoints, blocking=blocking)
    conversion = conversion_to_drop(trainer)
    saver = background_saver()  # a blocking save's fsyncs may still run there (durability "deferred")
    trainer._commits.attach(saver.future if not blocking or saver.in_flight else None,
                         lambda: after_commit(trainer, output_dir, run_dir, conversion))


def after_commit(trainer: ResumableTrainer, checkpoint: Path, run_dir: Path, conversion: Path | None) -> None:
    """What follows a checkpoint's commit: drop a converted stock checkpoint, push, upload, apply retention.

    Rank-local (no collective): a background save may be known to have committed at different steps on
    different ranks.
    """
    drop_conversion(conversion)
    if trainer.args.push_to_hub:
        trainer._push_from_checkpoint(str(checkpoint))
    if trainer._uploader is not None and trainer.args.should_save:
        trainer._uploader.submit(checkpoint)
    if trainer.args.should_save and trainer.args.save_total_limit:
        protect = [trainer.state.best_model_checkpoint] if trainer.state.best_model_checkpoint else []
        protect += list(trainer._uploader.pending()) if trainer._uploader is not None else []
        apply_retention(run_dir, keep_last=max(1, trainer.args.save_total_limit), protect=protect,
                        background=True)


def update_best_checkpoint(trainer: ResumableTrainer, run_dir: Path) -> None:
    # Same rule as Trainer._save_checkpoint: the best step's directory becomes best_model_checkpoint.
    if trainer.args.save_strategy in ("steps", "epoch", "best") and trainer.state.best_global_step:
        if trainer.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED:
            torch.distributed.barrier()
        best = run_dir / f"{CHECKPOINT_PREFIX}{trainer.state.best_global_step}"
        if best.exists() or trainer.state.best_global_step == trainer.state.global_step:
            trainer.state.best_model_checkpoint = str(best)


def export_callback_states(trainer: ResumableTrainer) -> None:
    # Same as Trainer._save_checkpoint: ExportableState callbacks and TrainerControl into the state.
    for callback in trainer.callback_handler.callbacks + [trainer.control]:
        if isinstance(callback, ExportableState):
            name = callback.__class__.__name__
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(callback.state())
            else:
                trainer.state.stateful_callbacks[name] = callback.state()


def metrics_of_this_step(trainer: ResumableTrainer) -> dict[str, float]:
    if trainer._last_eval is None or trainer._last_eval[0] != trainer.state.global_step:
        return {}
    return {k: float(v) for k, v in trainer._last_eval[1].items() if isinstance(v, (int, float))}


def loop_state(trainer: ResumableTrainer) -> dict[str, Any]:
    """The logging loop's accumulators, so the next logged loss averages the same steps as without a restart,
    and where the step stands in the loop (stopped, end-of-epoch bookkeeping done) so a restart neither
    repeats nor skips any of it."""
    loop = trainer._loop
    return {"tr_loss": float(trainer._tr_loss.item()), "total_loss_scalar": float(trainer._total_loss_scalar),
            "globalstep_last_logged": int(trainer._globalstep_last_logged),
            "initial_global_step": int(trainer._initial_global_step),
            # stopped before max_steps by a callback (EarlyStoppingCallback...); reaching max_steps is not
            # recorded as a stop, so a restart with a larger max_steps continues
            "stopped": (bool(trainer.control.should_training_stop)
                        and trainer.state.global_step < trainer.state.max_steps),
            "epoch_end_done": loop.in_epoch_end,
            # train/eval mode after this step's evaluation (TRL's log() picks its metrics by it)
            "model_training": bool(trainer.model.training),
            "grad_norm": loop.grad_norm, "learning_rate": loop.learning_rate}


def trainer_attributes(trainer: ResumableTrainer) -> dict[str, Any]:
    return {name: encode_attribute(getattr(trainer, name)) for name in trainer.resumable_state_attributes
            if hasattr(trainer, name)}


def current_run_config(trainer: ResumableTrainer) -> RunConfig:
    if trainer._run_config is None:
        seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed
        length, fingerprint = dataset_fingerprint(trainer.train_dataset, seed=seed)
        trainer._run_config = RunConfig(
            gradient_accumulation_steps=trainer.args.gradient_accumulation_steps,
            per_device_train_batch_size=trainer.args.per_device_train_batch_size,
            world_size=trainer._data_parallel()[1], seed=trainer.args.seed, data_seed=trainer.args.data_seed,
            dataset_length=length, dataset_fingerprint=fingerprint,
            train_sampling_strategy=str(trainer.args.train_sampling_strategy),
            dataloader_drop_last=bool(trainer.args.dataloader_drop_last))
    return trainer._run_config


def conversion_to_drop(trainer: ResumableTrainer) -> Path | None:
    """The converted copy of a stock checkpoint this run resumed from (removed once a checkpoint committed)."""
    resume = trainer._resume
    if resume is None or resume.converted_from is None or not trainer.args.should_save:
        return None
    return resume.path if resume.path.parent == Path(trainer.args.output_dir) / CONVERTED_DIR else None


def drop_conversion(path: Path | None) -> None:
    if path is not None and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty
