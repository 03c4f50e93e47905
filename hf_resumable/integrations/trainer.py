"""``ResumableTrainer``: a drop-in ``transformers.Trainer`` whose restarts continue bit for bit (docs/trainer.md).

The only module that touches ``Trainer`` internals (checked at import). The class is a thin front door: its overrides
call the functions of the ``_trainer_*.py`` modules, which take the trainer as an argument (docs/architecture.md).
Checkpoints land on optimizer-step boundaries, exactly where ``Trainer`` saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
import transformers.trainer as _trainer_module
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState, TrainerCallback

from .. import trace
from ..checkpoint import VerifyReport
from ..checkpoint.api import saves_async
from ..constants import CHECKPOINT_DIR_RE
from ..data._loaders import StepPosition
from ..errors import AsyncSaveError, InexactResumeError, UnsupportedStateError
from ..format.state import RunConfig
from ..format.state_codec import encode_state
from ..locations import open_uploader
from ..preemption import PreemptionAction, PreemptionHandler, PreemptionProtocol, exit_after_preemption
from ._core import AfterCommit, ResumeOptions, check_upstream, inexact, notice_save_in_flight, patched
from ._deepspeed import checkpoint_optimizer, deepspeed_resume_by_us
from ._engines import check_trainer_engine
from ._fallback import ResumeLoadError, resume_newest
from ._parallelism import ParallelLayout, data_parallel_rank
from ._save_interval import AutoSaveInterval, check_save_strategy
from ._trainer_data import build_train_dataloader
from ._trainer_discovery import ResumeCheckpointNotFoundError, colliding_checkpoints, collision_error
from ._trainer_elastic import trainer_world_size_mode
from ._trainer_family import DEFAULT_STATE_ATTRIBUTES, RESUMABLE_OPTIONS
from ._trainer_hparams import (
    HyperparameterChange,
    hyperparameter_changes,
    hyperparameter_snapshot,
    report_hyperparameter_changes,
)
from ._trainer_parallel import check_trainer_layout, sharded_model_construction, trainer_layout
from ._trainer_restore import (
    Resume,
    is_own_checkpoint,
    load_best_model,
    load_weights_and_optimizer,
    open_for_resume,
    resolve_checkpoint,
    restore_rng,
    resume_prologue,
)
from ._trainer_state import (
    EXTRA_HYPERPARAMETERS,
    PROGRESS_ATTRIBUTES,
    PROGRESS_LOOP,
    save_trainer_checkpoint,
    trainer_attributes,
)

logger = logging.getLogger(__name__)

__all__ = ["ResumableTrainer", "make_resumable", "ResumeCheckpointNotFoundError", "check_trainer_internals",
           "TESTED_TRANSFORMERS"]

# Range of transformers versions whose internals this module was written against.
TESTED_TRANSFORMERS = (">=5.0", "<6.0")
# Trainer internals we override or call; check_trainer_internals() verifies each still exists.
_INTERNALS = ("_inner_training_loop", "_run_epoch", "_init_training_state", "_prepare_for_training",
              "_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
              "_load_rng_state", "_load_best_model", "_remove_unused_columns", "_get_collator_with_removed_columns",
              "_get_output_dir", "_push_from_checkpoint", "store_flos", "_finalize_training",
              "_maybe_log_save_evaluate", "_evaluate", "set_initial_training_values", "_load_callback_state",
              "_get_dataloader", "_get_train_sampler")
# Source fragments of Trainer methods whose behaviour we rely on (name -> fragments; a tuple: any one of them).
_SOURCE_CONTRACT: dict[str, tuple[str | tuple[str, ...], ...]] = {
    # transformers 5.25 skips through Trainer.get_resumed_dataloader, whose default calls skip_first_batches
    "_run_epoch": (("skip_first_batches(train_dataloader, steps_trained_in_current_epoch)",
                    "self.get_resumed_dataloader(train_dataloader, steps_trained_in_current_epoch)"),
                   "self._load_rng_state(resume_from_checkpoint)", "train_dataloader.set_epoch(epoch)",
                   "self.control = self.callback_handler.on_epoch_end(", "self._maybe_log_save_evaluate("),
    "_inner_training_loop": ("self._tr_loss = torch.tensor(0.0",
                             "self._globalstep_last_logged = self.state.global_step", "on_train_begin",
                             "self.set_initial_training_values(args, train_dataloader)", "self._run_epoch(",
                             "if args.eval_on_start:", "return self._finalize_training("),
    "_prepare_for_training": ("self._load_optimizer_and_scheduler(resume_from_checkpoint)",
                              "deepspeed_load_checkpoint("),
    "_finalize_training": ("self._total_loss_scalar += self._tr_loss.item()", "sort_checkpoints("),
    "_init_training_state": ("self._load_callback_state()",),
    "_load_callback_state": ("if not self.args.restore_callback_states_from_checkpoint:",),
    "train": ("self._load_from_checkpoint(resume_from_checkpoint)", "TRAINER_STATE_NAME"),
    "get_resumed_dataloader": ("skip_first_batches(dataloader, num_batches)",),  # where it exists (>= 5.25)
}


def check_trainer_internals() -> list[str]:
    """Problems with the ``Trainer`` internals this module relies on (empty when all is as expected).

    Example:

    ```python
    >>> check_trainer_internals()
    []
    ```
    """
    problems = [f"Trainer.{name} is missing" for name in _INTERNALS if not callable(getattr(Trainer, name, None))]
    if not callable(getattr(_trainer_module, "skip_first_batches", None)):
        problems.append("transformers.trainer.skip_first_batches is missing")
    for name, fragments in _SOURCE_CONTRACT.items():
        if name == "get_resumed_dataloader" and not hasattr(Trainer, name):
            continue  # transformers < 5.25: _run_epoch calls skip_first_batches itself
        source = inspect.getsource(getattr(Trainer, name)) if callable(getattr(Trainer, name, None)) else ""
        for fragment in fragments:
            options = fragment if isinstance(fragment, tuple) else (fragment,)
            if not any(option in source for option in options):
                problems.append(f"Trainer.{name} no longer contains {' or '.join(map(repr, options))}")
    return problems


check_upstream("transformers", transformers.__version__, TESTED_TRANSFORMERS, check_trainer_internals())


def _cursor_skipping() -> contextlib.AbstractContextManager[None]:
    """Make the Trainer's ``skip_first_batches`` a cursor move for our loaders (others are unaffected)."""
    original = _trainer_module.skip_first_batches

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if callable(getattr(dataloader, "skip", None)) and callable(getattr(dataloader, "position", None)):
            return dataloader.skip(num_batches)
        return original(dataloader, num_batches)

    return patched(_trainer_module, "skip_first_batches", skip_first_batches)


def _own_checkpoints_only(trainer: "ResumableTrainer") -> contextlib.AbstractContextManager[None]:
    """Make the Trainer's ``sort_checkpoints`` list only committed hf_resumable checkpoints with no pending upload.

    ``Trainer._finalize_training`` deletes every listed checkpoint but the best one when ``save_total_limit=1``;
    a checkpoint another tool wrote (a stock ``checkpoint-N``) or one still being uploaded must never be deleted.
    """
    original = _trainer_module.sort_checkpoints

    def sort_checkpoints(output_dir: str, *args: Any, **kwargs: Any) -> list[str]:
        pending = {os.path.abspath(p) for p in trainer._uploader.pending()} if trainer._uploader is not None else set()
        return [path for path in original(output_dir, *args, **kwargs)
                if is_own_checkpoint(Path(path)) and os.path.abspath(path) not in pending]

    return patched(_trainer_module, "sort_checkpoints", sort_checkpoints)


@dataclasses.dataclass
class _LoopTracker:
    """Where the training loop stands relative to the Trainer's step-end / epoch-end bookkeeping.

    ``Trainer._run_epoch`` calls ``_maybe_log_save_evaluate`` once after every optimizer step and once more
    after ``on_epoch_end`` (same ``global_step``). A checkpoint written by the step-end call of the last step of
    an epoch (or of the run) therefore precedes that epoch's end-of-epoch logging, evaluation and saving; the
    resumed run performs it first (see :func:`._trainer_restore.resume_prologue`).
    """

    trial: Any = None
    ignore_keys_for_eval: list[str] | None = None
    last_call_step: int | None = None  # global_step of the previous _maybe_log_save_evaluate call
    in_epoch_end: bool = False  # the current _maybe_log_save_evaluate call follows on_epoch_end
    grad_norm: float | None = None  # of the last optimizer step (logged again by the epoch-end call)
    learning_rate: float | None = None
    steps_per_epoch: int | None = None  # optimizer steps per epoch (set_initial_training_values)
    prologue_done: bool = False
    finished: bool = False  # the resumed checkpoint is the end of the run: nothing is trained


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class ResumableTrainer(Trainer):
    """A ``transformers.Trainer`` whose runs can be killed at any moment and restarted bit for bit.

    Same constructor, ``TrainingArguments``, callbacks and evaluation as ``Trainer``. A run killed at any point and
    restarted with ``train(resume_from_checkpoint=True)`` produces the same logged losses, final weights and
    optimizer state, bit for bit, as the uninterrupted run (same machine type and world size).

    Args:
        *args, **kwargs: everything ``transformers.Trainer`` accepts.
        allow_config_drift (`bool`, *optional*, defaults to `False`): resume even when the gradient
            accumulation, batch size, world size, seed or training data differ from the checkpoint's
            (logs a WARNING; the run then does not continue exactly).
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): resume even when a piece of
            state is missing (RNG, data position), with a WARNING.
        exit_on_preemption (`bool`, *optional*, defaults to `True`): after a SIGTERM-triggered
            checkpoint has committed, exit the process with ``PREEMPTION_EXIT_CODE`` (143). With
            `False`, ``train`` returns and ``trainer.preempted`` is `True`.
        preemption_notice (`float`, *optional*): the seconds from SIGTERM to SIGKILL that the scheduler gives; with
            it, SIGTERM saves the step it lands in and training goes on while another step and a final save fit
            (docs/trainer.md, "The preemption notice"). Without it the signal's step is saved and the process exits.
        checkpoint_verify (`str`, *optional*, defaults to `"quick"`): verification when loading
            (``"quick"`` or ``"full"``).
        push_checkpoints_to (`str`, *optional*): upload each committed checkpoint in the background (queued, never
            skipped, retried) to the Hub (``"user/repo"``, ``"hf://user/repo[@branch][/path]"``) or an fsspec store
            (``"s3://bucket/run"``); retention never deletes a checkpoint whose upload is pending.
        storage_options (`dict`, *optional*): fsspec options for ``s3://`` pushes and resumes.
        restore_callback_states (`bool`, *optional*, defaults to `True`): on resume, restore every
            ``ExportableState`` callback and ``TrainerControl`` from the checkpoint, as
            ``restore_callback_states_from_checkpoint=True`` does in ``Trainer`` (whose default, `False`, makes a
            resumed run diverge).
        resume_hyperparameters (`str`, *optional*, defaults to `"checkpoint"`): when a run is resumed with another
            ``learning_rate``, ``weight_decay``, ``adam_beta1/2`` or ``adam_epsilon``, ``"checkpoint"`` keeps the
            values restored with the optimizer and scheduler (as ``Trainer`` does), ``"arguments"`` writes the new
            ones into them. Every change is reported at resume; schedule settings always follow the arguments.
        standalone_checkpoints (`bool`, *optional*, defaults to `False`): store frozen parameters (a PEFT base, a
            frozen embedding) in every checkpoint too; by default they are recorded, not stored, and checked against
            the model on resume (see :func:`hf_resumable.save_checkpoint`).
        save_async (`bool`, *optional*): write checkpoints in the background; by default on under torch.distributed
            unless a callback overrides ``on_save``, off in a single process. A failed background save raises
            :class:`~hf_resumable.errors.AsyncSaveError` at the next save or at the end of ``train`` (docs/trainer.md,
            "Background saves").
        elastic (`bool`, *optional*, defaults to `False`): let a restart use another number of processes and
            continue the same run, keeping the checkpoint's global batch by recomputing
            ``gradient_accumulation_steps`` (a world size that does not divide it raises ``ElasticWorldSizeError``
            before step 1); docs/trainer.md, "Elastic".
        mean_time_between_failures (`float`, *optional*): the expected seconds between preemptions or crashes; the
            trainer then saves at the interval that minimises the expected lost time, measured as it trains
            (``AutoSaveInterval``; ``save_strategy`` must be ``"steps"``).

    These options are validated when the trainer is built and kept in ``resume_options`` (a frozen
    ``ResumeOptions``, shared with ``ResumableAccelerator``).

    > [!WARNING]
    > ``train_sampling_strategy="batch_rebalance"`` uses the stock data loader, which does not resume exactly:
    > ``train`` refuses it (and other setups whose checkpoints could not resume exactly) before the first step
    > unless ``allow_inexact_resume=True``.

    Example:

    ```python
    >>> from hf_resumable import ResumableTrainer
    >>> trainer = ResumableTrainer(model=model, args=args, train_dataset=train)  # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)  # doctest: +SKIP
    ```
    """

    # Trainer attributes saved in every checkpoint when present (see _trainer_family); make_resumable adds more.
    resumable_state_attributes: tuple[str, ...] = DEFAULT_STATE_ATTRIBUTES

    def __init__(self, *args: Any, allow_config_drift: bool = False, allow_inexact_resume: bool = False,
                 exit_on_preemption: bool = True, checkpoint_verify: str = "quick",
                 push_checkpoints_to: str | None = None, storage_options: dict | None = None,
                 restore_callback_states: bool = True, resume_hyperparameters: str = "checkpoint",
                 standalone_checkpoints: bool = False, save_async: bool | None = None, elastic: bool = False,
                 mean_time_between_failures: float | None = None, preemption_notice: float | None = None,
                 **kwargs: Any) -> None:
        # Options given to a make_resumable() class were set aside before the subclass's constructor ran.
        options = dict(allow_config_drift=allow_config_drift, allow_inexact_resume=allow_inexact_resume,
                       exit_on_preemption=exit_on_preemption, checkpoint_verify=checkpoint_verify,
                       push_checkpoints_to=push_checkpoints_to, storage_options=storage_options,
                       restore_callback_states=restore_callback_states, resume_hyperparameters=resume_hyperparameters,
                       standalone_checkpoints=standalone_checkpoints, save_async=save_async, elastic=elastic,
                       preemption_notice=preemption_notice)
        # save_async=None: saves_async decides per save
        set_aside = self.__dict__.pop("_hfr_options", {})
        mean_time_between_failures = set_aside.pop("mean_time_between_failures", mean_time_between_failures)
        self.resume_options = ResumeOptions(**{**options, **set_aside})
        self._world_size_mode = trainer_world_size_mode(self.resume_options.elastic)  # chosen once
        # the save interval fits the failure rate (_save_interval.py); a bad value is refused before anything is built
        auto_interval = None if mean_time_between_failures is None else AutoSaveInterval(mean_time_between_failures)
        given = inspect.signature(Trainer.__init__).bind_partial(self, *args, **kwargs).arguments
        # a model sharded at load time (tensor parallel): stock's refusal of its checkpoints does not apply to ours;
        # a ParallelismConfig the constructor would replace by the model's layout is refused
        with sharded_model_construction(given.get("model"), given.get("args")):
            super().__init__(*args, **kwargs)
        if auto_interval is not None:
            check_save_strategy(self.args.save_strategy)
            self.add_callback(auto_interval)
        self._hyperparameter_changes: list[HyperparameterChange] = []
        self.preempted = False
        self.resumed_from: Path | None = None
        self._preemption = PreemptionHandler()
        self._preemption_protocol = PreemptionProtocol(self._preemption, notice=self.resume_options.preemption_notice)
        self._resume: Resume | None = None
        self._train_loader: Any = None
        self._train_position: StepPosition | None = None  # the training loader's LoaderPosition
        self._run_config: RunConfig | None = None
        self._last_eval: tuple[int, dict[str, float]] | None = None
        self._loop = _LoopTracker()
        self._rng_restored = False
        self._converted_from: Path | None = None
        self._loader_fallback: str | None = None
        self._uploader = None
        self._commits = AfterCommit()  # follow-ups of background saves not yet known to be committed
        self._save_error: AsyncSaveError | None = None  # its failure, raised at the next save or the end of train
        if self.resume_options.push_checkpoints_to is not None and self.args.should_save:
            self._uploader = open_uploader(self.resume_options.push_checkpoints_to, token=self.args.hub_token,
                                           storage_options=self.resume_options.storage_options)

    def _saves_in_background(self) -> bool:
        """``save_async``; by default (``None``) on under torch.distributed, unless a callback overrides ``on_save``:
        it is called when the save returns, as in ``Trainer``, and may read the checkpoint (a tracker uploading it),
        which a blocking save has committed by then."""
        if self.resume_options.save_async is not None or not saves_async(None):
            return saves_async(self.resume_options.save_async)
        readers = sorted({type(callback).__name__ for callback in self.callback_handler.callbacks
                          if type(callback).on_save is not TrainerCallback.on_save})
        if readers and not getattr(self, "_hfr_told_blocking", False):
            self._hfr_told_blocking = True
            logger.info("Saving checkpoints blocking: %s override on_save and may read the checkpoint there; pass "
                        "save_async=True to write them in the background anyway.", ", ".join(readers))
        return not readers

    def wait_for_uploads(self, timeout: float | None = None) -> None:
        """Block until every checkpoint queued for ``push_checkpoints_to`` is confirmed; raise the first failure."""
        if self._uploader is not None:
            self._uploader.wait(timeout=timeout)

    def wait_for_pending_saves(self) -> None:
        """Block until a checkpoint being written in the background (``save_async=True``) has committed, then apply
        what follows its commit (``save_total_limit`` retention, uploads).

        Raises:
            AsyncSaveError: the background save failed (the previous checkpoint is untouched and the newest).

        Example:

        ```python
        >>> trainer = ResumableTrainer(model=model, args=args, train_dataset=train, save_async=True)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> trainer.wait_for_pending_saves()  # doctest: +SKIP
        ```
        """
        self._settle_saves()

    # ---- train / resume discovery ----

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """Train, resuming from ``resume_from_checkpoint`` when given.

        Args:
            resume_from_checkpoint (`str`, `bool` or `os.PathLike`, *optional*): ``True`` or ``"auto"``: the newest
                checkpoint under ``output_dir`` that verifies, or a newer stock ``Trainer`` checkpoint (converted,
                not bit-exact), or a fresh start when there is none; one that fails its hashes while it is loaded is
                moved aside (``corrupt-checkpoint-N``) and the one before it used (docs/checkpoints.md). A path, or
                ``"hf://user/repo[@rev][/path]"`` / ``"s3://bucket/run"``: that checkpoint (it must verify; a stock
                one is converted). ``None``/``False``: a fresh start.

        Raises:
            ResumeCheckpointNotFoundError: the given path does not exist or is not a checkpoint (also a
                ``ValueError``, as in ``Trainer``, and a ``CheckpointNotFoundError``).
            CorruptCheckpointError / IncompleteCheckpointError: the given path does not verify; or, with ``True``,
                committed checkpoints exist but none verifies and loads (the message lists each one and why), or
                one failed its hashes while FSDP/DeepSpeed held the model (set aside: the next start resumes from
                the one before).
            ConfigDriftError: the run configuration differs from the checkpoint's.
            ElasticWorldSizeError: ``elastic=True`` and this world size cannot keep the checkpoint's global batch
                (a ``ConfigDriftError``; the message lists the world sizes that can), before the first step.
            CheckpointExistsError: the run would save over a ``checkpoint-N`` directory hf_resumable did not write
                (raised before the first step).
            UnsupportedEngineError: DeepSpeed ZeRO-Offload, FSDP1 hybrid sharding or XLA FSDP, refused before
                anything is read or trained; DeepSpeed's other optimizers (``BF16_Optimizer``) or pipeline, expert
                or context parallel beside a model sharded at load time, before the first step.
            InexactResumeError / UnsupportedStateError: before the first step, for a setup whose checkpoints could
                not be resumed exactly or not be written (see docs/trainer.md).
            SystemExit: with ``PREEMPTION_EXIT_CODE`` after a SIGTERM, when ``exit_on_preemption``.
        """
        # an engine whose state the checkpoints would not hold: refused before anything is read or trained
        fsdp_xla = bool(getattr(self, "is_fsdp_xla_enabled", False))
        check_trainer_engine(self.args, self.accelerator.state, fsdp_xla=fsdp_xla)
        self._settle_saves()  # discovery below sees only committed checkpoints
        self.preempted = False
        self._preemption_protocol.reset()
        self._run_config = None
        checkpoint, verified = resolve_checkpoint(self, resume_from_checkpoint)
        if verified is not None and (resume_from_checkpoint is True or resume_from_checkpoint == "auto"):
            # a discovered checkpoint that fails its hashes while it is loaded: the one before it (train() again)
            return resume_newest(self.args.output_dir, lambda report: self._train_from(
                Path(report.path), report, trial, ignore_keys_for_eval, **kwargs), pattern=CHECKPOINT_DIR_RE,
                owner="ResumableTrainer", first=verified)
        return self._train_from(checkpoint, verified, trial, ignore_keys_for_eval, **kwargs)

    def _train_from(self, checkpoint: Path | None, verified: VerifyReport | None, trial: Any,
                    ignore_keys_for_eval: list[str] | None, **kwargs: Any) -> Any:
        """``train`` from ``checkpoint`` (or from scratch); a failed hash while it is loaded leaves this trainer as
        ``train`` found it, for the fallback's next ``train``."""
        self._before_train = (self.optimizer, self.lr_scheduler, self._created_lr_scheduler, self.model_wrapped)
        self._resume = open_for_resume(self, checkpoint, verified) if checkpoint is not None else None
        self.resumed_from = None if self._resume is None else (self._resume.converted_from or checkpoint)
        self._loop = _LoopTracker(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        self._rng_restored = False
        self._world_size_mode.start()
        self._loader_fallback = None
        self._train_loader = self._train_position = None
        # eval_on_start evaluates before the first step of the run, not again at every restart
        no_eval = contextlib.nullcontext() if self._resume is None else patched(self.args, "eval_on_start", False)
        try:
            with self._preemption, _cursor_skipping(), _own_checkpoints_only(self), no_eval, \
                    deepspeed_resume_by_us():
                output = super().train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint),
                                       trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except ResumeLoadError as failed:
            self._undo_failed_resume(failed)
            raise
        except BaseException:
            self._settle_saves_after_error()
            raise
        finally:
            self._resume = None
        self._settle_saves()
        if self._preemption_protocol.signalled and not self.preempted:
            logger.warning("Preemption signal received, but the run reached its end (step %d) within the %.0f s "
                           "notice: it ended normally.", self.state.global_step, self._preemption_protocol.notice)
        if self.preempted:
            exit_after_preemption(self._preemption, checkpoint=str(self.args.output_dir), step=self.state.global_step,
                                  exit=self.resume_options.exit_on_preemption)
        return output

    def _undo_failed_resume(self, failed: ResumeLoadError) -> None:
        """Put back what ``train`` changed before the failed load: the optimizer, scheduler, unwrapped model and
        NEFTune's hook. FSDP and DeepSpeed wrap the model in place, so there ``failed.retry`` is false: the run
        stops, and its next start resumes from the checkpoint before."""
        self.optimizer, self.lr_scheduler, self._created_lr_scheduler, self.model_wrapped = self._before_train
        if self.neftune_noise_alpha is not None and getattr(self, "neftune_hook_handle", None) is not None:
            self.neftune_hook_handle.remove()  # train() adds it again
        failed.retry = not (self.is_fsdp_enabled or self.is_deepspeed_enabled)

    def _layout(self) -> ParallelLayout | None:
        """The run's tensor/N-D parallel layout; ``None`` without one."""
        return trainer_layout(self.accelerator.unwrap_model(self.model),
                              getattr(self.accelerator, "parallelism_config", None))

    def _inexact(self, message: str) -> None:
        inexact(message, allow=self.resume_options.allow_inexact_resume, owner="ResumableTrainer")

    # ---- data ----

    def get_train_dataloader(self) -> Any:
        """The training loader: position-seeded, resumable without replay (see :mod:`hf_resumable.data`)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._get_dataloader(self.train_dataset, description="Training", batch_size=self._train_batch_size,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> Any:
        """Training loaders are hf_resumable loaders (:func:`._trainer_data.build_train_dataloader`); evaluation
        loaders are the stock ones."""
        stock = functools.partial(super()._get_dataloader, dataset, description, batch_size, sampler_fn=sampler_fn,
                                  is_training=is_training, dataloader_key=dataloader_key)
        if not is_training:
            return stock()
        return build_train_dataloader(self, dataset, batch_size, sampler_fn, stock)

    def _data_parallel(self) -> tuple[int, int]:
        """This process's data-parallel rank and their number (under tensor/N-D parallel, over the data dimensions)."""
        return data_parallel_rank(self._layout(), process_index=self.args.process_index,
                                  world_size=self.args.world_size)

    def _load_callback_state(self) -> None:
        """Restore ``ExportableState`` callbacks from the checkpoint (``restore_callback_states``, default on)."""
        if not self.resume_options.restore_callback_states or self.args.restore_callback_states_from_checkpoint:
            return super()._load_callback_state()
        with patched(self.args, "restore_callback_states_from_checkpoint", True):
            super()._load_callback_state()

    # ---- saving ----

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Write ``checkpoint-<global_step>`` (:func:`._trainer_state.save_trainer_checkpoint`)."""
        save_trainer_checkpoint(self, model, trial)

    def _settle_saves(self, *, poll: bool = False, removals: bool = True) -> None:
        """Wait for this trainer's background save, then run what follows its commit; raise its failure.

        With ``poll``, only a finished save is settled and a failure is kept for the next save or the end of
        ``train`` (where every rank waits, so ranks never raise at different steps).
        """
        try:
            self._commits.settle(poll=poll, removals=removals)
        except AsyncSaveError as err:
            self._save_error = err
        if not poll and self._save_error is not None:
            error, self._save_error = self._save_error, None
            raise error

    def _settle_saves_after_error(self) -> None:
        """``train`` is raising: wait for a background save still in flight; log (not raise) its failure."""
        try:
            self._settle_saves()
        except AsyncSaveError as err:
            logger.error("%s (raised instead: the error that stopped training)", err)

    # ---- the training loop ----

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_for_training(*args, **kwargs)
        if self.is_deepspeed_enabled:
            checkpoint_optimizer(self.optimizer)  # DeepSpeed optimizers other than ZeRO's: refused before step 1
        return prepared

    def set_initial_training_values(self, args: TrainingArguments, dataloader: Any) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        self._loop.steps_per_epoch = values[1]
        self._check_before_training(dataloader, max_steps=values[-1])
        return values

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        self._world_size_mode.seed_micro_batch(self)  # elastic: dropout keyed by the chunk, not by the rank
        return super().training_step(model, inputs, *args, **kwargs)

    def _saves_checkpoints(self) -> bool:
        return str(getattr(self.args.save_strategy, "value", self.args.save_strategy)) != "no"

    def _check_before_training(self, dataloader: Any, *, max_steps: int) -> None:
        """Refuse, before the first step, a run whose checkpoints would fail or could not be resumed exactly."""
        start = (self._resume.loaded.step or 0) if self._resume is not None else 0
        record = self._resume.loaded.training_state.get(PROGRESS_LOOP) if self._resume is not None else None
        self._loop.finished = self._resume is not None and (start >= max_steps or bool((record or {}).get("stopped")))
        self._hyperparameter_changes = []
        saved = self._resume.loaded.extra.get(EXTRA_HYPERPARAMETERS) if self._resume is not None else None
        if saved is not None:
            self._hyperparameter_changes = hyperparameter_changes(
                saved, hyperparameter_snapshot(self.args, max_steps=max_steps))
            report_hyperparameter_changes(self._hyperparameter_changes, checkpoint=str(self._resume.path),
                                          mode=self.resume_options.resume_hyperparameters)
        if not self._loop.finished:  # on every rank: a refusal on one rank alone would leave the others waiting
            collisions = colliding_checkpoints(self._get_output_dir(self._loop.trial), after_step=start,
                                               up_to_step=max_steps)
            if collisions:
                raise collision_error(self._get_output_dir(self._loop.trial), collisions, after_step=start,
                                      up_to_step=max_steps)
        self._world_size_mode.check_before_training(self)
        check_trainer_layout(self.accelerator.unwrap_model(self.model),
                             getattr(self.accelerator, "parallelism_config", None))
        if not self._saves_checkpoints():
            return
        if self.args.save_only_model:
            self._refuse_at_start(
                "save_only_model=True writes checkpoints without optimizer, scheduler, RNG state or data position, "
                "so a restart from them cannot continue the run",
                fix="Set save_only_model=False (checkpoints hold no pickle either way)")
        if dataloader is not self._train_loader:
            reason = self._loader_fallback or (f"{type(self).__name__}.get_train_dataloader builds its own "
                                               f"{type(dataloader).__name__}")
            self._refuse_at_start(
                f"{reason}; its checkpoints record no data position",
                fix="Use train_sampling_strategy='random', 'sequential' or 'group_by_length' and the inherited "
                    "get_train_dataloader")
        try:
            encode_state(trainer_attributes(self), {}, prefix=PROGRESS_ATTRIBUTES)
        except UnsupportedStateError as err:
            raise UnsupportedStateError(
                f"{err} Every checkpoint stores the trainer attributes {self.resumable_state_attributes}, so the "
                "first "
                "save would fail. Nothing was trained. Leave that attribute out of make_resumable(..., "
                "state_attributes=...) or keep it to numbers, strings, tensors, lists and dicts.") from err
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ExportableState):
                try:
                    json.dumps(callback.state())
                except (TypeError, ValueError) as err:
                    raise UnsupportedStateError(
                        f"{type(callback).__name__}.state() is not JSON-serializable ({err}); every checkpoint's "
                        "trainer_state.json stores it, so the first save would fail. Nothing was trained. Return "
                        "only numbers, strings, lists and dicts from state().") from err

    def _refuse_at_start(self, message: str, *, fix: str) -> None:
        if self.resume_options.allow_inexact_resume:
            logger.warning("%s; training anyway because allow_inexact_resume=True: a restart will NOT continue "
                           "bit for bit (and needs allow_inexact_resume=True too).", message)
            return
        raise InexactResumeError(f"{message}. Nothing was trained. {fix}, or pass allow_inexact_resume=True to "
                                 "ResumableTrainer to train anyway (a restart is then NOT bit-exact).")

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, model: torch.nn.Module, trial: Any,
                                 epoch: float, ignore_keys_for_eval: list[str] | None, start_time: float,
                                 learning_rate: float | None = None, **kwargs: Any) -> None:
        # Called after every optimizer step and once more after on_epoch_end (same global_step); see _LoopTracker.
        self._settle_saves(poll=True)  # a background save that has committed meanwhile: its retention, uploads
        loop = self._loop
        loop.in_epoch_end = loop.last_call_step == self.state.global_step
        loop.last_call_step = self.state.global_step
        if not loop.in_epoch_end:
            loop.grad_norm, loop.learning_rate = _as_float(grad_norm), learning_rate
        # SIGTERM: save this step on every rank, then stop (or, within a notice, train on). The stop is requested
        # after the save so that the checkpoint records only the run's own decision to stop (a preempted run is not
        # a finished one).
        action, started = self._preemption_action(), self._preemption_protocol.clock()
        self.preempted = action.exits
        self.control.should_save = self.control.should_save or action.saves
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                         learning_rate=learning_rate, **kwargs)
        trace.on_logs(self.state.log_history)  # hf-resumable check: the metrics logged at this step
        if action is PreemptionAction.SAVE_AND_TRAIN:
            self._preemption_protocol.notice_saved(started=started, future=notice_save_in_flight())
        if action.exits:
            self.control.should_training_stop = True

    def _preemption_action(self) -> PreemptionAction:
        """The preemption protocol at this step boundary (every rank, every call: it is collective). A run that
        reaches ``max_steps`` inside a notice ends as any run does (without a notice it saves and exits with 143, as
        at any other step)."""
        if self.preempted:
            return PreemptionAction.EXIT
        protocol = self._preemption_protocol
        action = protocol.at_step_boundary(device=self.args.device, step=self.state.global_step)
        if action.exits and protocol.notice is not None and self.state.global_step >= self.state.max_steps:
            return PreemptionAction.TRAIN
        return action

    def _evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = super()._evaluate(*args, **kwargs)
        self._last_eval = (self.state.global_step, dict(metrics or {}))
        return metrics

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(Trainer._run_epoch).bind(self, *args, **kwargs).arguments
        resume_prologue(self, model=bound["model"], start_time=bound["start_time"])
        if self._loop.finished:  # the checkpoint is the end of the run: train nothing, save nothing
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        resume_prologue(self, model=self.model_wrapped, start_time=start_time)
        # the last checkpoint commits (or its failure is raised) before the best model is loaded and
        # save_total_limit=1 deletes checkpoints
        self._settle_saves()
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ---- loading ----

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # Weights are loaded together with the optimizer in _load_optimizer_and_scheduler (one verified read,
        # parameter names resolved against the same model).
        logger.debug("Deferring weight loading of %s until the optimizer exists.", resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        load_weights_and_optimizer(self, checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        # Loaded with the optimizer.
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Restore the RNG captured after the checkpoint's optimizer step (:func:`._trainer_restore.restore_rng`)."""
        restore_rng(self, checkpoint)

    def _load_best_model(self) -> None:
        if not load_best_model(self):  # a stock Trainer checkpoint (a run resumed from stock ones)
            super()._load_best_model()


_RESUMABLE_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def make_resumable(trainer_class: type, *, state_attributes: tuple[str, ...] | list[str] = ()) -> type:
    """The resumable version of a ``transformers.Trainer`` subclass (TRL's ``SFTTrainer``, ``Seq2SeqTrainer``...).

    The returned class, ``Resumable<Name>``, is ``trainer_class`` with ``ResumableTrainer`` placed under it in the
    method order: the subclass keeps its own overrides and gets ResumableTrainer's checkpoints and exact restarts.
    Its constructor takes the subclass's arguments plus ResumableTrainer's options. The same class is returned for
    the same arguments.

    Args:
        trainer_class (`type`): a subclass of ``transformers.Trainer``.
        state_attributes (`tuple[str, ...]`, *optional*): more trainer attributes to save in every checkpoint and
            restore before the first resumed step (numbers, strings, tensors, lists, dicts), besides
            ``ResumableTrainer.resumable_state_attributes`` (TRL's ``_metrics``, ``_total_train_tokens``, ``_step``).

    Returns:
        `type`: the resumable subclass (``trainer_class`` itself if it already is one).

    Raises:
        TypeError: if ``trainer_class`` is not a ``transformers.Trainer`` subclass.

    Example:

    ```python
    >>> from trl import SFTConfig, SFTTrainer  # doctest: +SKIP
    >>> ResumableSFTTrainer = make_resumable(SFTTrainer)  # doctest: +SKIP
    >>> trainer = ResumableSFTTrainer(model=model, args=SFTConfig("out"), train_dataset=data)  # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)  # doctest: +SKIP
    ```
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"make_resumable expects a transformers.Trainer subclass, got {trainer_class!r}.")
    extra = tuple(name for name in state_attributes if name not in ResumableTrainer.resumable_state_attributes)
    if issubclass(trainer_class, ResumableTrainer) and not extra:
        return trainer_class
    key = (trainer_class, extra)
    if key not in _RESUMABLE_CLASSES:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            self._hfr_options = {name: kwargs.pop(name) for name in RESUMABLE_OPTIONS if name in kwargs}
            super(resumable, self).__init__(*args, **kwargs)  # the subclass's constructor, else ResumableTrainer's

        bases = (trainer_class,) if issubclass(trainer_class, ResumableTrainer) else (trainer_class, ResumableTrainer)
        name = trainer_class.__name__ if trainer_class.__name__.startswith("Resumable") else (
            f"Resumable{trainer_class.__name__}")
        resumable = _RESUMABLE_CLASSES[key] = type(name, bases, {
            "__init__": __init__, "__module__": __name__, "__qualname__": name,
            "__doc__": f"``{trainer_class.__qualname__}`` made resumable by :func:`make_resumable`.\n\n"
                       + (trainer_class.__doc__ or ""),
            "resumable_state_attributes": ResumableTrainer.resumable_state_attributes + extra})
    return _RESUMABLE_CLASSES[key]
