"""No Python file of the project over 500 lines: a file that grows past it is split into modules that each own one
thing (a newcomer reads a module whole)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "tests", "benchmarks", "scripts")
MAX_LINES = 500


def test_every_python_file_is_at_most_500_lines():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}
    assert len(sizes) > 100, "the project's Python files were not found"
    too_long = {path: lines for path, lines in sizes.items() if lines > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines (split them into modules): {too_long}"
