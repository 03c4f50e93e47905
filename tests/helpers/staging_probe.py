"""A probe for background saves: their staging copy is held back until the optimizer's next step has begun.

A background save returns before it copies the parameters and optimizer state; the optimizer's next step must wait
for that copy. With the probe, the copy starts only once the step has begun, so a step that did not wait would
change the tensors before they are copied, and the checkpoint would not hold the state at the save. Nothing is
timed: the copy waits for an event, and the step (held by the save) for the copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from hf_resumable.checkpoint.background import _staging, async_save


@contextlib.contextmanager
def copy_after_next_step(optimizer: torch.optim.Optimizer) -> Iterator[threading.Event]:
    """While active, every background staging copy waits until ``optimizer``'s next step has begun (the returned
    event is set then). ``optimizer``: the torch optimizer that steps (ZeRO: its base optimizer)."""
    stepping = threading.Event()
    handle = optimizer.register_step_pre_hook(lambda *args: stepping.set())
    # before the save's own pre-hook (registered at the first background save): the probe must see the step begin
    optimizer._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)
    real = async_save.start_copy

    def copier(dst: int, src: int, nbytes: int) -> None:
        if not stepping.wait(300):
            raise TimeoutError("the optimizer never stepped after the background save")
        _staging.copy_bytes(dst, src, nbytes)

    async_save.start_copy = lambda pairs, **kwargs: real(pairs, copier=copier, **kwargs)
    try:
        yield stepping
    finally:
        async_save.start_copy = real
        handle.remove()
