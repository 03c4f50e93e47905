"""Model weights <-> named tensors: tied-weight dedup on save; on load, tied-record and global key checks, and
the choice between reading in place and the model's own ``load_state_dict``."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..constants import TIED_KEY  # noqa: F401 - also imported from here
from ..errors import CheckpointMismatchError, CorruptCheckpointError

logger = logging.getLogger(__name__)



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


def check_tied(tied: Any, stored: Mapping[str, Any], *, source: str) -> dict[str, str]:
    """Check the index's tied-weight record ``{dropped: kept}`` against the tensors actually stored.

    An alias must name a tensor that is NOT stored (else loading would overwrite one stored tensor with
    another, e.g. ``wpe.weight`` with ``wte.weight``) and point at one that is.

    Raises:
        CorruptCheckpointError: listing every bad alias.
    """
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise CorruptCheckpointError(f"{source}: metadata {TIED_KEY} is {tied!r:.120}, expected an object mapping "
                                     "each alias to the stored tensor it shares. Resume from another checkpoint.")
    problems = [f"{alias}: recorded as an alias of {kept!r} but stored itself (two stored tensors would alias)"
                for alias, kept in tied.items() if alias in stored]
    problems += [f"{alias}: alias of {kept!r}, which is not a stored tensor" for alias, kept in tied.items()
                 if alias not in stored and kept not in stored]
    if problems:
        raise CorruptCheckpointError(f"{source}: metadata {TIED_KEY} is inconsistent with the stored tensors:\n  "
                                     + "\n  ".join(problems[:20]) + "\nResume from another checkpoint.")
    return dict(tied)


def check_model_fits(
    model: torch.nn.Module,
    stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tied: Mapping[str, str],
    *,
    strict: bool,
    source: str,
    targets: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Compare checkpoint keys/shapes/dtypes with the model once, globally; return the model's targets.

    Aliases (``tied``) are checked against the tensor they share: the model's tensor under the alias name
    must have the stored tensor's dtype and shape, since it receives its bytes.

    Raises:
        CheckpointMismatchError: listing every missing, unexpected and mismatched key at once.
    """
    targets = dict(model.state_dict(keep_vars=True) if targets is None else targets)
    available = set(stored) | set(tied)
    missing = sorted(set(targets) - available)
    unexpected = sorted(available - set(targets))
    problems = []
    for name in sorted(set(targets) & available):
        dtype, shape = stored[tied.get(name, name)]
        target = targets[name]
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


# Module methods and hooks through which a model takes part in (de)serializing its state. A model that uses
# any of them is loaded with its own load_state_dict, as the stock Trainer loads it.
_STATE_METHODS = ("load_state_dict", "state_dict", "_load_from_state_dict", "_save_to_state_dict")
_STATE_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks",
                "_state_dict_hooks")


def load_state_dict_reason(model: torch.nn.Module, targets: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``model`` must be filled through its own ``load_state_dict`` instead of in place, or ``None``.

    Reading straight into ``state_dict(keep_vars=True)`` tensors is exact only if those ARE the model's
    parameters and buffers and nothing of the model's own runs on load. Checked once per load: overridden
    (de)serialization methods on any module, registered state-dict or load-state-dict (pre/post) hooks
    (lazy modules register one to materialize their shapes), and state-dict entries that are not
    registered parameters or buffers (a hook or override returned copies).
    """
    for name, module in model.named_modules():
        for method in _STATE_METHODS:
            if getattr(type(module), method, None) is not getattr(torch.nn.Module, method):
                return f"{name or 'the model'} ({type(module).__qualname__}) overrides {method}"
        for hooks in _STATE_HOOKS:
            if getattr(module, hooks, None):
                return f"{name or 'the model'} ({type(module).__qualname__}) registers {hooks.strip('_')}"
    registered = {id(t) for _, t in model.named_parameters(remove_duplicate=False)}
    registered |= {id(t) for _, t in model.named_buffers(remove_duplicate=False)}
    for key, tensor in targets.items():
        if id(tensor) not in registered:
            return f"its state_dict() entry {key!r} is not one of its registered parameters or buffers"
    return None


class ModelSnapshot:
    """The model's parameters and buffers (objects and values), to put back if its ``load_state_dict`` fails.

    ``Module.load_state_dict`` copies key by key and raises at the end, so a refusal would leave the model
    half loaded; a model's own ``_load_from_state_dict`` may also replace or resize tensors. Costs one copy of
    the model's tensors, only on the ``load_state_dict`` path.
    """

    def __init__(self, model: torch.nn.Module, *, skip: Collection[int] = ()) -> None:
        self.modules = [(m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
                        for m in model.modules()]
        self.values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for _, params, buffers, _ in self.modules:
            for tensor in (*params.values(), *buffers.values()):
                lazy = isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)  # no data to keep
                if tensor is not None and not lazy and id(tensor) not in self.values and id(tensor) not in skip:
                    self.values[id(tensor)] = (tensor, tensor.detach().clone())

    def restore(self) -> None:
        for module, params, buffers, non_persistent in self.modules:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for tensor, saved in self.values.values():
                if tensor.shape == saved.shape and tensor.dtype == saved.dtype:
                    tensor.copy_(saved)
                else:
                    tensor.data = saved


def load_through_state_dict(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], tied: Mapping[str, str],
                            *, strict: bool, source: str, reason: str, covered: Collection[str] = ()) -> None:
    """Fill ``model`` with its own ``load_state_dict`` (aliases included), putting it back if that raises.

    ``covered``: state-dict names the checkpoint does not store because they were checked against its frozen
    record; they are left as they are (not snapshotted, not missing).

    Raises:
        CheckpointMismatchError: with the model's own error; the model is as before the call.
    """
    state = dict(tensors)
    for alias, kept in tied.items():
        if kept in state:
            state.setdefault(alias, state[kept])
    logger.info("Loading %s through %s.load_state_dict: %s.", source, type(model).__qualname__, reason)
    kept_as_is = {id(t) for name, t in model.state_dict(keep_vars=True).items() if name in covered} if covered else ()
    snapshot = ModelSnapshot(model, skip=kept_as_is)
    try:
        result = model.load_state_dict(state, strict=strict and not covered)
        missing = [k for k in getattr(result, "missing_keys", []) if k not in covered]
        unexpected = list(getattr(result, "unexpected_keys", []))
        if covered and strict and (missing or unexpected):
            raise RuntimeError(f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    except Exception as err:  # noqa: BLE001 - the model's own refusal, re-raised typed after the rollback
        snapshot.restore()
        raise CheckpointMismatchError(f"{source}: {type(model).__qualname__}.load_state_dict refused the checkpoint "
                                      f"(the model is unchanged): {err}") from err
    if missing or unexpected:
        logger.warning("Loading %s with strict=False: %d missing key(s) %s, %d unexpected key(s) %s", source,
                       len(missing), list(missing)[:5], len(unexpected), list(unexpected)[:5])
