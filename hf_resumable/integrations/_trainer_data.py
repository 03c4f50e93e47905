"""The training loader of :class:`~hf_resumable.integrations.trainer.ResumableTrainer` and its position.

:func:`build_train_dataloader` replaces ``Trainer._get_dataloader`` for training: the loader is built from
:mod:`hf_resumable.data` (see docs/trainer.md) in the layout the world-size mode asks for, and put at the checkpoint's
position (:func:`restore_data_position`); :func:`data_position` is what a save records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer

from ..data import (
    DATA_KIND,
    build_map_dataloader,
    build_stream_dataloader,
    data_rng,
    has_shuffle_buffer,
    sampler_epoch_order,
    split_stream_for_rank,
)
from ..data._loaders import StepPosition
from ..distributed import broadcast_json
from ..format.rng import derive_seed
from ._trainer_elastic import elastic_padding

if TYPE_CHECKING:
    from .trainer import ResumableTrainer

logger = logging.getLogger(__name__)

__all__ = ["build_train_dataloader", "data_position", "loader_options", "restore_data_position", "split_for_rank",
           "train_dataset_and_collator", "train_lengths"]


def build_train_dataloader(trainer: ResumableTrainer, dataset: Any, batch_size: int, sampler_fn: Any,
                           stock: Callable[[], Any]) -> Any:
    """The training loader of ``Trainer._get_dataloader(..., is_training=True)`` (also those a subclass's own
    ``get_train_dataloader`` asks for, e.g. TRL's GRPO): an hf_resumable loader at the checkpoint's position, or
    ``stock()`` (the stock loader) for a sampling strategy ResumableTrainer does not replay."""
    strategy = trainer.args.train_sampling_strategy
    custom_sampler = (sampler_fn is not None and not isinstance(dataset, torch.utils.data.IterableDataset)
                      and type(trainer)._get_train_sampler is not Trainer._get_train_sampler)
    if strategy not in ("random", "sequential", "group_by_length") and not custom_sampler:
        trainer._loader_fallback = (f"train_sampling_strategy={strategy!r} is not supported by ResumableTrainer, "
                                    "so the training data comes from the stock loader")
        return stock()
    dataset, collator = train_dataset_and_collator(trainer, dataset)
    options = loader_options(trainer, batch_size)
    streaming = isinstance(dataset, torch.utils.data.IterableDataset)
    # the elastic layout (every process reads the whole order and keeps its chunks of each step), or per rank
    elastic = trainer._world_size_mode.elastic_layout(trainer, custom_sampler=custom_sampler, streaming=streaming,
                                                      num_workers=options["num_workers"])
    _, world_size = trainer._data_parallel()  # the ranks of one tensor-parallel group read the same batches
    global_batch = trainer._train_batch_size * trainer.args.gradient_accumulation_steps * world_size
    if streaming:
        if strategy == "group_by_length":
            logger.warning("train_sampling_strategy='group_by_length' is ignored for a streaming data set (it "
                           "has no lengths to group by); examples come in the stream's own order.")
        loader = build_stream_dataloader(dataset if elastic else split_for_rank(trainer, dataset),
                                         collate_fn=collator, drop_last=trainer.args.dataloader_drop_last,
                                         world_size=world_size,
                                         global_batch=global_batch if elastic else None,
                                         padding_fn=elastic_padding(trainer) if elastic else None, **options)
        if not loader.dataset.is_stateful and trainer._saves_checkpoints():
            trainer._refuse_at_start(
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
        loader = build_map_dataloader(dataset, collate_fn=collator, drop_last=trainer.args.dataloader_drop_last,
                                      world_size=world_size, num_samples=len(sampler),
                                      order=sampler_epoch_order(sampler, seed=options["seed"]), **options)
    else:
        grouped = strategy == "group_by_length"
        loader = build_map_dataloader(dataset, collate_fn=collator, drop_last=trainer.args.dataloader_drop_last,
                                      shuffle=strategy != "sequential", world_size=world_size,
                                      lengths=train_lengths(trainer) if grouped else None,
                                      group_size=global_batch if grouped else None,
                                      global_batch=global_batch if elastic else None,
                                      padding_fn=elastic_padding(trainer) if elastic else None, **options)
    trainer._train_loader = loader
    trainer._train_position = StepPosition(loader, steps_done=lambda: trainer.state.global_step,
                                           batches_per_step=trainer.args.gradient_accumulation_steps)
    restore_data_position(trainer, loader)
    return loader


def train_lengths(trainer: ResumableTrainer) -> list[int]:
    """Per-sample lengths for ``group_by_length``: ``length_column_name`` if present, else the length of the
    first model input (read under a fixed seed, so random transforms neither vary nor touch the global RNG)."""
    import datasets

    dataset, column = trainer.train_dataset, trainer.args.length_column_name
    if isinstance(dataset, datasets.Dataset) and column in dataset.column_names:
        return [int(length) for length in dataset[column]]
    names = getattr(trainer.processing_class, "model_input_names", None) or ["input_ids"]
    seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed
    with data_rng(derive_seed(seed, "group-by-length")):
        first = dataset[0] if len(dataset) else {}
        if not isinstance(first, Mapping) or names[0] not in first:
            raise ValueError(f"train_sampling_strategy='group_by_length' needs a {column!r} column or samples "
                             f"that are dicts with an {names[0]!r} key to read lengths from.")
        return [len(dataset[index][names[0]]) for index in range(len(dataset))]


def train_dataset_and_collator(trainer: ResumableTrainer, dataset: Any) -> tuple[Any, Any]:
    collator = trainer.data_collator
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="Training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="Training")
    return dataset, collator


def loader_options(trainer: ResumableTrainer, batch_size: int) -> dict[str, Any]:
    seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed
    return dict(batch_size=batch_size, seed=seed, rank=trainer._data_parallel()[0],
                num_workers=trainer.args.dataloader_num_workers,
                pin_memory=trainer.args.dataloader_pin_memory and torch.cuda.is_available(),
                persistent_workers=trainer.args.dataloader_persistent_workers,
                prefetch_factor=trainer.args.dataloader_prefetch_factor,
                multiprocessing_context=trainer.args.dataloader_multiprocessing_context)


def split_for_rank(trainer: ResumableTrainer, dataset: Any) -> Any:
    rank, world_size = trainer._data_parallel()
    return split_stream_for_rank(dataset, rank=rank, world_size=world_size)


def restore_data_position(trainer: ResumableTrainer, loader: Any) -> None:
    if trainer._resume is None:
        return
    record = trainer._resume.loaded.data_state
    if record is None and trainer._resume.converted_from is not None:
        return  # a stock checkpoint: the loader starts at the Trainer's (epoch, batch), in hf_resumable's order
    if trainer._world_size_mode.positions_by_step(trainer._train_position.kind):
        return  # the elastic layout's position is the global step (the Trainer's skip), at any world size
    if getattr(loader.dataset, "global_batch", None) is not None and (
            trainer._resume.loaded.manifest.world_size != trainer.args.world_size):
        # an elastic stream's position is global: rank 0's record (a new rank has none of its own), its batch
        # counters set for this world size when loaded
        record = broadcast_json(record if trainer.args.process_index == 0 else None)
    if record is None:
        trainer._inexact(f"{trainer._resume.path} has no data position for rank {trainer.args.process_index}")
        return
    if record.get(DATA_KIND) == "stream":
        if not trainer._train_position.fits(record):
            trainer._inexact(f"{trainer._resume.path} holds a streaming position but the training data is map-style")
            return
        if has_shuffle_buffer(getattr(loader.dataset, "dataset", None)):  # a buffer data.py could not replace
            trainer._inexact("The streaming training set has a shuffle buffer that hf_resumable could not replace "
                          "(see the WARNING above), whose content datasets does not save (the buffer is "
                          "refilled from the resume point)")
        trainer._train_position.load_position(record)


def data_position(trainer: ResumableTrainer) -> dict[str, Any] | None:
    position = trainer._train_position
    # a stream without state_dict(): refused at train start unless allow_inexact_resume
    if position is None or not getattr(position.loader.dataset, "is_stateful", True):
        return None
    return position.position()
