"""Commit, from one process, a checkpoint that several ranks will resume (a converted per-rank checkpoint).

A conversion builds every rank's files in one :class:`Payload`; the manifest records ``world_size`` ranks, which a
resume at that world size checks. The commit protocol is the writer's (:mod:`hf_resumable.checkpoint.commit`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..checkpoint.commit import Payload, begin_save, commit_dir, discard, write_bytes_durably, write_payload
from ..checkpoint.commit.manifest import Manifest
from ..constants import MANIFEST_FILE
from ..distributed import is_distributed

logger = logging.getLogger(__name__)

__all__ = ["commit_for_ranks"]


def commit_for_ranks(target: Path, payload: Payload, *, step: int | None, world_size: int,
                     overwrite: bool) -> Manifest:
    """Write ``payload`` (the files of every rank) at ``target`` and commit it as written by ``world_size`` ranks;
    return the committed manifest. ``overwrite`` replaces an existing checkpoint of ours atomically.

    Raises:
        RuntimeError: called under torch.distributed (a conversion runs in one process).
        CheckpointExistsError: ``target`` exists and ``overwrite`` is False (or it is not ours).
    """
    if is_distributed():
        raise RuntimeError("Converting a checkpoint runs in one process; call it outside torch.distributed (or on "
                           "one rank, before init_process_group).")
    start = begin_save(target, overwrite=overwrite)
    try:
        records = write_payload(start.tmp, payload)
        manifest = Manifest(files=records, step=step, world_size=world_size, metrics={})
        write_bytes_durably(start.tmp / MANIFEST_FILE, manifest.to_json())
        commit_dir(start.tmp, target, replaces=start.replaces)
    except BaseException:
        discard(start.tmp)
        raise
    logger.info("Saved %s (%d files, for %d rank(s))", target, len(records), world_size)
    return manifest
