"""``ResumableTrainer`` over a model that transformers sharded at load time (``DistributedConfig`` or
``tp_plan="auto"``): the constructor's refusal lifted, the run's layout, and the layouts refused before step 1
(docs/multi-gpu.md, "transformers' tensor parallel through ResumableTrainer"). Pure but the context manager.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..errors import UnsupportedEngineError
from ._core import patched
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

    ``args.save_only_model`` reads ``True`` inside the block only: the sole checks that read it there are that
    refusal (transformers' own checkpoints cannot hold DTensor optimizer state; ours can) and
    ``load_best_model_at_end`` beside FSDP/DeepSpeed, which such a model does not use. A layout mismatch happens with
    ``tp_plan="auto"``, whose ``device_mesh`` transformers 5 ignores (docs/multi-gpu.md).

    Raises:
        UnsupportedEngineError: ``args.parallelism_config`` asks for another tensor- or data-parallel size than the
            model was loaded with (after the constructor, which is not undone).
    """
    if args is None or not is_sharded_at_load(model):
        yield
        return
    requested = layout_of(getattr(args, "parallelism_config", None))
    with patched(args, "save_only_model", True):
        yield
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
    """The N-D layout of a Trainer run: the model's ``DistributedConfig`` when transformers sharded it at load time,
    else the accelerator's ``ParallelismConfig``'s (``None``: the plain data-parallel world)."""
    return _model_layout(model) or layout_of(parallelism_config)


def check_trainer_layout(model: Any, parallelism_config: Any) -> None:
    """Refuse, before step 1, a sharded-at-load model (unwrapped) whose layout ResumableTrainer does not resume (pure).

    Raises:
        UnsupportedEngineError: pipeline (``pp_size``) or expert (``ep_size``) parallel; context or sequence
            parallel beside a model sharded at load time.
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
