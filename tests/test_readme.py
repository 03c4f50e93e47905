"""Every ```python block of README.md runs as written.

Each block runs in a fresh process (forked by tests/helpers/zygote.py) in an empty directory, with huggingface_hub
pointed at the local fake Hub (tests/helpers/fakehub.py) through ``HF_ENDPOINT``, so the Hub quickstart pushes and
pulls without the network. ```bash blocks are not run. A failure names the block by its line in README.md and its first
line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env
from helpers.hub_fixtures import _hub_server, hub_environ  # noqa: F401 - fixture

README = REPO_ROOT / "README.md"
_FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced block tagged ``python``; ``line`` is the 1-based line of its first code line.

    Raises:
        ValueError: if a fence is left open.
    """
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if language is None:
            if fence:
                language, start, lines = fence.group(1), number + 1, []
        elif fence and not fence.group(1):
            if language == "python":
                blocks.append((start, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(line)
    if language is not None:
        raise ValueError(f"README.md: the ```{language} block opened at line {start - 1} is never closed")
    return blocks


def first_line(code: str) -> str:
    """The block's first non-empty line, which names it in failure messages."""
    return next((line.strip() for line in code.splitlines() if line.strip()), "")


def failing_readme_line(stderr: str, script: Path, start: int) -> int | None:
    """README.md line of the innermost traceback frame in the block's script, if there is one."""
    lines = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', stderr)
    return start + int(lines[-1]) - 1 if lines else None


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_python_blocks_are_found():
    assert python_blocks("text\n```python\nx = 1\n```\n```bash\nls\n```\n") == [(3, "x = 1\n")]
    assert len(BLOCKS) >= 3, "README.md should hold the three quickstarts as ```python blocks"
    script = Path("readme_line10.py")
    assert failing_readme_line(f'File "{script}", line 1\nFile "{script}", line 4\nError', script, 10) == 13


@pytest.fixture(scope="module")
def readme_env(_hub_server, tmp_path_factory) -> dict[str, str]:
    """One environment for every block (so one zygote serves them all): the fake Hub and a private HF_HOME. A fixed
    hash seed, or the zygotes would alternate between two seeds and every block would pay a zygote's imports."""
    return child_env({**hub_environ(_hub_server.endpoint, tmp_path_factory.mktemp("hf_home")),
                      "PYTHONHASHSEED": "0"})


@pytest.mark.slow
@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, readme_env, tmp_path):
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code, encoding="utf-8")
    done = zygote.run([sys.executable, str(script)], env=readme_env, cwd=tmp_path, capture_output=True, text=True,
                      timeout=300)
    where = failing_readme_line(done.stderr, script, line)
    assert done.returncode == 0, (
        f"README.md: the ```python block at line {line} (first line: `{first_line(code)}`) failed with exit code "
        f"{done.returncode}{f', at README.md line {where}' if where else ''}:\n{done.stderr[-4000:]}")
