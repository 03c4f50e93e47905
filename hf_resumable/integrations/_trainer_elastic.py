"""``ResumableTrainer(..., elastic=True)``: what a restart at another world size changes on the Trainer side (the rule
itself, :func:`~hf_resumable.integrations._elastic.plan_elastic_resume`, is shared with the Accelerator).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data import ignore_labels
from ..format.state import RunConfig
from ._elastic import ElasticPlan, plan_elastic_resume

if TYPE_CHECKING:
    from .trainer import ResumableTrainer

logger = logging.getLogger(__name__)

__all__ = ["check_elastic_loss", "elastic_chunk", "elastic_padding", "plan_elastic_load"]


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


def elastic_chunk(trainer: ResumableTrainer) -> tuple[int, int]:
    """``(epoch, chunk)`` of the micro-batch about to train (elastic layout: every optimizer step of an epoch has
    ``gradient_accumulation_steps`` micro-batches; rank ``r``'s ``j``-th is chunk ``j * world_size + r``)."""
    step = trainer.state.global_step
    if trainer._micro_of_step[0] != step:
        trainer._micro_of_step = (step, 0)
    micro = trainer._micro_of_step[1]
    trainer._micro_of_step = (step, micro + 1)
    per_epoch = trainer._loop.steps_per_epoch or 1
    epoch, step_in_epoch = divmod(step, per_epoch)
    batch = step_in_epoch * trainer.args.gradient_accumulation_steps + micro
    rank, world_size = trainer._data_parallel()
    return epoch, batch * world_size + rank


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
