"""The CLI: fast help, version, argument forms, one-line errors."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from eaglekit import __version__
from eaglekit.cli import main, split_args
from eaglekit.errors import EaglekitError
from eaglekit.stages import STAGES, available


def test_help_is_fast_and_imports_no_torch():
    code = "import sys, time; t=time.time(); from eaglekit.cli import main; main(['--help']); print('TORCH', 'torch' in sys.modules, time.time()-t)"
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "TORCH False" in out, out
    assert time.time() - start < 5  # interpreter start included; the help itself is milliseconds
    for name in STAGES:
        assert f"  {name}" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_argument_forms():
    path, overrides = split_args(["FILE", "--config", "c.yaml", "--target", "tiny", "--flag", "a.b=3", "--x=1"], ("data",))
    assert path == "c.yaml"
    assert overrides == ["data=FILE", "target=tiny", "flag=true", "a.b=3", "x=1"]
    with pytest.raises(EaglekitError, match="unexpected argument"):
        split_args(["a", "b"], ("data",))


def test_unknown_stage_suggests(capsys):
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(available()))
def test_every_stage_help_lists_options(name, capsys):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "options" in out and "default" in out
