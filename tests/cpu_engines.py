"""TEST-ONLY: make accelerate turn FSDP / DeepSpeed on for 2 gloo ranks on CPU.

accelerate enables FSDP (and DeepSpeed) only for accelerator devices: with ``cpu=True`` it silently trains DDP.
:func:`install` (called by a worker script before it builds an ``Accelerator`` or ``TrainingArguments``) makes
accelerate believe it runs on GPUs whose collective backend is gloo and whose device is the CPU
(``ACCELERATE_TORCH_DEVICE=cpu``), so the FSDP code paths run exactly as on GPUs, where they use NCCL. The library
never depends on this: nothing in ``hf_resumable`` imports it.
"""

from __future__ import annotations

import os

__all__ = ["install"]


def install() -> None:
    """Patch ``PartialState._prepare_backend`` to ``("gloo", MULTI_GPU)``; the device is the CPU."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"

    def prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = prepare_backend
