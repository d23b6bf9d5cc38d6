"""The stage config system: YAML + overrides, unknown keys, coercion, resolved config on disk."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import yaml

from eaglekit.config import config_hash, describe, load_config, option, save_resolved, to_dict
from eaglekit.errors import EaglekitError
from eaglekit.manifest import data_hash


@dataclass(frozen=True)
class Optim:
    lr: float = option(1e-4, "peak learning rate")
    betas: tuple[float, ...] = option((0.9, 0.95), "AdamW betas")


@dataclass(frozen=True)
class Demo:
    target: str = option("", "target model")
    steps: int = option(10, "training steps")
    compile: bool = option(False, "use torch.compile")
    layers: tuple[int, ...] | None = option(None, "aux layer ids")
    mode: str = option("offline", "training mode", choices=("offline", "online"))
    optim: Optim = option(Optim(), "optimiser")


def test_defaults_and_overrides_win_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 5\noptim:\n  lr: 0.01\n")
    cfg = load_config(Demo, path, ["steps=7", "optim.betas=[0.8,0.9]", "layers=2,4,5", "compile=true"])
    assert cfg.steps == 7 and cfg.optim.lr == 0.01 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.layers == (2, 4, 5) and cfg.compile is True and cfg.mode == "offline"


def test_unknown_key_suggests_closest():
    with pytest.raises(EaglekitError, match="did you mean 'steps'"):
        load_config(Demo, None, ["stpes=3"])
    with pytest.raises(EaglekitError, match="did you mean 'optim.lr'"):
        load_config(Demo, None, ["optim.lrr=3"])


def test_bad_values_are_clear_errors():
    with pytest.raises(EaglekitError, match="'steps'.*int"):
        load_config(Demo, None, ["steps=many"])
    with pytest.raises(EaglekitError, match="one of offline, online"):
        load_config(Demo, None, ["mode=sideways"])
    with pytest.raises(EaglekitError, match="does not exist"):
        load_config(Demo, "/nonexistent.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(Demo, None, ["target=x", "layers=[1,2,3]"])
    path = save_resolved(cfg, tmp_path)
    again = load_config(Demo, path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["layers"] == [1, 2, 3]
    assert config_hash(cfg) == config_hash(again) != config_hash(load_config(Demo, None, ["steps=11"]))
    assert config_hash(cfg, exclude=("steps",)) == config_hash(load_config(Demo, None, ["target=x", "layers=[1,2,3]", "steps=99"]), exclude=("steps",))
    assert to_dict(cfg)["optim"]["betas"] == [0.9, 0.95]
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # written atomically: no temporary left


def test_the_config_hash_is_the_manifests_digest():
    # the digest stored in earlier runs' records: a changed helper would make every run start over
    cfg = load_config(Demo, None, ["target=x", "steps=11"])
    assert config_hash(cfg) == "b8c0a66bf8633cdb" == data_hash(to_dict(cfg))
    assert config_hash(cfg, exclude=("steps",)) == "afef3110a18946c3"


def test_describe_lists_every_option():
    keys = [row[0] for row in describe(Demo)]
    assert keys == ["target", "steps", "compile", "layers", "mode", "optim.lr", "optim.betas"]
    assert any("one of offline, online" in row[3] for row in describe(Demo))


@dataclass(frozen=True)
class Ranged:
    steps: int = option(10, "training steps (0 = auto)", min=0)
    lr: float = option(1e-4, "learning rate", above=0)
    top_p: float = option(1.0, "nucleus cut", above=0, max=1)
    fraction: float = option(0.1, "held out", min=0, below=1)
    temperatures: tuple[float, ...] = option((0.0, 1.0), "temperatures", min=0)
    betas: tuple[float, ...] = option((0.9, 0.95), "AdamW betas", min=0, below=1,
                                      check=(lambda v: len(v) == 2, "two numbers"))
    limit: int | None = option(None, "optional cap", min=1)
    optim: Optim = option(Optim(), "optimiser")


@dataclass(frozen=True)
class Outer:
    section: Ranged = option(Ranged(), "a section with ranges")


def test_declared_ranges_refuse_every_bad_option_at_once():
    assert load_config(Ranged, None, ["steps=0", "top_p=1", "fraction=0", "temperatures=0"]).steps == 0
    with pytest.raises(EaglekitError) as error:
        load_config(Ranged, None, ["steps=-3", "lr=0", "top_p=0", "fraction=1", "temperatures=0,-1", "betas=0.9",
                                   "limit=0"])
    assert str(error.value) == (
        "steps must be >= 0 (steps=-3); lr must be > 0 (lr=0.0); top_p must be in (0, 1] (top_p=0.0); fraction must "
        "be in [0, 1) (fraction=1.0); temperatures must each be >= 0 (temperatures=0.0,-1.0); betas must be two "
        "numbers, each in [0, 1) (betas=0.9); limit must be >= 1 (limit=0): set each within its range (--help lists "
        "every option's range)")
    rows = {key: text for key, _, _, text in describe(Ranged)}
    assert rows["steps"].endswith("(>= 0)") and rows["top_p"].endswith("(in (0, 1])")
    assert rows["temperatures"].endswith("(each >= 0)") and rows["betas"].endswith("(two numbers, each in [0, 1))")
    assert config_hash(load_config(Ranged)) == config_hash(Ranged())  # a rule is no part of the value


def test_a_section_is_checked_unless_its_stage_checks_it(monkeypatch):
    from eaglekit.config import check_options, option_problems

    with pytest.raises(EaglekitError, match=r"^section.steps must be >= 0 \(section.steps=-1\): set it within"):
        load_config(Outer, None, ["section.steps=-1"])
    assert [p.key for p in option_problems(Outer(section=Ranged(steps=-1, lr=0.0)))] == ["section.steps", "section.lr"]
    monkeypatch.setattr(Outer, "CHECK_ON_LOAD", False, raising=False)
    config = load_config(Outer, None, ["section.steps=-1"])  # left to the stage (`eaglekit run` checks when it plans)
    with pytest.raises(EaglekitError, match=r"section.steps must be >= 0 \(section.steps=-1\)"):
        check_options(config)


def test_a_default_outside_its_own_range_is_a_programming_error():
    with pytest.raises(TypeError, match="breaks its own rule"):
        option(0, "steps", min=1)


def test_every_numeric_option_of_every_stage_declares_its_range():
    """A count, a rate, a fraction, an id: each option of a number (or of numbers) says what it may be, so that
    `load_config` refuses a bad value before any work."""
    import typing

    from eaglekit.config import _hints, _strip_optional
    from eaglekit.stages import STAGES, load_stage

    def undeclared(cls: type, prefix: str = "") -> list[str]:
        found, hints = [], _hints(cls)
        for f in dataclasses.fields(cls):
            tp, _ = _strip_optional(hints[f.name])
            if dataclasses.is_dataclass(tp):
                found += undeclared(tp, f"{prefix}{f.name}.")
                continue
            items = typing.get_args(tp)[:1] if typing.get_origin(tp) in (tuple, list) else (tp,)
            if items and items[0] in (int, float) and f.metadata.get("rule") is None:
                found.append(prefix + f.name)
        return found

    missing = [f"{name}: {key}" for name in STAGES for key in undeclared(load_stage(name).Config)]
    assert not missing, missing
