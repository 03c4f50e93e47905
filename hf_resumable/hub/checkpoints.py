"""Push and pull committed training checkpoints; find the newest one in a repo."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import EntryNotFoundError

from ..checkpoint.commit.manifest import read_manifest
from ..checkpoint.verify import verify_checkpoint
from ..constants import CHECKPOINT_DIR_RE, MANIFEST_FILE
from ..errors import IncompleteCheckpointError
from ..progress import progress_bar
from ._common import HfUrl, HubSnapshot, parse_hf_url
from .download import resumable_download

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- checkpoints
def _verify_against_manifest(directory: str | os.PathLike, *, check_hashes: bool = True) -> None:
    """Verify a checkpoint with :func:`hf_resumable.checkpoint.verify_checkpoint`; bad files are removed so a
    re-pull fetches them again.

    Raises:
        IncompleteCheckpointError: if the manifest or a listed file is missing.
        CorruptCheckpointError: on a size or hash mismatch.
    """
    directory = Path(directory)
    report = verify_checkpoint(directory, full=check_hashes)
    if not report.ok:
        for relpath, _why in report.problems:
            if relpath != MANIFEST_FILE and (directory / relpath).is_file():
                (directory / relpath).unlink()
        report.raise_if_bad()


def _default_pull_dir(url: HfUrl, commit: str) -> Path:
    return Path(constants.HF_HOME) / "hf_resumable" / "checkpoints" / url.repo_id.replace("/", "--") / commit


def pull_checkpoint(
    repo_id_or_hf_url: str,
    *,
    revision: str | None = None,
    local_dir: str | os.PathLike | None = None,
    token: str | None = None,
) -> Path:
    """Download a committed training checkpoint directory, resumably, and verify it against its manifest.

    Args:
        repo_id_or_hf_url (`str`): ``"user/repo"`` or ``"hf://user/repo@revision/sub/dir"``. A path that is
            not itself a checkpoint but holds ``checkpoint-N/`` directories resolves to the newest one
            with a manifest (so ``hf://user/run`` resumes the latest pushed checkpoint).
        revision (`str`, *optional*): overrides the URL's ``@revision``.
        local_dir (`str` or `os.PathLike`, *optional*): destination root (default: under ``HF_HOME``, keyed by
            commit); the checkpoint lands at ``local_dir/<sub/dir>``.
        token (`str`, *optional*): Hub token.

    Returns:
        `Path`: the local checkpoint directory (the one holding ``manifest.json``).

    Raises:
        IncompleteCheckpointError: if the remote directory has no ``manifest.json`` or misses a listed file.
        CorruptCheckpointError: if a file does not match the manifest (it is removed; pulling again re-fetches it).
        HubError: if the connection keeps failing (partial files are kept; pulling again resumes).
        huggingface_hub.errors.RepositoryNotFoundError / RevisionNotFoundError: if the repo or revision is unknown.

    Example:

    ```python
    >>> path = pull_checkpoint("hf://me/run@step-120/checkpoint-120")  # doctest: +SKIP
    >>> (path / "manifest.json").exists()  # doctest: +SKIP
    True
    ```
    """
    url = parse_hf_url(repo_id_or_hf_url)
    snapshot = HubSnapshot.resolve(url.repo_id, revision=revision or url.revision, token=token,
                                   repo_type=url.repo_type)
    root = Path(local_dir) if local_dir is not None else _default_pull_dir(url, snapshot.commit)
    prefix = f"{url.path_in_repo}/" if url.path_in_repo else ""
    remote = _list_remote_files(snapshot, url.path_in_repo)
    latest = _latest_checkpoint_under(remote, prefix) if f"{prefix}{MANIFEST_FILE}" not in remote else None
    if latest is not None:  # a run root: take its newest committed checkpoint-N
        url = HfUrl(url.repo_id, url.revision, f"{prefix}{latest}".strip("/"), url.repo_type)
        prefix = f"{url.path_in_repo}/"
        remote = {name: size for name, size in remote.items() if name.startswith(prefix)}
    if f"{prefix}{MANIFEST_FILE}" not in remote:
        raise IncompleteCheckpointError(
            f"hf://{snapshot.label}/{url.path_in_repo}: no {MANIFEST_FILE}; this is not a committed hf_resumable "
            "checkpoint. Push it with push_checkpoint(...) after the save completes."
        )
    get = functools.partial(resumable_download, url.repo_id, revision=snapshot.commit, local_dir=root, token=token,
                            repo_type=url.repo_type)
    manifest = read_manifest(get(f"{prefix}{MANIFEST_FILE}").parent).files  # validated by the checkpoint's parser
    with progress_bar(total=sum(remote.values()), desc=f"pulling {url.path_in_repo or url.repo_id}") as bar:
        for name, size in remote.items():
            record = manifest.get(name[len(prefix):])
            if name != f"{prefix}{MANIFEST_FILE}":  # a listed file is checked against its record as it lands
                get(name, expected_size=size if record is None else record.size, expected=record)
            bar.update(size)
    checkpoint_dir = root / url.path_in_repo if url.path_in_repo else root
    _verify_against_manifest(checkpoint_dir)
    logger.info("pulled checkpoint %s into %s", snapshot.label, checkpoint_dir)
    return checkpoint_dir


def _latest_checkpoint_under(remote: Mapping[str, int], prefix: str) -> str | None:
    """Name of the highest ``checkpoint-N`` directly under ``prefix`` that has a manifest."""
    steps = []
    for name in remote:
        parts = name[len(prefix):].split("/")
        if len(parts) == 2 and parts[1] == MANIFEST_FILE and CHECKPOINT_DIR_RE.match(parts[0]):
            steps.append((int(CHECKPOINT_DIR_RE.match(parts[0]).group(1)), parts[0]))
    return max(steps)[1] if steps else None


def find_latest_hub_checkpoint(repo_id_or_hf_url: str, *, revision: str | None = None,
                               token: str | None = None) -> str | None:
    """``hf://`` URL (pinned to a commit) of the newest committed ``checkpoint-N`` under a repo path, or None.

    Example:

    ```python
    >>> find_latest_hub_checkpoint("hf://me/run")  # doctest: +SKIP
    'hf://me/run@3f2a.../checkpoint-120'
    ```
    """
    url = parse_hf_url(repo_id_or_hf_url)
    snapshot = HubSnapshot.resolve(url.repo_id, revision=revision or url.revision, token=token,
                                   repo_type=url.repo_type)
    prefix = f"{url.path_in_repo}/" if url.path_in_repo else ""
    latest = _latest_checkpoint_under(_list_remote_files(snapshot, url.path_in_repo), prefix)
    if latest is None:
        return None
    kind = "" if url.repo_type == "model" else f"{url.repo_type}s/"
    return f"hf://{kind}{url.repo_id}@{snapshot.commit}/{prefix}{latest}"


def _list_remote_files(snapshot: HubSnapshot, path_in_repo: str) -> dict[str, int]:
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=snapshot.token)
    try:
        entries = api.list_repo_tree(snapshot.repo_id, path_in_repo=path_in_repo or None, recursive=True,
                                     revision=snapshot.commit, repo_type=snapshot.repo_type)
        return {e.path: e.size for e in entries if isinstance(e, RepoFile)}
    except EntryNotFoundError:
        return {}


@dataclass(frozen=True)
class PushedCheckpoint:
    """A checkpoint directory that is confirmed on the Hub.

    Args:
        local_path (`Path`): the directory that was uploaded.
        repo_id (`str`): the repo.
        revision (`str`): the branch it was committed to.
        commit (`str`): the commit sha that holds it.
        path_in_repo (`str`): where it lives in the repo.
        tag (`str`, *optional*): the tag pointing at ``commit``.
    """

    local_path: Path
    repo_id: str
    revision: str
    commit: str
    path_in_repo: str
    tag: str | None = None

    @property
    def url(self) -> str:
        """``hf://`` URL that :func:`pull_checkpoint` accepts, pinned to the commit."""
        return f"hf://{self.repo_id}@{self.commit}/{self.path_in_repo}".rstrip("/")


def push_checkpoint(
    local_checkpoint_dir: str | os.PathLike,
    repo_id: str,
    *,
    path_in_repo: str | None = None,
    branch: str | None = None,
    tag: str | None = None,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | None = None,
) -> PushedCheckpoint:
    """Upload one committed checkpoint directory as one Hub commit, optionally on a branch and/or tagged.

    Args:
        local_checkpoint_dir (`str` or `os.PathLike`): a directory holding ``manifest.json`` and its files.
        repo_id (`str`): target repo (created if missing).
        path_in_repo (`str`, *optional*): defaults to the directory's name, e.g. ``"checkpoint-120"``.
        branch (`str`, *optional*): commit to this branch (created from ``main`` if missing), e.g. ``"step-120"``.
        tag (`str`, *optional*): tag the new commit, e.g. ``"step-120"``.
        commit_message (`str`, *optional*): defaults to ``"Upload <dir name>"``.
        private (`bool`, *optional*): visibility of a newly created repo.
        token (`str`, *optional*): Hub token.

    Returns:
        [`PushedCheckpoint`]: the commit that holds the checkpoint.

    Raises:
        IncompleteCheckpointError: if the directory has no manifest or misses a file it lists.
        huggingface_hub.errors.HfHubHTTPError: if the Hub refuses the commit.

    Example:

    ```python
    >>> pushed = push_checkpoint("out/checkpoint-120", "me/run", branch="step-120")  # doctest: +SKIP
    >>> pull_checkpoint(pushed.url)  # doctest: +SKIP
    ```
    """
    directory = Path(local_checkpoint_dir)
    _verify_against_manifest(directory, check_hashes=False)
    path_in_repo = directory.name if path_in_repo is None else path_in_repo.strip("/")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if branch is not None:
        api.create_branch(repo_id, branch=branch, exist_ok=True)
    info = api.upload_folder(folder_path=directory, repo_id=repo_id, path_in_repo=path_in_repo or None,
                             revision=branch, commit_message=commit_message or f"Upload {directory.name}")
    if tag is not None:
        api.create_tag(repo_id, tag=tag, revision=info.oid, exist_ok=True)
    logger.info("pushed checkpoint %s to %s@%s (commit %s)", directory, repo_id, branch or "main", info.oid)
    return PushedCheckpoint(directory, repo_id, branch or "main", info.oid, path_in_repo, tag)


