"""``ResumableTrainer(..., elastic=True)``: what a restart at another world size changes on the Trainer side
(docs/trainer.md, "Elastic"). The trainer picks its mode once (:func:`trainer_world_size_mode`); every step that
differs is a method of that object. The Accelerator's counterpart is :mod:`._accelerate_elastic`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data import ignore_labels
from ..format.state import RunConfig
from ._elastic import ELASTIC_SETTINGS, ElasticPlan, plan_elastic_resume, seed_model_rng
from ._parallelism import KEY_PARALLELISM

if TYPE_CHECKING:
    from .trainer import ResumableTrainer

logger = logging.getLogger(__name__)

__all__ = ["ElasticTrainerWorldSize", "FixedTrainerWorldSize", "check_elastic_loss", "elastic_padding",
           "plan_elastic_load", "trainer_world_size_mode"]


def plan_elastic_load(trainer: ResumableTrainer, saved: RunConfig, path: Path) -> ElasticPlan | None:
    """``elastic=True`` at another world size: keep the checkpoint's global batch by changing
    ``gradient_accumulation_steps`` (before the Trainer sizes anything with it); ``None`` at the same size.

    Raises:
        ElasticWorldSizeError: the global batch does not divide at this world size.
    """
    per_device = trainer.args.per_device_train_batch_size
    _, world_size = trainer._data_parallel()
    if saved.world_size == world_size or saved.per_device_train_batch_size != per_device:
        return None  # a changed per-device batch is reported by the drift check
    plan = plan_elastic_resume(saved_world_size=saved.world_size,
                               saved_accumulation=saved.gradient_accumulation_steps,
                               per_device_batch=saved.per_device_train_batch_size,
                               world_size=world_size, checkpoint=str(path))
    if plan.gradient_accumulation_steps != trainer.args.gradient_accumulation_steps:
        trainer.args.gradient_accumulation_steps = plan.gradient_accumulation_steps
    trainer._run_config = None  # recorded with the new accumulation
    if trainer.args.process_index == 0:  # once per run, not per rank
        logger.info("Elastic resume of %s: %s.", path, plan.describe())
    return plan


def elastic_padding(trainer: ResumableTrainer) -> Callable[[Any], Any]:
    """What makes a padding batch of the elastic layout count nothing: its labels ignored, so the loss normalised
    by ``num_items_in_batch`` (which ``elastic=True`` requires) takes nothing from it."""
    return functools.partial(ignore_labels, names=tuple(trainer.label_names or ("labels",)))


def check_elastic_loss(trainer: ResumableTrainer) -> None:
    """``elastic=True`` needs the loss normalised over the whole global batch (tokens of every micro-batch and
    rank), which ``Trainer`` does with ``average_tokens_across_devices`` and a model or ``compute_loss_func``
    that takes ``num_items_in_batch``; a per-micro-batch mean would weigh tokens by the rank layout."""
    if trainer.args.average_tokens_across_devices and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func):
        return
    trainer._refuse_at_start(
        "elastic=True: the loss is not normalised over the whole global batch (average_tokens_across_devices="
        f"{trainer.args.average_tokens_across_devices}, model takes num_items_in_batch: "
        f"{bool(trainer.model_accepts_loss_kwargs)}), so the gradient would depend on how the batch is split "
        "across processes", fix="Set average_tokens_across_devices=True and use a model that accepts "
                                "num_items_in_batch (or pass compute_loss_func)")


class FixedTrainerWorldSize:
    """``elastic=False``: a resume continues at the checkpoint's world size (another one is drift). Each method is a
    step that :class:`ElasticTrainerWorldSize` does differently; here it is the plain ``Trainer`` behaviour."""

    enabled = False  # recorded in every checkpoint (EXTRA_ELASTIC)

    def start(self) -> None:
        """A new ``train()`` begins."""

    def elastic_layout(self, trainer: ResumableTrainer, *, custom_sampler: bool, streaming: bool,
                       num_workers: int) -> bool:
        """Whether the training loader is built in the elastic layout (the whole order read by every process, cut
        to whole global batches), after refusing a loader that cannot be."""
        return False

    def positions_by_step(self, kind: str) -> bool:
        """Whether a loader of ``kind`` (``"map"``/``"stream"``) is positioned by the global step alone."""
        return False

    def plan_load(self, trainer: ResumableTrainer, saved: RunConfig, path: Path) -> ElasticPlan | None:
        """Adapt the trainer to the checkpoint's run configuration before the Trainer sizes anything with it."""
        return None

    def drift(self, changed: dict[str, tuple[Any, Any]], plan: ElasticPlan | None) -> dict[str, tuple[Any, Any]]:
        """The changed run settings that count as drift."""
        return changed

    def layout_change(self, trainer: ResumableTrainer, saved: str | None, now: str | None) -> dict[str, Any]:
        """A checkpoint of another tensor/N-D layout: drift, named by both."""
        return {KEY_PARALLELISM: (saved, now)}

    def resumes_across(self, saved_world_size: int, world_size: int) -> bool:
        """Whether a checkpoint of ``saved_world_size`` continues at ``world_size`` (never, here: that is drift)."""
        return False

    def seed_micro_batch(self, trainer: ResumableTrainer) -> None:
        """Before a micro-batch trains (``training_step``)."""

    def check_before_training(self, trainer: ResumableTrainer) -> None:
        """Refuse, before step 1, a setup this mode cannot resume."""


class ElasticTrainerWorldSize(FixedTrainerWorldSize):
    """``elastic=True``: a resume at another world size keeps the checkpoint's global batch, sample order and model
    randomness (see ``ResumableTrainer``'s ``elastic`` and docs/trainer.md)."""

    enabled = True

    def __init__(self) -> None:
        self.micro_of_step = (-1, 0)  # (global_step, micro-batches trained in it): elastic dropout keys

    def start(self) -> None:
        self.micro_of_step = (-1, 0)

    def elastic_layout(self, trainer: ResumableTrainer, *, custom_sampler: bool, streaming: bool,
                       num_workers: int) -> bool:
        if custom_sampler:
            trainer._refuse_at_start(
                "elastic=True keeps the sample order across world sizes in ResumableTrainer's own order (map-style "
                "or streaming), not for a custom sampler",
                fix="Use train_sampling_strategy 'random', 'sequential' or 'group_by_length' without overriding "
                    "_get_train_sampler, or elastic=False")
        if streaming and num_workers:
            trainer._refuse_at_start(
                f"elastic=True reads a stream in one order on every process; dataloader_num_workers="
                f"{num_workers} would split it by worker", fix="Set dataloader_num_workers=0")
        return not (streaming and num_workers)

    def positions_by_step(self, kind: str) -> bool:
        return kind == "map"

    def plan_load(self, trainer: ResumableTrainer, saved: RunConfig, path: Path) -> ElasticPlan | None:
        return plan_elastic_load(trainer, saved, path)

    def drift(self, changed: dict[str, tuple[Any, Any]], plan: ElasticPlan | None) -> dict[str, tuple[Any, Any]]:
        if plan is not None:  # the world size changed and the global batch is kept
            changed = {name: values for name, values in changed.items() if name not in ELASTIC_SETTINGS}
        return changed

    def layout_change(self, trainer: ResumableTrainer, saved: str | None, now: str | None) -> dict[str, Any]:
        # the pieces are resharded for this layout as they are read (open_checkpoint(reshard=True)), and the global
        # batch is kept by the data-parallel world (plan_elastic_load)
        if trainer.args.process_index == 0:
            logger.info("Elastic resume at another layout: %s -> %s.", saved or "data parallel only",
                        now or "data parallel only")
        return {}

    def resumes_across(self, saved_world_size: int, world_size: int) -> bool:
        return saved_world_size != world_size

    def seed_micro_batch(self, trainer: ResumableTrainer) -> None:
        if trainer._train_loader is not None:
            # dropout keyed by the chunk this micro-batch trains on, not by the rank: the same at any world size
            epoch, chunk = self.chunk(trainer)
            seed_model_rng(trainer.args.seed, epoch=epoch, chunk=chunk)

    def chunk(self, trainer: ResumableTrainer) -> tuple[int, int]:
        """``(epoch, chunk)`` of the micro-batch about to train (elastic layout: every optimizer step of an epoch
        has ``gradient_accumulation_steps`` micro-batches; rank ``r``'s ``j``-th is chunk ``j * world_size + r``)."""
        step = trainer.state.global_step
        if self.micro_of_step[0] != step:
            self.micro_of_step = (step, 0)
        micro = self.micro_of_step[1]
        self.micro_of_step = (step, micro + 1)
        per_epoch = trainer._loop.steps_per_epoch or 1
        epoch, step_in_epoch = divmod(step, per_epoch)
        batch = step_in_epoch * trainer.args.gradient_accumulation_steps + micro
        rank, world_size = trainer._data_parallel()
        return epoch, batch * world_size + rank

    def check_before_training(self, trainer: ResumableTrainer) -> None:
        check_elastic_loss(trainer)


def trainer_world_size_mode(elastic: bool) -> FixedTrainerWorldSize:
    """The trainer's mode for ``elastic`` (chosen once, when it is built).

    Example:

    ```python
    >>> trainer_world_size_mode(True).enabled, trainer_world_size_mode(False).enabled
    (True, False)
    ```
    """
    return ElasticTrainerWorldSize() if elastic else FixedTrainerWorldSize()
