"""`eaglekit run` fine-tuning a drafter (`train.init_from`): the vocab step keeps the drafter's own mapping, so
train accepts it and the final drafter has the init drafter's d2t; `train.device_map` wiring rules."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from eaglekit.config import load_config
from eaglekit.drafters.eagle3.build import drafter_config_for
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.errors import EaglekitError
from eaglekit.stages import run as run_stage
from eaglekit.stages.run import Config, plan



@pytest.fixture
def init_drafter(chat_target, tmp_path) -> Eagle3Drafter:
    """A drafter for the chat target whose draft vocabulary (every third id) no count-based vocab would pick."""
    from eaglekit.targets.capture import default_aux_layers
    from eaglekit.targets.loading import load_target_config

    text = load_target_config(chat_target)
    used = torch.arange(0, int(text.vocab_size), 3)
    drafter = Eagle3Drafter(drafter_config_for(text, used.numel(), default_aux_layers(int(text.num_hidden_layers)), chat_target, "LlamaForCausalLM"))
    drafter.set_vocab_mapping(used)
    drafter.save_pretrained(tmp_path / "init")
    return drafter


def fine_tune_run(target: str, data: str, out, init: str, **extra) -> Config:
    values = {"target": target, "data": [data], "out": str(out), "device": "cpu", "training": "online",
              "stages": ["vocab", "train"], "vocab": {"size": 32},
              "train": {"init_from": init, "epochs": 1, "batch_size": 2, "ttt_steps": 2, "max_length": 64, "val_fraction": 0.25,
                        "lr": 1e-3, "log_every": 1}, **extra}
    return load_config(Config, overrides=values)


def test_run_with_init_from_keeps_the_drafters_mapping(chat_target, run_prompts, init_drafter, tmp_path):
    init = str(tmp_path / "init")
    config = fine_tune_run(chat_target, run_prompts, tmp_path / "run", init)
    steps = {s.name: s for s in plan(config)}
    assert steps["vocab"].make_config().init_from == init and init in steps["train"].inputs
    result = run_stage.run(config)
    assert {s["stage"]: s["status"] for s in result["steps"]} == {"vocab": "ran", "train": "ran"}
    vocab_manifest = json.loads((tmp_path / "run" / "vocab" / "manifest.json").read_text())
    assert vocab_manifest["mapping"] == f"kept from {init}"
    final = Eagle3Drafter.from_pretrained(tmp_path / "run" / "train")
    assert torch.equal(final.d2t, init_drafter.d2t) and torch.equal(final.t2d, init_drafter.t2d)
    manifest = json.loads((tmp_path / "run" / "train" / "manifest.json").read_text())
    assert manifest["init_from"] == init and manifest["steps"] == 3
    # train.rebuild_vocab asks the vocab step for a new mapping (train then remaps the lm_head rows)
    rebuilt = dataclasses.replace(config, train=dataclasses.replace(config.train, rebuild_vocab=True))
    assert {s.name: s for s in plan(rebuilt)}["vocab"].make_config().rebuild


def test_train_device_map_only_online_in_one_process(chat_target, run_prompts, tmp_path):
    base = {"target": chat_target, "data": [run_prompts], "out": str(tmp_path / "run"), "stages": ["vocab", "train"]}
    online = load_config(Config, overrides={**base, "training": "online", "train": {"device_map": "auto"}})
    assert {s.name: s for s in plan(online)}["train"].make_config().device_map == "auto"
    for extra in ({"training": "offline", "stages": ["extract", "vocab", "train"]}, {"training": "online", "train_processes": 2}):
        with pytest.raises(EaglekitError, match="train_processes=1"):
            plan(load_config(Config, overrides={**base, **extra, "train": {"device_map": "auto"}}))
