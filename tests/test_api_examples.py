"""The Python examples the package docstring and the README show run as written (on the built-in tiny target)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import eaglekit
from eaglekit.targets.loading import tiny_target_path

README = Path(__file__).resolve().parents[1] / "README.md"


def docstring_example() -> str:
    """The indented `import eaglekit` block of eaglekit's module docstring, dedented."""
    block = re.search(r"\n\n(    import eaglekit\n(?:    .*\n)+)", eaglekit.__doc__)
    assert block, "eaglekit's docstring lost its run_stage example"
    return textwrap.dedent(block.group(1))


def readme_example() -> str:
    """The README's first ```python block."""
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md lost its Python example"
    return block.group(1)


def test_readme_shows_the_docstring_example():
    assert docstring_example() in readme_example()


def test_run_stage_example_runs_as_written(tmp_path, monkeypatch):
    """The README's block (which holds the docstring's) extracts, trains and saves a drafter that loads back."""
    rows = (tiny_target_path().parent / "tiny_prompts.jsonl").read_text().splitlines()[:8]
    (tmp_path / "chats.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), str(README), "exec"), {})
    extract = json.loads((tmp_path / "runs/x/extract/manifest.json").read_text())
    drafter_dir = tmp_path / "runs/x/drafter"
    assert json.loads((drafter_dir / "manifest.json").read_text())["stage"] == "train"
    assert extract["stage"] == "extract"
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    drafter = Eagle3Drafter.from_pretrained(drafter_dir)
    assert drafter.config.target_hidden_size > 0 and len(drafter.config.aux_layer_ids) == 3
