"""TEST-ONLY shim: transformers' ``ReplicateParallel`` for accelerate's FSDP2 + tensor-parallel preparation.

accelerate 1.16 (``Accelerator._prepare_tp`` under FSDP2) turns every parameter that tensor parallel left plain (the
RMSNorm weights of a Llama, for example) into a ``Replicate()`` DTensor over the ``tp`` mesh, and calls
``ReplicateParallel().prepare_module_tp(module, tp_mesh)`` on the module that owns it, imported from
``transformers.integrations.tensor_parallel``. transformers 5 no longer has that class, so stock accelerate stops
there with an ``ImportError`` and ``ResumableAccelerator`` refuses the layout before step 1
(``integrations/_parallelism.check_runnable``).

:func:`install_replicate_parallel`, called by a worker script before accelerate prepares, adds a class of that name
when it is missing: the stack then behaves as one where accelerate and transformers match, and the library's own path
for ``dp_shard x tp`` and ``dp_replicate x dp_shard x tp`` (pieces sharded on one mesh dimension and replicated on
another) runs unchanged. Nothing in ``hf_resumable`` imports this module.

What the module needs: transformers 5's tensor-parallel layers take and return plain (local) tensors, so a module
whose parameters are now ``Replicate()`` DTensors gets its tensor inputs as ``Replicate()`` DTensors over the same mesh
(every rank of a tp group holds the same activations) and hands its DTensor outputs back as local tensors. Inputs that
are already DTensors pass as they are.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["install_replicate_parallel"]

logger = logging.getLogger(__name__)

_PREPARED = "_hfr_replicate_parallel"  # set on a module once its hooks are in (one per module, however many params)


def _to_replicate(value: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return value


def _to_local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, tuple):
        return tuple(_to_local(item) for item in value)
    return value


class _ReplicateParallel:
    """A module whose plain parameters accelerate made ``Replicate()`` DTensors over ``device_mesh``: floating-point
    tensor inputs enter as ``Replicate()`` DTensors, DTensor outputs leave as local tensors."""

    def prepare_module_tp(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        if getattr(module, _PREPARED, False):
            return module

        def enter(_module, args, kwargs):
            return (tuple(_to_replicate(arg, device_mesh) for arg in args),
                    {key: _to_replicate(value, device_mesh) for key, value in kwargs.items()})

        def leave(_module, _args, output):
            return _to_local(output)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave)
        setattr(module, _PREPARED, True)
        return module


def install_replicate_parallel() -> bool:
    """Add ``ReplicateParallel`` to ``transformers.integrations.tensor_parallel`` where it is missing.

    Returns:
        `bool`: whether the shim was installed (``False``: the installed transformers has the class already).
    """
    from transformers.integrations import tensor_parallel

    if hasattr(tensor_parallel, "ReplicateParallel"):
        return False
    tensor_parallel.ReplicateParallel = _ReplicateParallel
    logger.info("test shim: transformers.integrations.tensor_parallel.ReplicateParallel installed")
    return True
