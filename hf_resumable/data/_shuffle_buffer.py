"""A shuffle buffer whose content and generator are part of the saved position (datasets saves neither)."""

from __future__ import annotations

import base64
import copy
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import InexactResumeError
from ..format.rng import derive_seed
from ._position import _TAG_SHUFFLE_BUFFER

_BUFFER_NODE = "BufferShuffledExamplesIterable"  # datasets' shuffle buffer in an IterableDataset pipeline
_ARRAY = "__hfr_array__"  # marker of a tensor/ndarray encoded inside a shuffle buffer's JSON state

logger = logging.getLogger(__name__)


def has_shuffle_buffer(dataset: Any) -> bool:
    """Whether a ``datasets.IterableDataset`` pipeline contains a ``.shuffle(buffer_size=...)`` buffer, whose content
    ``datasets`` does not save (its ``load_state_dict`` refills it from the resume point), so that
    :func:`build_stream_dataloader` replaces it (:func:`resumable_shuffle_buffer`)."""
    return _has_buffer_node(getattr(dataset, "_ex_iterable", None))


def _has_buffer_node(root: Any) -> bool:
    pending, seen = [root], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == _BUFFER_NODE:
            return True
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or [])
    return False


def _encode_example(value: Any) -> Any:
    """A JSON-safe deep copy of an example: tensors and arrays become exact base64 records."""
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        raw = array.view(torch.uint8) if array.dim() else array.reshape(1).view(torch.uint8)
        return {_ARRAY: "torch", "dtype": str(array.dtype).removeprefix("torch."), "shape": list(array.shape),
                "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {_ARRAY: "numpy", "dtype": array.dtype.str, "shape": list(array.shape),
                "data": base64.b64encode(array.tobytes()).decode("ascii")}
    if isinstance(value, Mapping):
        return {k: _encode_example(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode_example(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_encode_example(v) for v in value)
    return value


def _decode_example(value: Any) -> Any:
    """Invert :func:`_encode_example`."""
    if isinstance(value, Mapping):
        if value.get(_ARRAY) == "numpy":
            raw = base64.b64decode(value["data"])
            return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
        if value.get(_ARRAY) == "torch":
            dtype = getattr(torch, value["dtype"])
            raw = torch.frombuffer(bytearray(base64.b64decode(value["data"])), dtype=torch.uint8)
            return raw.view(dtype).reshape(value["shape"]).clone()
        return {k: _decode_example(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_example(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_decode_example(v) for v in value)
    return value


class ResumableShuffleBuffer(IterableDataset):
    """A shuffle buffer over a stream whose content is part of its ``state_dict``, so it resumes bit for bit.

    The buffer holds up to ``buffer_size`` examples; once full, every new example from ``source`` replaces a
    uniformly drawn slot, whose previous example is yielded. When the source ends, the remaining examples
    are yielded in random order. The draws come from a private numpy ``Generator`` seeded with
    ``(seed, epoch, rank, worker)``: in ``DataLoader`` workers each worker shuffles its own shards with its
    own buffer (as ``datasets`` does). :meth:`state_dict` holds the source's ``state_dict()``, the
    buffer's examples (JSON-safe; tensors and arrays are stored exactly as base64) and the generator
    state, so a restored buffer continues exactly where it was.

    The sample order is not the one ``datasets``' ``shuffle(buffer_size=...)`` produces with the same seed,
    only a shuffle of the same quality.

    Args:
        source: a stateful stream (``datasets.IterableDataset`` without a shuffle buffer, or any iterable
            data set with ``state_dict``/``load_state_dict``).
        buffer_size (`int`): number of examples held.
        seed (`int`): seed of the buffer's draws.
        rank (`int`, *optional*, defaults to 0): data-parallel rank (part of the seed).

    Example:

    ```python
    >>> import datasets
    >>> stream = datasets.Dataset.from_dict({"x": list(range(6))}).to_iterable_dataset()
    >>> buffer = ResumableShuffleBuffer(stream, buffer_size=3, seed=0)
    >>> sorted(example["x"] for example in buffer)
    [0, 1, 2, 3, 4, 5]
    ```
    """

    def __init__(self, source: Any, *, buffer_size: int, seed: int, rank: int = 0) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}.")
        self.source, self.buffer_size, self.seed, self.rank = source, buffer_size, seed, rank
        self.epoch = 0
        self._buffer: list[Any] = []
        self._encoded: list[Any] = []  # _buffer's examples as state_dict() stores them, encoded as they come in
        self._rng: np.random.Generator | None = None
        self._pending: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (of the buffer's seed and of the source's own shuffling)."""
        self.epoch = epoch
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def _fresh_rng(self) -> np.random.Generator:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        seed = derive_seed(self.seed, _TAG_SHUFFLE_BUFFER, self.epoch, self.rank, worker)
        return np.random.Generator(np.random.PCG64(seed))

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        if pending is not None and int(pending["epoch"]) == self.epoch:
            encoded = list(pending["buffer"])
            buffer = [_decode_example(example) for example in encoded]
            rng = np.random.Generator(np.random.PCG64())
            rng.bit_generator.state = _rng_state_from_json(pending["rng"])
        else:
            buffer, encoded, rng = [], [], self._fresh_rng()
        self._buffer, self._encoded, self._rng = buffer, encoded, rng
        # Invariant at every yield: source position, buffer content and generator state describe the rest
        # of the stream exactly (the yielded example is out of the buffer, the one replacing it is in). Each
        # example is encoded once, as it comes in (before anything downstream can change it), so that taking the
        # state (a prepared stream does it for every batch) copies the encoded list only.
        for example in self.source:
            if len(buffer) < self.buffer_size:
                buffer.append(example)
                encoded.append(_encode_example(example))
                continue
            slot = int(rng.integers(self.buffer_size))
            out, buffer[slot], encoded[slot] = buffer[slot], example, _encode_example(example)
            yield out
        while buffer:
            slot = int(rng.integers(len(buffer)))
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            encoded[slot], encoded[-1] = encoded[-1], encoded[slot]
            encoded.pop()
            yield buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        """Source position, buffer content and generator state after the last yielded example."""
        if self._pending is not None:  # restored but not iterated yet: the restored state is still current
            return copy.deepcopy(self._pending)
        rng = self._rng if self._rng is not None else self._fresh_rng()
        return {"source": self.source.state_dict(), "buffer": list(self._encoded),
                "rng": _rng_state_to_json(rng.bit_generator.state), "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (takes effect at the next ``iter``)."""
        self.source.load_state_dict(state["source"])
        self._pending = dict(state)


def _rng_state_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    # PCG64 state and increment are 128-bit integers: stored as decimal strings.
    return {"bit_generator": state["bit_generator"], "state": str(state["state"]["state"]),
            "inc": str(state["state"]["inc"]), "has_uint32": int(state["has_uint32"]),
            "uinteger": int(state["uinteger"])}


def _rng_state_from_json(state: Mapping[str, Any]) -> dict[str, Any]:
    return {"bit_generator": state["bit_generator"],
            "state": {"state": int(state["state"]), "inc": int(state["inc"])},
            "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}


def resumable_shuffle_buffer(dataset: Any, *, rank: int = 0) -> ResumableShuffleBuffer:
    """Replace the shuffle buffer of a ``datasets.IterableDataset`` pipeline by a :class:`ResumableShuffleBuffer`.

    The ``datasets`` buffer node is removed from the pipeline (shard shuffling and every ``.map`` /
    ``.filter`` are kept, so they now run before the buffer) and a :class:`ResumableShuffleBuffer` of the
    same size is put on top. Its seed is drawn from the ``datasets`` buffer's generator, so
    ``shuffle(seed=...)`` still selects the order. The order differs from the one ``datasets`` produces.

    Args:
        dataset (`datasets.IterableDataset`): a pipeline with one ``shuffle(buffer_size=...)``.
        rank (`int`, *optional*, defaults to 0): data-parallel rank (part of the buffer's seed).

    Raises:
        InexactResumeError: the pipeline has no shuffle buffer, several, or one below a multi-source node
            (``interleave_datasets``, ``concatenate_datasets``).
    """
    from datasets import IterableDataset as HfIterableDataset

    if not isinstance(dataset, HfIterableDataset):
        raise InexactResumeError(f"Expected a datasets.IterableDataset, got {type(dataset).__name__}.")
    path, node = [], dataset._ex_iterable
    while node is not None and type(node).__name__ != _BUFFER_NODE:
        path.append(node)
        node = getattr(node, "ex_iterable", None)
    if node is None:
        raise InexactResumeError("The stream's shuffle buffer is inside a multi-source pipeline "
                                 "(interleave/concatenate) "
                                 "or absent; hf_resumable can only replace a buffer of a single-source pipeline.")
    child = node.ex_iterable
    if type(child).__name__ == "InterleavedShardsExamplesIterable":
        # shuffle() reads several shards at once to feed its buffer; that node's state does not survive
        # DataLoader-worker sharding (datasets 5.2 fails to load it), so shards are read one after the other.
        child = child.ex_iterable
    if _has_buffer_node(child):
        raise InexactResumeError("The stream has several shuffle buffers; hf_resumable can replace only one.")
    for parent in reversed(path):  # rebuild the nodes above the buffer, leaving the caller's pipeline untouched
        parent = copy.copy(parent)
        parent.ex_iterable = child
        child = parent
    source = HfIterableDataset(child, info=dataset._info.copy(), split=dataset._split, formatting=dataset._formatting,
                               distributed=copy.deepcopy(dataset._distributed),
                               token_per_repo_id=dataset._token_per_repo_id)
    source.set_epoch(int(dataset.epoch))
    seed = int(copy.deepcopy(node.generator).integers(0, 1 << 62))
    buffer = ResumableShuffleBuffer(source, buffer_size=node.buffer_size, seed=seed, rank=rank)
    buffer.set_epoch(int(dataset.epoch))
    return buffer
