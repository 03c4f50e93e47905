"""Read the pieces of a checkpoint into whatever sharding the loading rank has (any world size): the box each
tensor's template holds, assembled from the slices of the stored pieces it overlaps (``plan_region_reads``), every
byte checked against the manifest (``VerifiedFile``); files wanted whole are streamed as a regular load reads them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CorruptCheckpointError, FormatVersionError
from ...format.safetensors_io import STR_TO_DTYPE
from ...format.sharding import ShardIndex, check_relative_name
from .._types import Box
from ..commit._parallel_read import read_files
from ..state._model import match_keys
from ._dtensor import local_box
from ._piece_layout import (
    LAYOUT_FILE,
    LAYOUT_KEY_VERSION,
    LAYOUT_KEY_WORLD_SIZE,
    LAYOUT_VERSION,
    LAYOUT_VERSION_MASTERS,
    SECTION_PIECES,
    SECTION_TENSORS,
    SECTION_TIED,
    TENSOR_MASTER,
    TENSOR_VIEW,
    layout_document,
    plan_region_reads,
    whole_tensor_section,
)

logger = logging.getLogger(__name__)

__all__ = ["Section", "parse_layout", "layout_from_regular", "check_pieces_stored", "PieceReader", "check_fits",
           "fill_state"]


@dataclass(frozen=True)
class Section:
    """A validated layout section: global tensor descriptions, stored pieces by tensor, tied aliases, and the shape of
    each tensor stored flattened (ZeRO-3's partitioned weights, ``"view"`` in its description)."""

    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]
    pieces: dict[str, dict[str, Box]]  # tensor name -> {file: box}
    tied: dict[str, str]
    views: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor name -> its shape (stored flattened)
    masters: dict[str, str] = field(default_factory=dict)  # weight -> the parameter whose master weights give it

    @classmethod
    def from_json(cls, document: Mapping[str, Any], *, source: str) -> "Section":
        try:
            described = document[SECTION_TENSORS]
            dtypes = {n: STR_TO_DTYPE[d["dtype"]] for n, d in described.items()}
            shapes = {n: tuple(int(x) for x in d["shape"]) for n, d in described.items()}
            tied = {str(k): str(v) for k, v in (document.get(SECTION_TIED) or {}).items()}
            views = {n: tuple(int(x) for x in d[TENSOR_VIEW]) for n, d in described.items() if TENSOR_VIEW in d}
            masters = {n: str(d[TENSOR_MASTER]) for n, d in described.items() if TENSOR_MASTER in d}
            pieces: dict[str, dict[str, Box]] = {n: {} for n in described}
            for file, entries in document[SECTION_PIECES].items():
                check_relative_name(file, source=source)
                for name, entry in entries.items():
                    pieces[name][file] = Box.from_json(entry, source=source)
        except (KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(
                f"{source}: malformed layout section ({type(err).__name__}: {err}).") from None
        for name, view in views.items():
            if math.prod(view) != math.prod(shapes[name]) or len(shapes[name]) != 1:
                raise CorruptCheckpointError(f"{source}: {name!r} is stored with shape {list(shapes[name])}, which "
                                             f"is not the flattened view {list(view)}.")
        return cls(dtypes, shapes, pieces, tied, views, masters)


def parse_layout(document: Any, *, source: str) -> dict[str, Any]:
    """Check the layout document's version and basic structure; returns it.

    Raises:
        FormatVersionError: if it was written by a newer hf_resumable.
        CorruptCheckpointError: if it is not a layout document.
    """
    if not isinstance(document, dict) or not isinstance(document.get(LAYOUT_KEY_VERSION), int):
        raise CorruptCheckpointError(f"{source}: not an hf_resumable piece layout ({LAYOUT_FILE}).")
    newest = max(LAYOUT_VERSION, LAYOUT_VERSION_MASTERS)
    if document[LAYOUT_KEY_VERSION] > newest:
        raise FormatVersionError(f"{source}: layout version {document[LAYOUT_KEY_VERSION]}; this hf_resumable reads "
                                 f"up to {newest}. Upgrade hf_resumable to load it.")
    if not isinstance(document.get(LAYOUT_KEY_WORLD_SIZE), int):
        raise CorruptCheckpointError(f"{source}: layout lacks its world size.")
    return document


def _whole_tensor_section(index: ShardIndex, headers: Mapping[str, Any], tied: Mapping[str, str]) -> dict[str, Any]:
    """A layout section for an HF-style index (its files checked against the manifest by ``_Reader.index``): every
    tensor is one piece, the whole tensor, in its shard."""
    files = index.group_by_file()
    described = {}
    for file, names in files.items():
        for name in names:
            info = headers[file].tensors[name]
            described[name] = {"dtype": info.dtype, "shape": list(info.shape)}
    return whole_tensor_section(files, described, tied)


def layout_from_regular(model: ShardIndex | None, optimizer: ShardIndex | None, headers: Mapping[str, Any], *,
                        world_size: int, tied: Mapping[str, str], optimizer_document: Mapping[str, Any] | None
                        ) -> dict[str, Any]:
    """The layout of a regular checkpoint (its model and optimizer indexes; ``tied``: the checked alias record), so
    it loads into any sharding as a checkpoint of pieces: its tensors and optimizer document already use the piece
    layout's names; only the pieces (whole tensors) are implied by the indexes."""
    return layout_document(
        world_size=world_size,
        model=_whole_tensor_section(model, headers, tied) if model is not None else None,
        optimizer=_whole_tensor_section(optimizer, headers, {}) if optimizer is not None else None,
        optimizer_document=optimizer_document if optimizer is not None else None)


def check_pieces_stored(section: Section, headers: Mapping[str, Any], *, source: str) -> None:
    """Check every piece the layout names against the verified safetensors headers (file, name, shape, dtype).

    Raises:
        CorruptCheckpointError: listing every piece that is not stored as the layout says.
    """
    problems = []
    for name, pieces in section.pieces.items():
        for file, box in pieces.items():
            header = headers.get(file)
            info = header.tensors.get(name) if header is not None else None
            if header is None:
                problems.append(f"{file}: named by the layout but not listed in the manifest")
            elif info is None or info.shape != box.shape or info.torch_dtype != section.dtypes[name]:
                problems.append(f"{file}: {name!r} is not stored as a {section.dtypes[name]} piece of shape "
                                f"{list(box.shape)}")
    if problems:
        raise CorruptCheckpointError(f"{source}: the layout does not match the stored pieces:\n  "
                                     + "\n  ".join(problems[:20]) + "\nLoad an earlier checkpoint.")


def read_section(reader: Any, layout: Mapping[str, Any], key: str) -> Section:
    """The layout section ``key`` (``reader``: the opened checkpoint's, whose verification checked every piece a
    layout file names against the headers: :func:`check_pieces_stored`; a regular checkpoint's are its headers')."""
    return Section.from_json(layout[key], source=str(reader.path / LAYOUT_FILE))


class PieceReader:
    """Reads boxes of a layout section's tensors through the opened checkpoint's reader, every byte a slice uses
    checked; keeps each file open once (a context manager). ``masters`` (a ``MasterWeights``, closed with this
    reader) gives the elements of a weight described with ``"master"`` that no piece stores.
    """

    def __init__(self, reader: Any, section: Section, *, source: str, masters: Any = None) -> None:
        self.reader = reader
        self.section = section
        self.source = source
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._masters = masters
        if masters is not None:
            self._stack.callback(masters.close)

    def __enter__(self) -> "PieceReader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(self.reader.verified_file(file))
        return self._handles[file]

    def read_whole_files(self, wanted: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Read whole, streamed as a regular checkpoint's files are (each file's hash checked in byte order), the
        files whose every tensor is in ``wanted`` (name -> a tensor of its shape to read into, or ``None``: new) as
        one whole piece. Returns what was read, by name; the rest is left to :meth:`read_box`."""
        whole = {name for name in wanted if name not in self.section.masters
                 and _is_whole(self.section, name)}
        reads = []
        for file in sorted({next(iter(self.section.pieces[name])) for name in whole}):
            header = self.reader.report.headers.get(file)
            if header is None or not set(header.tensors) <= whole:
                continue
            into = {name: wanted[name] for name in header.tensors if wanted[name] is not None}
            reads.append((list(header.tensors), self.reader.file_read(file, into)))
        if not reads:
            return {}
        new = read_files([read for _, read in reads])
        return {name: new[name] if name in new else wanted[name] for names, _ in reads for name in names}

    def read_box(self, name: str, wanted: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``wanted`` box of stored tensor ``name`` as a new CPU tensor (or into ``out``, a contiguous CPU tensor
        of its shape and stored dtype)."""
        out = torch.empty(wanted.shape, dtype=self.section.dtypes[name]) if out is None else out
        master = self.section.masters.get(name)
        reads = plan_region_reads(wanted, self.section.pieces[name], name=name, source=self.source,
                                  partial=master is not None)
        if master is not None and sum(math.prod(s.stop - s.start for s in r.target) for r in reads) < wanted.numel:
            if self._masters is None:
                raise CorruptCheckpointError(f"{self.source}: {name!r} is given by the master weights of {master!r}, "
                                             "which this reader was not given; this is a bug in hf_resumable.")
            # then the pieces any rank stored, over them
            out.copy_(self._masters.read(master, wanted, self.section.shapes[name], out.dtype))
        for read in reads:  # straight into out's memory where the region is contiguous in both
            self._handle(read.file).read_slice_into(name, read.source, out[read.target] if out.dim() else out)
        return out

    def read_full(self, name: str) -> torch.Tensor:
        """The whole stored tensor ``name``."""
        shape = self.section.shapes[name]
        return self.read_box(name, Box.whole(shape))

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every stored tensor of the section, whole (files that hold only whole tensors streamed whole); a tensor
        stored flattened (ZeRO-3's partitions) gets its own shape back."""
        section = self.section
        whole = self.read_whole_files(dict.fromkeys(section.dtypes))
        return {name: whole[name] if name in whole else self.read_full(name).view(section.views.get(
            name, section.shapes[name])) for name in section.dtypes}


def _wrap_like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of the same kind as ``template`` (a DTensor with its mesh and placements)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def check_fits(current: Mapping[str, torch.Tensor], section: Section, *, strict: bool, source: str,
               what: str) -> list[str]:
    """Names of ``current`` to fill (in its order), matched by ``match_keys``; every missing, unexpected or
    mismatched key is reported at once (a tensor on the meta device cannot receive bytes).

    Raises:
        CheckpointMismatchError: listing all offending keys.
    """
    stored = {name: (section.dtypes[name], _shape_for(current.get(name), section, name)) for name in section.dtypes}
    meta = {name: "the model's tensor is on the meta device (use hf_resumable.load_lazily)"
            for name, t in current.items() if t.device.type == "meta"}
    match = match_keys({name: (t.dtype, tuple(t.shape)) for name, t in current.items()}, stored, tied=section.tied,
                       unusable=meta)
    match.check(strict=strict, source=source, what=what)
    filled = match.filled
    return [name for name in current if name in filled]


def _shape_for(template: torch.Tensor | None, section: Section, name: str) -> tuple[int, ...]:
    """The stored shape ``template`` is matched against: a flattened tensor's own shape (its ``"view"``) when the
    template is a whole tensor of that shape (a model that is not partitioned), else the stored global shape."""
    view = section.views.get(name)
    if view is not None and template is not None and not hasattr(template, "to_local") and \
            tuple(template.shape) == view:
        return view
    return section.shapes[name]


def fill_state(current: Mapping[str, torch.Tensor], reader: PieceReader, names: list[str], *,
               in_place: bool = False) -> dict[str, torch.Tensor]:
    """New tensors shaped and sharded like ``current[name]`` for each of ``names``, read from the pieces (a tensor
    stored flattened, into a template of its own shape: read whole and viewed); with ``in_place``, a template that
    is a whole contiguous CPU tensor of the stored dtype is read into itself. Whole files are read whole."""
    filled: dict[str, torch.Tensor] = {}
    section = reader.section
    wanted: dict[str, torch.Tensor | None] = {}
    for name in names:
        template, stored = current[name], section.tied.get(name, name)
        box = local_box(template)
        if tuple(box.shape) == section.shapes[stored] and not any(box.offset):
            itself = in_place and _fills_itself(template, section.dtypes[stored])
            wanted.setdefault(stored, template if itself else None)
    whole = reader.read_whole_files(wanted)
    written: set[int] = set()  # tied names share their memory: read once
    for name in names:
        template = current[name]
        stored = section.tied.get(name, name)
        if stored in whole:
            filled[name] = whole[stored] if whole[stored] is template else _wrap_like(template, whole[stored])
            continue
        shape = _shape_for(template, reader.section, stored)
        if shape != reader.section.shapes[stored]:
            filled[name] = reader.read_full(stored).view(shape)
            continue
        if in_place and _fills_itself(template, reader.section.dtypes[stored]):
            if template.data_ptr() not in written or not template.numel():
                reader.read_box(stored, local_box(template), out=template)
                written.add(template.data_ptr())
            filled[name] = template
            continue
        local = reader.read_box(stored, local_box(template))
        filled[name] = _wrap_like(template, local)
    return filled


def _is_whole(section: Section, name: str) -> bool:
    """Whether stored tensor ``name`` is one piece: the whole tensor, in one file."""
    pieces = section.pieces.get(name) or {}
    if len(pieces) != 1:
        return False
    box = next(iter(pieces.values()))
    return not any(box.offset) and tuple(box.shape) == section.shapes[name]


def _fills_itself(template: torch.Tensor, dtype: torch.dtype) -> bool:
    return (not hasattr(template, "to_local") and template.device.type == "cpu" and template.dtype == dtype
            and template.is_contiguous())
