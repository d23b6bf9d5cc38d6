"""Every shipped recipe loads into the run Config (each section into its stage's Config), says at the top
which command runs it, and plans a run whose stage configs are wired to the run folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from eaglekit.config import load_config
from eaglekit.errors import EaglekitError
from eaglekit.stages import load_stage
from eaglekit.stages.run import PACKAGE_DIR, Config, plan, torchrun_command

RECIPES = sorted((PACKAGE_DIR / "recipes").glob("*.yaml"))
SECTIONS = ("regen", "extract", "vocab", "train", "bench", "export", "doctor")


def test_the_three_recipes_ship():
    assert {p.name for p in RECIPES} >= {"demo.yaml", "llama-8b-1gpu.yaml", "kimi-k2-8gpu.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_plans_and_names_its_command(recipe: Path, tmp_path):
    header = "\n".join(line for line in recipe.read_text().splitlines()[:20] if line.startswith("#"))
    assert f"--config src/eaglekit/recipes/{recipe.name}" in header or (recipe.name == "demo.yaml" and "make demo" in header)
    config = load_config(Config, recipe)
    for name in SECTIONS:
        assert isinstance(getattr(config, name), load_stage(name).Config)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    if not config.data:  # the GPU recipes take --data on the command line
        config = dataclasses.replace(config, data=(str(prompts),))
    config = dataclasses.replace(config, out=str(tmp_path / "run"))
    steps = plan(config)
    assert steps and all(Path(s.directory).is_relative_to(tmp_path / "run") for s in steps)
    for step in steps:
        stage_config = step.make_config()
        assert isinstance(stage_config, load_stage(step.name.split("-")[0]).Config)
        output = getattr(stage_config, "output", "")
        assert not output or Path(output) == step.directory


def test_demo_recipe_runs_the_whole_path_on_the_tiny_target():
    config = load_config(Config, PACKAGE_DIR / "recipes" / "demo.yaml")
    assert config.target == "tiny" and config.device == "cpu" and set(config.stages) == set(SECTIONS)
    names = [s.name for s in plan(dataclasses.replace(config, out="/tmp/unused"))]
    assert names[:5] == ["regen", "extract", "vocab", "train", "bench"] and "export-vllm" in names and "doctor-vllm" in names


def test_a_misspelled_section_key_names_the_closest_option(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: tiny\ntrain:\n  ttt_step: 3\n")
    with pytest.raises(EaglekitError, match="did you mean 'train.ttt_steps'"):
        load_config(Config, recipe)


def test_torchrun_launch_command(tmp_path):
    command = torchrun_command("train", tmp_path / "launch.yaml", 8)
    assert command[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m", "eaglekit", "train",
                           "--config", str(tmp_path / "launch.yaml")]
