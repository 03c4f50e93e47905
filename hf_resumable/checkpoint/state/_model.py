"""Model weights <-> named tensors: the one tied-weight detector (:func:`find_aliases`), the one key matcher
(:func:`match_keys`) with its one error message, and on load the tied-record check and the choice between reading in
place and the model's own ``load_state_dict``.

Example:

```python
>>> import torch
>>> w = torch.ones(2, 3)
>>> find_aliases({"wte.weight": w, "lm_head.weight": w, "wpe.weight": torch.ones(2, 3)})
{'lm_head.weight': 'wte.weight'}
>>> spec = (torch.float32, (2, 3))
>>> match = match_keys({"a": spec, "b": (torch.float32, (3, 3)), "c": spec}, {"a": spec, "b": spec, "d": spec})
>>> match.missing, match.unexpected, [m.name for m in match.mismatched]
(['c'], ['d'], ['b'])
>>> print(mismatch_message(match, source="ckpt", what="model", strict=True))
ckpt does not fit the model (3 problem(s): missing keys (1), unexpected keys (1), shape mismatches (1)):
  b: checkpoint [2, 3] vs model [3, 3]
  c: missing from the checkpoint
  d: in the checkpoint but not in the model
Build the model with the checkpoint's config; strict=False skips missing/unexpected keys, not mismatches.

```
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...constants import TIED_KEY  # noqa: F401 - also imported from here
from ...errors import CheckpointMismatchError, CorruptCheckpointError

logger = logging.getLogger(__name__)

__all__ = ["TensorSpec", "storage_key", "find_aliases", "dedupe_tied", "Mismatch", "KeyMatch", "match_keys",
           "mismatch_message", "check_tied", "load_state_dict_reason", "ModelSnapshot",
           "load_through_state_dict", "model_state"]

# What a key match compares: a tensor's dtype and shape.
TensorSpec = tuple[torch.dtype, tuple[int, ...]]


# --------------------------------------------------------------------------------------------------- tied weights
def storage_key(tensor: torch.Tensor) -> tuple | None:
    """What two names of one tied tensor share: device, storage, offset, shape, stride and dtype; ``None`` for a
    tensor without bytes (empty, or on the meta device), which shares nothing by storage."""
    if tensor.device.type == "meta" or not tensor.numel():
        return None
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def find_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: first name}`` for the names of ``state`` that are one tensor (tied weights, e.g. GPT-2's
    ``lm_head.weight`` and ``transformer.wte.weight``): entries that view the same bytes the same way
    (:func:`storage_key`), or, without bytes, the very same object. The first name is kept, as transformers keeps it.

    Args:
        state: names -> tensors, in state-dict order (a DTensor's local piece, to compare its storage).
    """
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = storage_key(tensor)
        key = ("object", id(tensor)) if key is None else key  # ``state`` keeps the object alive: its id is unique
        kept = first.setdefault(key, name)
        if kept != name:
            aliases[name] = kept
    return aliases


def model_state(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict to save (detached tensors), in the model's registration order."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        return {k: v.detach() for k, v in model_or_state_dict.state_dict().items()}
    return {k: v.detach() for k, v in model_or_state_dict.items()}


def dedupe_tied(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop aliases (:func:`find_aliases`), keeping the first name, as transformers does (so ``from_pretrained``
    re-ties correctly).

    Returns:
        `(tensors, tied)`: tensors to write, and ``{dropped_name: kept_name}``.

    Raises:
        CheckpointMismatchError: a tensor is on the meta device (it has no data to save).
    """
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            raise CheckpointMismatchError(f"Tensor {name!r} is on the meta device and has no data to save.")
    tied = find_aliases(state)
    return {name: tensor for name, tensor in state.items() if name not in tied}, tied


def check_tied(tied: Any, stored: Collection[str], *, source: str) -> dict[str, str]:
    """Check the index's tied-weight record ``{dropped: kept}`` against the tensors stored: an alias must not be
    stored itself (loading would overwrite one stored tensor with another) and must point at one that is.

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


# --------------------------------------------------------------------------------------------------- key matching
@dataclass(frozen=True)
class Mismatch:
    """An expected tensor the checkpoint cannot fill as it is: another shape or dtype, or a ``reason``.

    Args:
        name (`str`): the expected (model) name.
        stored, expected (`TensorSpec`, *optional*): the checkpoint's and the model's dtype and shape.
        reason (`str`, *optional*): why it cannot receive bytes at all (e.g. it is on the meta device).
    """

    name: str
    stored: TensorSpec | None = None
    expected: TensorSpec | None = None
    reason: str | None = None

    @property
    def kind(self) -> str:
        """``"shape"``, ``"dtype"`` or ``"unusable"`` (a ``reason``)."""
        if self.reason is not None or self.stored is None or self.expected is None:
            return "unusable"
        return "shape" if tuple(self.stored[1]) != tuple(self.expected[1]) else "dtype"

    def describe(self, what: str = "model") -> str:
        if self.kind == "unusable":
            return f"{self.name}: {self.reason}"
        (dtype, shape), (want_dtype, want_shape) = self.stored, self.expected
        if dtype == want_dtype:
            return f"{self.name}: checkpoint {list(shape)} vs {what} {list(want_shape)}"
        return f"{self.name}: checkpoint {dtype} {list(shape)} vs {what} {want_dtype} {list(want_shape)}"


@dataclass(frozen=True)
class KeyMatch:
    """How a checkpoint's tensors meet what is to be filled (pure facts; :meth:`check` decides with ``strict``).

    Args:
        sources (`dict[str, list[str]]`): stored name -> expected names it fills (itself, and aliases of it).
        missing (`list[str]`): expected names nothing fills (sorted).
        unexpected (`list[str]`): stored names and recorded aliases nothing expects (sorted).
        mismatched (`list[Mismatch]`): expected names whose stored tensor has another shape or dtype (sorted).
    """

    sources: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[Mismatch] = field(default_factory=list)

    @property
    def filled(self) -> set[str]:
        """Expected names that receive stored bytes."""
        return {name for names in self.sources.values() for name in names}

    def fits(self, *, strict: bool) -> bool:
        """No mismatch, and with ``strict`` nothing missing or unexpected."""
        return not self.mismatched and not (strict and (self.missing or self.unexpected))

    def check(self, *, strict: bool, source: str, what: str = "model") -> None:
        """Raise if it does not fit; with ``strict=False`` log what is skipped.

        Raises:
            CheckpointMismatchError: :func:`mismatch_message`, every problem at once.
        """
        if not self.fits(strict=strict):
            raise CheckpointMismatchError(mismatch_message(self, source=source, what=what, strict=strict))
        if self.missing or self.unexpected:
            logger.warning("Loading %s with strict=False: %d missing key(s) %s, %d unexpected key(s) %s", source,
                           len(self.missing), self.missing[:5], len(self.unexpected), self.unexpected[:5])


def match_keys(
    expected: Mapping[str, TensorSpec],
    stored: Mapping[str, TensorSpec],
    *,
    tied: Mapping[str, str] | None = None,
    shared: Mapping[str, str] | None = None,
    unusable: Mapping[str, str] | None = None,
    compare_dtype: bool = True,
    report_unexpected: bool = True,
) -> KeyMatch:
    """The one answer to "does this checkpoint fit": match expected names to stored tensors by dtype and shape (pure).

    An expected name is filled by the stored tensor of the same name, or by the one the checkpoint's ``tied``
    record says it is an alias of (it receives that tensor's bytes, so it must have its shape and dtype). A name
    the checkpoint does not fill is still covered, not missing, when the expected side ties it (``shared``) to a
    name that is stored: it is the same tensor.

    Args:
        expected: names to fill -> their dtype and shape (the model's state dict).
        stored: the checkpoint's tensors -> dtype and shape (from the headers).
        tied: the checkpoint's alias record ``{alias: stored name}``.
        shared: the expected side's own ties ``{alias: first name}`` (:func:`find_aliases`).
        unusable: expected names that cannot receive bytes -> why (reported as mismatches when filled).
        compare_dtype: a dtype difference is a mismatch (lazy loading casts, as ``from_pretrained``; a resume
            does not).
        report_unexpected: list stored tensors nothing expects (off when ``expected`` is a chosen subset).

    Returns:
        `KeyMatch`
    """
    tied, shared, unusable = tied or {}, shared or {}, unusable or {}
    groups: dict[str, list[str]] = {}
    for alias, first in shared.items():
        groups.setdefault(first, [first]).append(alias)
    sources: dict[str, list[str]] = {}
    missing: list[str] = []
    mismatched: list[Mismatch] = []
    for name, spec in expected.items():
        source = name if name in stored else tied.get(name)
        if source not in stored:
            group = groups.get(shared.get(name, name), ())
            if not any(other in stored for other in group):
                missing.append(name)
            continue
        have = stored[source]
        if name in unusable:
            mismatched.append(Mismatch(name, have, spec, reason=unusable[name]))
        elif tuple(have[1]) != tuple(spec[1]) or (compare_dtype and have[0] != spec[0]):
            mismatched.append(Mismatch(name, have, spec))
        else:
            sources.setdefault(source, []).append(name)
    unexpected = sorted(n for n in (*stored, *tied) if n not in expected) if report_unexpected else []
    return KeyMatch(sources, sorted(missing), unexpected, sorted(mismatched, key=lambda m: m.name))


# Lines listed per kind of problem; the count says how many there are in all.
_LISTED = 50


def _first(lines: list[str]) -> list[str]:
    return lines[:_LISTED] + ([f"... and {len(lines) - _LISTED} more"] if len(lines) > _LISTED else [])


def mismatch_message(match: KeyMatch, *, source: str, what: str = "model", strict: bool = True) -> str:
    """The one "does not fit" message: counts per kind, the first names of each, and the fix.

    With ``strict=False`` missing and unexpected names are not problems and are not listed.
    """
    keys = [("missing keys", [f"{n}: missing from the checkpoint" for n in match.missing]),
            ("unexpected keys", [f"{n}: in the checkpoint but not in the {what}" for n in match.unexpected])]
    mismatches = [(label, [m.describe(what) for m in match.mismatched if m.kind == kind])
                  for kind, label in (("unusable", "unusable tensors"), ("shape", "shape mismatches"),
                                      ("dtype", "dtype mismatches"))]
    key_groups = [group for group in keys if group[1]] if strict else []
    mismatch_groups = [group for group in mismatches if group[1]]
    total = sum(len(lines) for _, lines in key_groups + mismatch_groups)
    counts = ", ".join(f"{label} ({len(lines)})" for label, lines in key_groups + mismatch_groups)
    # Mismatches are listed first: they are errors even with strict=False.
    listed = [line for _, lines in mismatch_groups + key_groups for line in _first(lines)]
    fix = (f"Build the {what} with the checkpoint's config; strict=False skips missing/unexpected keys, not "
           "mismatches." if match.mismatched else
           f"Build the {what} with the checkpoint's config, or pass strict=False to skip missing/unexpected keys.")
    return f"{source} does not fit the {what} ({total} problem(s): {counts}):\n  " + "\n  ".join(listed) + "\n" + fix


# Module methods and hooks through which a model takes part in (de)serializing its state. A model that uses
# any of them is loaded with its own load_state_dict, as the stock Trainer loads it.
_STATE_METHODS = ("load_state_dict", "state_dict", "_load_from_state_dict", "_save_to_state_dict")
_STATE_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks",
                "_state_dict_hooks")


def load_state_dict_reason(model: torch.nn.Module, targets: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``model`` must be filled through its own ``load_state_dict`` instead of in place, or ``None``: reading
    into ``state_dict(keep_vars=True)`` is exact only if those ARE its parameters and buffers and nothing of its own
    runs on load (no overridden (de)serialization method, no state-dict hook, e.g. a lazy module's).
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
    """The model's parameters and buffers (objects and values), to put back if its ``load_state_dict`` fails
    (``Module.load_state_dict`` copies key by key and raises at the end; a model's own ``_load_from_state_dict`` may
    replace or resize tensors)."""

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
    ``covered``: names checked against the frozen record instead, left as they are (not snapshotted, not missing).

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
