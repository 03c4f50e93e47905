"""The Colab notebook runs top to bottom against the local Hub server, with tiny sizes."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id  # noqa: F401 - fixtures

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "resume_finetune_colab.ipynb"


@pytest.mark.slow
def test_colab_notebook_executes_against_the_local_hub(hub, hub_env, tmp_path, monkeypatch):
    repo_id = new_repo_id("colab")
    monkeypatch.setenv("NOTEBOOK_REPO_ID", repo_id)
    monkeypatch.setenv("NOTEBOOK_MAX_STEPS", "16")
    monkeypatch.setenv("NOTEBOOK_LOST_AT", "7")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "\n".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                        for o in cell.get("outputs", []))
    assert "runtime disconnected at step 7" in outputs
    assert "match bit for bit" in outputs
    pushed = set(hub.head(repo_id).files)
    assert any(p.endswith("checkpoint-4/manifest.json") for p in pushed), sorted(pushed)[:20]
