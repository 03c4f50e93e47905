"""Model weights <-> named tensors: tied-weight dedup on save, strict global key checks on load."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from ..errors import CheckpointMismatchError

logger = logging.getLogger(__name__)

# Index metadata key recording tied / shared tensors that were stored once: {dropped: kept}.
TIED_KEY = "hf_resumable_tied"


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def model_state(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict to save (detached tensors), in the model's registration order."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        return {k: v.detach() for k, v in model_or_state_dict.state_dict().items()}
    return {k: v.detach() for k, v in model_or_state_dict.items()}


def dedupe_tied(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop exact aliases (same storage, offset, shape, stride, dtype), keeping the first name.

    The first name in state-dict order is the one transformers keeps too (e.g. GPT-2's
    ``transformer.wte.weight`` over ``lm_head.weight``), so ``from_pretrained`` re-ties correctly.

    Returns:
        `(tensors, tied)`: tensors to write, and ``{dropped_name: kept_name}``.
    """
    kept: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            raise CheckpointMismatchError(f"Tensor {name!r} is on the meta device and has no data to save.")
        key = _storage_key(tensor) if tensor.numel() else None
        if key is not None and key in kept:
            tied[name] = kept[key]
            continue
        if key is not None:
            kept[key] = name
        tensors[name] = tensor
    return tensors, tied


def check_model_fits(
    model: torch.nn.Module,
    stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tied: Mapping[str, str],
    *,
    strict: bool,
    source: str,
) -> dict[str, torch.Tensor]:
    """Compare checkpoint keys/shapes/dtypes with the model once, globally; return the model's targets.

    Raises:
        CheckpointMismatchError: listing every missing, unexpected and mismatched key at once.
    """
    targets = model.state_dict(keep_vars=True)
    available = set(stored) | set(tied)
    missing = sorted(set(targets) - available)
    unexpected = sorted(available - set(targets))
    problems = []
    for name, (dtype, shape) in stored.items():
        target = targets.get(name)
        if target is None:
            continue
        if target.device.type == "meta":
            problems.append(f"{name}: the model's tensor is on the meta device (use hf_resumable.load_lazily)")
        elif tuple(target.shape) != shape or target.dtype != dtype:
            problems.append(f"{name}: checkpoint has {dtype} {list(shape)}, model has {target.dtype} "
                            f"{list(target.shape)}")
    if problems or (strict and (missing or unexpected)):
        lines = problems + [f"{n}: missing from the checkpoint" for n in missing if strict]
        lines += [f"{n}: in the checkpoint but not in the model" for n in unexpected if strict]
        raise CheckpointMismatchError(
            f"{source} does not fit the model ({len(lines)} problem(s)):\n  " + "\n  ".join(lines[:50])
            + ("\nBuild the model with the checkpoint's config, or pass strict=False to skip missing/unexpected "
               "keys." if not problems else "")
        )
    if missing or unexpected:
        logger.warning("Loading %s with strict=False: %d missing key(s) %s, %d unexpected key(s) %s", source,
                       len(missing), missing[:5], len(unexpected), unexpected[:5])
    return {name: t for name, t in targets.items() if name in stored}


def retie(model_targets: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> None:
    """After loading, copy kept tensors into aliases that the target model does not share."""
    for dropped, kept in tied.items():
        target, source = model_targets.get(dropped), model_targets.get(kept)
        if target is None or source is None:
            continue
        if target.data_ptr() != source.data_ptr():
            with torch.no_grad():
                target.copy_(source)
