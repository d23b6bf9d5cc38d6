"""`eaglekit run`'s pre-flight: what bench and export would refuse after training is refused before the first
stage runs (nothing written), with the stage's own reason and fix; a run they accept passes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglekit.config import load_config
from eaglekit.errors import EaglekitError
from eaglekit.preflight import check_steps
from eaglekit.stages import bench as bench_stage
from eaglekit.stages import run as run_stage
from eaglekit.stages.run import Config, plan


def run_config(target: str, out, **sections) -> Config:
    return load_config(Config, overrides={"target": target, "data": ["tiny"], "out": str(out), "device": "cpu",
                                          **sections})


def refused(config: Config, *fragments: str) -> str:
    with pytest.raises(EaglekitError) as error:
        run_stage.run(config)
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, message
    assert not Path(config.out).exists()  # nothing ran, nothing written
    return message


@pytest.fixture(scope="module")
def chunked_target(tmp_path_factory):
    """The config.json of a Llama-4 text model (chunked attention in three layers of four): all pre-flight reads."""
    from test_sliding_window import target_config

    directory = tmp_path_factory.mktemp("llama4")
    target_config("llama4").save_pretrained(directory)
    return str(directory)


def test_a_target_speculative_decoding_cannot_run_is_refused_before_training(chunked_target, tmp_path):
    message = refused(run_config(chunked_target, tmp_path / "run"), "bench would refuse this run after training, "
                      "so nothing ran", "chunked_attention layers", "(bench: methods=plain,hf,hf_prompt_lookup)")
    assert "\n" not in message
    refused(run_config(chunked_target, tmp_path / "run", bench={"methods": ["plain"], "backend": "static"}),
            "bench would refuse", "the static fast path covers llama, mistral, qwen2, qwen3 targets, not "
            "'llama4_text'; use backend=eager")
    # measuring plain decoding only, bench accepts the target: the run's plan passes
    config = run_config(chunked_target, tmp_path / "run", bench={"methods": ["plain"]})
    check_steps(plan(config), config.target, bench_options=bench_stage._check)


def test_a_further_drafter_types_bench_is_checked_before_training(chunked_target, tmp_path):
    """drafter_types: each further type's bench (bench-<type>) is checked too; its methods draft, so a target
    speculative decoding cannot run is refused even when the run's own bench measures plain decoding only."""
    refused(run_config(chunked_target, tmp_path / "run", bench={"methods": ["plain"]}, drafter_types=["eagle3", "dflash"]),
            "bench-dflash would refuse this run after training", "chunked_attention layers")


def test_an_export_the_planned_drafter_cannot_take_is_refused_before_training(tmp_path):
    refused(run_config("tiny", tmp_path / "run", train={"aux_layer_ids": [0, 2, 3]}),
            "export would refuse this run after training", "export --to sglang: aux layer ids (0, 2, 3) include 0",
            "(or leave sglang out of export_formats)")
    config = run_config("tiny", tmp_path / "run", train={"aux_layer_ids": [0, 2, 3]}, export_formats=["vllm"])
    check_steps(plan(config), config.target, bench_options=bench_stage._check)


def test_bench_options_and_engine_are_checked_before_training(tmp_path):
    refused(run_config("tiny", tmp_path / "run", bench={"repeats": 0}), "bench would refuse", "repeats must be >= 1")
    missing = tmp_path / "no-python"
    refused(run_config("tiny", tmp_path / "run", bench={"engine": "vllm", "vllm_python": str(missing)}),
            "bench would refuse", f"vllm_python {missing} does not exist")


def test_a_target_without_a_tokenizer_that_loads_is_refused_before_anything_is_written(tmp_path):
    """The run's first stage would fail on it after writing its folder (transformers' message runs over lines)."""
    import shutil

    from eaglekit.targets.loading import tiny_target_path

    target = tmp_path / "weights-only"
    target.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_target_path() / name, target / name)
    message = refused(run_config(str(target), tmp_path / "run"), f"target {target} has no tokenizer files",
                      f"copy the tokenizer files of the model it was made from into {target}")
    assert "\n" not in message
    shutil.copy(tiny_target_path() / "tokenizer_config.json", target / "tokenizer_config.json")  # a config only
    message = refused(run_config(str(target), tmp_path / "run"), f"cannot load the tokenizer of {target}",
                      "check its tokenizer files")
    assert "\n" not in message


def test_the_default_plan_passes(tmp_path):
    config = run_config("tiny", tmp_path / "run")
    check_steps(plan(config), config.target, bench_options=bench_stage._check)


def test_bench_and_serve_refuse_speculative_decoding_of_such_a_target_before_any_work(chunked_target, tmp_path):
    import types

    from test_sliding_window import sliding_target

    from eaglekit.decode.serving import SpeculativeEngine

    (tmp_path / "drafter").mkdir()
    config = load_config(bench_stage.Config, overrides={"target": chunked_target, "prompts": "x.jsonl",
                                                        "drafter": str(tmp_path / "drafter"),
                                                        "output": str(tmp_path / "bench")})
    with pytest.raises(EaglekitError, match="chunked_attention layers: .* methods=plain,hf,hf_prompt_lookup"):
        bench_stage.run(config)
    assert not (tmp_path / "bench").exists()
    base = types.SimpleNamespace(model=sliding_target("llama4"), max_context=64)
    with pytest.raises(EaglekitError, match="chunked_attention layers: .*decode it with method=plain"):
        SpeculativeEngine(base, None, method="tree")
