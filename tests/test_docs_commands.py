"""Every `eaglekit ...` command the README, docs/*.md, the stages' help and eaglekit's messages suggest must run as
written: its stage exists, every option parses with the stage's Config, and each local path it reads exists or is
written by an earlier command of the same page. The cheap ones (inspect and doctor, on the tiny target where the
page leaves the target to the reader, and --help) run for real.

What a page may leave to the reader, and the test does not check as a path: ALL-CAPS words (MODEL, PATH, DIR),
`<...>`, `...`, `path/to/...`, `$VARIABLES`, and bare file names (`prompts.jsonl`: the reader's own data), except
names that look like shipped files (`tiny...`), which must name one. Hub ids are taken for `target`-like options.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from eaglekit.cli import main, split_args
from eaglekit.config import describe, flag_keys, load_config
from eaglekit.errors import EaglekitError
from eaglekit.stages import STAGES, load_stage

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCE = ROOT / "src" / "eaglekit"
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…|(^|/)path/to\b|\$|^[A-Z][A-Z0-9_/]*$|^\{|^[A-Z]+=")
INLINE = re.compile(r"`((?:torchrun [^`]*?-m )?eaglekit [a-z][^`]*)`")
OUTPUT_KEYS = ("output", "out", "fix_output", "coverage")
HUB_KEYS = ("target", "init_from", "drafter", "tokenizer", "source", "assistant")
SHIPPED_LOOKING = re.compile(r"^tiny")
CHEAP_STAGES = ("inspect", "doctor")


@dataclass
class Command:
    where: str  # page:line
    argv: list[str]  # after `eaglekit`
    whole: bool = False  # a command line of a code block (not a mention in prose)


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line, command text, whole) for `eaglekit` lines of fenced blocks (continuations joined: whole commands) and
    inline code spans (mentions in prose)."""
    found, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            stripped = line.strip().removeprefix("$ ")
            if pending or stripped.startswith("eaglekit ") or " -m eaglekit " in stripped:
                start = start if pending else number
                pending += " " + stripped
                if stripped.endswith("\\"):
                    pending = pending[:-1]
                    continue
                found.append((start, pending.strip(), True))
                pending = ""
            continue
        found += [(number, span, False) for span in INLINE.findall(line)]
    return found


def to_commands(where: str, text: str, whole: bool = False) -> list[Command]:
    """The eaglekit argv of each command in `text` (shell comments dropped, `&&`/`;`/`|` chains split)."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose
        return []
    commands, current = [], None
    for word in words + [";"]:
        if word in ("&&", ";", "|", "||"):
            if current is not None:
                commands.append(Command(where, current, whole))
            current = None
        elif current is not None:
            current.append(word)
        elif word == "eaglekit":
            current = []
    return [c for c in commands if c.argv]


def page_commands(page: Path) -> list[Command]:
    text = page.read_text()
    return [c for line, command, whole in command_lines(text)
            for c in to_commands(f"{page.relative_to(ROOT)}:{line}", command, whole)]


def message_commands() -> list[Command]:
    """Backticked `eaglekit ...` in eaglekit's string literals (f-string fields read as <value>), and the example
    lines of every stage's docstring (`eaglekit <stage> --help` prints them)."""
    commands = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<value>" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            commands += [c for span in INLINE.findall(text) for c in to_commands(where, span)]
    for name in STAGES:
        doc = load_stage(name).__doc__ or ""
        commands += [c for line in doc.splitlines() if line.strip().startswith("eaglekit ")
                     for c in to_commands(f"eaglekit {name} --help", line.strip())]
    return commands


def placeholder(value: str) -> bool:
    return bool(PLACEHOLDER.search(value))


def parsed(command: Command):
    """(stage, config, overrides) with placeholder values left out (their keys are checked by name)."""
    name = command.argv[0]
    rest = [w.strip("[]") for w in command.argv[1:] if w.strip("[]") and w.strip("[]") not in ("...", "…")]
    assert name in STAGES, f"{command.where}: no stage '{name}' in `eaglekit {' '.join(command.argv)}`"
    stage = load_stage(name)
    if any(a in ("-h", "--help") for a in rest):
        return stage, None, []
    flags = flag_keys(stage.Config)
    if rest and rest[-1].startswith("--") and rest[-1][2:] not in flags:  # prose naming an option: `--target`
        rest = [*rest, "<value>"]
    try:
        config_path, overrides = split_args(rest, getattr(stage, "POSITIONAL", ()), flags)
    except EaglekitError as error:
        raise AssertionError(f"{command.where}: `eaglekit {' '.join(command.argv)}`: {error}") from None
    keys = {key for key, *_ in describe(stage.Config)}
    overrides = [o for o in overrides if not placeholder(o.split("=", 1)[0])]  # `KEY=VALUE`
    for override in overrides:
        key = override.split("=", 1)[0].replace("-", "_")
        assert key in keys, f"{command.where}: `{key}` is no option of eaglekit {name}"
    concrete = [o for o in overrides if not placeholder(o.split("=", 1)[1])]
    if config_path is not None and (placeholder(config_path) or "/" not in config_path):
        config_path = None  # the reader's own recipe
    elif config_path is not None:
        config_path = str(ROOT / config_path)
    try:
        config = load_config(stage.Config, config_path, concrete)
    except EaglekitError as error:
        raise AssertionError(f"{command.where}: `eaglekit {' '.join(command.argv)}`: {error}") from None
    return stage, config, overrides


def path_problem(key: str, value: str, produced: list[Path]) -> str | None:
    """Why `value` of option `key` is no path the command can read (None: fine)."""
    if placeholder(value) or "://" in value or "/" not in value and not value.endswith((".jsonl", ".json", ".yaml")):
        return None
    if "/" not in value:  # a bare name: the reader's own file, unless it claims to be a shipped one
        if SHIPPED_LOOKING.match(value):
            from eaglekit.data.readers import SHIPPED_DATA

            return None if value in SHIPPED_DATA else f"{value} names no shipped file ({', '.join(SHIPPED_DATA)} do)"
        return None
    path = Path(value)
    if (ROOT / path).exists() or any(p == path or p in path.parents or path in p.parents for p in produced):
        return None
    local_roots = {p.parts[0] for p in produced if p.parts}  # `runs/` once a command wrote under it
    if (key in HUB_KEYS and not (ROOT / path.parts[0]).exists() and path.parts[0] not in local_roots
            and not value.startswith((".", "/", "~"))):
        return None  # a hub id
    return f"{value} does not exist and no earlier command of the page writes it"


def check_paths(command: Command, config, overrides: list[str], produced: list[Path],
                elsewhere: list[Path] = ()) -> list[str]:
    """Problems with the paths `command` reads; what it writes is added to `produced`."""
    problems = []
    for override in overrides:
        key, value = override.split("=", 1)
        if key.split(".")[-1] in OUTPUT_KEYS:
            continue
        for part in value.split(","):
            problem = path_problem(key.split(".")[-1], part.strip("[]'\" "), [*produced, *elsewhere])
            if problem:
                problems.append(f"{command.where}: {key}={problem}")
    for key in OUTPUT_KEYS:
        value = getattr(config, key, None) if config is not None else None
        if value and not placeholder(str(value)):
            produced.append(Path(value))
    return problems


PAGE_COMMANDS = {str(page.relative_to(ROOT)): page_commands(page) for page in PAGES}


def outputs_of(commands: list[Command]) -> list[Path]:
    """What the commands write (their output options), for pages that start from another stage's output."""
    produced: list[Path] = []
    for command in commands:
        try:
            _, config, overrides = parsed(command)
        except AssertionError:
            continue
        check_paths(command, config, [], produced)
    return produced


def test_pages_have_commands_to_check():
    assert sum(len(c) for c in PAGE_COMMANDS.values()) >= 40
    assert any(c.whole for c in PAGE_COMMANDS["README.md"])  # the quick start's commands are read


def test_the_checks_catch_a_wrong_command():
    with pytest.raises(AssertionError, match="no option of eaglekit bench"):
        parsed(Command("page:1", ["bench", "tiny-eval", "--bogus", "1"]))
    with pytest.raises(AssertionError, match="no stage 'benchmark'"):
        parsed(Command("page:1", ["benchmark", "tiny-eval"]))
    assert "names no shipped file" in path_problem("prompts", "tiny_prompts_eval.jsonl", [])
    assert "does not exist" in path_problem("drafter", "runs/nowhere/train", [Path("runs/other")])
    assert path_problem("drafter", "runs/nowhere/train", [Path("runs/nowhere")]) is None  # written earlier
    assert path_problem("target", "meta-llama/Llama-3.1-8B-Instruct", []) is None  # a hub id


@pytest.mark.parametrize("page", list(PAGE_COMMANDS))
def test_every_command_of_a_page_parses_and_reads_what_exists(page):
    """A path read must exist, be written by an earlier command of the page, or by a command of another page (a
    stage's page starts from what the previous stage's page wrote: train.md's shards=runs/hidden is extract.md's)."""
    others = outputs_of([c for name, commands in PAGE_COMMANDS.items() if name != page for c in commands])
    problems, produced = [], []
    for command in PAGE_COMMANDS[page]:
        try:
            _, config, overrides = parsed(command)
        except AssertionError as error:
            problems.append(str(error))
            continue
        problems += check_paths(command, config, overrides, produced, others)
    assert not problems, "\n".join(problems)


def test_every_command_a_message_or_a_stages_help_suggests_parses():
    commands = message_commands()
    assert len(commands) >= 10
    problems = []
    for command in commands:
        try:
            _, config, overrides = parsed(command)
        except AssertionError as error:
            problems.append(str(error))
            continue
        for override in overrides:  # no page to produce paths: only shipped-looking names are checked
            key, value = override.split("=", 1)
            if "/" not in value and path_problem(key, value, []):
                problems.append(f"{command.where}: {key}={path_problem(key, value, [])}")
    assert not problems, "\n".join(problems)


def on_tiny(argv: list[str]) -> list[str]:
    """The command on the built-in tiny target and its shipped prompts: a placeholder target becomes `tiny`, a bare
    data file name (the reader's own) the shipped prompt file."""
    from eaglekit.data.readers import SHIPPED_DATA

    result = []
    for index, word in enumerate(argv):
        key, _, value = word.rpartition("=") if "=" in word else ("", "", word)
        after_target = index > 0 and argv[index - 1] == "--target"
        if (key == "target" or after_target) and placeholder(value):
            value = "tiny"
        elif "/" not in value and value.endswith((".jsonl", ".json")) and not SHIPPED_LOOKING.match(value):
            value = str(SHIPPED_DATA["tiny"])
        result.append(f"{key}={value}" if key else value)
    return result


def cheap(command: Command) -> bool:
    """Runs in seconds: a whole inspect/doctor command on local or built-in things only (on the tiny target where
    the page leaves the target to the reader), or --help."""
    if not command.whole:
        return False
    if "--help" in command.argv:
        return True
    argv = on_tiny(command.argv)
    if argv[0] not in CHEAP_STAGES or "--fix" in argv or "fix=true" in argv:
        return False
    for word in argv[1:]:
        value = word.split("=", 1)[-1]
        if placeholder(value) or re.search(r"\.[A-Za-z]\w*$", value) and not (ROOT / value).exists():
            return False  # the reader's own file (my_template.jinja), a wheel to download
        if "/" in value and not (ROOT / value).exists():  # a hub id or something an earlier command writes
            return False
    return True


CHEAP = [c for commands in PAGE_COMMANDS.values() for c in commands if cheap(c)]


@pytest.mark.parametrize("command", CHEAP, ids=[c.where for c in CHEAP])
def test_cheap_commands_run_as_written(command, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = on_tiny(command.argv)
    engine = next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--engine"), None)
    if engine:
        from eaglekit.doctor.source import open_source

        try:
            open_source(engine)
        except EaglekitError as error:
            pytest.skip(f"{command.where} reads {engine}'s source: {error}")
    code = main(argv)
    assert code == 0, f"{command.where}: `eaglekit {' '.join(argv)}` exited {code}: {capsys.readouterr().err}"
