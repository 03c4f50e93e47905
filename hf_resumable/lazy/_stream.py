"""Run a model that lives on the meta device, each block's weights loaded just before it runs."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._load import LoadPlan, _as_weights, _empty, _read_shard, _tie, plan_load
from ._weights import LazyStateDict

logger = logging.getLogger(__name__)


def _find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` holding most parameters: the transformer blocks."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            count = sum(p.numel() for p in module.parameters())
            if best is None or count > best[0]:
                best = (count, name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to stream; pass blocks= explicitly.")
    return best[1], best[2]


class _BufferPool:
    """Reuses released block tensors for the next block: blocks share shapes, so after the first block no new
    memory is allocated (no allocator churn, no first-touch page faults)."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        stack = self.free.get((tuple(shape), dtype))
        return stack.pop() if stack else _empty(shape, dtype)

    def release(self, module: nn.Module) -> None:
        """Put a block's parameters back on the meta device, keeping their memory for the next block."""
        with torch.no_grad():
            for sub in module.modules():
                for attr, param in list(sub._parameters.items()):
                    if param is not None and not param.is_meta:
                        self.free.setdefault((tuple(param.shape), param.dtype), []).append(param.data)
                        setattr(sub, attr, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    def clear(self) -> None:
        self.free.clear()


class StreamingModel(contextlib.AbstractContextManager):
    """Run a meta-device model by loading each block's weights just before it runs and releasing them after.

    On enter, every weight outside the blocks (embeddings, final norm, head) is loaded and the key match is checked
    once for the whole model (``strict`` as in :func:`load_lazily`); each block then gets a forward pre-hook that
    reads its tensors from the shards and a forward hook that puts them back on the meta device. Peak memory is the
    non-block weights plus one block. Outputs equal those of the fully loaded model. ``generate`` works too (every
    decoding step streams every block again).

    Args:
        model (`torch.nn.Module`): the model on the meta device (``accelerate.init_empty_weights()``).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): where the weights are.
        blocks (`str`, *optional*): dotted name of the ``nn.ModuleList`` of blocks (default: the largest one).
        strict (`bool`, *optional*, defaults to `True`): fail on missing or unexpected keys.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Example:

    ```python
    >>> with init_empty_weights():  # doctest: +SKIP
    ...     model = LlamaForCausalLM(config)
    >>> with StreamingModel(model, "me/tiny-llama") as streamed, torch.no_grad():  # doctest: +SKIP
    ...     logits = streamed(input_ids).logits
    ```
    """

    def __init__(self, model: nn.Module, path_or_repo_id: str | os.PathLike | LazyStateDict, *,
                 blocks: str | None = None, strict: bool = True, revision: str | None = None,
                 token: str | None = None) -> None:
        self.model = model
        self.weights = _as_weights(path_or_repo_id, revision, token)
        if blocks is None:
            self.blocks_name, self.blocks = _find_blocks(model)
        else:
            self.blocks_name, self.blocks = blocks, model.get_submodule(blocks)
        self.strict = strict
        self.plan: LoadPlan | None = None
        self._handles: list[Any] = []
        self._pool = _BufferPool()

    def _block_prefix(self, index: int) -> str:
        return f"{self.blocks_name}.{index}."

    def __enter__(self) -> nn.Module:
        _tie(self.model)
        self.plan = plan_load(self.model, self.weights)
        self.plan.match.check(strict=self.strict, source=self.weights.source)
        block_prefix = f"{self.blocks_name}."
        outside = [n for n, keys in self.plan.sources.items() if not keys[0].startswith(block_prefix)]
        self._load(outside)
        _tie(self.model)
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(block.register_forward_hook(lambda module, args, output: self._pool.release(module)))
        return self.model

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self.blocks:
            self._pool.release(block)
        self._pool.clear()
        self.weights.release()

    def _load(self, names: list[str]) -> None:
        for filename, group in self.weights.group_by_file(names).items():
            _read_shard(self.model, self.weights, filename, group, self.plan.sources, self._pool.allocate)

    def _pre_hook(self, index: int) -> Callable[..., None]:
        prefix = self._block_prefix(index)

        def hook(module: nn.Module, args: tuple) -> None:
            self._load([n for n, keys in self.plan.sources.items() if keys[0].startswith(prefix)])

        return hook


def stream_forward(model: nn.Module, path_or_repo_id: str | os.PathLike | LazyStateDict, input_ids: torch.Tensor,
                   *, attention_mask: torch.Tensor | None = None, revision: str | None = None,
                   token: str | None = None) -> Any:
    """One forward pass of a meta-device model with its blocks streamed from the shards (see :class:`StreamingModel`).

    Args:
        model (`torch.nn.Module`): the model on the meta device (``accelerate.init_empty_weights()``).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): where the weights are.
        input_ids (`torch.Tensor`): token ids, shape ``(batch, sequence)``.
        attention_mask (`torch.Tensor`, *optional*): passed to the model.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Returns:
        The model's output (e.g. ``CausalLMOutputWithPast``), computed under ``torch.no_grad()``.

    Raises:
        CheckpointMismatchError: if the weights do not fit the model (checked once, before any block runs).

    Example:

    ```python
    >>> out = stream_forward(meta_model, "out/model", torch.tensor([[1, 2, 3]]))  # doctest: +SKIP
    >>> out.logits.shape  # doctest: +SKIP
    torch.Size([1, 3, 128])
    ```
    """
    with StreamingModel(model, path_or_repo_id, revision=revision, token=token) as streamed, torch.no_grad():
        return streamed(input_ids, attention_mask=attention_mask)
