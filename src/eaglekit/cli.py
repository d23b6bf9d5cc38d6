"""`eaglekit <stage> [--config FILE] [key=value | --key value ...]`: a thin layer over `eaglekit.stages`.

Only argument parsing lives here; every stage's work is in its module. Heavy libraries are imported
by the stage itself, so `eaglekit --help` answers at once.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path
from typing import Collection

from eaglekit.version import __version__
from eaglekit.errors import EaglekitError
from eaglekit.stages import STAGES, load_stage

USAGE = ("usage: eaglekit <stage> [--config FILE] [key=value ...] [--key value ...] [--verbose | --log-level LEVEL]"
         "   (eaglekit <stage> --help)")


def _summary(module_name: str) -> str:
    """A stage's one-line summary, read from its source without importing it."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return "(not installed)"
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _print_main_help() -> None:
    print(f"eaglekit {__version__}: an EAGLE-3 drafter for any LLM, and proof that it speeds the model up.\n")
    print(USAGE + "\n\nstages:")
    for name, module in STAGES.items():
        print(f"  {name:<10} {_summary(module)}")


def _print_stage_help(name: str) -> None:
    from eaglekit.config import describe

    stage = load_stage(name)
    print(f"usage: eaglekit {name} [--config FILE] [key=value ...] [--verbose | --log-level LEVEL]\n")
    print((stage.__doc__ or "").strip() + "\n\noptions (key, type, default: meaning):")
    for key, type_name, default, help_text in describe(stage.Config):
        print(f"  {key} ({type_name}, default {default!r}): {help_text}")


KEY_VALUE = re.compile(r"^[A-Za-z_][\w.-]*=")  # `key=value`, `train.lr=1e-4`
BOOLEAN_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def split_args(
    args: list[str], positional: tuple[str, ...] = (), flags: Collection[str] = ()
) -> tuple[str | None, list[str]]:
    """`--config F`, `key=value`, `--key value`, `--key=value`, `--flag`, bare positionals -> (config, overrides).

    `--key value` takes the next argument as the value whatever it holds (`--prompt "x = 1"`); a boolean key
    (in `flags`) stands alone as true unless a true/false word follows it; an argument is `key=value` only when
    what comes before its `=` is a key (`generate "x = 1"` is a positional prompt)."""
    config_path, overrides, bare = None, [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(args):
                raise EaglekitError("--config needs a file path")
            config_path, i = args[i + 1], i + 2
            continue
        if arg.startswith("--") and "=" in arg:
            overrides.append(arg[2:])
        elif arg.startswith("--"):
            key, following = arg[2:], args[i + 1] if i + 1 < len(args) else None
            if key.replace("-", "_") in flags:
                taken = following is not None and following.lower() in BOOLEAN_WORDS
                overrides.append(f"{key}={following if taken else 'true'}")
                i += taken
            elif following is None or following.startswith("--"):
                raise EaglekitError(f"{arg} needs a value: {arg} VALUE, or {key}=VALUE")
            else:
                overrides.append(f"{key}={following}")
                i += 1
        elif KEY_VALUE.match(arg):
            overrides.append(arg)
        else:  # text with no `key=` in front ("x = 1" too): a positional argument
            bare.append(arg)
        i += 1
    if len(bare) > len(positional):
        names = ", ".join(positional) or "none"
        raise EaglekitError(
            f"unexpected argument '{bare[len(positional)]}' (positional arguments: {names}); use key=value"
        )
    overrides = [f"{key}={value}" for key, value in zip(positional, bare)] + overrides
    return config_path, overrides


LOG_LEVELS = ("debug", "info", "warning", "error")


def logging_options(args: list[str]) -> tuple[list[str], str | None]:
    """Take `--verbose`/`-v` (= `--log-level info`) and `--log-level LEVEL` out of a stage's arguments."""
    rest, level = [], None
    arguments = iter(args)
    for arg in arguments:
        if arg in ("--verbose", "-v"):
            level = "info"
        elif arg == "--log-level" or arg.startswith("--log-level="):
            level = (arg.partition("=")[2] or next(arguments, "")).lower()
            if level not in LOG_LEVELS:
                raise EaglekitError(f"--log-level {level or '(missing)'}: choose one of {', '.join(LOG_LEVELS)}")
        else:
            rest.append(arg)
    return rest, level


def setup_logging(level: str | None) -> None:
    """eaglekit's own lines at INFO; other libraries' (HTTP clients' request lines, ...) only from WARNING, unless
    `--log-level`/`--verbose` asks for them: then every library logs at that level. Progress bars are not logs."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if level is not None:
        logging.getLogger().setLevel(level.upper())
    logging.getLogger("eaglekit").setLevel((level or "info").upper())


def _show(print_help, *args) -> int:
    """Print help; a reader that leaves early (`eaglekit run --help | head`) is not an error."""
    try:
        print_help(*args)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit cannot fail again
    return 0


def os_error_message(error: OSError) -> str:
    """One line for a filesystem error: what failed on which path, and the fix."""
    import errno

    where = f" ({error.filename})" if error.filename else ""
    if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return f"disk full{where}: free space there or pass output= a directory on another disk, then run it again"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied{where}: pass a path you can write to"
    if error.errno == errno.ENOTDIR:
        return f"a file stands where a directory is needed{where}: choose another output path"
    return f"{error.strerror or error}{where}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        return _show(_print_main_help)
    if argv[0] in ("-V", "--version"):
        print(f"eaglekit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in STAGES:
        import difflib

        close = difflib.get_close_matches(name, list(STAGES), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"eaglekit: unknown stage '{name}'{hint}\n{USAGE}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):
        return _show(_print_stage_help, name)
    try:
        rest, level = logging_options(rest)
    except EaglekitError as error:
        print(f"eaglekit {name}: error: {error}", file=sys.stderr)
        return 1
    setup_logging(level)
    try:
        from eaglekit.config import flag_keys, load_config

        stage = load_stage(name)
        config_path, overrides = split_args(rest, getattr(stage, "POSITIONAL", ()), flag_keys(stage.Config))
        config = load_config(stage.Config, config_path, overrides)
        result = stage.run(config)
        code = stage.exit_code(result) if hasattr(stage, "exit_code") else 0  # a verdict as the status (doctor)
    except EaglekitError as error:
        print(f"eaglekit {name}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a filesystem problem no stage turned into an EaglekitError: still one line
        print(f"eaglekit {name}: error: {os_error_message(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"eaglekit {name}: interrupted; finished work is kept, re-run the same command to continue", file=sys.stderr
        )
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
