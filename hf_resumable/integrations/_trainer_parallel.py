"""``ResumableTrainer`` over a model that transformers sharded at load time (tensor parallel, with FSDP2 or HSDP
beside it): ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...,
dp_replicate_size=...))``, or ``tp_plan="auto"`` with an accelerate ``ParallelismConfig`` in the ``TrainingArguments``.

What the Trainer needs, and nothing else:

* **Admission.** transformers 5.25's ``Trainer.__init__`` refuses such a model unless ``save_only_model=True`` or
  ``save_strategy="no"`` ("Resuming is not supported for models sharded at load time"), because its own checkpoints
  cannot hold the optimizer state. ResumableTrainer's can (every rank saves its DTensor pieces of the weights and of
  the optimizer state through the piece engine), so :func:`sharded_model_construction` lifts that one refusal while
  the constructor runs; ``save_only_model`` is what the user passed everywhere else. A ``ParallelismConfig`` asking
  for another layout than the model was loaded with is refused there (the constructor would silently train the
  model's).
* **Layout.** :func:`trainer_layout`: the run's :class:`~._parallelism.ParallelLayout`, read from the model's
  ``DistributedConfig`` or from the arguments' ``ParallelismConfig``. The ranks of one tensor-parallel group read
  the same batches, different data-parallel ranks different ones (:meth:`~._parallelism.ParallelLayout.data_rank`).
* **Refusals before step 1.** :func:`check_trainer_layout`: pipeline and expert parallel (whose pieces and token
  routing the Trainer integration does not resume), context and sequence parallel beside such a model.

Everything here is pure but the context manager, which sets one attribute for the length of the block.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..errors import UnsupportedEngineError
from ._parallelism import ParallelLayout, layout_of

logger = logging.getLogger(__name__)

__all__ = ["is_sharded_at_load", "sharded_model_construction", "trainer_layout", "check_trainer_layout"]


def is_sharded_at_load(model: Any) -> bool:
    """Whether transformers sharded ``model`` at load time (``from_pretrained(distributed_config=...)``, or
    ``tp_plan``), so the model owns its placement and gradient reduction and accelerate wraps nothing."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


@contextlib.contextmanager
def sharded_model_construction(model: Any, args: Any) -> Iterator[None]:
    """Around ``Trainer.__init__`` for a model sharded at load time: lift its refusal of such a model, then refuse
    a ``ParallelismConfig`` that the constructor would silently replace by the model's layout.

    * transformers refuses the model when checkpoints would hold the optimizer state (``save_only_model=False``),
      since its own ``_save_checkpoint`` cannot write DTensor optimizer state; ResumableTrainer writes it, so the
      refusal does not apply. ``args.save_only_model`` reads ``True`` inside the block only (the sole checks that read
      it there are that refusal, and ``load_best_model_at_end`` beside FSDP/DeepSpeed, which such a model does not
      use), and its own value again afterwards.
    * The constructor overwrites ``args.parallelism_config``'s ``tp_size`` and ``dp_shard_size`` with the model's.
      They differ when the model was loaded at another layout than the ``ParallelismConfig`` says: transformers 5
      ignores the ``device_mesh`` given beside ``tp_plan="auto"`` and splits tensor parallel over every process
      (``DistributedConfig(tp_plan=...)`` derives ``tp_size`` from ``WORLD_SIZE``), so the ``dp_shard_size=2,
      tp_size=2`` of accelerate's ``nd_parallel_trainer.py`` on 4 processes trains as ``tp=4`` (or fails in the
      first forward pass when the heads do not split 4 ways). That is refused here, before step 1.

    Args:
        model (`torch.nn.Module`, *optional*): the model given to the Trainer (``None``: ``model_init``).
        args (`TrainingArguments`, *optional*): the Trainer's arguments (``None``: the Trainer builds defaults).

    Raises:
        UnsupportedEngineError: ``args.parallelism_config`` asks for another tensor- or data-parallel size than the
            model was loaded with (after the constructor, which is not undone).
    """
    if args is None or not is_sharded_at_load(model):
        yield
        return
    requested = layout_of(getattr(args, "parallelism_config", None))
    lifted = not args.save_only_model
    args.save_only_model = True
    try:
        yield
    finally:
        if lifted:
            args.save_only_model = False
    loaded = _model_layout(model)
    if requested is not None and (requested.tp, requested.data_world) != (loaded.tp, loaded.data_world):
        raise UnsupportedEngineError(
            f"TrainingArguments.parallelism_config asks for {requested.describe()}, but the model was loaded as "
            f"{loaded.describe()} (its DistributedConfig); the Trainer would train that layout instead (a model "
            "loaded with tp_plan='auto': transformers ignores its device_mesh and splits tensor parallel over every "
            "process). Nothing was trained. Load the model with from_pretrained(..., "
            f"distributed_config=DistributedConfig(tp_size={requested.tp}, fsdp_size={requested.dp_shard}, "
            f"dp_replicate_size={requested.dp_replicate})) "
            "and pass no parallelism_config (the Trainer builds it from the model).")


def _model_layout(model: Any) -> ParallelLayout | None:
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is None or not is_sharded_at_load(model):
        return None
    return ParallelLayout(dp_replicate=int(config.dp_replicate_size or 1), dp_shard=int(config.fsdp_size or 1),
                          tp=int(config.tp_size or 1))


def trainer_layout(model: Any, parallelism_config: Any) -> ParallelLayout | None:
    """The N-D layout of a Trainer run (``None``: no tensor/N-D parallelism, the plain data-parallel world).

    Args:
        model (`torch.nn.Module`): the Trainer's model (unwrapped).
        parallelism_config (`accelerate.ParallelismConfig`, *optional*): the accelerator's, which the Trainer fills
            from the model's ``DistributedConfig`` or takes from ``TrainingArguments.parallelism_config``.

    Returns:
        `ParallelLayout` or `None`: the model's ``DistributedConfig`` when transformers sharded it at load time, else
        the ``ParallelismConfig``'s layout.
    """
    return _model_layout(model) or layout_of(parallelism_config)


def check_trainer_layout(model: Any, parallelism_config: Any) -> None:
    """Refuse, before step 1, a sharded-at-load model whose layout ResumableTrainer does not resume (pure).

    Args:
        model (`torch.nn.Module`): the Trainer's model (unwrapped).
        parallelism_config (`accelerate.ParallelismConfig`, *optional*): the accelerator's.

    Raises:
        UnsupportedEngineError: pipeline (``pp_size``) or expert (``ep_size``) parallel; context or sequence
            parallel beside a model sharded at load time.

    Example:

    ```python
    >>> check_trainer_layout(model, None)  # doctest: +SKIP
    ```
    """
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is None or not is_sharded_at_load(model):
        return
    for name, what in (("pp_size", "pipeline parallel"), ("ep_size", "expert parallel")):
        if int(getattr(config, name, 1) or 1) > 1:
            raise UnsupportedEngineError(
                f"DistributedConfig({name}={getattr(config, name)}): {what} is not resumed by ResumableTrainer (its "
                "stages or expert shards are not recorded in its checkpoints). Nothing was trained. Load the model "
                "with tp_size / fsdp_size / dp_replicate_size only, or train with the stock Trainer and "
                "save_only_model=True.")
    accelerator_layout = layout_of(parallelism_config)
    if accelerator_layout is not None and accelerator_layout.group_size != accelerator_layout.tp:
        raise UnsupportedEngineError(
            f"ParallelismConfig {accelerator_layout.describe()} beside a model sharded at load time "
            f"({_model_layout(model).describe()}): context and sequence parallel are not applied to such a model by "
            "the Trainer. Nothing was trained. Set cp_size=1 and sp_size=1.")
