"""Push a sharded model in one commit; download only the shards that hold the tensors asked for."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import CommitInfo, HfApi

from ..constants import (
    FORMAT_VERSION,
    INDEX_VERSION_KEY,
    MODEL_FILE_PATTERN,
    MODEL_INDEX_FILE,
    README_FILE,
    SINGLE_MODEL_FILE,
)
from ..errors import CheckpointMismatchError, CheckpointNotFoundError
from ..format._jsonio import json_bytes
from ..format.sharding import ShardIndex
from ._common import WEIGHT_PATTERNS, HubSnapshot

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- push a model
def write_sharded_model(state_dict: Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
                        max_shard_size: int | str) -> dict:
    """Write ``state_dict`` as ``model-0000k-of-0000N.safetensors`` plus the index into ``directory``.

    Shared tensors are stored once (first name in ``state_dict`` order) and recorded in the index metadata as
    ``{dropped_name: kept_name}``, like ``huggingface_hub.save_torch_state_dict``. The metadata also records each
    shard's size and xxh3-128 under ``"hf_resumable_shards"``.

    Returns:
        `dict`: the index document that was written.

    Example:

    ```python
    >>> index = write_sharded_model(model.state_dict(), "out", max_shard_size="100MB")  # doctest: +SKIP
    >>> sorted(index["metadata"]["hf_resumable_shards"])  # doctest: +SKIP
    ['model-00001-of-00001.safetensors']
    ```
    """
    from ..checkpoint.commit import Payload, index_document
    from ..checkpoint.pieces import add_sharded
    from ..checkpoint.state import dedupe_tied
    from ..format.safetensors_io import write_safetensors

    directory = Path(directory)
    tensors, aliases = dedupe_tied(state_dict)
    payload = Payload()
    add_sharded(payload, tensors, pattern=MODEL_FILE_PATTERN, index=MODEL_INDEX_FILE, max_shard_size=max_shard_size,
                metadata={**aliases, INDEX_VERSION_KEY: FORMAT_VERSION})
    records = {file.relpath: write_safetensors(directory / file.relpath, file.tensors, metadata=file.metadata,
                                               fsync=False) for file in payload.tensor_files}
    (spec,) = payload.indexes
    index = index_document(spec, records)
    (directory / MODEL_INDEX_FILE).write_bytes(json_bytes(index))
    return index


def _stage_model(model_or_state_dict: Any, directory: Path, *, max_shard_size: int | str,
                 processing_class: Any | None) -> None:
    """Save weights (+ config, generation config, processing class when available) into ``directory``."""
    state_dict = model_or_state_dict
    if hasattr(model_or_state_dict, "state_dict"):
        model = model_or_state_dict
        state_dict = model.state_dict()
        for attribute in ("config", "generation_config"):
            saved_beside = getattr(model, attribute, None)
            if saved_beside is not None and hasattr(saved_beside, "save_pretrained"):
                saved_beside.save_pretrained(directory)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"push_sharded needs a torch.nn.Module, a state dict or a directory, got {type(state_dict)}.")
    write_sharded_model(state_dict, directory, max_shard_size=max_shard_size)
    if processing_class is not None:
        processing_class.save_pretrained(directory)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _check_model_dir(directory: Path) -> None:
    if not (directory / MODEL_INDEX_FILE).is_file() and not (directory / SINGLE_MODEL_FILE).is_file():
        from ..checkpoint.pieces import base_not_stored

        wanted = ("push_sharded uploads a whole model (push the checkpoint itself with push_checkpoint, or "
                  "`hf-resumable push DIR REPO --path-in-repo NAME`)")
        if (error := base_not_stored(directory, wanted=wanted)) is not None:
            raise error
        raise CheckpointNotFoundError(
            f"{directory}: no {MODEL_INDEX_FILE} or {SINGLE_MODEL_FILE}; save the model there first "
            "(model.save_pretrained(dir)) or pass the model itself to push_sharded."
        )


def push_sharded(
    model_or_state_dict_or_dir: Any,
    repo_id: str,
    *,
    max_shard_size: int | str = "2GB",
    revision: str | None = None,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    create_pr: bool = False,
    processing_class: Any | None = None,
    card: str | None = None,
) -> CommitInfo:
    """Save a model as sharded safetensors locally, then push it to the Hub in one commit.

    Tied or shared tensors are stored once (first name in ``state_dict()`` order wins) and the dropped names are
    recorded in the index metadata, so ``transformers`` re-ties them on load. Stale shards of an earlier push are
    deleted in the same commit. Re-pushing unchanged weights uploads no LFS bytes.

    Args:
        model_or_state_dict_or_dir (`torch.nn.Module`, `Mapping[str, torch.Tensor]` or path):
            a model (its ``config`` and ``generation_config`` are saved too), a state dict, or a directory that
            already holds ``model.safetensors[.index.json]`` (uploaded as is).
        repo_id (`str`): target repo, created if missing.
        max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): shard size limit (decimal units).
        revision (`str`, *optional*): target branch (created from ``main`` if missing).
        commit_message (`str`, *optional*): defaults to ``"Upload model with hf_resumable"``.
        private (`bool`, *optional*): visibility of a newly created repo.
        token (`str`, *optional*): Hub token.
        create_pr (`bool`, *optional*, defaults to `False`): open a pull request instead of committing.
        processing_class (*optional*): tokenizer or processor; saved with ``save_pretrained`` next to the weights.
        card (`str`, *optional*): model card text, written as ``README.md``.

    Returns:
        `huggingface_hub.CommitInfo`: ``.oid`` is the commit sha.

    Raises:
        CheckpointNotFoundError: if a directory holds no safetensors weights.
        BaseNotStoredError: if a directory is a checkpoint that holds only its trainable part (export a full model
            with ``hf-resumable export`` first, or push it with :func:`push_checkpoint`).
        CheckpointMismatchError: if a tensor is on the meta device.

    Example:

    ```python
    >>> info = push_sharded(model, "me/tiny-gpt2", max_shard_size="10MB")  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained("me/tiny-gpt2", revision=info.oid)  # doctest: +SKIP
    ```
    """
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="hf_resumable-push-") as tmp:
        # 1. Stage the files locally (or use the given directory as is).
        folder = Path(tmp)
        if isinstance(model_or_state_dict_or_dir, (str, os.PathLike)):
            _check_model_dir(Path(model_or_state_dict_or_dir))
            if card is None:
                folder = Path(model_or_state_dict_or_dir)
            else:  # never write into the caller's directory: link its files into the staging dir
                shutil.copytree(model_or_state_dict_or_dir, folder, dirs_exist_ok=True, copy_function=_link_or_copy)
        else:
            _stage_model(model_or_state_dict_or_dir, folder, max_shard_size=max_shard_size,
                         processing_class=processing_class)
        if card is not None:
            (folder / README_FILE).unlink(missing_ok=True)
            (folder / README_FILE).write_text(card, encoding="utf-8")
        # 2. Make sure the repo and branch exist, then 3. push everything in one commit.
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None and not create_pr:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, create_pr=create_pr,
                                 commit_message=commit_message or "Upload model with hf_resumable",
                                 delete_patterns=WEIGHT_PATTERNS)
    logger.info("pushed %s to %s (commit %s)", type(model_or_state_dict_or_dir).__name__, repo_id, info.oid)
    return info


# --------------------------------------------------------------------------------------------------- download shards
def _select_names(index: ShardIndex, tensors: Iterable[str] | None,
                  prefixes: Iterable[str] | None) -> list[str] | None:
    if tensors is None and prefixes is None:
        return None
    names = list(tensors or [])
    unknown = [n for n in names if n not in index.weight_map]
    if unknown:
        raise CheckpointMismatchError(
            f"{index.source}: no tensors named {unknown[:10]} (of {len(unknown)} unknown); list the available names"
            " with LazyStateDict.from_pretrained(repo_id).keys()."
        )
    prefixes = tuple(prefixes or ())
    names += [n for n in index.weight_map if prefixes and n.startswith(prefixes) and n not in names]
    return names


def download_shards(
    repo_id: str,
    *,
    tensors: Iterable[str] | None = None,
    prefixes: Iterable[str] | None = None,
    revision: str | None = None,
    token: str | None = None,
    local_dir: str | os.PathLike | None = None,
) -> Path:
    """Download the index, then only the shards that hold the requested tensors (default: all of them).

    Each shard is verified against the size and xxh3-128 (sha256 in older indexes) recorded by :func:`push_sharded`.

    Args:
        repo_id (`str`): the model repo.
        tensors (`Iterable[str]`, *optional*): exact tensor names.
        prefixes (`Iterable[str]`, *optional*): name prefixes, e.g. ``["model.layers.3."]``.
        revision (`str`, *optional*): branch, tag or commit (resolved to a commit once).
        token (`str`, *optional*): Hub token.
        local_dir (`str` or `os.PathLike`, *optional*): download there instead of the Hub cache.

    Returns:
        `Path`: the local folder holding the index and the downloaded shards.

    Raises:
        CheckpointNotFoundError: if the repo has neither an index nor ``model.safetensors``.
        UnsafeIndexError: if the index names a path outside the repo (``../``) or a non-safetensors file.
        IncompleteCheckpointError: if the index names a shard the repo does not have.
        CorruptCheckpointError: if a shard's hash does not match the index (the bad file is removed).
        CheckpointMismatchError: if a requested tensor name is not in the index.
        huggingface_hub.errors.RepositoryNotFoundError / RevisionNotFoundError: if the repo or revision is unknown.

    Example:

    ```python
    >>> folder = download_shards("me/tiny-llama", prefixes=["model.layers.0."])  # doctest: +SKIP
    >>> sorted(p.name for p in folder.glob("*.safetensors"))  # doctest: +SKIP
    ['model-00002-of-00005.safetensors']
    ```
    """
    snapshot = HubSnapshot.resolve(repo_id, revision=revision, token=token, local_dir=local_dir)
    index, folder = snapshot.fetch_index()
    if index is None:
        return folder
    for filename in index.group_by_file(_select_names(index, tensors, prefixes)):
        snapshot.fetch_shard(index, filename)
    logger.info("downloaded shards of %s into %s", snapshot.label, folder)
    return folder


