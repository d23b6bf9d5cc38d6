"""What the bad-input tests share: running `eaglekit` (a subprocess or `cli.main` in-process), the one error
line it must print, snapshots of the files it must leave as they were, and a drafter shaped for a target
(a library for tests/test_user_errors*.py: holds no tests)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from eaglekit.cli import main

CHAT = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]


# ---- helpers -------------------------------------------------------------------------------------

def snapshot(root: Path) -> dict[str, str]:
    files = (p for p in sorted(root.rglob("*")) if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_unchanged(before: dict[str, str], root: Path) -> None:
    after = snapshot(root)
    changed = [name for name, digest in before.items() if after.get(name) != digest]
    assert not changed, f"files changed or removed: {changed}"


def cli(*args: str, cwd: Path) -> tuple[int, str]:
    """`python -m eaglekit ARGS` -> (exit code, stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "eaglekit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stderr


def run_main(*args: str, cwd: Path) -> tuple[int, str]:
    """`eaglekit ARGS` through cli.main in this process, from `cwd` -> (exit code, what a terminal would show on
    stderr: the error line and eaglekit's log lines). The code path of `cli` without a new interpreter's imports."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("eaglekit")
    logger.addHandler(handler)
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(stream):
            code = main(list(args))
    finally:
        os.chdir(previous)
        logger.removeHandler(handler)
    return code, stream.getvalue()


def one_error(stderr: str, *fragments: str) -> str:
    """The single 'eaglekit STAGE: error: ...' line, checked for the fragments; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def in_process(capsys, *args: str) -> str:
    """`eaglekit ARGS` through cli.main in this process; asserts exit 1 and returns the error line."""
    assert main(list(args)) == 1
    return one_error(capsys.readouterr().err)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_drafter(directory: Path, target_dir: str, target_name: str) -> Path:
    """An untrained eaglekit drafter shaped for `target_dir`, naming `target_name` as its target."""
    from transformers import AutoConfig

    from eaglekit.drafters.eagle3.build import drafter_config_for
    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.targets.capture import default_aux_layers

    config = AutoConfig.from_pretrained(target_dir)
    drafter = Eagle3Drafter(drafter_config_for(config, config.vocab_size, default_aux_layers(config.num_hidden_layers),
                                               target_name, config.architectures[0]))
    drafter.set_vocab_mapping(torch.arange(config.vocab_size))
    drafter.save_pretrained(directory)
    return directory
