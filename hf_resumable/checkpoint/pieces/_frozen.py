"""Frozen parameters are identity, not state: the record a checkpoint keeps instead of their bytes
(``frozen_base.json``, whole tensors or per piece), its fingerprints (cached per process) and the checks on load.

See docs/format.md#a-checkpoint-of-a-model-with-frozen-parameters and docs/peft.md#how-the-base-is-checked.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from ...constants import (
    FROZEN_KEY_HASH,
    FROZEN_KEY_SAMPLE,
    FROZEN_KEY_SOURCE,
    FROZEN_KEY_TENSORS,
    FROZEN_KEY_TIED,
    FROZEN_KEY_VERSION,
    FROZEN_RECORD_FILE,
    FROZEN_RECORD_VERSION,
    LAYOUT_FILE,
    MAX_JSON_SIZE,
    RENAMED_KEY,
    TIED_KEY,
    TRAINABLE_INDEX_FILE,
)
from ...distributed import all_gather_json
from ...errors import (
    BaseMismatchError,
    BaseNotStoredError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
)
from ...format._bytes import tensor_bytes
from ...format._jsonio import json_bytes, parse_json, require_field
from ...format._safefile import read_regular_file
from ...format.safetensors_io import DTYPE_TO_STR, STR_TO_DTYPE
from ...format.sharding import ShardIndex
from .._types import Box, intersect_boxes
from ..commit._threads import run_in_threads
from ..state._model import check_tied
from ._dtensor import is_dtensor, local_box, local_tensor, writes_piece

logger = logging.getLogger(__name__)

__all__ = ["FrozenTensor", "FrozenRecord", "TrainablePart", "frozen_names", "build_record", "base_provenance",
           "check_frozen_base", "describe_source", "fingerprint", "forget_fingerprints", "base_not_stored",
           "FrozenPiece", "raise_base_problems", "split_frozen_sharded"]

# The sampled fingerprint: SAMPLE_WINDOWS windows of SAMPLE_BYTES bytes, evenly spaced from the first byte to the
# last; tensors up to SAMPLE_WINDOWS * SAMPLE_BYTES bytes are sampled whole (sample == every byte).
SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 4096
# Tensors hashed concurrently (xxhash releases the GIL; on small machines memory bandwidth is the limit).
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
# Device tensors are copied to the host in chunks of this many bytes to be hashed (bounded host memory).
_HOST_CHUNK = 64 * 1024 * 1024
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
# Largest number of frozen tensors a record may describe (a 70B model has ~ 1000).
MAX_FROZEN_TENSORS = 1_000_000
_ERRORS_SHOWN = 10
# A record with per-piece fingerprints (sharded checkpoints) is version 2; whole-tensor records stay version 1.
PIECES_RECORD_VERSION = 2


# ------------------------------------------------------------------------------------------------ fingerprints
def _update(digest: "xxhash.xxh3_128", data: torch.Tensor) -> None:
    """Feed a flat uint8 tensor into ``digest`` (device tensors through bounded host copies)."""
    if data.numel() == 0:
        return
    if data.device.type == "cpu":
        digest.update(memoryview(data.numpy()).cast("B"))
        return
    for start in range(0, data.numel(), _HOST_CHUNK):
        digest.update(memoryview(data[start:start + _HOST_CHUNK].cpu().numpy()).cast("B"))


def _full_hash(tensor: torch.Tensor) -> str:
    digest = xxhash.xxh3_128()
    _update(digest, tensor_bytes(tensor))
    return digest.hexdigest()


def _sample_starts(total: int) -> list[int]:
    """Byte offsets of the sampled windows of a tensor of ``total`` bytes (more than the whole sample)."""
    span = total - SAMPLE_BYTES
    return [(span * i) // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]


def _sample_hash(tensor: torch.Tensor) -> str:
    data = tensor_bytes(tensor)
    total = data.numel()
    if total <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return _full_hash(tensor)
    digest = xxhash.xxh3_128()
    if data.device.type == "cpu":
        # Slices of one memoryview: no tensor per window (the per-window torch slicing was most of the cost).
        view = memoryview(data.numpy()).cast("B")
        for start in _sample_starts(total):
            digest.update(view[start:start + SAMPLE_BYTES])
    else:  # one device-to-host copy of the windows, not one per window
        windows = torch.cat([data[start:start + SAMPLE_BYTES] for start in _sample_starts(total)])
        digest.update(memoryview(windows.cpu().numpy()).cast("B"))
    return digest.hexdigest()


def _cache_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor._version)


@dataclass
class _Fingerprint:
    sample: str
    full: str | None = None


# storage identity -> fingerprint. A hit is trusted only after its sample is hashed again and matches (a tensor
# written in place through .data does not bump the version counter).
_CACHE: dict[tuple, _Fingerprint] = {}
_CACHE_LIMIT = 200_000


def fingerprint(tensor: torch.Tensor, *, full: bool) -> _Fingerprint:
    """The tensor's sampled fingerprint, and with ``full`` the xxh3-128 of every byte (computed once, cached)."""
    key = _cache_key(tensor)
    sample = _sample_hash(tensor)
    entry = _CACHE.get(key)
    if entry is None or entry.sample != sample:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        entry = _CACHE[key] = _Fingerprint(sample=sample)
    if full and entry.full is None:
        entry.full = sample if tensor_bytes(tensor).numel() <= SAMPLE_WINDOWS * SAMPLE_BYTES else _full_hash(tensor)
    return entry


def forget_fingerprints(tensors: Iterable[torch.Tensor]) -> None:
    """Drop cached fingerprints of tensors that were just written (a load fills them without a version bump)."""
    if not _CACHE:
        return
    for tensor in tensors:
        if (isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"
                and not isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)):
            _CACHE.pop(_cache_key(tensor), None)


def _fingerprints(tensors: Mapping[str, torch.Tensor], *, full: bool) -> dict[str, _Fingerprint]:
    """Fingerprints of many tensors, largest first on a few threads."""
    names = sorted(tensors, key=lambda n: -tensors[n].numel() * tensors[n].element_size())
    results = run_in_threads(lambda n: fingerprint(tensors[n], full=full), names, workers=HASH_THREADS)
    return dict(zip(names, results))


# ------------------------------------------------------------------------------------------------ the record
@dataclass(frozen=True)
class FrozenPiece:
    """The fingerprints of one box of a frozen tensor (a piece record holds each rank's): where it starts, its
    shape, the xxh3-128 of its bytes (C order) and of its sample."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    xxh3_128: str
    sample_xxh3_128: str

    @property
    def box(self) -> Box:
        return Box(self.offset, self.shape)

    def to_json(self) -> dict[str, Any]:
        return {**self.box.to_json(), "xxh3_128": self.xxh3_128, "sample_xxh3_128": self.sample_xxh3_128}


@dataclass(frozen=True)
class FrozenTensor:
    """One frozen tensor as a checkpoint records it: safetensors dtype name, shape, and the xxh3-128 of every byte
    (C order) and of the sample; in a piece record whose tensor was split over ranks the hashes are ``None`` and
    ``pieces`` (which tile the tensor) hold them."""

    dtype: str
    shape: tuple[int, ...]
    xxh3_128: str | None
    sample_xxh3_128: str | None
    pieces: tuple[FrozenPiece, ...] = ()

    @classmethod
    def of_pieces(cls, dtype: str, shape: tuple[int, ...], pieces: list[FrozenPiece]) -> "FrozenTensor":
        """A tensor recorded by ``pieces`` that tile it, with the hashes of the whole where one piece is all of it."""
        whole = len(pieces) == 1 and pieces[0].shape == tuple(shape)
        return cls(dtype, tuple(shape), pieces[0].xxh3_128 if whole else None,
                   pieces[0].sample_xxh3_128 if whole else None, pieces=tuple(pieces))

    def boxes(self) -> tuple[FrozenPiece, ...]:
        """The recorded boxes: the pieces, or the whole tensor as one."""
        if self.pieces:
            return self.pieces
        return (FrozenPiece((0,) * len(self.shape), self.shape, self.xxh3_128, self.sample_xxh3_128),)

    @property
    def nbytes(self) -> int:
        return self.numel * STR_TO_DTYPE[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FrozenRecord:
    """What a checkpoint records about the frozen parameters it does not store (``frozen_base.json``): each
    tensor, the aliases (state-dict names sharing a recorded tensor -> the recorded name), and where the base came
    from when known (``name_or_path``, ``kind`` "local" or "hub", ``revision``, ``commit``, ``quantization``,
    ``model_class``)."""

    tensors: dict[str, FrozenTensor]
    tied: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def to_json(self) -> dict[str, Any]:
        document = {FROZEN_KEY_VERSION: FROZEN_RECORD_VERSION, FROZEN_KEY_HASH: "xxh3-128",
                FROZEN_KEY_SAMPLE: {"windows": SAMPLE_WINDOWS, "window_bytes": SAMPLE_BYTES},
                FROZEN_KEY_SOURCE: dict(self.source),
                FROZEN_KEY_TIED: dict(sorted(self.tied.items())),
                FROZEN_KEY_TENSORS: {name: _tensor_json(t) for name, t in self.tensors.items()}}
        if any(t.pieces for t in self.tensors.values()):
            document[FROZEN_KEY_VERSION] = PIECES_RECORD_VERSION  # readers of version 1 cannot check pieces
        return document

    @classmethod
    def from_json(cls, document: Any, *, source: str) -> "FrozenRecord":
        """Validate a parsed ``frozen_base.json``.

        Raises:
            FormatVersionError: a newer record version.
            CorruptCheckpointError: anything malformed (named).
        """
        require_field(isinstance(document, dict), source, "", type(document).__name__, "a JSON object")
        version = document.get(FROZEN_KEY_VERSION)
        require_field(type(version) is int, source, FROZEN_KEY_VERSION, version, "an int")
        if version > PIECES_RECORD_VERSION:
            raise FormatVersionError(f"{source}: frozen record version {version} is newer than this hf_resumable "
                                     f"reads ({PIECES_RECORD_VERSION}); upgrade hf_resumable.")
        require_field(document.get(FROZEN_KEY_HASH) == "xxh3-128", source, FROZEN_KEY_HASH,
                      document.get(FROZEN_KEY_HASH), "'xxh3-128'")
        sample = {"windows": SAMPLE_WINDOWS, "window_bytes": SAMPLE_BYTES}
        require_field(document.get(FROZEN_KEY_SAMPLE) == sample, source, FROZEN_KEY_SAMPLE,
                      document.get(FROZEN_KEY_SAMPLE), repr(sample))
        entries = document.get(FROZEN_KEY_TENSORS)
        require_field(isinstance(entries, dict) and len(entries) <= MAX_FROZEN_TENSORS, source, FROZEN_KEY_TENSORS,
                      entries, f"an object of at most {MAX_FROZEN_TENSORS} tensors")
        tensors = {name: _tensor_entry(name, entry, source) for name, entry in entries.items()}
        tied = document.get(FROZEN_KEY_TIED, {})
        names = isinstance(tied, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items())
        require_field(names, source, FROZEN_KEY_TIED, tied, "an object mapping each alias to a recorded tensor name")
        wrong = [f"{a} -> {k}" for a, k in tied.items() if a in tensors or k not in tensors]
        require_field(not wrong, source, FROZEN_KEY_TIED, wrong[:5],
                      "aliases that are not recorded themselves and point at a recorded tensor")
        origin = document.get(FROZEN_KEY_SOURCE, {})
        require_field(isinstance(origin, dict), source, FROZEN_KEY_SOURCE, origin, "an object")
        return cls(tensors=tensors, tied=dict(tied), source=origin)


def _tensor_entry(name: Any, entry: Any, source: str) -> FrozenTensor:
    """One validated entry of ``tensors`` (whole, or tiled by pieces)."""
    require_field(isinstance(name, str) and bool(name) and len(name) <= 1024, source, FROZEN_KEY_TENSORS, name,
                  "tensor names that are non-empty strings of at most 1024 characters")
    where = f"{FROZEN_KEY_TENSORS}.{name}"
    require_field(isinstance(entry, dict), source, where, entry,
                  "an object with dtype, shape, xxh3_128 and sample_xxh3_128")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    require_field(dtype in STR_TO_DTYPE, source, f"{where}.dtype", dtype, f"one of {sorted(STR_TO_DTYPE)}")
    require_field(isinstance(shape, list) and len(shape) <= 64
                  and all(type(d) is int and 0 <= d < 2 ** 62 for d in shape),
                  source, f"{where}.shape", shape, "a list of non-negative ints")
    if "pieces" not in entry:
        return FrozenTensor(dtype, tuple(shape), *_hashes(where, entry, source))
    listed = entry["pieces"]
    require_field(isinstance(listed, list) and len(listed) <= MAX_FROZEN_TENSORS, source, f"{where}.pieces",
                  type(listed).__name__, "a list of boxes with their fingerprints")
    pieces = []
    for piece in listed:
        require_field(isinstance(piece, dict), source, f"{where}.pieces", piece,
                      "objects with offset, shape, xxh3_128 and sample_xxh3_128")
        offset, box = piece.get("offset"), piece.get("shape")
        inside = (isinstance(offset, list) and isinstance(box, list) and len(offset) == len(shape)
                  and len(box) == len(shape) and all(type(d) is int for d in offset + box)
                  and not any(o < 0 or n <= 0 or o + n > d for o, n, d in zip(offset, box, shape)))
        require_field(inside, source, f"{where}.pieces", piece, f"boxes inside the tensor's shape {shape}")
        pieces.append(FrozenPiece(tuple(offset), tuple(box), *_hashes(where, piece, source)))
    held = sum(math.prod(p.shape) for p in pieces)
    require_field(held == math.prod(shape), source, f"{where}.pieces", f"{held} elements",
                  f"pieces that tile the tensor's {math.prod(shape)} elements")
    return FrozenTensor.of_pieces(dtype, tuple(shape), pieces)


def _hashes(where: str, entry: Mapping[str, Any], source: str) -> tuple[str, str]:
    hashes = (entry.get("xxh3_128"), entry.get("sample_xxh3_128"))
    require_field(all(isinstance(h, str) and _HEX128.match(h) for h in hashes), source,
                  f"{where}.xxh3_128/sample_xxh3_128", hashes, "32 lowercase hex digits each")
    return hashes


def _tensor_json(tensor: FrozenTensor) -> dict[str, Any]:
    document: dict[str, Any] = {"dtype": tensor.dtype, "shape": list(tensor.shape)}
    if tensor.pieces:
        document["pieces"] = [piece.to_json() for piece in tensor.pieces]
    else:
        document.update(xxh3_128=tensor.xxh3_128, sample_xxh3_128=tensor.sample_xxh3_128)
    return document


def describe_source(source: Mapping[str, Any]) -> str:
    """Where a record's base came from: ``"gpt2 (Hub, revision main, commit 1a2b...)"``, ``"/path/to/base (local)"``
    or ``"unknown"``."""
    name = source.get("name_or_path")
    if not name:
        return "unknown (not recorded)"
    details = ["local" if source.get("kind") == "local" else "Hub"]
    if source.get("revision"):
        details.append(f"revision {source['revision']}")
    if source.get("commit"):
        details.append(f"commit {source['commit']}")
    if source.get("quantization"):
        method = source["quantization"].get("quant_method") if isinstance(source["quantization"], dict) else None
        details.append(f"quantized: {method or 'yes'}")
    return f"{name} ({', '.join(details)})"


# ------------------------------------------------------------------------------------------------ saving
def frozen_names(model: torch.nn.Module, names: Iterable[str]) -> set[str]:
    """The state-dict entries of ``model`` that are frozen: parameters with ``requires_grad=False``, and entries a
    module's own ``_save_to_state_dict`` adds for frozen parameters (bitsandbytes' quantization state, e.g.
    ``weight.absmax`` or ``SCB``: not registered tensors, on a module whose parameters are all frozen).
    Buffers are state (running statistics change), never frozen.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    frozen_params = {n for n, p in params.items() if not p.requires_grad}
    if not frozen_params:
        return set()
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    modules = dict(model.named_modules(remove_duplicate=False))
    frozen: set[str] = set()
    for name in names:
        if name in params:
            if name in frozen_params:
                frozen.add(name)
            continue
        if name in buffers:
            continue
        owner = _owner(modules, name)
        direct = list(owner.parameters(recurse=False)) if owner is not None else []
        if direct and not any(p.requires_grad for p in direct):
            frozen.add(name)
    return frozen


def _owner(modules: Mapping[str, torch.nn.Module], name: str) -> torch.nn.Module | None:
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        module = modules.get(".".join(parts[:cut]))
        if module is not None:
            return module
    return None


def base_provenance(model: torch.nn.Module) -> dict[str, Any]:
    """Where the frozen base came from, when the model knows: PEFT's ``base_model_name_or_path`` and ``revision``,
    else ``config._name_or_path``; the Hub commit ``from_pretrained`` resolved (``config._commit_hash``); the
    ``quantization_config``; the base model's class."""
    peft = getattr(model, "peft_config", None)
    config = getattr(model, "config", None)
    name = revision = None
    if isinstance(peft, Mapping) and peft:
        first = next(iter(peft.values()))
        name, revision = getattr(first, "base_model_name_or_path", None), getattr(first, "revision", None)
    name = name or getattr(config, "_name_or_path", None) or None
    source: dict[str, Any] = {"name_or_path": str(name) if name else None,
                              "kind": None if not name else "local" if os.path.isdir(str(name)) else "hub",
                              "revision": revision if isinstance(revision, str) else None,
                              "commit": getattr(config, "_commit_hash", None) if config is not None else None}
    if source["kind"] == "local":
        source["name_or_path"] = os.path.abspath(str(name))
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        as_dict = quantization.to_dict() if hasattr(quantization, "to_dict") else quantization
        source["quantization"] = _json_safe(as_dict)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source["model_class"] = type(base).__name__
    return source


def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    """The safetensors name of a frozen tensor's dtype; refuses one the format cannot describe."""
    if tensor.dtype not in DTYPE_TO_STR:
        raise CheckpointMismatchError(f"Frozen tensor {name!r} has dtype {tensor.dtype}, which the checkpoint "
                                      "format cannot describe; save with standalone=True.")
    return DTYPE_TO_STR[tensor.dtype]


def build_record(tensors: Mapping[str, torch.Tensor], tied: Mapping[str, str],
                 source: Mapping[str, Any]) -> FrozenRecord:
    """The record of the frozen ``tensors`` (deduplicated; ``tied``: their aliases), with full fingerprints."""
    prints = _fingerprints(tensors, full=True)
    entries = {}
    for name, tensor in tensors.items():
        entries[name] = FrozenTensor(_dtype_name(name, tensor), tuple(tensor.shape), prints[name].full,
                                     prints[name].sample)
    return FrozenRecord(tensors=entries, tied=dict(tied), source=dict(source))


# ------------------------------------------------------------------------------------------------ loading
def check_frozen_base(record: FrozenRecord, targets: Mapping[str, torch.Tensor], *, full: bool, strict: bool,
                      source: str, pieces: bool = False) -> set[str]:
    """Check the live model's tensors against the frozen record (names, dtypes and shapes, then the sampled
    fingerprint, or with ``full`` every byte); return the state-dict names it covers.

    With ``pieces`` (a piece load, a collective: every rank raises the same error) the live tensors may be DTensor
    pieces: each rank hashes the recorded boxes inside the piece it holds, and the boxes no rank holds whole are
    checked on ``full_tensor()``. Without it, a record of pieces is refused.

    Raises:
        BaseMismatchError: a recorded tensor differs (the first ones are named, with what differs).
        CheckpointMismatchError: with ``strict``, recorded tensors the model does not have.
    """
    wanted = {**{n: n for n in record.tensors}, **record.tied}  # model name -> recorded name
    present = {n: r for n, r in sorted(wanted.items()) if n in targets}
    problems: list[str] = []
    regions: dict[tuple[str, int], torch.Tensor] = {}  # (name, box index) -> the live bytes of a recorded box
    settled: list[tuple[str, int]] = []  # boxes of tensors that cannot be compared at all
    for name, recorded in present.items():
        live, entry = targets[name], record.tensors[recorded]
        problem = _live_problem(name, live, entry, pieces=pieces)
        if problem is not None:
            problems.append(problem)
            settled += [(name, index) for index in range(len(entry.boxes()))]
            continue
        held, local = (local_box(live), local_tensor(live)) if pieces else (Box.whole(live.shape), live.detach())
        for index, piece in enumerate(entry.boxes()):
            if intersect_boxes(held, piece.box) == piece.box:
                regions[name, index] = local[piece.box.slices(held)]
    problems += _compare(regions, record, present, full=full)
    if pieces:
        reports = all_gather_json({"problems": problems, "settled": [*settled, *regions]})
        problems = sorted({line for r in reports for line in r["problems"]})
        done = {(name, index) for r in reports for name, index in r["settled"]}
        for name, recorded in present.items():  # the same order on every rank: full_tensor() is a collective
            boxes = record.tensors[recorded].boxes()
            missing = [i for i in range(len(boxes)) if (name, i) not in done]
            if missing:
                live = targets[name]
                whole = live.full_tensor() if is_dtensor(live) else live.detach()
                problems += _compare({(name, i): whole[boxes[i].box.slices(Box.whole(whole.shape))] for i in missing},
                                     record, present, full=full)
                del whole
    raise_base_problems(describe_source(record.source), problems, len(present), sorted(set(wanted) - set(targets)),
                        strict=strict, source=source)
    logger.info("%s: the model's %d frozen tensor(s) match the checkpoint's base record (%s).", source, len(present),
                "every byte" if full else "names, dtypes, shapes and sampled bytes")
    return set(present)


def _compare(regions: Mapping[tuple[str, int], torch.Tensor], record: FrozenRecord, present: Mapping[str, str], *,
             full: bool) -> list[str]:
    """What differs between each live region ``(name, box index)`` and its recorded fingerprint."""
    prints = _fingerprints(regions, full=full)
    problems = []
    for (name, index), got in prints.items():
        entry = record.tensors[present[name]]
        box = entry.boxes()[index]
        got, expected = (got.full, box.xxh3_128) if full else (got.sample, box.sample_xxh3_128)
        if got != expected:
            what = f"the bytes of its box at {list(box.offset)} {list(box.shape)} differ" if entry.pieces else (
                "its bytes differ")
            problems.append(f"{name}: {what} ({'' if full else 'sampled '}xxh3-128 {got}, recorded {expected})")
    return problems


def _live_problem(name: str, live: torch.Tensor, entry: FrozenTensor, *, pieces: bool) -> str | None:
    """Why the live tensor cannot be compared with its record at all (``None``: it can)."""
    if live.device.type == "meta":
        return f"{name}: the model's tensor is on the meta device (nothing to compare)"
    if entry.xxh3_128 is None and not pieces:
        return f"{name}: recorded piece by piece (a checkpoint of per-rank pieces, whose load checks each piece)"
    if DTYPE_TO_STR.get(live.dtype) == entry.dtype and tuple(live.shape) == entry.shape:
        return None
    return (f"{name}: the checkpoint's base has {entry.dtype} {list(entry.shape)}, the model has "
            f"{DTYPE_TO_STR.get(live.dtype, live.dtype)} {list(live.shape)}")


def raise_base_problems(base: str, problems: list[str], checked: int, absent: list[str], *, strict: bool,
                        source: str) -> None:
    """Raise for the ``problems`` of a base check (``base``: where it came from); warn of ``absent`` ones skipped."""
    if problems:
        raise BaseMismatchError(
            f"{source}: the model's frozen parameters are not the base this checkpoint was trained with: "
            f"{len(problems)} of {checked} recorded tensor(s) differ:\n  " + "\n  ".join(problems[:_ERRORS_SHOWN])
            + (f"\n  ... and {len(problems) - _ERRORS_SHOWN} more" if len(problems) > _ERRORS_SHOWN else "")
            + f"\nThe checkpoint stores only the trainable part; its base is {base}. Build the "
            "model from that base (same revision, dtype and quantization, the same PEFT config) before loading, or "
            "resume from a standalone checkpoint (save_checkpoint(..., standalone=True), "
            "ResumableTrainer(standalone_checkpoints=True)).")
    if absent and strict:
        raise CheckpointMismatchError(
            f"{source}: {len(absent)} frozen tensor(s) of the checkpoint's base are not in the model, e.g. "
            f"{absent[:5]}. Build the model from {base} with the checkpoint's PEFT config, or "
            "pass strict=False.")
    if absent:
        logger.warning("Loading %s with strict=False: %d recorded frozen tensor(s) are not in the model %s", source,
                       len(absent), absent[:5])


@dataclass
class TrainablePart:
    """The model part of a checkpoint that references its frozen base: the trainable index (names as in its files;
    ``renamed`` maps them to state-dict names where they differ), the stored aliases in state-dict names, and the
    frozen record."""

    index: ShardIndex
    renamed: dict[str, str]
    tied: dict[str, str]
    record: FrozenRecord

    @classmethod
    def open(cls, reader: Any, path: Any) -> "TrainablePart | None":
        """The trainable part of the checkpoint ``reader`` reads, or ``None`` if it stores its whole model.

        Raises:
            IncompleteCheckpointError: the trainable index without its frozen record.
            CorruptCheckpointError: an inconsistent index, rename map, tied record or frozen record.
        """
        files = reader.manifest.files
        if TRAINABLE_INDEX_FILE not in files:
            return None
        if FROZEN_RECORD_FILE not in files:
            raise IncompleteCheckpointError(f"{path}: has {TRAINABLE_INDEX_FILE} but no {FROZEN_RECORD_FILE}; the "
                                            "checkpoint is incomplete. Resume from another checkpoint.")
        index = reader.index(TRAINABLE_INDEX_FILE)
        source = str(path / TRAINABLE_INDEX_FILE)
        renamed = _check_renamed(index, source=source)
        stored = {renamed.get(n, n) for n in index.weight_map}  # every name verification found in its file
        tied = check_tied(index.metadata.get(TIED_KEY) or {}, stored, source=source)
        record = FrozenRecord.from_json(reader.json(FROZEN_RECORD_FILE), source=str(path / FROZEN_RECORD_FILE))
        both = sorted((set(record.tensors) | set(record.tied)) & (stored | set(tied)))
        if both:
            raise CorruptCheckpointError(f"{path}: tensors both stored and recorded as frozen: {both[:5]}. Resume "
                                         "from another checkpoint.")
        return cls(index=index, renamed=renamed, tied=tied, record=record)


def _check_renamed(index: ShardIndex, *, source: str) -> dict[str, str]:
    renamed = index.metadata.get(RENAMED_KEY) or {}
    if not isinstance(renamed, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in renamed.items()):
        raise CorruptCheckpointError(f"{source}: metadata {RENAMED_KEY} must map names in files to state-dict "
                                     "names. Resume from another checkpoint.")
    unknown = sorted(set(renamed) - set(index.weight_map))
    targets = [renamed.get(n, n) for n in index.weight_map]
    if unknown or len(set(targets)) != len(targets):
        raise CorruptCheckpointError(f"{source}: metadata {RENAMED_KEY} renames tensors the index does not hold, or "
                                     f"two stored tensors to one name ({unknown[:5]}). Resume from another "
                                     "checkpoint.")
    return dict(renamed)


def base_not_stored(directory: Any, *, wanted: str) -> BaseNotStoredError | None:
    """Where a whole model is expected: the error for a checkpoint that holds only its trainable part, else ``None``.

    Args:
        directory (`Path`): the directory that was given.
        wanted (`str`): what the caller needed, e.g. ``"lazy loading needs every weight"``.
    """
    record = Path(directory) / FROZEN_RECORD_FILE
    if not record.is_file():
        return None
    try:
        document = parse_json(read_regular_file(record, limit=MAX_JSON_SIZE), source=str(record))
        base = describe_source(document.get(FROZEN_KEY_SOURCE) or {}) if isinstance(document, dict) else "unknown"
    except (OSError, ValueError):
        base = "unknown (unreadable record)"
    if (Path(directory) / LAYOUT_FILE).is_file():
        how = "Load it with load_checkpoint into a model built from that base (at any world size)"
    else:
        how = (f"Load it with load_checkpoint into a model built from that base, or write a full model directory "
               f"with `hf-resumable export {directory} --output DIR` (add --merge to merge PEFT adapters)")
    return BaseNotStoredError(
        f"{directory} holds only the trainable part of its model (its frozen base, {base}, is recorded in "
        f"{FROZEN_RECORD_FILE}, not stored), and {wanted}. {how}; save with standalone=True to store the base in "
        "every checkpoint.")


# ------------------------------------------------------------------------------------------------ sharded (FSDP2)


def split_frozen_sharded(model: torch.nn.Module, state: Mapping[str, torch.Tensor], tied: Mapping[str, str], *,
                         rank: int) -> tuple[dict[str, torch.Tensor], dict[str, str], bytes | None]:
    """A piece save's model state without its frozen parameters, this rank's aliases of stored tensors, and on
    rank 0 the record's bytes (``None`` elsewhere, or when nothing is frozen).

    Each rank fingerprints the pieces of the frozen tensors it would have written; rank 0 gathers them and every
    rank's aliases (a rank whose piece is empty cannot see a tie). A collective when something is frozen, so it runs
    on the training loop's thread.
    """
    frozen = frozen_names(model, state)
    if not frozen:
        return dict(state), dict(tied), None
    mine: dict[str, tuple[Any, torch.Tensor]] = {}
    for name in sorted(frozen - set(tied)):
        tensor = state[name]
        _dtype_name(name, tensor)
        box = local_box(tensor, name=name)
        if box.numel and writes_piece(name, tensor, rank):
            mine[name] = (box, local_tensor(tensor))
    prints = _fingerprints({name: local for name, (_, local) in mine.items()}, full=True)
    report = {name: FrozenPiece(box.offset, box.shape, prints[name].full, prints[name].sample).to_json()
              for name, (box, _) in mine.items()}
    gathered = all_gather_json({"pieces": report, "tied": dict(tied)})
    stored = {name: tensor for name, tensor in state.items() if name not in frozen}
    kept_tied = {alias: kept for alias, kept in tied.items() if kept not in frozen}
    if rank != 0:
        return stored, kept_tied, None
    tied = {alias: kept for ranks in gathered for alias, kept in ranks["tied"].items()}
    entries = {}
    for name in sorted(frozen - set(tied)):
        pieces = sorted((FrozenPiece(tuple(p["offset"]), tuple(p["shape"]), p["xxh3_128"], p["sample_xxh3_128"])
                         for ranks in gathered for n, p in ranks["pieces"].items() if n == name),
                        key=lambda p: p.offset)
        entries[name] = FrozenTensor.of_pieces(DTYPE_TO_STR[state[name].dtype], tuple(state[name].shape), pieces)
    record = FrozenRecord(tensors=entries, tied={a: k for a, k in tied.items() if k in frozen},
                          source=base_provenance(model))
    logger.info("Frozen base not stored in the sharded checkpoint: %d tensor(s), %.1f MB (%s).", len(entries),
                record.total_bytes / 1e6, describe_source(record.source))
    return stored, kept_tied, json_bytes(record.to_json())
