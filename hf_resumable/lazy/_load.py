"""Fill a model shard by shard, strictness decided once against all shards before anything is read."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..checkpoint.state import KeyMatch, Mismatch, find_aliases, match_keys, mismatch_message
from ..errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from ..format.safetensors_io import read_header, read_safetensors
from ._weights import LazyStateDict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadPlan:
    """What to read for a model, decided once across all shards before any data is read.

    Args:
        sources (`dict[str, list[str]]`): checkpoint name -> model keys it fills.
        missing (`list[str]`): model keys nothing fills (tied copies of loaded tensors excluded).
        unexpected (`list[str]`): checkpoint names (and recorded aliases) the model has no key for.
        mismatched (`list[str]`): ``"key: checkpoint shape vs model shape"`` entries.
        match (`KeyMatch`, *optional*): the key match these come from (the checkpoint loader's own matcher).
    """

    sources: dict[str, list[str]]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    match: KeyMatch | None = field(default=None, repr=False, compare=False)

    def describe(self, source: str, *, strict: bool = True) -> str:
        """The one "does not fit" message (:func:`hf_resumable.checkpoint.state._model.mismatch_message`)."""
        match = self.match or KeyMatch(self.sources, self.missing, self.unexpected,
                                       [Mismatch(line.partition(": ")[0], reason=line.partition(": ")[2])
                                        for line in self.mismatched])
        return mismatch_message(match, source=source, what="model", strict=strict)


def _model_tensors(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers by state-dict key (tied names included)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k.startswith(prefix)}


def plan_load(model: nn.Module, weights: LazyStateDict, *, keys: list[str] | None = None) -> LoadPlan:
    """Match model keys to stored tensors using headers only: sources, missing, unexpected and shape mismatches.

    The same matcher as a checkpoint load (:func:`hf_resumable.checkpoint.state._model.match_keys`), on shapes only:
    a stored dtype is cast into the model's, as ``from_pretrained`` does. A model key counts as filled when it is
    stored, when the index records it as an alias of a stored tensor, or when the model ties it to a stored key
    (:func:`hf_resumable.checkpoint.state._model.find_aliases`: one parameter under two names, e.g. on the meta
    device).

    Example:

    ```python
    >>> plan = plan_load(model, LazyStateDict.from_pretrained("out"))  # doctest: +SKIP
    >>> plan.missing, plan.unexpected  # doctest: +SKIP
    ([], [])
    ```
    """
    tensors = _model_tensors(model)
    wanted = list(tensors) if keys is None else keys
    stored = {name: (meta.dtype, meta.shape) for name, meta in weights._metas.items()}
    match = match_keys({key: (tensors[key].dtype, tuple(tensors[key].shape)) for key in wanted}, stored,
                       tied=weights.aliases, shared=find_aliases(tensors), compare_dtype=False,
                       report_unexpected=keys is None)
    return LoadPlan(match.sources, match.missing, match.unexpected, [m.describe("model") for m in match.mismatched],
                    match=match)


# --------------------------------------------------------------------------------------------------- loading
def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    module_path, _, attr = key.rpartition(".")
    return model.get_submodule(module_path) if module_path else model, attr


Allocator = Callable[[torch.Size, torch.dtype], torch.Tensor]


def _empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu")


def _materialize(model: nn.Module, key: str, allocate: Allocator = _empty) -> torch.Tensor:
    """The CPU tensor behind ``key``; a meta tensor is replaced by memory from ``allocate`` first.

    Parameters are swapped in place (``torch.utils.swap_tensors``) so every module sharing them stays tied.
    """
    module, attr = _owner(model, key)
    current = getattr(module, attr)
    if not current.is_meta:
        return current
    fresh = allocate(current.shape, current.dtype)
    if isinstance(current, nn.Parameter):
        torch.utils.swap_tensors(current, nn.Parameter(fresh, requires_grad=current.requires_grad))
        return current
    setattr(module, attr, fresh)
    return fresh


def _read_into(weights: LazyStateDict, filename: str, into: Mapping[str, torch.Tensor]) -> None:
    """Read the tensors named in ``into`` from one shard straight into them (``readinto``, no intermediate copy)."""
    path = weights.shard_path(filename)
    header = read_header(path)
    for name, target in into.items():
        info = header.tensors.get(name)
        if info is None or info.shape != tuple(target.shape):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} is missing or has another shape than its header "
                                         "promised; the file changed under us. Re-download it.")
    read_safetensors(path, header=header, names=list(into), into=into)


def _fill_aliases(model: nn.Module, filled: Mapping[str, torch.Tensor], sources: Mapping[str, list[str]],
                  allocate: Allocator = _empty) -> None:
    """Copy each stored tensor into the other model keys it fills (untied aliases recorded in the index)."""
    with torch.no_grad():
        for name, tensor in filled.items():
            for extra in sources[name][1:]:
                target = _materialize(model, extra, allocate)
                if target is not tensor:
                    target.copy_(tensor)


def _read_shard(model: nn.Module, weights: LazyStateDict, filename: str, names: list[str],
                sources: Mapping[str, list[str]], allocate: Allocator = _empty) -> None:
    """Read ``names`` of one shard straight into the model's tensors (``readinto``, no intermediate copy)."""
    into = {name: _materialize(model, sources[name][0], allocate) for name in names}
    _read_into(weights, filename, into)
    _fill_aliases(model, into, sources, allocate)


def _tie(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _meta_leftovers(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    return names + [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]


def _as_weights(path_or_repo_id: str | os.PathLike | LazyStateDict, revision: str | None,
                token: str | None) -> LazyStateDict:
    if isinstance(path_or_repo_id, LazyStateDict):
        return path_or_repo_id
    return LazyStateDict.from_pretrained(path_or_repo_id, revision=revision, token=token)


def load_lazily(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike | LazyStateDict,
    *,
    strict: bool = True,
    revision: str | None = None,
    token: str | None = None,
) -> tuple[list[str], list[str]]:
    """Fill ``model`` from sharded safetensors, one shard at a time, with strictness checked once for all shards.

    1. Read the index and headers only, and match every model key (tied weights and recorded aliases count as
       filled). Any shape mismatch, and with ``strict=True`` any missing or unexpected key, raises one error that
       lists them all, before a single tensor is read.
    2. Per shard: download it if needed, then read its tensors straight into the parameters (meta parameters get
       CPU memory first, swapped in place so tied modules stay tied). Only that shard is in flight.
    3. Re-tie weights (``model.tie_weights()`` when the model has it).

    Args:
        model (`torch.nn.Module`): the model; may live on the meta device (build it with
            ``accelerate.init_empty_weights()`` so non-persistent buffers stay real).
        path_or_repo_id (`str`, `os.PathLike` or [`LazyStateDict`]): local directory/file or Hub repo id.
        strict (`bool`, *optional*, defaults to `True`): fail on missing or unexpected keys.
        revision (`str`, *optional*): Hub revision.
        token (`str`, *optional*): Hub token.

    Returns:
        `tuple[list[str], list[str]]`: ``(missing_keys, unexpected_keys)``.

    Raises:
        CheckpointMismatchError: on shape mismatches, or missing/unexpected keys with ``strict=True``, or when a
            non-persistent buffer is left on the meta device.

    Example:

    ```python
    >>> with init_empty_weights():  # doctest: +SKIP
    ...     model = LlamaForCausalLM(config)
    >>> load_lazily(model, "out/checkpoint-120")  # doctest: +SKIP
    ([], [])
    ```
    """
    weights = _as_weights(path_or_repo_id, revision, token)
    _tie(model)
    plan = plan_load(model, weights)
    plan.match.check(strict=strict, source=weights.source)
    # Each shard is read with an implicit strict=False: strictness was decided above, across all shards at once.
    for filename, names in weights.group_by_file(list(plan.sources)).items():
        _read_shard(model, weights, filename, names, plan.sources)
        weights.release(filename)
    _tie(model)
    _check_no_meta(model, set(plan.missing), weights.source)
    return plan.missing, plan.unexpected


def _check_no_meta(model: nn.Module, allowed: set[str], source: str) -> None:
    leftovers = [n for n in _meta_leftovers(model) if n not in allowed]
    if leftovers:
        raise CheckpointMismatchError(
            f"After loading {source}, {leftovers[:10]} are still on the meta device (not stored in the checkpoint). "
            "Build the model with accelerate.init_empty_weights() (buffers stay real) or initialize them first."
        )
    if allowed & set(_meta_leftovers(model)):
        logger.warning("missing keys left on the meta device: %s", sorted(allowed)[:10])
