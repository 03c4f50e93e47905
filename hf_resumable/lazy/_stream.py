"""Run a model that lives on the meta device, each block's weights loaded just before it runs."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._urls import location_kind
from ..hub import parse_hf_url
from ._load import LoadPlan, _as_weights, _empty, _fill_aliases, _materialize, _read_into, _read_shard, _tie, plan_load
from ._mapped import MappedBlock, ShardMaps
from ._prefetch import BlockPrefetcher
from ._residency import ResidencyPlan, plan_residency
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
    """Reuses released block tensors for the next block: blocks share shapes, so after the first blocks no new
    memory is allocated (no allocator churn, no first-touch page faults). Thread-safe: the prefetch thread
    allocates while the forward pass releases."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._owned: set[int] = set()  # data pointers of the tensors allocated here (mapped ones are not pooled)
        self._lock = threading.Lock()

    def allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            stack = self.free.get((tuple(shape), dtype))
            if stack:
                return stack.pop()
        tensor = _empty(shape, dtype)
        with self._lock:
            self._owned.add(tensor.data_ptr())
        return tensor

    def put(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` for reuse if it was allocated here; drop it otherwise (a mapping is unmapped with it, a
        device copy freed)."""
        with self._lock:
            if tensor.is_cpu and tensor.data_ptr() in self._owned:
                self.free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)

    def put_block(self, block: dict[str, torch.Tensor]) -> None:
        for tensor in block.values():
            self.put(tensor)

    def release(self, module: nn.Module) -> None:
        """Put a block's parameters back on the meta device, keeping their memory for the next block."""
        with torch.no_grad():
            for sub in module.modules():
                for attr, param in list(sub._parameters.items()):
                    if param is not None and not param.is_meta:
                        self.put(param.data)
                        setattr(sub, attr, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    def clear(self) -> None:
        with self._lock:
            self.free.clear()
            self._owned.clear()


def _normalize_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device`` with an index (``"cuda"`` is the current CUDA device), or `None`."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve(path_or_repo_id: str | os.PathLike, revision: str | None) -> tuple[str | os.PathLike, str | None]:
    """``hf://namespace/name[@revision]`` -> ``(namespace/name, revision)``; anything else unchanged."""
    if location_kind(path_or_repo_id) != "hub":
        return path_or_repo_id, revision
    url = parse_hf_url(str(path_or_repo_id))
    if url.path_in_repo or url.repo_type != "model":
        raise ValueError(f"{path_or_repo_id}: streaming reads a model repo's root (hf://namespace/name[@revision]); "
                         "push the checkpoint's model files to the root of a model repo.")
    return url.repo_id, url.revision or revision


def _model_on_meta(location: str | os.PathLike, config: Any, revision: str | None, token: str | None) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on the meta device (buffers stay real), in eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if config is None:
        config = AutoConfig.from_pretrained(location, revision=revision, token=token)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


class StreamingModel(contextlib.AbstractContextManager):
    """Run a meta-device model within a memory budget: blocks that do not fit are read from the shards as they run.

    On enter, the weights outside the blocks are loaded and the key match is checked once for the whole model
    (``strict`` as in :func:`load_lazily`); :func:`plan_residency` splits the budget. A streamed block is read by a
    background thread while the one before it computes, and hooks wait for its pages and hand its slot back. Outputs
    equal those of the fully loaded model, and ``generate`` works with the KV cache. The weights held never exceed
    ``max_memory``; activations and the KV cache come on top. How blocks are mapped, installed and evicted:
    docs/streamed-inference.md.

    > [!WARNING]
    > A streamed block's parameters are read-only views of the shard files: an in-place change to one is dropped
    > the next time its pages are evicted. Anything that reads every parameter outside a forward pass (e.g.
    > ``model.state_dict()`` summed up) maps those pages into the process until each block runs again.

    > [!WARNING]
    > The prefetch thread needs a core while the model computes: on a machine with few cores, leave it one
    > (``torch.set_num_threads(os.cpu_count() - 1)``).

    Args:
        model (`torch.nn.Module`): the model on the meta device (``accelerate.init_empty_weights()``).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): where the weights are.
        blocks (`str`, *optional*): dotted name of the ``nn.ModuleList`` of blocks (default: the largest one).
        max_memory (`int` or `str`, *optional*): budget for the weights, in bytes or as ``"1GB"`` (default: no
            budget; every block is streamed).
        prefetch (`bool`, *optional*, defaults to `True`): read the next block while one runs (when it fits).
        device (`str` or `torch.device`, *optional*): where the model computes, e.g. ``"cuda"``. The weights
            outside the blocks and the resident blocks move there once; a streamed block is copied there from the
            host just before it runs and freed after, so the device holds at most the weights ``max_memory``
            allows. Default: the host, where a streamed block's parameters are views of the shards (no copy).
        keep_resident (`bool`, *optional*, defaults to `False`): keep as many blocks loaded as the rest of the
            budget holds (see :func:`plan_residency`; by default a model that does not fit streams every block).
        strict (`bool`, *optional*, defaults to `True`): fail on missing or unexpected keys.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Raises:
        MemoryBudgetError: on enter, if ``max_memory`` is smaller than the non-block weights plus one block (the
            message names the smallest budget that works).
        CheckpointMismatchError: on enter, if the weights do not fit the model.

    Example:

    ```python
    >>> with StreamingModel.from_pretrained("me/llama-7b", max_memory="4GB") as model:  # doctest: +SKIP
    ...     tokens = model.generate(input_ids, max_new_tokens=32, do_sample=False)
    >>> with init_empty_weights():  # doctest: +SKIP
    ...     model = LlamaForCausalLM(config)
    >>> with StreamingModel(model, "out/checkpoint-120") as streamed, torch.no_grad():  # doctest: +SKIP
    ...     logits = streamed(input_ids).logits
    ```
    """

    def __init__(self, model: nn.Module, path_or_repo_id: str | os.PathLike | LazyStateDict, *,
                 blocks: str | None = None, max_memory: int | str | None = None, prefetch: bool = True,
                 keep_resident: bool = False, strict: bool = True, revision: str | None = None,
                 token: str | None = None, device: str | torch.device | None = None) -> None:
        self.model = model
        self.weights = _as_weights(path_or_repo_id, revision, token)
        if blocks is None:
            self.blocks_name, self.blocks = _find_blocks(model)
        else:
            self.blocks_name, self.blocks = blocks, model.get_submodule(blocks)
        self.max_memory, self.prefetch, self.strict = max_memory, prefetch, strict
        self.keep_resident = keep_resident
        self.device = _normalize_device(device)
        self.plan: LoadPlan | None = None
        self.residency: ResidencyPlan | None = None
        self._handles: list[Any] = []
        self._pool = _BufferPool()
        self._prefetcher: BlockPrefetcher | None = None
        self._installed: int | None = None
        self._maps = ShardMaps()
        self._mapped: dict[int, list[MappedBlock]] = {}  # per streamed block: its views, made on its first read
        self._copied: dict[int, list[tuple[str, list[str]]]] = {}  # per streamed block: (shard, names) to cast
        self._fixed: set[int] = set()  # streamed blocks whose parameters are views of the shards, installed for good
        self._finished: deque[int] = deque()  # blocks that ran (or were dropped): the thread evicts their pages

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, *, config: Any = None,
                        max_memory: int | str | None = None, prefetch: bool = True, keep_resident: bool = False,
                        strict: bool = True, revision: str | None = None, token: str | None = None,
                        device: str | torch.device | None = None) -> StreamingModel:
        """A streamed ``AutoModelForCausalLM`` from a model directory, a checkpoint directory, or a Hub repo.

        Only headers are parsed here; the model is built on the meta device from ``config`` (default:
        ``AutoConfig.from_pretrained`` of the same location), and weights are read on enter. For a Hub repo
        (``namespace/name`` or ``hf://namespace/name[@revision]``), each shard is downloaded (once, into the Hub
        cache) when a block in it is first read.

        Args:
            path_or_repo_id (`str` or `os.PathLike`): a directory holding ``config.json`` and the weights (a
                ``save_pretrained`` output or a ``checkpoint-N`` directory), or a Hub repo.
            config (`transformers.PretrainedConfig`, *optional*): the model's config (e.g. from ``AutoConfig``).
            max_memory, prefetch, keep_resident, strict, revision, token, device: as in :class:`StreamingModel`.

        Raises:
            CheckpointNotFoundError: if there are no weights at ``path_or_repo_id``.
            ValueError: for an ``hf://`` URL with a path inside the repo, or a ``max_memory`` that cannot be parsed.

        Example:

        ```python
        >>> with StreamingModel.from_pretrained("out/checkpoint-500", max_memory="1GB") as model:  # doctest: +SKIP
        ...     model.generate(input_ids, max_new_tokens=32, do_sample=False)
        ```
        """
        location, revision = _resolve(path_or_repo_id, revision)
        weights = LazyStateDict.from_pretrained(location, revision=revision, token=token)
        model = _model_on_meta(location, config, revision, token)
        return cls(model, weights, max_memory=max_memory, prefetch=prefetch, keep_resident=keep_resident,
                   strict=strict, device=device)

    def __enter__(self) -> nn.Module:
        try:
            return self._enter()
        except BaseException:  # a failed enter stops the threads it (or from_pretrained) started, then re-raises
            self.__exit__(None, None, None)
            raise

    def _enter(self) -> nn.Module:
        # 1. Match keys once, for the whole model.
        _tie(self.model)
        self.plan = plan_load(self.model, self.weights)
        self.plan.match.check(strict=self.strict, source=self.weights.source)
        # 2. Split the budget: non-block weights and resident blocks are loaded now; the rest is streamed.
        outside, per_block = self._names_by_block()
        sizes = self._nbytes()
        self.residency = plan_residency(sum(sizes[n] for n in outside),
                                        [sum(sizes[n] for n in names) for names in per_block],
                                        max_memory=self.max_memory, prefetch=self.prefetch,
                                        keep_resident=self.keep_resident)
        # 3. Hooks on the streamed blocks, and the thread that reads them ahead, started first: it reads the first
        #    blocks while the non-block weights (and resident blocks) are loaded here.
        self._start_streaming(per_block)
        self._load(outside + [n for i in self.residency.resident for n in per_block[i]])
        if self.device is not None:
            self._move_to_device()
        _tie(self.model)
        self._log_plan()
        return self.model

    def _start_streaming(self, per_block: list[list[str]]) -> None:
        """Hook the streamed blocks and start the read-ahead thread (nothing when every block is resident)."""
        streamed = self.residency.streamed
        if not streamed:
            return
        self._next_streamed = dict(zip(streamed, streamed[1:] + streamed[:1]))
        self._per_block = per_block
        self._prefetcher = BlockPrefetcher(streamed, self._read_block, self._discard, slots=self.residency.slots)
        for index in streamed:
            block = self.blocks[index]
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(block.register_forward_hook(self._post_hook))
        self._prefetcher.start()

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        for block in self.blocks:
            self._pool.release(block)
        self._installed = None
        self._pool.clear()
        self._mapped.clear()
        self._copied.clear()
        self._fixed.clear()
        self._finished.clear()
        self._maps.clear()
        self.weights.release()

    def _names_by_block(self) -> tuple[list[str], list[list[str]]]:
        """Checkpoint names outside the blocks, and those of each block."""
        per_block: list[list[str]] = [[] for _ in self.blocks]
        outside: list[str] = []
        prefix = f"{self.blocks_name}."
        for name, keys in self.plan.sources.items():
            index, dot, _ = keys[0][len(prefix):].partition(".")
            if keys[0].startswith(prefix) and dot and index.isdigit() and int(index) < len(per_block):
                per_block[int(index)].append(name)
            else:
                outside.append(name)
        return outside, per_block

    def _nbytes(self) -> dict[str, int]:
        """Bytes each checkpoint tensor takes in the model (its dtype there, which a load casts to)."""
        tensors = self.model.state_dict(keep_vars=True)
        self._targets = {name: (tensors[keys[0]].shape, tensors[keys[0]].dtype)
                         for name, keys in self.plan.sources.items()}
        return {name: shape.numel() * dtype.itemsize for name, (shape, dtype) in self._targets.items()}

    def _log_plan(self) -> None:
        plan = self.residency
        logger.info("Streaming %s: %d of %d blocks resident, %d streamed (%s); %.3f GB of weights held%s.",
                    self.weights.source, len(plan.resident), len(self.blocks), len(plan.streamed),
                    "read ahead" if plan.prefetch else "read as they run", plan.weight_bytes / 1e9,
                    f" of a {plan.budget / 1e9:.3f} GB budget" if plan.budget is not None else "")

    def _load(self, names: list[str]) -> None:
        for filename, group in self.weights.group_by_file(names).items():
            _read_shard(self.model, self.weights, filename, group, self.plan.sources, self._pool.allocate)

    def _read_block(self, index: int) -> dict[str, torch.Tensor]:
        """One block's tensors (runs on the prefetch thread; touches no module): evict the blocks that ran (here: a
        syscall the compute thread need not wait for), populate this block's views and read the rest into pooled
        buffers, then ask the disk for the next block's pages (docs/streamed-inference.md)."""
        self._evict_finished()
        block = {}
        for mapped in self._view_block(index):
            mapped.populate()
            block.update(mapped.tensors)
        # After this block, not before: asked first, the next block's read competed with this one's in the
        # larger-than-memory regime (docs/streamed-inference.md).
        for mapped in self._view_block(self._next_streamed[index]):
            mapped.hint()
        for filename, group in self._copied[index]:
            into = {name: self._pool.allocate(*self._targets[name]) for name in group}
            _read_into(self.weights, filename, into)
            block.update(into)
        return block

    def _view_block(self, index: int) -> list[MappedBlock]:
        """A block's tensors stored in the model's dtype, as views of their shards (made on first use, no data
        read); the (shard, names) that must be cast are noted in ``_copied``."""
        if index not in self._mapped:
            groups = self.weights.group_by_file(self._per_block[index])
            self._copied[index] = [(f, g) for f, g in groups.items() if not self._is_mappable(g)]
            self._mapped[index] = [self._maps.view(self.weights.shard_path(f), g, self._targets)
                                   for f, g in groups.items() if self._is_mappable(g)]
        return self._mapped[index]

    def _is_mappable(self, names: list[str]) -> bool:
        return all(self.weights.meta(name).dtype == self._targets[name][1] for name in names)

    def _is_fixable(self, index: int) -> bool:
        """Whether block ``index`` can keep its parameters installed between passes: every tensor is a view of a
        shard (nothing cast into pooled memory) and fills one model key (no alias copied into extra memory), so
        installed parameters hold no memory of their own; RSS counts only the pages populated and not evicted."""
        return not self._copied[index] and all(len(self.plan.sources[name]) == 1
                                               for name in self._per_block[index])

    def _evict_finished(self) -> None:
        while self._finished:
            for mapped in self._mapped.get(self._finished.popleft(), ()):
                mapped.evict()

    def _discard(self, index: int, block: dict[str, torch.Tensor]) -> None:
        """A block read ahead and never run: its pooled buffers go back, its pages are evicted on the next read."""
        self._pool.put_block(block)
        self._finished.append(index)

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if self._installed is not None:  # the previous pass stopped inside a block (an exception): free it
                self._finish()
            block = self._prefetcher.take(index)
            if index not in self._fixed:
                self._install(block)
                if self.device is None and self._is_fixable(index):  # a device copy is freed after every run
                    self._fixed.add(index)
            self._installed = index

        return hook

    def _install(self, block: dict[str, torch.Tensor]) -> None:
        if self.device is not None:  # copies on the device; the host buffers go back to the pool at once
            for name, tensor in block.items():  # copy=True: on the host too, the pooled buffer goes back
                _materialize(self.model, self.plan.sources[name][0],
                             lambda *_, t=tensor: t.to(self.device, copy=True))
            _fill_aliases(self.model, block, self.plan.sources, self._allocate_on_device)
            self._pool.put_block(block)
            return
        for name, tensor in block.items():
            _materialize(self.model, self.plan.sources[name][0], lambda *_, t=tensor: t)
        _fill_aliases(self.model, block, self.plan.sources, self._pool.allocate)

    def _allocate_on_device(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _move_to_device(self) -> None:
        """The weights loaded once (outside the blocks, resident blocks) and the real buffers go to the device.
        Parameters are swapped in place, so tied ones stay tied; their host memory goes back to the pool."""
        with torch.no_grad():
            for param in self.model.parameters():  # each shared parameter once
                if not param.is_meta and param.device != self.device:
                    moved = nn.Parameter(param.data.to(self.device), requires_grad=param.requires_grad)
                    torch.utils.swap_tensors(param, moved)
                    self._pool.put(moved.data)  # after the swap: the host tensor
            for module in self.model.modules():
                for attr, buffer in list(module._buffers.items()):
                    if buffer is not None and not buffer.is_meta and buffer.device != self.device:
                        module._buffers[attr] = buffer.to(self.device)

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        """The installed block has run: put its pooled memory back (a fixed block keeps its views), have the thread
        evict its pages, and free its slot."""
        index, self._installed = self._installed, None
        if index not in self._fixed:
            self._pool.release(self.blocks[index])
        self._finished.append(index)
        self._prefetcher.done()


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
