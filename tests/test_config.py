"""The stage config system: YAML + overrides, unknown keys, coercion, resolved config on disk."""

from __future__ import annotations

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
