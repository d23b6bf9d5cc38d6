"""Stage configuration: frozen dataclasses filled from a YAML file plus `key=value` overrides.

Every stage declares one frozen dataclass whose fields use `option(default, help)`, with the range each
value must lie in beside it (`option(4, "sequences per micro-batch", min=1)`). Nested dataclasses are
addressed with dotted keys (`optim.lr=1e-4`). Unknown keys are rejected with the closest valid name; values
are coerced to the declared type, then every option outside its range is refused in one error before any
work (`load_config`, `check_options`). The fully resolved config is written next to every output a stage
produces (`save_resolved`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

import yaml

from eaglekit.errors import EaglekitError

C = TypeVar("C")


def _number(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class Rule:
    """What an option's value must be: bounds (`min`/`max` inclusive, `above`/`below` exclusive; for a sequence,
    of each item) and/or a test of the whole value with its description (`check=(test, "two numbers")`)."""

    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None
    test: Callable[[Any], bool] | None = None
    text: str = ""

    def bounds(self) -> str:
        """`>= 1`, `> 0`, `in [0, 1)`, `in (0, 1]`, ... ('' without bounds)."""
        low = (f"[{_number(self.min)}" if self.min is not None else
               f"({_number(self.above)}" if self.above is not None else None)
        high = (f"{_number(self.max)}]" if self.max is not None else
                f"{_number(self.below)})" if self.below is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return ""

    def describe(self, sequence: bool) -> str:
        """The rule in words: `>= 1`, `each >= 0`, `two numbers, each in [0, 1)`."""
        bounds = self.bounds()
        if bounds and sequence:
            bounds = f"each {bounds}"
        return ", ".join(part for part in (self.text, bounds) if part)

    def _within(self, value: float) -> bool:
        return ((self.min is None or value >= self.min) and (self.max is None or value <= self.max)
                and (self.above is None or value > self.above) and (self.below is None or value < self.below))

    def holds(self, value: Any) -> bool:
        if value is None:
            return True  # an optional option left unset
        if self.test is not None and not self.test(value):
            return False
        items = value if isinstance(value, (tuple, list)) else (value,)
        return all(self._within(item) for item in items if isinstance(item, (int, float)))


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, min: float | None = None,
           max: float | None = None, above: float | None = None, below: float | None = None,
           check: tuple[Callable[[Any], bool], str] | None = None) -> Any:
    """A config field with its default and a one-line meaning shown by `eaglekit <stage> --help`, and the rule its
    value must follow: `choices`, bounds (`min=1`: >= 1; `above=0`: > 0; `max`, `below`; a sequence's items each),
    `check=(test, "what it must be")`. `load_config` refuses every option outside its rule in one error. (`min` and
    `max` name the bounds as a reader says them; the builtins are not needed here.)"""
    rule = None
    if (min, max, above, below, check) != (None,) * 5:
        test, text = check if check is not None else (None, "")
        rule = Rule(min, max, above, below, test, text)
        if not rule.holds(default):
            raise TypeError(f"the default {default!r} breaks its own rule ({rule.describe(False)})")
    metadata = {"help": help, "choices": choices, "rule": rule}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple (immutable) default for sequence options")
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


class CommandLineText(str):
    """A value as typed on the command line: kept verbatim for a text option (`prompt=x = 1`, `prompt=#1`), read as
    a YAML scalar for any other type (`1e-4`, `true`, `[2,3]`)."""


def _read_text(value: CommandLineText, tp: Any) -> Any:
    if tp is str:
        return str(value)
    if not value.strip():
        return ""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return str(value)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML-parsed value (or command-line text) to the declared field type, or raise a clear error."""
    tp, optional = _strip_optional(tp)
    if isinstance(value, CommandLineText):
        if optional and value.lower() in ("none", "null"):
            return None
        value = _read_text(value, tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional or tp is Any:
            return None
        raise EaglekitError(f"config key '{key}' cannot be empty")
    origin = typing.get_origin(tp)
    try:
        if tp is Any:
            return value
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
                return False
            raise ValueError(value)
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if origin in (tuple, list):
            args = typing.get_args(tp)
            item_tp = args[0] if args else Any
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()] if value.strip() else []
            if not isinstance(value, (list, tuple)):
                value = [value]
            return tuple(_coerce(v, item_tp, key) for v in value)
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise EaglekitError(f"config key '{key}': cannot read {value!r} as {getattr(tp, '__name__', tp)}") from None
    return value


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """All dotted keys a config class accepts."""
    keys: list[str] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _strip_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            keys.extend(valid_keys(tp, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


def _build(cls: type[C], values: dict[str, Any], prefix: str) -> C:
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    all_keys = valid_keys(cls)
    renamed = getattr(cls, "RENAMED", {})
    for key in values:
        if key in renamed:
            raise EaglekitError(
                f"config key '{prefix}{key}' is now called '{prefix}{renamed[key]}' (same meaning): rename it"
            )
        if key not in names:
            raise EaglekitError(
                f"unknown config key '{prefix}{key}'" + _suggest(prefix + key, [prefix + k for k in all_keys])
            )
    kwargs: dict[str, Any] = {}
    for name, f in names.items():
        tp, _ = _strip_optional(hints[name])
        if dataclasses.is_dataclass(tp):
            sub = values.get(name, {})
            if dataclasses.is_dataclass(sub):
                sub = dataclasses.asdict(sub)
            if not isinstance(sub, dict):
                raise EaglekitError(
                    f"config key '{prefix}{name}' is a section; set its fields, e.g. {prefix}{name}.<key>=..."
                )
            kwargs[name] = _build(tp, sub, f"{prefix}{name}.")
        elif name in values:
            value = _coerce(values[name], hints[name], prefix + name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise EaglekitError(f"config key '{prefix}{name}' must be one of {', '.join(choices)}, not {value!r}")
            kwargs[name] = value
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise EaglekitError(f"config key '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["a.b=1", "name=x"]` -> nested dict of `CommandLineText` values (read by each option's type when built)."""
    tree: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise EaglekitError(f"expected key=value, got '{pair}'")
        key, raw = pair.split("=", 1)
        _set_dotted(tree, key.strip().replace("-", "_"), CommandLineText(raw))
    return tree


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | dict[str, Any] = ()) -> C:
    """Build `cls` from an optional YAML file, then `key=value` overrides (which win); refuse every option outside
    its declared rule in one error. A class with `CHECK_ON_LOAD = False` leaves that to its stage (`eaglekit run`
    checks its own and every section's options when it plans, naming the stage that would refuse each)."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise EaglekitError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise EaglekitError(f"config file {path} is not valid YAML: {error}") from None
        if not isinstance(loaded, dict):
            raise EaglekitError(f"config file {path} must hold a mapping of keys to values")
        values = loaded
    extra = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides))
    config = _build(cls, _merge(values, extra), "")
    if getattr(cls, "CHECK_ON_LOAD", True):
        check_options(config)
    return config


class Problem(NamedTuple):
    """An option outside its rule: its dotted key and `KEY must be RULE (KEY=VALUE)`."""

    key: str
    text: str


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "(empty)"
    return str(value)


def option_problems(config: Any, prefix: str = "") -> list[Problem]:
    """Every option of `config` and of its sections (keys dotted) whose value breaks its declared rule."""
    problems: list[Problem] = []
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            problems += option_problems(value, f"{prefix}{f.name}.")
            continue
        rule = f.metadata.get("rule")
        if rule is not None and not rule.holds(value):
            tp, _ = _strip_optional(hints[f.name])
            sequence = typing.get_origin(tp) in (tuple, list)
            key = prefix + f.name
            must = rule.describe(sequence)
            must = f"must each be {must[5:]}" if must.startswith("each ") else f"must be {must}"
            problems.append(Problem(key, f"{key} {must} ({key}={_shown(value)})"))
    return problems


def out_of_range(problems: list[Problem]) -> str:
    """One message for the options outside their rules, naming the fix."""
    them = "it" if len(problems) == 1 else "each"
    return f"{'; '.join(p.text for p in problems)}: set {them} within its range (--help lists every option's range)"


def check_options(config: Any) -> None:
    """Refuse, in one `EaglekitError`, every option of `config` (and of its sections) outside its declared rule."""
    problems = option_problems(config)
    if problems:
        raise EaglekitError(out_of_range(problems))


def to_dict(config: Any) -> dict[str, Any]:
    """Plain dict (tuples as lists) for YAML/JSON output."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return {k: plain(v) for k, v in dataclasses.asdict(config).items()}


def config_hash(config: Any, exclude: tuple[str, ...] = ()) -> str:
    """Stable short hash of a config (keys in `exclude` ignored), to tell a changed run from a resumed one."""
    from eaglekit.manifest import data_hash

    return data_hash({k: v for k, v in to_dict(config).items() if k not in exclude})


def save_resolved(config: Any, directory: str | Path, name: str = "config.yaml") -> Path:
    """Write the fully resolved config next to a stage's outputs (atomically)."""
    from eaglekit.manifest import atomic_write_text

    target = Path(directory) / name
    atomic_write_text(target, yaml.safe_dump(to_dict(config), sort_keys=False))
    return target


def flag_keys(cls: type) -> frozenset[str]:
    """The dotted keys of boolean options: `--key` alone on the command line sets them to true."""
    return frozenset(key for key, type_name, _, _ in describe(cls) if type_name == "bool")


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every option, nested sections flattened with dots."""
    rows: list[tuple[str, str, Any, str]] = []
    hints = _hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp, _ = _strip_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        type_name = getattr(tp, "__name__", str(tp).replace("typing.", ""))
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_text += f" (one of {', '.join(f.metadata['choices'])})"
        if f.metadata.get("rule") is not None:
            help_text += f" ({f.metadata['rule'].describe(typing.get_origin(tp) in (tuple, list))})"
        rows.append((prefix + f.name, type_name, getattr(defaults, f.name), help_text))
    return rows
