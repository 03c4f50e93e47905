"""How :class:`~hf_resumable.integrations.trainer.ResumableTrainer` resumes: the checkpoint it starts from
(:func:`resolve_checkpoint`, a stock ``Trainer`` checkpoint converted), what it checks before the Trainer loads
anything (:func:`open_for_resume`: drift, layout, elastic plan), and the restore of weights, optimizer, RNG, logging
loop and trainer attributes at the points where ``Trainer`` asks for them. The save side is
:mod:`~hf_resumable.integrations._trainer_state`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer

from ..checkpoint import VerifyReport, load_checkpoint, open_checkpoint, read_manifest, verify_checkpoint
from ..checkpoint.api import read_on_load
from ..constants import CHECKPOINT_DIR_RE, LAYOUT_FILE, OPTIMIZER_INDEX_FILE
from ..distributed import rank_and_world_size
from ..errors import HfResumableError
from ..format.state import RunConfig
from ..locations import is_remote, resolve_resume_path
from ._core import check_drift, restore_resumed_rng
from ._deepspeed import (
    checkpoint_optimizer,
    deepspeed_engine,
    restore_engine_state,
    saved_engine_state,
    torch_optimizer,
)
from ._engines import checkpoint_model
from ._fallback import agreed_load, find_agreed_checkpoint, refuse_fresh_start
from ._trainer_discovery import (
    CONVERTED_DIR,
    CheckpointKind,
    classify_checkpoint_dir,
    newest_stock_checkpoint,
    not_a_checkpoint_error,
)
from ._trainer_family import restore_attribute
from ._trainer_hparams import apply_new_hyperparameters
from ._trainer_state import (
    EXTRA_ELASTIC,
    EXTRA_MODEL_ONLY,
    EXTRA_PARALLELISM,
    EXTRA_RUN_CONFIG,
    PROGRESS_ATTRIBUTES,
    PROGRESS_LOOP,
    current_run_config,
)

if TYPE_CHECKING:
    from .trainer import ResumableTrainer

logger = logging.getLogger(__name__)

__all__ = ["Resume", "convert_stock_checkpoint", "decay_groups", "is_conversion_of", "is_own_checkpoint",
           "layout_change", "load_best_model", "load_weights_and_optimizer", "open_for_resume", "resolve_checkpoint",
           "restore_loop_state", "restore_rng", "restore_trainer_attributes", "resume_prologue", "step_of"]


def step_of(path: Path) -> int:
    match = CHECKPOINT_DIR_RE.match(Path(path).name)
    return int(match.group(1)) if match else -1


def is_conversion_of(target: Path, stock: Path) -> bool:
    """Whether ``target`` is a committed conversion of ``stock`` made after ``stock`` last changed."""
    try:
        manifest = read_manifest(target)
        newest_source = max(p.stat().st_mtime for p in stock.iterdir() if p.is_file())
    except (HfResumableError, OSError, ValueError):
        return False
    return manifest.step == step_of(stock) and manifest.created >= newest_source and not verify_checkpoint(
        target, full=False).problems


def is_own_checkpoint(path: Path) -> bool:
    try:
        read_manifest(path)
    except (HfResumableError, OSError):
        return False
    return True


@dataclasses.dataclass
class Resume:
    """What train() read from the checkpoint it resumes from, before the Trainer loads the weights."""

    path: Path
    loaded: Any  # LoadedCheckpoint (training state, extra, data state, RNG state)
    converted_from: Path | None = None  # the stock transformers.Trainer checkpoint ``path`` was converted from


def resolve_checkpoint(trainer: ResumableTrainer, resume_from_checkpoint: str | bool | os.PathLike | None
                        ) -> tuple[Path | None, VerifyReport | None]:
    """The checkpoint to resume from, and the verification that chose it (handed to the open, so that a resume
    verifies the checkpoint and reads its small files once)."""
    if resume_from_checkpoint in (None, False):
        return None, None
    output_dir = trainer.args.output_dir
    if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
        report = find_agreed_checkpoint(output_dir, pattern=CHECKPOINT_DIR_RE)
        latest = None if report is None else Path(report.path)
        stock = newest_stock_checkpoint(output_dir)
        if stock is not None and (latest is None or stock.step > step_of(latest)):
            logger.info("The newest checkpoint under %s is %s, written by the stock transformers.Trainer.",
                        output_dir, stock.path)
            return convert_stock_checkpoint(trainer, stock.path), None
        if latest is None:
            refuse_fresh_start(output_dir, pattern=CHECKPOINT_DIR_RE, owner="ResumableTrainer")
            logger.info("No valid checkpoint under %s: starting a fresh run.", output_dir)
        else:
            logger.info("Resuming from %s (newest checkpoint that verifies).", latest)
        return latest, report
    if is_remote(resume_from_checkpoint):  # hf://user/repo[@rev][/path] or s3://bucket/run[/checkpoint-N]
        cache = Path(output_dir) / ".remote-resume"
        return resolve_resume_path(resume_from_checkpoint, cache_dir=cache, token=trainer.args.hub_token,
                                   storage_options=trainer.resume_options.storage_options), None
    path = Path(resume_from_checkpoint)
    kind = classify_checkpoint_dir(path)
    if kind is CheckpointKind.STOCK:
        return convert_stock_checkpoint(trainer, path), None
    if kind is not CheckpointKind.OURS:
        raise not_a_checkpoint_error(path, output_dir)
    report = verify_checkpoint(path, full=trainer.resume_options.checkpoint_verify == "full", raise_on_error=True,
                               keep=read_on_load(rank_and_world_size()[0]))
    return path, report


def convert_stock_checkpoint(trainer: ResumableTrainer, stock: Path) -> Path:
    """Convert a stock ``transformers.Trainer`` checkpoint under ``output_dir/.hf-resumable-converted``.

    The stock files are only read (pickles with ``torch.load(weights_only=True)``, after the converter's
    WARNING); the stock directory is never changed or deleted. The weights are read by the stock
    ``Trainer._load_from_checkpoint`` into this trainer's model (any model class, PEFT adapters included).
    """
    from ..conversions.stock import convert_trainer_checkpoint

    target = Path(trainer.args.output_dir) / CONVERTED_DIR / stock.name
    logger.warning("Resuming from %s, a checkpoint of the stock transformers.Trainer, converted to %s. This "
                   "resume is NOT bit-exact: the stock checkpoint has no data position, logging accumulators "
                   "or run configuration, and hf_resumable's sample order differs from the stock sampler's. "
                   "Every checkpoint this run writes resumes bit for bit.", stock, target)
    # one process per filesystem converts (save_on_each_node: node-local output_dirs), the others wait for it
    with trainer.args.main_process_first(local=trainer.args.save_on_each_node, desc="converting a stock checkpoint"):
        if not is_conversion_of(target, stock):
            Trainer._load_from_checkpoint(trainer, str(stock))
            convert_trainer_checkpoint(stock, target, model=trainer.accelerator.unwrap_model(trainer.model),
                                       overwrite=target.exists())
    trainer._converted_from = stock
    return target


def open_for_resume(trainer: ResumableTrainer, path: Path, verified: VerifyReport | None = None) -> Resume:
    # Opened (decoded) once here, with the verification that found it; the weights and optimizer are filled from
    # this same object in _load_optimizer_and_scheduler, so a resume never verifies, reads or hashes a file twice.
    loaded = open_checkpoint(path, verify=trainer.resume_options.checkpoint_verify, verified=verified,
                             reshard=trainer.resume_options.elastic)  # FSDP2/ZeRO pieces: resharded
    converted_from, trainer._converted_from = trainer._converted_from, None
    if converted_from is not None or loaded.extra.get("converted_from"):
        return Resume(path=path, loaded=loaded, converted_from=converted_from or path)
    if loaded.extra.get(EXTRA_MODEL_ONLY):
        trainer._inexact(f"{path} was saved with save_only_model=True (no optimizer, scheduler or RNG state)")
    saved = loaded.extra.get(EXTRA_RUN_CONFIG)
    if saved is None:
        trainer._inexact(f"{path} records no run configuration (not written by ResumableTrainer)")
    else:
        saved_config = RunConfig.from_dict(saved)
        mode = trainer._world_size_mode
        plan = mode.plan_load(trainer, saved_config, path)
        changed = mode.drift(saved_config.diff(current_run_config(trainer)), plan)
        layouts = (bool(loaded.extra.get(EXTRA_ELASTIC)), mode.enabled)
        if layouts[0] != layouts[1]:
            changed["elastic"] = layouts
        changed.update(layout_change(trainer, loaded.extra))
        check_drift(changed, checkpoint=str(path), allow=trainer.resume_options.allow_config_drift,
                    option="allow_config_drift", owner="ResumableTrainer")
    return Resume(path=path, loaded=loaded)


def layout_change(trainer: ResumableTrainer, extra: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"parallelism": (saved, current)}`` when the checkpoint was written at another tensor/N-D layout
    (configuration drift, named by both), else nothing; with ``elastic=True`` another layout is taken (logged by
    the world-size mode).
    """
    current = trainer._layout()
    saved, now = extra.get(EXTRA_PARALLELISM), None if current is None else current.describe()
    if saved == now or EXTRA_PARALLELISM not in extra:  # a checkpoint from before layouts were recorded
        return {}
    return trainer._world_size_mode.layout_change(trainer, saved, now)


def restore_trainer_attributes(trainer: ResumableTrainer) -> None:
    saved = trainer._resume.loaded.training_state.get(PROGRESS_ATTRIBUTES) or {}
    for name, value in saved.items():
        if name in trainer.resumable_state_attributes:
            setattr(trainer, name, restore_attribute(getattr(trainer, name, None), value))
    missing = [name for name in trainer.resumable_state_attributes if hasattr(trainer, name) and name not in saved]
    if missing and trainer._resume.converted_from is None:
        trainer._inexact(f"{trainer._resume.path} does not hold the trainer attributes {missing} of "
                      f"{type(trainer).__name__}")


def restore_loop_state(trainer: ResumableTrainer) -> dict[str, Any] | None:
    loop = trainer._resume.loaded.training_state.get(PROGRESS_LOOP)
    if loop is None and trainer._resume.converted_from is not None:
        return None  # a stock checkpoint: the accumulators start from zero, as in a stock resume
    if loop is None:
        trainer._inexact(f"{trainer._resume.path} has no logging-loop state")
        return None
    trainer._tr_loss = torch.tensor(loop["tr_loss"], dtype=trainer._tr_loss.dtype, device=trainer._tr_loss.device)
    trainer._total_loss_scalar = loop["total_loss_scalar"]
    trainer._globalstep_last_logged = loop["globalstep_last_logged"]
    trainer._initial_global_step = loop["initial_global_step"]
    return loop


def resume_prologue(trainer: ResumableTrainer, *, model: torch.nn.Module, start_time: float) -> None:
    """Once per ``train``, before the first resumed step (or the end of training when nothing is left).

    Restores the logging accumulators; finishes the end-of-epoch work (``on_epoch_end``, epoch-strategy
    logging, evaluation and saving) that the uninterrupted run did right after the checkpoint's step; and
    recognises a checkpoint that ends the run (``max_steps`` reached, or the run asked to stop, e.g. by
    ``EarlyStoppingCallback``), so that re-running a finished run trains nothing and writes nothing.
    """
    loop = trainer._loop
    if loop.prologue_done:
        return
    loop.prologue_done = True
    if trainer._resume is None:
        return
    restore_trainer_attributes(trainer)
    record = restore_loop_state(trainer)
    if record is None:
        return
    if "model_training" in record:
        trainer.model.train(record["model_training"])
    step = trainer.state.global_step
    loop.finished = step >= trainer.state.max_steps or bool(record.get("stopped"))
    per_epoch = loop.steps_per_epoch or trainer.state.max_steps
    if step > 0 and (step % per_epoch == 0 or loop.finished) and not record.get("epoch_end_done", True):
        trainer._load_rng_state(str(trainer._resume.path))  # the RNG the epoch-end evaluation drew from
        trainer._rng_restored = True
        trainer.control.should_log = trainer.control.should_evaluate = trainer.control.should_save = False
        trainer.control = trainer.callback_handler.on_epoch_end(trainer.args, trainer.state, trainer.control)
        loop.last_call_step = step
        trainer._maybe_log_save_evaluate(trainer._tr_loss, record.get("grad_norm"), model, loop.trial,
                                      (step - 1) // per_epoch, loop.ignore_keys_for_eval, start_time,
                                      learning_rate=record.get("learning_rate"))
    if loop.finished:
        logger.info("%s is the end of this run (step %d of %d%s): nothing left to train.", trainer._resume.path,
                    step, trainer.state.max_steps, ", stopped by a callback" if record.get("stopped") else "")
        if not trainer._rng_restored:
            trainer._load_rng_state(str(trainer._resume.path))
            trainer._rng_restored = True


def load_weights_and_optimizer(trainer: ResumableTrainer, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    model_only = trainer._resume is not None and trainer._resume.loaded.extra.get(EXTRA_MODEL_ONLY)
    if trainer._resume is not None and trainer._resume.converted_from is not None:
        # a stock checkpoint saved with save_only_model has no optimizer state: a fresh optimizer, as stock
        files = trainer._resume.loaded.manifest.files  # a converted DeepSpeed checkpoint holds it in pieces
        model_only = OPTIMIZER_INDEX_FILE not in files and LAYOUT_FILE not in files
    opened = (trainer._resume.loaded if trainer._resume is not None and Path(checkpoint) == trainer._resume.path
              else open_checkpoint(checkpoint, verify=trainer.resume_options.checkpoint_verify,
                                   reshard=trainer.resume_options.elastic))
    model = checkpoint_model(trainer.model, trainer.accelerator.unwrap_model(trainer.model))  # FSDP1: its root
    optimizer = checkpoint_optimizer(trainer.optimizer)  # ZeRO: this rank's partitions
    objects = dict(optimizer=None if model_only else optimizer,
                   scheduler=None if model_only else trainer.lr_scheduler,
                   scaler=None if model_only else trainer.accelerator.scaler)
    engine = deepspeed_engine(trainer.model_wrapped)
    engine_state = None
    if engine is not None and not model_only:  # checked before anything is loaded
        engine_state = saved_engine_state(opened.extra, where=checkpoint)
    with agreed_load(checkpoint):  # a failed hash on any rank: ResumeLoadError on all (train's fallback)
        # FSDP2 / ZeRO: every rank reads its pieces' slices; a world-size change was already refused (or allowed)
        # by the run-config drift check
        opened.load_into(model=model, **objects, restore_rng=False, allow_inexact_resume=True)
        if engine_state is not None:
            restore_engine_state(engine, [optimizer], engine_state)
    changes = trainer._hyperparameter_changes and not model_only
    if changes and trainer.resume_options.resume_hyperparameters == "arguments":
        apply_new_hyperparameters(torch_optimizer(trainer.optimizer), trainer.lr_scheduler,
                                  trainer._hyperparameter_changes, decay_groups=decay_groups(trainer))


def decay_groups(trainer: ResumableTrainer) -> list[bool]:
    """Per optimizer param group: whether it holds only parameters ``Trainer`` applies weight decay to."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = set(trainer.get_decay_parameter_names(model))
    return [bool(group["params"]) and all(names.get(id(p)) in decay for p in group["params"])
            for group in trainer.optimizer.param_groups]


def restore_rng(trainer: ResumableTrainer, checkpoint: str | None) -> None:
    """Restore the RNG captured after the checkpoint's optimizer step; the Trainer calls this right
    before the first resumed forward pass (our data loading never touches the global RNG)."""
    if checkpoint is None or trainer._resume is None or trainer._rng_restored:
        return
    state = trainer._resume.loaded.rng_state
    if state is None and trainer._resume.converted_from is not None:
        return
    restore_resumed_rng(
        state, allow_inexact_resume=trainer.resume_options.allow_inexact_resume,
        across_world_sizes=trainer._world_size_mode.resumes_across(trainer._resume.loaded.manifest.world_size,
                                                                   trainer.args.world_size),
        missing=lambda: trainer._inexact(f"{checkpoint} has no RNG state for rank {trainer.args.process_index}"))


def load_best_model(trainer: ResumableTrainer) -> bool:
    """``Trainer._load_best_model`` for a checkpoint hf_resumable wrote; ``False`` for another one (the stock
    method loads it)."""
    best = trainer.state.best_model_checkpoint
    if not is_own_checkpoint(Path(best)):
        return False
    logger.info("Loading best model from %s (score: %s).", best, trainer.state.best_metric)
    model = checkpoint_model(trainer.model, trainer.accelerator.unwrap_model(trainer.model))  # FSDP1: its root
    # FSDP2 and ZeRO checkpoints hold per-rank pieces; under ZeRO-1/2 every rank loads the whole weights
    load_checkpoint(best, model=model, restore_rng=False, verify=trainer.resume_options.checkpoint_verify,
                    allow_inexact_resume=True)  # weights only: no drift
    return True
