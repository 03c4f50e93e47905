"""Bookkeeping of :class:`~hf_resumable.integrations.accelerate.ResumableAccelerator` around its saves: optimizer
step counting (whatever the loop looks like) and the fingerprint that proves a checkpoint already holds the
current state.

* :class:`StepHook` is registered with ``register_step_post_hook`` on every prepared optimizer. torch calls it
  only when the optimizer really stepped, so micro-steps inside an accumulation window (accelerate's
  ``AcceleratedOptimizer.step`` does nothing then) and steps a ``GradScaler`` skipped on overflow are not
  counted, and a loop that never calls ``accelerator.accumulate()`` is counted like one that does.
* :func:`state_fingerprint` digests everything a save would write, cheaply: parameters, buffers and
  optimizer tensors by identity and autograd version counter (every in-place update bumps it), small state
  (schedulers, scaler, registered objects, loader positions, counters) by content, and the RNG states. Two
  equal fingerprints mean that nothing a checkpoint holds changed in between.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..checkpoint._dtensor import is_dtensor
from ..format.rng import capture_rng_state

__all__ = ["StepCounts", "StepHook", "state_fingerprint"]

# Tensors up to this size are digested by content; larger ones by identity and version counter.
_CONTENT_DIGEST_BYTES = 1 << 16


class StepCounts:
    """Optimizer steps of one accelerator: ``global_step`` is the count of the most-stepped optimizer.

    Args:
        global_step (`int`, *optional*, defaults to 0): the starting value.
    """

    def __init__(self, global_step: int = 0) -> None:
        self.global_step = global_step


class StepHook:
    """``register_step_post_hook`` callback counting the real steps of one optimizer.

    Args:
        counts (`StepCounts`): shared with the accelerator (the hook holds no reference to the accelerator).
    """

    def __init__(self, counts: StepCounts) -> None:
        self.counts = counts
        self.count = 0

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1
        self.counts.global_step = max(self.counts.global_step, self.count)


class _Digest:
    """Feeds values into one blake2b digest in a canonical, type-tagged form."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def text(self, value: str) -> None:
        data = value.encode()
        self._hash.update(len(data).to_bytes(8, "little") + data)

    def tensor(self, tensor: torch.Tensor) -> None:
        if is_dtensor(tensor):  # FSDP2: this rank's piece (every rank digests its own; the save compares them all)
            self.text(f"P{tensor.placements}")
            tensor = tensor.to_local()
        self.text(f"T{tuple(tensor.shape)}{tensor.dtype}{tensor.device}")
        if tensor.numel() * tensor.element_size() <= _CONTENT_DIGEST_BYTES and tensor.device.type != "meta":
            self._hash.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            # Identity and autograd version counter: every in-place write (optimizer step, copy_, load_state_dict)
            # bumps ``_version``; the data pointer catches a swapped storage.
            self.text(f"{id(tensor)}/{tensor.data_ptr()}/{tensor._version}")

    def value(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensor(value)
        elif isinstance(value, np.ndarray):
            self.text(f"A{value.dtype}{value.shape}")
            self._hash.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, Mapping):
            self.text(f"D{len(value)}")
            for key, item in value.items():
                self.value(key)
                self.value(item)
        elif isinstance(value, (list, tuple)):
            self.text(f"{'L' if isinstance(value, list) else 'U'}{len(value)}")
            for item in value:
                self.value(item)
        else:
            self.text(f"{type(value).__qualname__}:{value!r}")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _module_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def state_fingerprint(*, models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                      small_state: Any) -> str:
    """A digest of everything a save writes; equal digests mean nothing changed in between.

    Args:
        models: the prepared models (parameters and buffers by identity and version counter).
        optimizers: the underlying torch optimizers (state tensors likewise; param groups by content).
        small_state: JSON-like state digested by content (counters, scheduler/scaler/registered-object
            state dicts, loader positions, the names a save goes to).

    Example:

    ```python
    >>> import torch  # doctest: +SKIP
    >>> model = torch.nn.Linear(2, 1)  # doctest: +SKIP
    >>> before = state_fingerprint(models=[model], optimizers=[], small_state={"step": 1})  # doctest: +SKIP
    >>> with torch.no_grad():  # doctest: +SKIP
    ...     model.weight.add_(1.0)
    >>> before == state_fingerprint(models=[model], optimizers=[], small_state={"step": 1})  # doctest: +SKIP
    False
    ```
    """
    digest = _Digest()
    for index, model in enumerate(models):
        digest.text(f"model{index}")
        for name, tensor in _module_tensors(model):
            digest.text(name)
            digest.tensor(tensor)
    for index, optimizer in enumerate(optimizers):
        digest.text(f"optimizer{index}")
        for group in optimizer.param_groups:
            digest.value({k: v for k, v in group.items() if k != "params"})
            digest.text(",".join(str(id(p)) for p in group["params"]))
        for param, state in optimizer.state.items():
            digest.text(str(id(param)))
            digest.value(state)
    digest.value(small_state)
    rng = capture_rng_state()
    digest.text(json.dumps(rng.python[1]) + repr(rng.python[0]) + repr(rng.python[2]))
    digest.value(list(rng.numpy))
    digest.tensor(rng.torch_cpu)
    for state in rng.cuda:
        digest.tensor(state)
    return digest.hexdigest()
