"""Model cards for pushed checkpoints, rendered with ``huggingface_hub.ModelCard`` from a packaged template.

The card carries YAML metadata the Hub parses without warnings (``library_name: transformers``,
``tags: [hf_resumable, ...]``), the training state (step, epoch, effective batch size, resumes), a
table of every shard with its size and checksum, and how to load the weights lazily or resume the run.

Example:

```python
>>> from hf_resumable.hub.cards import render_checkpoint_card
>>> card = render_checkpoint_card("out/checkpoint-120", repo_id="me/run")  # doctest: +SKIP
>>> card.data.library_name  # doctest: +SKIP
'transformers'
>>> card.push_to_hub("me/run")  # doctest: +SKIP
```
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..checkpoint.summary import CheckpointSummary, format_size, summarize_checkpoint

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

logger = logging.getLogger(__name__)

__all__ = ["TEMPLATE_NAME", "DEFAULT_TAGS", "render_model_card", "render_checkpoint_card"]

# Packaged template (setup.cfg ships templates/*.md as package data).
TEMPLATE_NAME = "modelcard_template.md"
# Tags every card carries; the first one lets users find hf_resumable checkpoints on the Hub.
DEFAULT_TAGS = ("hf_resumable", "safetensors", "checkpoint")


def _template_text() -> str:
    return resources.files("hf_resumable").joinpath("templates", TEMPLATE_NAME).read_text(encoding="utf-8")


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _shard_rows(summary: CheckpointSummary) -> list[dict[str, Any]]:
    return [
        {"file": s.file, "kind": s.kind, "size": format_size(s.size), "num_tensors": s.num_tensors,
         "dtypes": ", ".join(f"{d} x{n}" for d, n in sorted(s.dtypes.items())) or "-", "checksum": s.checksum}
        for s in summary.shards
    ]


def _template_values(summary: CheckpointSummary, *, repo_id: str, revision: str | None,
                     path_in_repo: str) -> dict[str, Any]:
    batch = summary.effective_batch_size
    if batch is not None:
        batch = (f"{batch} ({summary.per_device_batch_size} per device x {summary.gradient_accumulation_steps} "
                 f"accumulation x {summary.world_size} ranks)")
    revision_part = f"@{revision}" if revision else ""
    hf_url = f"hf://{repo_id}{revision_part}" + (f"/{path_in_repo}" if path_in_repo else "")
    return {
        "repo_id": repo_id,
        "hf_url": hf_url,
        "revision_kwarg": f', revision="{revision}"' if revision else "",
        "step": _dash(summary.step),
        "epoch": _dash(None if summary.epoch is None else f"{summary.epoch:g}"),
        "samples_seen": _dash(summary.samples_seen),
        "effective_batch_size": _dash(batch),
        "resumes": _dash(summary.resumes),
        "parameter_count": _dash(None if summary.parameter_count is None else f"{summary.parameter_count:,}"),
        "optimizer_class": _dash(summary.optimizer_class),
        "verification": ("passed" if summary.verified else "FAILED") + f" ({summary.verification}, at render time)",
        "metrics": sorted(summary.metrics.items()),
        "shards": _shard_rows(summary),
        "total_size": format_size(summary.total_size),
    }


def render_model_card(
    summary: CheckpointSummary,
    *,
    repo_id: str,
    revision: str | None = None,
    path_in_repo: str = "",
    model_name: str | None = None,
    description: str | None = None,
    license: str | None = None,
    base_model: str | None = None,
    datasets: str | Iterable[str] | None = None,
    tags: Iterable[str] = (),
    pipeline_tag: str | None = "text-generation",
    template_path: str | os.PathLike | None = None,
) -> ModelCard:
    """Render a model card for a summarized checkpoint.

    Args:
        summary ([`CheckpointSummary`]): from :func:`hf_resumable.checkpoint.summary.summarize_checkpoint`.
        repo_id (`str`): the repo the card is for (used in the code snippets).
        revision (`str`, *optional*): branch, tag or commit the snippets should pin.
        path_in_repo (`str`, *optional*, defaults to `""`): sub-directory of the checkpoint in the repo.
        model_name (`str`, *optional*): title (defaults to the repo name).
        description (`str`, *optional*): a paragraph under the title.
        license (`str`, *optional*): SPDX-style license id for the metadata.
        base_model (`str`, *optional*): repo id of the model that was fine-tuned.
        datasets (`str` or `Iterable[str]`, *optional*): training data set ids.
        tags (`Iterable[str]`, *optional*): extra tags (``hf_resumable`` is always included).
        pipeline_tag (`str`, *optional*, defaults to `"text-generation"`): Hub pipeline tag (``None`` to omit).
        template_path (`str` or `os.PathLike`, *optional*): a Jinja template to use instead of the packaged one.

    Returns:
        `huggingface_hub.ModelCard`: ``str(card)`` is the README text; ``card.data`` the metadata.

    Example:

    ```python
    >>> card = render_model_card(summarize_checkpoint("out/checkpoint-120"), repo_id="me/run")  # doctest: +SKIP
    >>> "hf_resumable" in card.data.tags  # doctest: +SKIP
    True
    ```
    """
    from huggingface_hub import ModelCard, ModelCardData

    all_tags = list(dict.fromkeys([*DEFAULT_TAGS, *tags]))
    if isinstance(datasets, str):
        datasets = [datasets]
    card_data = ModelCardData(library_name="transformers", tags=all_tags, license=license, base_model=base_model,
                              datasets=list(datasets) if datasets is not None else None, pipeline_tag=pipeline_tag)
    values = _template_values(summary, repo_id=repo_id, revision=revision, path_in_repo=path_in_repo)
    values["model_name"] = model_name or repo_id.split("/")[-1]
    values["description"] = description or f"Training checkpoint at step {values['step']} of `{repo_id}`."
    if template_path is not None:
        return ModelCard.from_template(card_data, template_path=os.fspath(template_path), **values)
    return ModelCard.from_template(card_data, template_str=_template_text(), **values)


def render_checkpoint_card(
    directory: str | os.PathLike,
    *,
    repo_id: str,
    revision: str | None = None,
    path_in_repo: str = "",
    **card_options: Any,
) -> ModelCard:
    """Summarize the checkpoint at ``directory`` and render its model card.

    Args:
        directory (`str` or `os.PathLike`): a local checkpoint directory.
        repo_id (`str`): the repo the card is for.
        revision (`str`, *optional*): branch, tag or commit the snippets should pin.
        path_in_repo (`str`, *optional*, defaults to `""`): sub-directory of the checkpoint in the repo.
        card_options: any keyword option of :func:`render_model_card` (``license``, ``tags``, ...).

    Returns:
        `huggingface_hub.ModelCard`

    Raises:
        CheckpointNotFoundError: if ``directory`` is not a directory.
        TypeError: for an unknown option.

    Example:

    ```python
    >>> card = render_checkpoint_card("out/checkpoint-120", repo_id="me/run", license="apache-2.0")  # doctest: +SKIP
    >>> card.save("out/checkpoint-120-README.md")  # doctest: +SKIP
    ```
    """
    summary = summarize_checkpoint(directory)
    if not summary.verified:
        logger.warning("Rendering a card for %s, which does not verify: %s", directory,
                       "; ".join(f"{f}: {why}" for f, why in summary.problems)[:300])
    return render_model_card(summary, repo_id=repo_id, revision=revision, path_in_repo=path_in_repo, **card_options)


def card_metadata(card_text: str) -> Mapping[str, Any]:
    """Parse the YAML metadata of a rendered card the way the Hub does (for checks and tests)."""
    from huggingface_hub import ModelCard

    return ModelCard(card_text).data.to_dict()
