"""``ResumableTrainer``: a drop-in ``transformers.Trainer`` whose restarts continue bit for bit.

This is the only module that touches ``Trainer`` internals (its helpers live in ``_trainer_*.py``). What it
changes, and why:

* **Data** (``_get_dataloader`` for training loaders, so also a subclass's own ``get_train_dataloader``): the
  training loader is built from :mod:`hf_resumable.data`: the sample order is a pure function of
  ``(seed, epoch)`` (random, sequential, ``group_by_length``, or a subclass's ``_get_train_sampler`` replayed
  per epoch), every batch is fetched, transformed and collated under a seed derived from its position (private
  generators of the collator and data set included), and the loader has its own ``torch.Generator``.
  Streaming data sets go through ``torchdata``'s ``StatefulDataLoader`` and resume from their
  ``state_dict``; a ``.shuffle(buffer_size=...)`` buffer is replaced by
  :class:`~hf_resumable.data.ResumableShuffleBuffer`, saved with its content (sample order differs from
  ``datasets``' own buffer with the same seed). The main-process RNG is therefore consumed only by the model.
* **Skipping** (``transformers.trainer.skip_first_batches``, patched for the duration of ``train``):
  for our loaders, skipping is a cursor move: nothing before the resume point is fetched.
* **Checkpoints** (``_save_checkpoint``, ``_load_*``): written and read with
  :func:`hf_resumable.checkpoint.save_checkpoint` / ``load_checkpoint`` (sharded safetensors, no pickle,
  atomic, hashed); with ``save_async`` (by default under torchrun) staged and written in the background while
  training goes on (retention and uploads act on a checkpoint only once it has committed). The RNG captured after
  the optimizer step is restored by the Trainer's own ``_load_rng_state`` call, i.e. right before the first resumed
  forward pass.
  The logging accumulators (``_tr_loss``, ...), where the step stands in the loop (stopped by a callback,
  end-of-epoch work done), and a subclass's own counters (``resumable_state_attributes``: TRL's ``_metrics``,
  ``_total_train_tokens``...) are saved too, so every logged value matches the uninterrupted run.
* **The loop** (``_run_epoch``, ``_finalize_training``, ``_maybe_log_save_evaluate``): before the first resumed
  step, the end-of-epoch logging/evaluation/saving that followed the checkpoint in the uninterrupted run is done,
  and a checkpoint that ends the run (``max_steps``, or a callback's stop) trains and writes nothing more.
  ``ExportableState`` callbacks are restored by default (``_load_callback_state``).
* **Discovery** (:mod:`._trainer_discovery`): ``train(resume_from_checkpoint=True)`` (or ``"auto"``) resumes
  from the newest checkpoint that verifies, skipping partial or corrupt ones, or from a newer stock
  ``transformers.Trainer`` checkpoint (converted on the fly, not bit-exact), and starts fresh when there is none.
  Directories hf_resumable did not write are never overwritten or deleted.
* **Engines** (:mod:`._engines`): DDP, FSDP2 and FSDP1 (``fsdp=``/``fsdp_config``, either ``state_dict_type``:
  every rank saves and loads its own pieces, :func:`~hf_resumable.checkpoint.save_checkpoint`)
  and DeepSpeed ZeRO-1/2/3 (``deepspeed=``: every rank saves and loads its ZeRO partitions,
  :mod:`._deepspeed`; DeepSpeed's own ``global_step*`` checkpoints are neither written nor read); ZeRO-Offload,
  FSDP1 hybrid sharding and XLA FSDP are refused when ``train()`` starts.
* **Checks before the first step** (``set_initial_training_values``): a setup whose checkpoints would fail or
  not resume exactly is refused with the fix; changed optimization hyperparameters are reported
  (:mod:`._trainer_hparams`).
* **Drift**: the run configuration is recorded in every checkpoint; resuming with another one raises
  :class:`~hf_resumable.errors.ConfigDriftError` unless ``allow_config_drift=True``.
* **Preemption**: SIGTERM finishes the current optimizer step, saves, and exits with
  :data:`~hf_resumable.preemption.PREEMPTION_EXIT_CODE`; with ``preemption_notice`` it saves that step, trains on
  while another step and a final save fit in the notice, then saves and exits (or ends normally at ``max_steps``).
  Under ``torch.distributed`` the ranks' proposals are all-reduced (MAX) at every optimizer-step boundary
  (:class:`~hf_resumable.preemption.PreemptionProtocol`), so a signal that reaches one rank makes every rank
  save the same step (checkpoints are collective: each rank writes its RNG and data position).
* **Subclasses** (:func:`make_resumable`, :mod:`._trainer_family`): ``ResumableTrainer`` goes under TRL's and
  the user's ``Trainer`` subclasses in the method order, so their own overrides stay in effect.

Checkpoints land on optimizer-step boundaries (after the optimizer step, the scheduler step, logging
and evaluation of that step), exactly where ``Trainer`` saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
import transformers.trainer as _trainer_module
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState, TrainerCallback

from .. import trace
from ..checkpoint import (
    VerifyReport,
    apply_retention,
    load_checkpoint,
    open_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from ..checkpoint._reader import read_on_load
from ..checkpoint.api import background_saver, saves_async
from ..constants import CHECKPOINT_DIR_RE, CHECKPOINT_PREFIX, LAYOUT_FILE, OPTIMIZER_INDEX_FILE, TRAINER_STATE_FILE
from ..data import (
    DATA_KIND,
    build_map_dataloader,
    build_stream_dataloader,
    data_rng,
    dataset_fingerprint,
    has_shuffle_buffer,
    ignore_labels,
    sampler_epoch_order,
    split_stream_for_rank,
)
from ..data._loaders import StepPosition
from ..distributed import broadcast_json, rank_and_world_size
from ..errors import AsyncSaveError, HfResumableError, InexactResumeError, UnsupportedStateError
from ..format.rng import derive_seed, restore_rng_state
from ..format.state import RunConfig
from ..format.state_codec import encode_state
from ..locations import is_remote, open_uploader, resolve_resume_path
from ..preemption import PreemptionAction, PreemptionHandler, PreemptionProtocol, exit_after_preemption
from ._core import AfterCommit, ResumeOptions, check_drift, check_upstream, inexact, notice_save_in_flight
from ._deepspeed import (
    EXTRA_DEEPSPEED,
    capture_engine_state,
    checkpoint_optimizer,
    deepspeed_engine,
    deepspeed_resume_by_us,
    restore_engine_state,
    saved_engine_state,
    torch_optimizer,
)
from ._elastic import ELASTIC_SETTINGS, ElasticPlan, plan_elastic_resume, seed_model_rng
from ._engines import check_trainer_engine, checkpoint_model
from ._fallback import ResumeLoadError, agreed_load, find_agreed_checkpoint, refuse_fresh_start, resume_newest
from ._parallelism import KEY_PARALLELISM, ParallelLayout
from ._save_interval import AutoSaveInterval, check_save_strategy
from ._trainer_discovery import (
    CONVERTED_DIR,
    CheckpointKind,
    ResumeCheckpointNotFoundError,
    classify_checkpoint_dir,
    colliding_checkpoints,
    collision_error,
    newest_stock_checkpoint,
    not_a_checkpoint_error,
)
from ._trainer_family import DEFAULT_STATE_ATTRIBUTES, RESUMABLE_OPTIONS, encode_attribute, restore_attribute
from ._trainer_hparams import (
    HyperparameterChange,
    apply_new_hyperparameters,
    hyperparameter_changes,
    hyperparameter_snapshot,
    report_hyperparameter_changes,
)
from ._trainer_parallel import check_trainer_layout, data_parallel_rank, sharded_model_construction, trainer_layout

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
# Keys of the progress record saved in training_state.json["progress"].
_PROGRESS_LOOP = "trainer_loop"  # accumulators of the logging loop (exact floats)
_PROGRESS_ATTRIBUTES = "trainer_attributes"  # resumable_state_attributes of a Trainer subclass (TRL counters)
_EXTRA_RUN_CONFIG = "run_config"  # RunConfig.to_dict()
_EXTRA_MODEL_ONLY = "model_only"  # True when saved with save_only_model (cannot resume exactly)
_EXTRA_HYPERPARAMETERS = "hyperparameters"  # _trainer_hparams.hyperparameter_snapshot()
_EXTRA_ELASTIC = "elastic"  # True when written with elastic=True (the elastic sample layout)
_EXTRA_PARALLELISM = KEY_PARALLELISM  # ParallelLayout.describe() of a tensor/N-D parallel run (None without one)


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


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.<name>`` is ``value`` for the duration of the block."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _cursor_skipping() -> contextlib.AbstractContextManager[None]:
    """Make the Trainer's ``skip_first_batches`` a cursor move for our loaders (others are unaffected)."""
    original = _trainer_module.skip_first_batches

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if callable(getattr(dataloader, "skip", None)) and callable(getattr(dataloader, "position", None)):
            return dataloader.skip(num_batches)
        return original(dataloader, num_batches)

    return _patched(_trainer_module, "skip_first_batches", skip_first_batches)


def _own_checkpoints_only(trainer: "ResumableTrainer") -> contextlib.AbstractContextManager[None]:
    """Make the Trainer's ``sort_checkpoints`` list only committed hf_resumable checkpoints with no pending upload.

    ``Trainer._finalize_training`` deletes every listed checkpoint but the best one when ``save_total_limit=1``;
    a checkpoint another tool wrote (a stock ``checkpoint-N``) or one still being uploaded must never be deleted.
    """
    original = _trainer_module.sort_checkpoints

    def sort_checkpoints(output_dir: str, *args: Any, **kwargs: Any) -> list[str]:
        pending = {os.path.abspath(p) for p in trainer._uploader.pending()} if trainer._uploader is not None else set()
        return [path for path in original(output_dir, *args, **kwargs)
                if _is_own_checkpoint(Path(path)) and os.path.abspath(path) not in pending]

    return _patched(_trainer_module, "sort_checkpoints", sort_checkpoints)


def _step_of(path: Path) -> int:
    match = CHECKPOINT_DIR_RE.match(Path(path).name)
    return int(match.group(1)) if match else -1


def _is_conversion_of(target: Path, stock: Path) -> bool:
    """Whether ``target`` is a committed conversion of ``stock`` made after ``stock`` last changed."""
    try:
        manifest = read_manifest(target)
        newest_source = max(p.stat().st_mtime for p in stock.iterdir() if p.is_file())
    except (HfResumableError, OSError, ValueError):
        return False
    return manifest.step == _step_of(stock) and manifest.created >= newest_source and not verify_checkpoint(
        target, full=False).problems


def _is_own_checkpoint(path: Path) -> bool:
    try:
        read_manifest(path)
    except (HfResumableError, OSError):
        return False
    return True


@dataclasses.dataclass
class _LoopTracker:
    """Where the training loop stands relative to the Trainer's step-end / epoch-end bookkeeping.

    ``Trainer._run_epoch`` calls ``_maybe_log_save_evaluate`` once after every optimizer step and once more
    after ``on_epoch_end`` (same ``global_step``). A checkpoint written by the step-end call of the last step of
    an epoch (or of the run) therefore precedes that epoch's end-of-epoch logging, evaluation and saving; the
    resumed run performs it first (see ``ResumableTrainer._resume_prologue``).
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


@dataclasses.dataclass
class _Resume:
    """What train() read from the checkpoint it resumes from, before the Trainer loads the weights."""

    path: Path
    loaded: Any  # LoadedCheckpoint (training state, extra, data state, RNG state)
    converted_from: Path | None = None  # the stock transformers.Trainer checkpoint ``path`` was converted from


class ResumableTrainer(Trainer):
    """A ``transformers.Trainer`` whose runs can be killed at any moment and restarted bit for bit.

    Same constructor, ``TrainingArguments``, callbacks, evaluation and ``load_best_model_at_end`` as
    ``Trainer``; checkpoints are written in the :mod:`hf_resumable.checkpoint` format. A run killed
    at any point and restarted with ``train(resume_from_checkpoint=True)`` produces the same logged
    losses and the same final weights and optimizer state, bit for bit, as the uninterrupted run
    (same machine type and world size).

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
        preemption_notice (`float`, *optional*): the seconds from SIGTERM to SIGKILL that the scheduler gives
            (Kubernetes' ``terminationGracePeriodSeconds``, SLURM's ``--signal=TERM@<seconds>``). With it, SIGTERM
            commits a checkpoint of the step it lands in (in the background with ``save_async``) and training goes
            on while another step and a final save fit in the time left (measured step and save times, with a safety
            margin; see :mod:`hf_resumable.preemption`); then the step is saved and the process exits as without a
            notice. A run that reaches ``max_steps`` inside the notice ends normally. Without it (the default) the
            signal's step is saved and the process exits at once.
        checkpoint_verify (`str`, *optional*, defaults to `"quick"`): verification when loading
            (``"quick"`` or ``"full"``).
        push_checkpoints_to (`str`, *optional*): after each checkpoint commits, upload it in the background
            (queued, never skipped, retried): ``"user/repo"`` / ``"hf://user/repo[@branch][/path]"`` (one Hub
            commit per checkpoint) or an fsspec URL such as ``"s3://bucket/run"`` (remote manifest written
            last). Local retention (``save_total_limit``) never deletes a checkpoint whose upload is pending.
        storage_options (`dict`, *optional*): fsspec options for ``s3://`` pushes and resumes.
        restore_callback_states (`bool`, *optional*, defaults to `True`): on resume, restore the state of every
            ``ExportableState`` callback (``EarlyStoppingCallback``'s patience counter...) and of
            ``TrainerControl`` from the checkpoint, as ``restore_callback_states_from_checkpoint=True`` does in
            ``Trainer`` (whose default is `False`, which makes a resumed run diverge). `False` leaves the
            callbacks as constructed unless ``restore_callback_states_from_checkpoint=True``.
        resume_hyperparameters (`str`, *optional*, defaults to `"checkpoint"`): when a run is resumed with another
            ``learning_rate``, ``weight_decay``, ``adam_beta1/2`` or ``adam_epsilon``, ``"checkpoint"`` keeps the
            values restored with the optimizer and scheduler (as ``Trainer`` does), ``"arguments"`` writes the new
            ones into them. Every changed optimization setting is reported at resume (old -> new, which one is in
            effect); schedule settings (``lr_scheduler_type``, ``warmup_steps``, ``max_steps``) and
            ``max_grad_norm`` always follow the arguments.
        standalone_checkpoints (`bool`, *optional*, defaults to `False`): store frozen parameters (a PEFT base, a
            frozen embedding) in every checkpoint too. By default they are recorded, not stored (names, dtypes,
            shapes, fingerprints, where the base came from) and checked against the model on resume; see
            :func:`hf_resumable.save_checkpoint`.
        save_async (`bool`, *optional*): write checkpoints in the background; by default on under torch.distributed
            (torchrun with 2+ processes) unless a callback overrides ``on_save`` (which may read the checkpoint), off
            in a single process; ``False`` turns it off, ``True`` on. A save copies
            the tensors into reusable host buffers (one more copy of model and optimizer state in memory), captures
            everything else of that step (``trainer_state.json``, RNG, data position, logging accumulators) and
            returns; training goes on while the files are written, hashed and committed. Under torch.distributed
            every rank writes its files in the background and rank 0 commits once every rank's are durable. The
            next save, a load, the end of ``train`` (also a preempted one: the SIGTERM save is written before the
            exit) and interpreter exit wait for it; a failed background save raises
            :class:`~hf_resumable.errors.AsyncSaveError` at the next save or at the end of ``train``, and the
            previous checkpoint stays the newest. ``save_total_limit`` retention, ``push_checkpoints_to`` uploads
            and ``push_to_hub`` only ever act on committed checkpoints; ``best_model_checkpoint`` is decided once
            the previous save has committed, so it is the same as with blocking saves. Callbacks'
            ``on_save`` is called when the save returns, as in ``Trainer``: with ``save_async=True`` the
            checkpoint may still be in flight then (call :meth:`wait_for_pending_saves` to wait for it).
        elastic (`bool`, *optional*, defaults to `False`): let a restart use another number of processes and
            continue the same run. The checkpoint's global batch (``per_device_train_batch_size`` x
            ``gradient_accumulation_steps`` x world size) is kept by recomputing ``gradient_accumulation_steps``
            (logged once, old -> new; a world size that does not divide it is refused before step 1 with
            ``ElasticWorldSizeError``, listing those that do); every optimizer step trains on the same samples,
            each batch built and each dropout mask drawn identically whichever rank trains on it, so losses and
            weights match the uninterrupted run up to float rounding (see docs/trainer.md). Map-style training data
            (every epoch cut to whole global batches) or a stream with ``dataloader_num_workers=0`` (read whole by
            every process, step k being its positions ``[k * G, (k + 1) * G)``); not a custom sampler. DDP, FSDP2
            and ZeRO (checkpoint pieces resharded).
        mean_time_between_failures (`float`, *optional*): the expected seconds between preemptions or crashes; the
            trainer then measures its own save cost and step time and saves at the interval that minimises the
            expected lost time (Young/Daly, ``sqrt(2 * save cost * mean_time_between_failures)``, in steps),
            logging each choice and deciding again when the measurements drift by more than 1.5x; ``save_steps`` is
            replaced (``save_strategy`` must be ``"steps"``). See ``AutoSaveInterval``.

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
        self._resume: _Resume | None = None
        self._train_loader: Any = None
        self._train_position: StepPosition | None = None  # the training loader's LoaderPosition
        self._run_config: RunConfig | None = None
        self._last_eval: tuple[int, dict[str, float]] | None = None
        self._loop = _LoopTracker()
        self._rng_restored = False
        self._micro_of_step = (-1, 0)  # (global_step, micro-batches trained in it): elastic dropout keys
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
            resume_from_checkpoint (`str`, `bool` or `os.PathLike`, *optional*): ``True`` or ``"auto"``:
                the newest checkpoint under ``output_dir`` that verifies (partial/corrupt ones are
                skipped with a WARNING) or a newer stock ``transformers.Trainer`` checkpoint (converted, not
                bit-exact), or a fresh start when there is none. One that fails its hashes while it is loaded, on
                any rank, is moved aside (``corrupt-checkpoint-N``, kept) and the one before it used instead,
                as a clean resume from it would be (docs/checkpoints.md). A path: that checkpoint (it must verify;
                a stock Trainer checkpoint is converted). ``"hf://user/repo[@rev][/path]"`` or
                ``"s3://bucket/run"``: that remote checkpoint, or the newest committed one under a run root,
                downloaded resumably and hash-checked first. ``None``/``False``: a fresh start.

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
            UnsupportedEngineError: DeepSpeed ZeRO-Offload (``TrainingArguments.deepspeed``), FSDP1 hybrid sharding
                or XLA FSDP, refused before anything is read or trained; DeepSpeed's other optimizers
                (``BF16_Optimizer``) once built, before the first step; pipeline or expert parallel, or context
                parallel, beside a model sharded at load time (:mod:`._trainer_parallel`). FSDP1/2, ZeRO-1/2/3 and
                tensor parallel (``DistributedConfig``) are supported: every rank saves its pieces.
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
        checkpoint, verified = self._resolve_checkpoint(resume_from_checkpoint)
        if verified is not None and (resume_from_checkpoint is True or resume_from_checkpoint == "auto"):
            # a discovered checkpoint that fails its hashes while it is loaded: the one before it (train() again)
            return resume_newest(self.args.output_dir, lambda report: self._train_from(
                Path(report.path), report, trial, ignore_keys_for_eval, **kwargs), pattern=CHECKPOINT_DIR_RE,
                owner="ResumableTrainer", first=verified)
        return self._train_from(checkpoint, verified, trial, ignore_keys_for_eval, **kwargs)

    def _train_from(self, checkpoint: Path | None, verified: VerifyReport | None, trial: Any,
                    ignore_keys_for_eval: list[str] | None, **kwargs: Any) -> Any:
        """``train`` from ``checkpoint`` (or from scratch); a failed hash while it is loaded leaves this trainer as
        ``train`` found it, so that the fallback's next ``train`` is a clean resume of the checkpoint before."""
        self._before_train = (self.optimizer, self.lr_scheduler, self._created_lr_scheduler, self.model_wrapped)
        self._resume = self._open_checkpoint(checkpoint, verified) if checkpoint is not None else None
        self.resumed_from = None if self._resume is None else (self._resume.converted_from or checkpoint)
        self._loop = _LoopTracker(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        self._rng_restored = False
        self._micro_of_step = (-1, 0)
        self._loader_fallback = None
        self._train_loader = self._train_position = None
        # eval_on_start evaluates before the first step of the run, not again at every restart
        no_eval = contextlib.nullcontext() if self._resume is None else _patched(self.args, "eval_on_start", False)
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
        """Put back what ``train`` changed before the failed load (nothing was trained or saved): the optimizer and
        scheduler it was given (``None``: created again), the unwrapped model, NEFTune's hook. Every object the load
        wrote into is filled again by the next checkpoint's load. FSDP and DeepSpeed wrap the model in place, so
        there ``failed.retry`` is false: the run stops, and its next start resumes from the checkpoint before."""
        self.optimizer, self.lr_scheduler, self._created_lr_scheduler, self.model_wrapped = self._before_train
        if self.neftune_noise_alpha is not None and getattr(self, "neftune_hook_handle", None) is not None:
            self.neftune_hook_handle.remove()  # train() adds it again
        failed.retry = not (self.is_fsdp_enabled or self.is_deepspeed_enabled)

    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | os.PathLike | None
                            ) -> tuple[Path | None, VerifyReport | None]:
        """The checkpoint to resume from, and the verification that chose it (handed to the open, so that a resume
        verifies the checkpoint and reads its small files once)."""
        if resume_from_checkpoint in (None, False):
            return None, None
        output_dir = self.args.output_dir
        if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
            report = find_agreed_checkpoint(output_dir, pattern=CHECKPOINT_DIR_RE)
            latest = None if report is None else Path(report.path)
            stock = newest_stock_checkpoint(output_dir)
            if stock is not None and (latest is None or stock.step > _step_of(latest)):
                logger.info("The newest checkpoint under %s is %s, written by the stock transformers.Trainer.",
                            output_dir, stock.path)
                return self._convert_stock_checkpoint(stock.path), None
            if latest is None:
                refuse_fresh_start(output_dir, pattern=CHECKPOINT_DIR_RE, owner="ResumableTrainer")
                logger.info("No valid checkpoint under %s: starting a fresh run.", output_dir)
            else:
                logger.info("Resuming from %s (newest checkpoint that verifies).", latest)
            return latest, report
        if is_remote(resume_from_checkpoint):  # hf://user/repo[@rev][/path] or s3://bucket/run[/checkpoint-N]
            cache = Path(output_dir) / ".remote-resume"
            return resolve_resume_path(resume_from_checkpoint, cache_dir=cache, token=self.args.hub_token,
                                       storage_options=self.resume_options.storage_options), None
        path = Path(resume_from_checkpoint)
        kind = classify_checkpoint_dir(path)
        if kind is CheckpointKind.STOCK:
            return self._convert_stock_checkpoint(path), None
        if kind is not CheckpointKind.OURS:
            raise not_a_checkpoint_error(path, output_dir)
        report = verify_checkpoint(path, full=self.resume_options.checkpoint_verify == "full", raise_on_error=True,
                                   keep=read_on_load(rank_and_world_size()[0]))
        return path, report

    def _convert_stock_checkpoint(self, stock: Path) -> Path:
        """Convert a stock ``transformers.Trainer`` checkpoint under ``output_dir/.hf-resumable-converted``.

        The stock files are only read (pickles with ``torch.load(weights_only=True)``, after the converter's
        WARNING); the stock directory is never changed or deleted. The weights are read by the stock
        ``Trainer._load_from_checkpoint`` into this trainer's model (any model class, PEFT adapters included).
        """
        from ..conversions.stock import convert_trainer_checkpoint

        target = Path(self.args.output_dir) / CONVERTED_DIR / stock.name
        logger.warning("Resuming from %s, a checkpoint of the stock transformers.Trainer, converted to %s. This "
                       "resume is NOT bit-exact: the stock checkpoint has no data position, logging accumulators "
                       "or run configuration, and hf_resumable's sample order differs from the stock sampler's. "
                       "Every checkpoint this run writes resumes bit for bit.", stock, target)
        # one process per filesystem converts (save_on_each_node: node-local output_dirs), the others wait for it
        with self.args.main_process_first(local=self.args.save_on_each_node, desc="converting a stock checkpoint"):
            if not _is_conversion_of(target, stock):
                Trainer._load_from_checkpoint(self, str(stock))
                convert_trainer_checkpoint(stock, target, model=self.accelerator.unwrap_model(self.model),
                                           overwrite=target.exists())
        self._converted_from = stock
        return target

    def _conversion_to_drop(self) -> Path | None:
        """The converted copy of a stock checkpoint this run resumed from (removed once a checkpoint committed)."""
        resume = self._resume
        if resume is None or resume.converted_from is None or not self.args.should_save:
            return None
        return resume.path if resume.path.parent == Path(self.args.output_dir) / CONVERTED_DIR else None

    @staticmethod
    def _drop_conversion(path: Path | None) -> None:
        if path is not None and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only when empty

    def _open_checkpoint(self, path: Path, verified: VerifyReport | None = None) -> _Resume:
        # Opened (decoded) once here, with the verification that found it; the weights and optimizer are filled from
        # this same object in _load_optimizer_and_scheduler, so a resume never verifies, reads or hashes a file twice.
        loaded = open_checkpoint(path, verify=self.resume_options.checkpoint_verify, verified=verified,
                                 reshard=self.resume_options.elastic)
        converted_from, self._converted_from = self._converted_from, None
        if converted_from is not None or loaded.extra.get("converted_from"):
            return _Resume(path=path, loaded=loaded, converted_from=converted_from or path)
        if loaded.extra.get(_EXTRA_MODEL_ONLY):
            self._inexact(f"{path} was saved with save_only_model=True (no optimizer, scheduler or RNG state)")
        saved = loaded.extra.get(_EXTRA_RUN_CONFIG)
        if saved is None:
            self._inexact(f"{path} records no run configuration (not written by ResumableTrainer)")
        else:
            saved_config = RunConfig.from_dict(saved)
            elastic = self._plan_elastic(saved_config, path) if self.resume_options.elastic else None
            changed = saved_config.diff(self._current_run_config())
            if elastic is not None:  # the world size changed and the global batch is kept
                changed = {name: values for name, values in changed.items() if name not in ELASTIC_SETTINGS}
            layouts = (bool(loaded.extra.get(_EXTRA_ELASTIC)), self.resume_options.elastic)
            if layouts[0] != layouts[1]:
                changed["elastic"] = layouts
            changed.update(self._layout_change(loaded.extra))
            check_drift(changed, checkpoint=str(path), allow=self.resume_options.allow_config_drift,
                        option="allow_config_drift", owner="ResumableTrainer")
        return _Resume(path=path, loaded=loaded)

    def _plan_elastic(self, saved: RunConfig, path: Path) -> ElasticPlan | None:
        """``elastic=True`` at another world size: keep the checkpoint's global batch by changing
        ``gradient_accumulation_steps`` (before the Trainer sizes anything with it); ``None`` at the same size.

        Raises:
            ElasticWorldSizeError: the global batch does not divide at this world size.
        """
        per_device = self.args.per_device_train_batch_size
        _, world_size = self._data_parallel()
        if saved.world_size == world_size or saved.per_device_train_batch_size != per_device:
            return None  # a changed per-device batch is reported by the drift check
        plan = plan_elastic_resume(saved_world_size=saved.world_size,
                                   saved_accumulation=saved.gradient_accumulation_steps,
                                   per_device_batch=saved.per_device_train_batch_size,
                                   world_size=world_size, checkpoint=str(path))
        if plan.gradient_accumulation_steps != self.args.gradient_accumulation_steps:
            self.args.gradient_accumulation_steps = plan.gradient_accumulation_steps
        self._run_config = None  # recorded with the new accumulation
        if self.args.process_index == 0:  # once per run, not per rank
            logger.info("Elastic resume of %s: %s.", path, plan.describe())
        return plan

    def _layout(self) -> ParallelLayout | None:
        """The run's tensor/N-D parallel layout (:mod:`._trainer_parallel`); ``None`` without one."""
        return trainer_layout(self.accelerator.unwrap_model(self.model),
                              getattr(self.accelerator, "parallelism_config", None))

    def _layout_change(self, extra: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{"parallelism": (saved, current)}`` when the checkpoint was written at another tensor/N-D layout
        (configuration drift, named by both), else nothing; with ``elastic=True`` another layout is taken (logged).
        """
        current = self._layout()
        saved, now = extra.get(_EXTRA_PARALLELISM), None if current is None else current.describe()
        if saved == now or _EXTRA_PARALLELISM not in extra:  # a checkpoint from before layouts were recorded
            return {}
        if not self.resume_options.elastic:
            return {KEY_PARALLELISM: (saved, now)}
        # elastic: the pieces are resharded for this layout as they are read (open_checkpoint(elastic=True)), and
        # the global batch is kept by the data-parallel world (_plan_elastic)
        if self.args.process_index == 0:
            logger.info("Elastic resume at another layout: %s -> %s.", saved or "data parallel only",
                        now or "data parallel only")
        return {}

    def _inexact(self, message: str) -> None:
        inexact(message, allow=self.resume_options.allow_inexact_resume, owner="ResumableTrainer")

    def _current_run_config(self) -> RunConfig:
        if self._run_config is None:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            length, fingerprint = dataset_fingerprint(self.train_dataset, seed=seed)
            self._run_config = RunConfig(
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                per_device_train_batch_size=self.args.per_device_train_batch_size,
                world_size=self._data_parallel()[1], seed=self.args.seed, data_seed=self.args.data_seed,
                dataset_length=length, dataset_fingerprint=fingerprint,
                train_sampling_strategy=str(self.args.train_sampling_strategy),
                dataloader_drop_last=bool(self.args.dataloader_drop_last))
        return self._run_config

    # ---- data ----

    def get_train_dataloader(self) -> Any:
        """The training loader: position-seeded, resumable without replay (see :mod:`hf_resumable.data`)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._get_dataloader(self.train_dataset, description="Training", batch_size=self._train_batch_size,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> Any:
        """Training loaders (also those a subclass's own ``get_train_dataloader`` asks for, e.g. TRL's GRPO) are
        hf_resumable loaders; evaluation loaders are the stock ones."""
        if not is_training:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn=sampler_fn,
                                           is_training=is_training, dataloader_key=dataloader_key)
        strategy = self.args.train_sampling_strategy
        custom_sampler = (sampler_fn is not None and not isinstance(dataset, torch.utils.data.IterableDataset)
                          and type(self)._get_train_sampler is not Trainer._get_train_sampler)
        if strategy not in ("random", "sequential", "group_by_length") and not custom_sampler:
            self._loader_fallback = (f"train_sampling_strategy={strategy!r} is not supported by ResumableTrainer, so "
                                     "the training data comes from the stock loader")
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn=sampler_fn,
                                           is_training=is_training, dataloader_key=dataloader_key)
        dataset, collator = self._train_dataset_and_collator(dataset)
        options = self._loader_options(batch_size)
        streaming = isinstance(dataset, torch.utils.data.IterableDataset)
        if self.resume_options.elastic and custom_sampler:
            self._refuse_at_start(
                "elastic=True keeps the sample order across world sizes in ResumableTrainer's own order (map-style "
                "or streaming), not for a custom sampler",
                fix="Use train_sampling_strategy 'random', 'sequential' or 'group_by_length' without overriding "
                    "_get_train_sampler, or elastic=False")
        _, world_size = self._data_parallel()  # the ranks of one tensor-parallel group read the same batches
        global_batch = self._train_batch_size * self.args.gradient_accumulation_steps * world_size
        elastic_stream = self.resume_options.elastic and streaming and not options["num_workers"]
        if self.resume_options.elastic and streaming and options["num_workers"]:
            self._refuse_at_start(
                f"elastic=True reads a stream in one order on every process; dataloader_num_workers="
                f"{options['num_workers']} would split it by worker", fix="Set dataloader_num_workers=0")
        if streaming:
            if strategy == "group_by_length":
                logger.warning("train_sampling_strategy='group_by_length' is ignored for a streaming data set (it "
                               "has no lengths to group by); examples come in the stream's own order.")
            # elastic: not split by rank, every process reads the whole stream and keeps its chunks of each step
            loader = build_stream_dataloader(dataset if elastic_stream else self._split_for_rank(dataset),
                                             collate_fn=collator, drop_last=self.args.dataloader_drop_last,
                                             world_size=world_size,
                                             global_batch=global_batch if elastic_stream else None,
                                             padding_fn=self._elastic_padding() if elastic_stream else None, **options)
            if not loader.dataset.is_stateful and self._saves_checkpoints():
                self._refuse_at_start(
                    f"The training set {type(dataset).__name__} is a torch IterableDataset without state_dict() and "
                    "load_state_dict(), so no checkpoint can record where the stream stands",
                    fix="Use a datasets.IterableDataset (e.g. Dataset.to_iterable_dataset()) or a map-style data set, "
                        "or implement state_dict()/load_state_dict() on your data set")
        elif custom_sampler:
            # a subclass's _get_train_sampler (TRL's RepeatSampler, a weighted sampler...): replayed per epoch under a
            # seed derived from (seed, epoch), batched and resumed by cursor
            sampler = sampler_fn(dataset)
            if sampler is None:
                sampler = range(len(dataset))  # what DataLoader does without a sampler
            loader = build_map_dataloader(dataset, collate_fn=collator, drop_last=self.args.dataloader_drop_last,
                                          world_size=world_size, num_samples=len(sampler),
                                          order=sampler_epoch_order(sampler, seed=options["seed"]), **options)
        else:
            grouped = strategy == "group_by_length"
            loader = build_map_dataloader(dataset, collate_fn=collator, drop_last=self.args.dataloader_drop_last,
                                          shuffle=strategy != "sequential", world_size=world_size,
                                          lengths=self._train_lengths() if grouped else None,
                                          group_size=global_batch if grouped else None,
                                          global_batch=global_batch if self.resume_options.elastic else None,
                                          padding_fn=self._elastic_padding() if self.resume_options.elastic else None,
                                          **options)
        self._train_loader = loader
        self._train_position = StepPosition(loader, steps_done=lambda: self.state.global_step,
                                            batches_per_step=self.args.gradient_accumulation_steps)
        self._restore_data_position(loader)
        return loader

    def _elastic_padding(self) -> Callable[[Any], Any]:
        """What makes a padding batch of the elastic layout count nothing: its labels ignored, so the loss normalised
        by ``num_items_in_batch`` (which ``elastic=True`` requires) takes nothing from it."""
        return functools.partial(ignore_labels, names=tuple(self.label_names or ("labels",)))

    def _train_lengths(self) -> list[int]:
        """Per-sample lengths for ``group_by_length``: ``length_column_name`` if present, else the length of the
        first model input (read under a fixed seed, so random transforms neither vary nor touch the global RNG)."""
        import datasets

        dataset, column = self.train_dataset, self.args.length_column_name
        if isinstance(dataset, datasets.Dataset) and column in dataset.column_names:
            return [int(length) for length in dataset[column]]
        names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        with data_rng(derive_seed(seed, "group-by-length")):
            first = dataset[0] if len(dataset) else {}
            if not isinstance(first, Mapping) or names[0] not in first:
                raise ValueError(f"train_sampling_strategy='group_by_length' needs a {column!r} column or samples "
                                 f"that are dicts with an {names[0]!r} key to read lengths from.")
            return [len(dataset[index][names[0]]) for index in range(len(dataset))]

    def _train_dataset_and_collator(self, dataset: Any) -> tuple[Any, Any]:
        collator = self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is a dependency
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        return dataset, collator

    def _loader_options(self, batch_size: int) -> dict[str, Any]:
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return dict(batch_size=batch_size, seed=seed, rank=self._data_parallel()[0],
                    num_workers=self.args.dataloader_num_workers,
                    pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
                    persistent_workers=self.args.dataloader_persistent_workers,
                    prefetch_factor=self.args.dataloader_prefetch_factor,
                    multiprocessing_context=self.args.dataloader_multiprocessing_context)

    def _split_for_rank(self, dataset: Any) -> Any:
        rank, world_size = self._data_parallel()
        return split_stream_for_rank(dataset, rank=rank, world_size=world_size)

    def _data_parallel(self) -> tuple[int, int]:
        """This process's data-parallel rank and their number: the process index and count, or, under tensor/N-D
        parallel, the coordinate over the data dimensions (:mod:`._trainer_parallel`)."""
        return data_parallel_rank(self._layout(), process_index=self.args.process_index,
                                  world_size=self.args.world_size)

    def _restore_data_position(self, loader: Any) -> None:
        if self._resume is None:
            return
        record = self._resume.loaded.data_state
        if record is None and self._resume.converted_from is not None:
            return  # a stock checkpoint: the loader starts at the Trainer's (epoch, batch), in hf_resumable's order
        if self.resume_options.elastic and self._train_position.kind == "map":
            return  # the elastic layout's position is the global step (the Trainer's skip), at any world size
        if getattr(loader.dataset, "global_batch", None) is not None and (
                self._resume.loaded.manifest.world_size != self.args.world_size):
            # an elastic stream's position is global: rank 0's record (a new rank has none of its own), its batch
            # counters set for this world size when loaded
            record = broadcast_json(record if self.args.process_index == 0 else None)
        if record is None:
            self._inexact(f"{self._resume.path} has no data position for rank {self.args.process_index}")
            return
        if record.get(DATA_KIND) == "stream":
            if not self._train_position.fits(record):
                self._inexact(f"{self._resume.path} holds a streaming position but the training data is map-style")
                return
            if has_shuffle_buffer(getattr(loader.dataset, "dataset", None)):  # a buffer data.py could not replace
                self._inexact("The streaming training set has a shuffle buffer that hf_resumable could not replace "
                              "(see the WARNING above), whose content datasets does not save (the buffer is "
                              "refilled from the resume point)")
            self._train_position.load_position(record)

    def _data_position(self) -> dict[str, Any] | None:
        position = self._train_position
        # a stream without state_dict(): refused at train start unless allow_inexact_resume
        if position is None or not getattr(position.loader.dataset, "is_stateful", True):
            return None
        return position.position()

    def _load_callback_state(self) -> None:
        """Restore ``ExportableState`` callbacks from the checkpoint (``restore_callback_states``, default on)."""
        if not self.resume_options.restore_callback_states or self.args.restore_callback_states_from_checkpoint:
            return super()._load_callback_state()
        with _patched(self.args, "restore_callback_states_from_checkpoint", True):
            super()._load_callback_state()

    # ---- saving ----

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Write ``checkpoint-<global_step>`` in the hf_resumable format (atomic, hashed, no pickle).

        With ``save_async`` the checkpoint is staged and written in the background (the save before a preemption
        exit excepted: the process exits right after it); what follows its commit (retention, uploads) runs once it
        has committed.
        Everything the checkpoint holds is captured here, at this step.
        """
        # the previous background save has committed (or its failure is raised here)
        self._settle_saves(removals=False)
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = Path(self._get_output_dir(trial=trial))
        output_dir = run_dir / f"{CHECKPOINT_PREFIX}{self.state.global_step}"
        self._update_best_checkpoint(run_dir)
        self._export_callback_states()
        model_only = self.args.save_only_model
        # The SIGTERM save is blocking: the process exits right after it.
        blocking = not self._saves_in_background() or self.preempted
        unwrapped = checkpoint_model(self.model, self.accelerator.unwrap_model(self.model))  # FSDP1: its root
        optimizer = checkpoint_optimizer(self.optimizer)  # ZeRO: this rank's partitions
        engine = deepspeed_engine(self.model_wrapped)
        save_checkpoint(  # FSDP1/2 / ZeRO: every rank writes its pieces
            output_dir, model=unwrapped,
            optimizer=None if model_only else optimizer,
            scheduler=None if model_only else self.lr_scheduler,
            scaler=None if model_only else self.accelerator.scaler,
            step=self.state.global_step,
            training_state={_PROGRESS_LOOP: self._loop_state(), _PROGRESS_ATTRIBUTES: self._trainer_attributes()},
            extra={_EXTRA_RUN_CONFIG: self._current_run_config().to_dict(), _EXTRA_MODEL_ONLY: model_only,
                   _EXTRA_HYPERPARAMETERS: hyperparameter_snapshot(self.args, max_steps=self.state.max_steps),
                   _EXTRA_ELASTIC: self.resume_options.elastic,
                   _EXTRA_PARALLELISM: None if self._layout() is None else self._layout().describe(),
                   **({EXTRA_DEEPSPEED: capture_engine_state(engine, [optimizer])} if engine is not None else {})},
            extra_files={TRAINER_STATE_FILE: json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True)},
            data_state=self._data_position(), rng=not model_only, metrics=self._metrics_of_this_step(),
            # as Trainer._save: without a processing_class, the collator's tokenizer is saved
            processing_class=self.processing_class or getattr(self.data_collator, "tokenizer", None), overwrite=True,
            standalone=self.resume_options.standalone_checkpoints, blocking=blocking)
        conversion = self._conversion_to_drop()
        saver = background_saver()  # a blocking save's fsyncs may still run there (durability "deferred")
        self._commits.attach(saver.future if not blocking or saver.in_flight else None,
                             lambda: self._after_commit(output_dir, run_dir, conversion))

    def _after_commit(self, checkpoint: Path, run_dir: Path, conversion: Path | None) -> None:
        """What follows a checkpoint's commit: drop a converted stock checkpoint, push, upload, apply retention.

        Rank-local (no collective): a background save may be known to have committed at different steps on
        different ranks.
        """
        self._drop_conversion(conversion)
        if self.args.push_to_hub:
            self._push_from_checkpoint(str(checkpoint))
        if self._uploader is not None and self.args.should_save:
            self._uploader.submit(checkpoint)
        if self.args.should_save and self.args.save_total_limit:
            protect = [self.state.best_model_checkpoint] if self.state.best_model_checkpoint else []
            protect += list(self._uploader.pending()) if self._uploader is not None else []
            apply_retention(run_dir, keep_last=max(1, self.args.save_total_limit), protect=protect,
                            background=True)

    def _settle_saves(self, *, poll: bool = False, removals: bool = True) -> None:
        """Wait for this trainer's background save, then run what follows its commit; raise its failure.

        With ``poll``, only a save that has already finished is settled, and a failure is kept to be raised at the
        next save or at the end of ``train`` (where every rank waits: ranks never raise at different steps). With
        ``removals=False`` (before a save) the old checkpoints retention removed may still be being deleted.
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

    def _update_best_checkpoint(self, run_dir: Path) -> None:
        # Same rule as Trainer._save_checkpoint: the best step's directory becomes best_model_checkpoint.
        if self.args.save_strategy in ("steps", "epoch", "best") and self.state.best_global_step:
            if self.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED:
                torch.distributed.barrier()
            best = run_dir / f"{CHECKPOINT_PREFIX}{self.state.best_global_step}"
            if best.exists() or self.state.best_global_step == self.state.global_step:
                self.state.best_model_checkpoint = str(best)

    def _export_callback_states(self) -> None:
        # Same as Trainer._save_checkpoint: ExportableState callbacks and TrainerControl into the state.
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, ExportableState):
                name = callback.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(callback.state())
                else:
                    self.state.stateful_callbacks[name] = callback.state()

    def _metrics_of_this_step(self) -> dict[str, float]:
        if self._last_eval is None or self._last_eval[0] != self.state.global_step:
            return {}
        return {k: float(v) for k, v in self._last_eval[1].items() if isinstance(v, (int, float))}

    def _loop_state(self) -> dict[str, Any]:
        """The logging loop's accumulators, so the next logged loss averages the same steps as without a restart,
        and where the step stands in the loop (stopped, end-of-epoch bookkeeping done) so a restart neither
        repeats nor skips any of it."""
        loop = self._loop
        return {"tr_loss": float(self._tr_loss.item()), "total_loss_scalar": float(self._total_loss_scalar),
                "globalstep_last_logged": int(self._globalstep_last_logged),
                "initial_global_step": int(self._initial_global_step),
                # stopped before max_steps by a callback (EarlyStoppingCallback...); reaching max_steps is not
                # recorded as a stop, so a restart with a larger max_steps continues
                "stopped": bool(self.control.should_training_stop) and self.state.global_step < self.state.max_steps,
                "epoch_end_done": loop.in_epoch_end,
                # train/eval mode after this step's evaluation (TRL's log() picks its metrics by it)
                "model_training": bool(self.model.training),
                "grad_norm": loop.grad_norm, "learning_rate": loop.learning_rate}

    def _trainer_attributes(self) -> dict[str, Any]:
        return {name: encode_attribute(getattr(self, name)) for name in self.resumable_state_attributes
                if hasattr(self, name)}

    def _restore_trainer_attributes(self) -> None:
        saved = self._resume.loaded.training_state.get(_PROGRESS_ATTRIBUTES) or {}
        for name, value in saved.items():
            if name in self.resumable_state_attributes:
                setattr(self, name, restore_attribute(getattr(self, name, None), value))
        missing = [name for name in self.resumable_state_attributes if hasattr(self, name) and name not in saved]
        if missing and self._resume.converted_from is None:
            self._inexact(f"{self._resume.path} does not hold the trainer attributes {missing} of "
                          f"{type(self).__name__}")

    def _restore_loop_state(self) -> dict[str, Any] | None:
        loop = self._resume.loaded.training_state.get(_PROGRESS_LOOP)
        if loop is None and self._resume.converted_from is not None:
            return None  # a stock checkpoint: the accumulators start from zero, as in a stock resume
        if loop is None:
            self._inexact(f"{self._resume.path} has no logging-loop state")
            return None
        self._tr_loss = torch.tensor(loop["tr_loss"], dtype=self._tr_loss.dtype, device=self._tr_loss.device)
        self._total_loss_scalar = loop["total_loss_scalar"]
        self._globalstep_last_logged = loop["globalstep_last_logged"]
        self._initial_global_step = loop["initial_global_step"]
        return loop

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
        if self.resume_options.elastic and self._train_loader is not None:
            # dropout keyed by the chunk this micro-batch trains on, not by the rank: the same at any world size
            epoch, chunk = self._elastic_chunk()
            seed_model_rng(self.args.seed, epoch=epoch, chunk=chunk)
        return super().training_step(model, inputs, *args, **kwargs)

    def _elastic_chunk(self) -> tuple[int, int]:
        """``(epoch, chunk)`` of the micro-batch about to train (elastic layout: every optimizer step of an epoch has
        ``gradient_accumulation_steps`` micro-batches; rank ``r``'s ``j``-th is chunk ``j * world_size + r``)."""
        step = self.state.global_step
        if self._micro_of_step[0] != step:
            self._micro_of_step = (step, 0)
        micro = self._micro_of_step[1]
        self._micro_of_step = (step, micro + 1)
        per_epoch = self._loop.steps_per_epoch or 1
        epoch, step_in_epoch = divmod(step, per_epoch)
        batch = step_in_epoch * self.args.gradient_accumulation_steps + micro
        rank, world_size = self._data_parallel()
        return epoch, batch * world_size + rank

    def _saves_checkpoints(self) -> bool:
        return str(getattr(self.args.save_strategy, "value", self.args.save_strategy)) != "no"

    def _check_before_training(self, dataloader: Any, *, max_steps: int) -> None:
        """Refuse, before the first step, a run whose checkpoints would fail or could not be resumed exactly."""
        start = (self._resume.loaded.step or 0) if self._resume is not None else 0
        record = self._resume.loaded.training_state.get(_PROGRESS_LOOP) if self._resume is not None else None
        self._loop.finished = self._resume is not None and (start >= max_steps or bool((record or {}).get("stopped")))
        self._hyperparameter_changes = []
        saved = self._resume.loaded.extra.get(_EXTRA_HYPERPARAMETERS) if self._resume is not None else None
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
        if self.resume_options.elastic:
            self._check_elastic_loss()
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
            encode_state(self._trainer_attributes(), {}, prefix=_PROGRESS_ATTRIBUTES)
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

    def _check_elastic_loss(self) -> None:
        """``elastic=True`` needs the loss normalised over the whole global batch (tokens of every micro-batch and
        rank), which ``Trainer`` does with ``average_tokens_across_devices`` and a model or ``compute_loss_func``
        that takes ``num_items_in_batch``; a per-micro-batch mean would weigh tokens by the rank layout."""
        if self.args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func):
            return
        self._refuse_at_start(
            "elastic=True: the loss is not normalised over the whole global batch (average_tokens_across_devices="
            f"{self.args.average_tokens_across_devices}, model takes num_items_in_batch: "
            f"{bool(self.model_accepts_loss_kwargs)}), so the gradient would depend on how the batch is split "
            "across processes", fix="Set average_tokens_across_devices=True and use a model that accepts "
                                    "num_items_in_batch (or pass compute_loss_func)")

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
        self._resume_prologue(model=bound["model"], start_time=bound["start_time"])
        if self._loop.finished:  # the checkpoint is the end of the run: train nothing, save nothing
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        self._resume_prologue(model=self.model_wrapped, start_time=start_time)
        # the last checkpoint commits (or its failure is raised) before the best model is loaded and
        # save_total_limit=1 deletes checkpoints
        self._settle_saves()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _resume_prologue(self, *, model: torch.nn.Module, start_time: float) -> None:
        """Once per ``train``, before the first resumed step (or the end of training when nothing is left).

        Restores the logging accumulators; finishes the end-of-epoch work (``on_epoch_end``, epoch-strategy
        logging, evaluation and saving) that the uninterrupted run did right after the checkpoint's step; and
        recognises a checkpoint that ends the run (``max_steps`` reached, or the run asked to stop, e.g. by
        ``EarlyStoppingCallback``), so that re-running a finished run trains nothing and writes nothing.
        """
        loop = self._loop
        if loop.prologue_done:
            return
        loop.prologue_done = True
        if self._resume is None:
            return
        self._restore_trainer_attributes()
        record = self._restore_loop_state()
        if record is None:
            return
        if "model_training" in record:
            self.model.train(record["model_training"])
        step = self.state.global_step
        loop.finished = step >= self.state.max_steps or bool(record.get("stopped"))
        per_epoch = loop.steps_per_epoch or self.state.max_steps
        if step > 0 and (step % per_epoch == 0 or loop.finished) and not record.get("epoch_end_done", True):
            self._load_rng_state(str(self._resume.path))  # the RNG the epoch-end evaluation drew from
            self._rng_restored = True
            self.control.should_log = self.control.should_evaluate = self.control.should_save = False
            self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
            loop.last_call_step = step
            self._maybe_log_save_evaluate(self._tr_loss, record.get("grad_norm"), model, loop.trial,
                                          (step - 1) // per_epoch, loop.ignore_keys_for_eval, start_time,
                                          learning_rate=record.get("learning_rate"))
        if loop.finished:
            logger.info("%s is the end of this run (step %d of %d%s): nothing left to train.", self._resume.path,
                        step, self.state.max_steps, ", stopped by a callback" if record.get("stopped") else "")
            if not self._rng_restored:
                self._load_rng_state(str(self._resume.path))
                self._rng_restored = True

    # ---- loading ----

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # Weights are loaded together with the optimizer in _load_optimizer_and_scheduler (one verified read,
        # parameter names resolved against the same model).
        logger.debug("Deferring weight loading of %s until the optimizer exists.", resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        model_only = self._resume is not None and self._resume.loaded.extra.get(_EXTRA_MODEL_ONLY)
        if self._resume is not None and self._resume.converted_from is not None:
            # a stock checkpoint saved with save_only_model has no optimizer state: a fresh optimizer, as stock
            files = self._resume.loaded.manifest.files  # a converted DeepSpeed checkpoint holds it in pieces
            model_only = OPTIMIZER_INDEX_FILE not in files and LAYOUT_FILE not in files
        opened = (self._resume.loaded if self._resume is not None and Path(checkpoint) == self._resume.path
                  else open_checkpoint(checkpoint, verify=self.resume_options.checkpoint_verify,
                                       reshard=self.resume_options.elastic))
        model = checkpoint_model(self.model, self.accelerator.unwrap_model(self.model))  # FSDP1: its root
        optimizer = checkpoint_optimizer(self.optimizer)  # ZeRO: this rank's partitions
        objects = dict(optimizer=None if model_only else optimizer,
                       scheduler=None if model_only else self.lr_scheduler,
                       scaler=None if model_only else self.accelerator.scaler)
        engine = deepspeed_engine(self.model_wrapped)
        engine_state = None
        if engine is not None and not model_only:  # checked before anything is loaded
            engine_state = saved_engine_state(opened.extra, where=checkpoint)
        with agreed_load(checkpoint):  # a failed hash on any rank: ResumeLoadError on all (train's fallback)
            # FSDP2 / ZeRO: every rank reads its pieces' slices; a world-size change was already refused (or
            # allowed) by the run-config drift check
            opened.load_into(model=model, **objects, restore_rng=False, allow_inexact_resume=True)
            if engine_state is not None:
                restore_engine_state(engine, [optimizer], engine_state)
        changes = self._hyperparameter_changes and not model_only
        if changes and self.resume_options.resume_hyperparameters == "arguments":
            apply_new_hyperparameters(torch_optimizer(self.optimizer), self.lr_scheduler,
                                      self._hyperparameter_changes, decay_groups=self._decay_groups())

    def _decay_groups(self) -> list[bool]:
        """Per optimizer param group: whether it holds only parameters ``Trainer`` applies weight decay to."""
        model = self.accelerator.unwrap_model(self.model)
        names = {id(p): n for n, p in model.named_parameters()}
        decay = set(self.get_decay_parameter_names(model))
        return [bool(group["params"]) and all(names.get(id(p)) in decay for p in group["params"])
                for group in self.optimizer.param_groups]

    def _load_scaler(self, checkpoint: str | None) -> None:
        # Loaded with the optimizer.
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Restore the RNG captured after the checkpoint's optimizer step; the Trainer calls this right
        before the first resumed forward pass (our data loading never touches the global RNG)."""
        if checkpoint is None or self._resume is None or self._rng_restored:
            return
        state = self._resume.loaded.rng_state
        if state is None and self._resume.converted_from is not None:
            return
        if self.resume_options.elastic and self._resume.loaded.manifest.world_size != self.args.world_size:
            # the model's randomness is keyed per micro-batch (training_step); a rank the checkpoint had keeps its
            # other streams, a new one starts from its seed
            if state is not None:
                restore_rng_state(state, allow_device_mismatch=True)
            return
        if state is None:
            self._inexact(f"{checkpoint} has no RNG state for rank {self.args.process_index}")
            return
        restore_rng_state(state, allow_device_mismatch=self.resume_options.allow_inexact_resume)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not _is_own_checkpoint(Path(best)):  # a stock Trainer checkpoint (a run resumed from stock ones)
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        model = checkpoint_model(self.model, self.accelerator.unwrap_model(self.model))  # FSDP1: its root
        # FSDP2 and ZeRO checkpoints hold per-rank pieces; under ZeRO-1/2 every rank loads the whole weights
        load_checkpoint(best, model=model, restore_rng=False, verify=self.resume_options.checkpoint_verify,
             allow_inexact_resume=True)  # weights only: no drift


_RESUMABLE_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def make_resumable(trainer_class: type, *, state_attributes: tuple[str, ...] | list[str] = ()) -> type:
    """The resumable version of a ``transformers.Trainer`` subclass (TRL's ``SFTTrainer``, ``Seq2SeqTrainer``...).

    The returned class, ``Resumable<Name>``, is ``trainer_class`` with ``ResumableTrainer`` placed under it: the
    subclass keeps its own preprocessing, ``compute_loss``, ``log``, model card and ``_save_checkpoint`` extras,
    and gets ResumableTrainer's checkpoints, exact restarts, stock-checkpoint resume and early errors. Its
    constructor takes the subclass's arguments plus ResumableTrainer's options (``allow_config_drift``,
    ``allow_inexact_resume``, ``exit_on_preemption``, ``checkpoint_verify``, ``push_checkpoints_to``,
    ``storage_options``, ``restore_callback_states``, ``resume_hyperparameters``, ``standalone_checkpoints``,
    ``save_async``, ``elastic``, ``mean_time_between_failures``, ``preemption_notice``). The same class is returned
    for the same arguments.

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
