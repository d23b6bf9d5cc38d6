"""Every `eaglekit ...` command the README, docs/*.md, the stages' help and eaglekit's messages suggest must run as
written: its stage exists, every option parses with the stage's Config, and each local path it reads exists or is
written by an earlier command of the same page. The cheap ones (inspect and doctor, on the tiny target where the
page leaves the target to the reader, and --help) run for real.

The fixes an error names must work too: an option a stage's message tells the reader to set (`pass overwrite=true`,
`or set skip_errors=true`) is an option of that stage (`eaglekit run`'s dotted section keys included), and the fix
of a malformed data line, met by every stage that reads data, is an option of the command that met it and, added
to that command, makes it run.

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


def literals(path: Path) -> list[tuple[str, str]]:
    """(file:line, text) of every string literal of a source file (f-string fields read as <value>)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "<value>" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        found.append((f"{path.relative_to(ROOT)}:{node.lineno}", text))
    return found


def message_commands() -> list[Command]:
    """Backticked `eaglekit ...` in eaglekit's string literals (f-string fields read as <value>), and the example
    lines of every stage's docstring (`eaglekit <stage> --help` prints them)."""
    commands = []
    for path in sorted(SOURCE.rglob("*.py")):
        for where, text in literals(path):
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
    data file name (the reader's own) the shipped prompt file; a file the command writes (`OUTPUT_KEYS`, or after
    `--<output key>`) is left alone, so that no command overwrites a shipped file."""
    from eaglekit.data.readers import SHIPPED_DATA

    result = []
    for index, word in enumerate(argv):
        key, _, value = word.rpartition("=") if "=" in word else ("", "", word)
        after_target = index > 0 and argv[index - 1] == "--target"
        written = key.split(".")[-1] in OUTPUT_KEYS or index > 0 and argv[index - 1].lstrip("-") in OUTPUT_KEYS
        if (key == "target" or after_target) and placeholder(value):
            value = "tiny"
        elif not written and "/" not in value and value.endswith((".jsonl", ".json")) and not SHIPPED_LOOKING.match(value):
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


# ---- the fixes eaglekit's errors name ---------------------------------------------------------------

# `pass overwrite=true`, `or set skip_errors=true`, `use backend=eager`, `pass --overwrite`: (dashes, key, =value)
ADVICE = re.compile(r"\b(?:(?:pass|set|use|add|or)\s+)+(--)?([a-z_][a-z0-9_.]*)(?:(=)([^\s;,)]*))?")
COMMAND_LINE_FLAGS = ("config",)  # `--config recipe.yaml`: the command line's, no option


def advised(message: str) -> list[tuple[str, str]]:
    """(key, value) of each option the message tells the reader to set (value '' where it leaves it to them)."""
    return [(key, value.rstrip(".:") or ("true" if dashes else "")) for dashes, key, equals, value
            in ADVICE.findall(message) if (dashes or equals) and key not in COMMAND_LINE_FLAGS]


def stage_keys(name: str) -> set[str]:
    return {key for key, *_ in describe(load_stage(name).Config)}


def test_advice_is_read_from_messages():
    assert advised("x:7: not valid JSON; fix or remove this record, or set skip_errors=true to skip bad records") == [
        ("skip_errors", "true")]
    assert advised("choose a new output directory, or pass overwrite=true to write into it anyway") == [
        ("overwrite", "true")]
    assert advised("pass --overwrite or choose a new output directory; use backend=eager)") == [
        ("overwrite", "true"), ("backend", "eager")]
    assert advised("pass output= a directory path") == [("output", "")]
    assert advised("the drafter is 5 layers; set it within its range") == []


def test_the_options_a_stages_messages_advise_are_its_own():
    """A message of stage module S that says `pass KEY=...` names an option of `eaglekit S` (`run`: a dotted
    section key, `train.lr=...`, is the run's too)."""
    problems = []
    for name in STAGES:
        keys = stage_keys(name)
        for where, text in literals(Path(load_stage(name).__file__)):
            problems += [f"{where}: `{key}` is no option of eaglekit {name}: {text[:80]!r}"
                         for key, _ in advised(text) if key not in keys]
    assert not problems, "\n".join(problems)


MALFORMED = '{"messages": [broken\n'
RUN_BUDGET = ["stages=regen,extract,vocab,train,bench", "device=cpu", "regen.max_new_tokens=4",
              "extract.max_length=64", "extract.dtype=fp32", "extract.shard_mb=1", "vocab.size=64", "train.max_steps=1",
              "train.batch_size=2", "train.ttt_steps=1", "train.max_length=64", "train.val_fraction=0",
              "bench.methods=plain", "bench.temperatures=0", "bench.num_prompts=1", "bench.max_new_tokens=2",
              "bench.repeats=1", "bench.warmup=0"]
READERS = {  # every stage that reads conversation files, on the built-in tiny target, with tiny budgets
    "inspect": ["inspect", "{data}", "target=tiny", "limit=2", "show_text=false"],
    "regen": ["regen", "{data}", "target=tiny", "output={out}", "max_new_tokens=2", "device=cpu"],
    "extract": ["extract", "{data}", "target=tiny", "output={out}", "max_length=64", "dtype=fp32", "shard_mb=1",
                "device=cpu"],
    "vocab": ["vocab", "{data}", "target=tiny", "output={out}", "size=64"],
    "train": ["train", "target=tiny", "data={data}", "output={out}", "max_steps=1", "batch_size=2", "ttt_steps=1",
              "draft_vocab_size=64", "max_length=64", "val_fraction=0", "device=cpu"],
    "bench": ["bench", "{data}", "target=tiny", "output={out}", "methods=plain", "temperatures=0", "num_prompts=1",
              "max_new_tokens=2", "repeats=1", "warmup=0", "device=cpu"],
    "run": ["run", "--target", "tiny", "--data", "{data}", "--out", "{out}", *RUN_BUDGET],
    "run regen.skip_errors": ["run", "--target", "tiny", "--data", "{data}", "--out", "{out}", *RUN_BUDGET,
                              "regen.skip_errors=true"],  # regen skips the line; bench, reading it too, would not
}


@pytest.mark.parametrize("reader", list(READERS))
def test_the_fix_a_malformed_data_line_names_works(reader, tmp_path, monkeypatch, capsys):
    """A malformed line met by any stage that reads data: one error, whose fix is an option of that command, and the
    command with that fix added runs (the line skipped)."""
    from eaglekit.data.readers import SHIPPED_DATA

    lines = SHIPPED_DATA["tiny"].read_text().splitlines(keepends=True)[:12]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(lines[:6]) + MALFORMED + "".join(lines[6:]))
    monkeypatch.chdir(tmp_path)
    argv = [word.format(data=data, out=tmp_path / "out") for word in READERS[reader]]
    keys, errors = stage_keys(argv[0]), []
    for _ in range(3):
        if main(argv) == 0:
            break
        lines = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
        assert len(lines) == 1 and "prompts.jsonl:7" in lines[0], lines
        errors.append(lines[0])
        fixes = advised(lines[0])
        assert fixes, f"`eaglekit {' '.join(argv)}` names no fix: {lines[0]}"
        for key, value in fixes:
            assert key in keys, f"{lines[0]}\n`{key}` is no option of eaglekit {argv[0]}"
            assert value and not placeholder(value), f"{lines[0]}\n`{key}=` leaves the value to the reader"
        argv += [f"{key}={value}" for key, value in fixes]
    else:
        pytest.fail(f"the fixes named did not make `eaglekit {' '.join(argv)}` run: {errors}")
    assert errors, f"`eaglekit {' '.join(argv)}` did not stop at the malformed line"


def test_a_file_a_command_writes_is_never_the_shipped_prompt_file():
    from eaglekit.data.readers import SHIPPED_DATA

    shipped = str(SHIPPED_DATA["tiny"])
    assert on_tiny(["doctor", "--coverage", "coverage.json", "output=report.json", "prompts.jsonl"]) == [
        "doctor", "--coverage", "coverage.json", "output=report.json", shipped]
