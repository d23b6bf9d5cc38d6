"""The CLI: fast help, version, argument forms, one-line errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from eaglekit import __version__
from eaglekit.cli import main, split_args
from eaglekit.errors import EaglekitError
from eaglekit.stages import STAGES, available


def test_help_imports_only_the_standard_library():
    """`eaglekit --help` imports eaglekit and the standard library only (no torch, transformers, numpy, yaml ...):
    what keeps it fast on any machine, asserted without a clock."""
    code = textwrap.dedent("""
        import sys
        before = set(sys.modules)
        from eaglekit.cli import main
        main(['--help'])
        loaded = {name.split('.')[0] for name in set(sys.modules) - before}
        print('OTHERS', sorted(loaded - set(sys.stdlib_module_names) - {'eaglekit'}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "OTHERS []" in out, out.splitlines()[-1]
    for name in STAGES:
        assert f"  {name}" in out


def test_help_into_a_closed_pipe_is_quiet():
    """`eaglekit run --help | head -1`: the reader leaves early; no traceback, exit status 0."""
    code = "import sys; from eaglekit.cli import main; sys.exit(main(['run', '--help']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and first.startswith(b"usage"), (first, err)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_stage_modules_import_no_torch_and_run_help_lists_options():
    """Every stage module (and `eaglekit run --help`, which reads every stage's Config) stays light:
    torch and transformers are imported only when a stage runs."""
    code = textwrap.dedent("""
        import importlib, sys
        from eaglekit.cli import main
        from eaglekit.stages import STAGES

        offenders = {}  # heavy library -> the first stage module (or command) that imported it
        def note(name):
            for heavy in ("torch", "transformers"):
                if heavy in sys.modules:
                    offenders.setdefault(heavy, name)

        for name, module in STAGES.items():
            importlib.import_module(module)
            note(name)
        main(["run", "--help"])
        note("run --help")
        print("OFFENDERS", offenders)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "OFFENDERS {}" in out, out[out.find("OFFENDERS"):]
    for option in ("  target (str", "  export_formats (tuple, default ('vllm', 'sglang', 'speculators'))",
                   "  regen.data (tuple", "  extract.dtype (str", "  vocab.size (int, default 32000)", "  train.lr (float"):
        assert option in out, option


def test_stage_literals_match_the_library():
    """Stage configs spell out a few library constants so that `--help` needs no torch; they must agree."""
    from dataclasses import fields

    from eaglekit.layers import INPUT_OF_LAYER, OUTPUT_OF_LAYER
    from eaglekit.training.vocab import DEFAULT_SIZE
    from eaglekit.stages import extract, vocab
    from eaglekit.targets.store import STORAGE_DTYPES

    choices = {f.name: f.metadata["choices"] for f in fields(extract.Config)}
    assert choices["dtype"] == tuple(STORAGE_DTYPES)
    assert choices["aux_layer_convention"] == (INPUT_OF_LAYER, OUTPUT_OF_LAYER)
    assert extract.Config().aux_layer_convention == INPUT_OF_LAYER
    assert vocab.Config().size == DEFAULT_SIZE


def test_version(capsys):
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_argument_forms():
    args = ["FILE", "--config", "c.yaml", "--target", "tiny", "--flag", "a.b=3", "--x=1", "--on", "false"]
    path, overrides = split_args(args, ("data",), flags={"flag", "on"})
    assert path == "c.yaml"
    assert overrides == ["data=FILE", "target=tiny", "flag=true", "a.b=3", "x=1", "on=false"]
    with pytest.raises(EaglekitError, match="unexpected argument"):
        split_args(["a", "b"], ("data",))
    with pytest.raises(EaglekitError, match="--prompt needs a value: --prompt VALUE, or prompt=VALUE"):
        split_args(["--prompt", "--max_new_tokens", "3"])


@pytest.mark.parametrize("text", ["x = 1", "a=b", "#1", "[1, 2]", "key: value", "null", "true", "3", "  padded "])
def test_any_text_after_a_text_option_is_its_value(text):
    """`generate --prompt "x = 1"` is the prompt "x = 1", not an option x; YAML never reads a text option."""
    from eaglekit.config import flag_keys, load_config
    from eaglekit.stages import generate

    positional = [[text]] if "=" not in text or " =" in text else []  # `a=b` alone is the option a
    for args in (["--prompt", text], [f"prompt={text}"], [f"--prompt={text}"], *positional):
        path, overrides = split_args([*args, "--chat", "--max_new_tokens", "3"], generate.POSITIONAL,
                                     flag_keys(generate.Config))
        config = load_config(generate.Config, path, overrides)
        assert (config.prompt, config.chat, config.max_new_tokens) == (text, True, 3), args


def test_a_flag_before_a_positional_stays_a_flag():
    from eaglekit.config import flag_keys
    from eaglekit.stages import doctor

    _, overrides = split_args(["--fix", "org/model"], doctor.POSITIONAL, flag_keys(doctor.Config))
    assert overrides == [f"{doctor.POSITIONAL[0]}=org/model", "fix=true"]


def test_unknown_stage_suggests(capsys):
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(available()))
def test_every_stage_help_lists_options(name, capsys):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "options" in out and "default" in out


@pytest.mark.parametrize("level, shown", [(None, ["mine", "their warning"]),
                                          ("info", ["HTTP Request: GET /", "mine", "their warning"]),
                                          ("warning", ["their warning"])])
def test_other_libraries_info_lines_are_off_unless_asked(level, shown):
    """httpx's "HTTP Request:" lines and the like are INFO of another library: hidden by default (a fresh process:
    logging is configured once)."""
    import subprocess
    import sys

    code = ("import logging; from eaglekit.cli import setup_logging; setup_logging(%r); "
            "logging.getLogger('httpx').info('HTTP Request: GET /'); logging.getLogger('eaglekit.run').info('mine'); "
            "logging.getLogger('urllib3').warning('their warning')" % level)
    stderr = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert [line.split(": ", 1)[1] for line in stderr.splitlines()] == shown


def test_verbose_and_log_level_are_taken_before_the_stage_options():
    from eaglekit.cli import logging_options

    assert logging_options(["data.jsonl", "--verbose", "lr=1"]) == (["data.jsonl", "lr=1"], "info")
    assert logging_options(["--log-level", "DEBUG", "x=1"]) == (["x=1"], "debug")
    assert logging_options(["--log-level=warning"]) == ([], "warning")
    with pytest.raises(EaglekitError, match="--log-level loud: choose one of debug, info, warning, error"):
        logging_options(["--log-level", "loud"])
