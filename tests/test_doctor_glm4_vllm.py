"""GLM-4 in the real vLLM (CPU build): pre-flight refuses what vLLM would, and `doctor --fix`'s subclass plugin makes
vLLM serve a drafter for it and capture its hidden states.

vLLM 0.32's `Glm4ForCausalLM` lacks the EAGLE-3 interface, so vLLM refuses both ("Model does not support EAGLE3
interface") once the weights are loaded; its decoder `Glm4Model` is a `LlamaModel`, which collects the aux states, so
a subclass that only adds the interface serves it. A tiny random GLM-4 (4 layers, width 128, head_dim 32: what the
CPU build's attention takes) with the tiny target's tokenizer. The pre-flight refusals need vLLM's Python (its version
and device type) but start no engine; a target whose head_dim the CPU attention does not take (16) is refused the
same way by `extract`, `bench` and `run`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import engines
from eaglekit.cli import main
from eaglekit.config import load_config
from eaglekit.stages import doctor, extract
from eaglekit.vllm import engine as ve
from eaglekit.vllm.support import engine_source
from test_doctor_serving import DRAFTS, build_drafter_export

pytestmark = pytest.mark.engine


def build_target(directory: Path, name: str = "Glm4Config", **shape) -> str:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    fields = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=2, pad_token_id=0)
    config = getattr(tf, name)(**{**fields, **shape})
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    engines._with_tiny_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def engine() -> ve.Engine:
    return ve.find_engine(engines.vllm_python())


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("glm4")
    return {"root": root, "glm4": build_target(root / "glm4"), "drafter": build_drafter_export(root / "drafter"),
            "narrow": build_target(root / "narrow", "LlamaConfig", hidden_size=64, head_dim=16)}


def refused(argv: list[str], capsys, *fragments: str) -> str:
    code = main(argv)
    error = capsys.readouterr().err
    assert code == 1 and "Traceback" not in error, error
    for fragment in fragments:
        assert fragment in error, error
    return error


def test_pre_flight_refuses_before_any_engine_or_stage_starts(engine, setup, tmp_path, capsys):
    glm4, narrow, python = setup["glm4"], setup["narrow"], engine.python
    extract_args = [str(engines.PROMPTS), "backend=vllm", f"vllm_python={python}", "limit=2"]
    refused(["extract", *extract_args, f"target={glm4}", f"output={tmp_path / 'x'}"], capsys,
            f"vLLM 0.32.0 will not capture hidden states from {glm4}: this vLLM's class for the target needs a plugin: "
            f"run `eaglekit doctor --engine vllm --target {glm4} --fix`", "or capture them with backend=hf")
    refused(["run", "--target", glm4, "--data", "tiny", "--out", str(tmp_path / "run"), "capture=vllm",
             f"extract.vllm_python={python}"], capsys,
            "extract would refuse this run, so nothing ran: vLLM 0.32.0 will not capture hidden states", "--fix")
    head = ("vllm/v1/attention/backends/cpu_attn.py:69) is [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]; the "
            "target's head_dim is 16")
    refused(["extract", *extract_args, f"target={narrow}", f"output={tmp_path / 'y'}"], capsys, head,
            "run it on a GPU build of vLLM")
    (tmp_path / "drafter").mkdir()
    refused(["bench", str(engines.EVAL_PROMPTS), f"target={narrow}", f"drafter={tmp_path / 'drafter'}",
             "engine=vllm", f"vllm_python={python}", "methods=plain", f"output={tmp_path / 'bench'}"], capsys,
            f"vLLM 0.32.0 will not run {narrow} with a drafter: vLLM's CPU build runs", head)
    refused(["run", "--target", narrow, "--data", "tiny", "--out", str(tmp_path / "run2"), "bench.engine=vllm",
             f"bench.vllm_python={python}"], capsys, "bench would refuse this run after training", head)
    assert not any((tmp_path / name).exists() for name in ("x", "y", "run", "run2", "bench"))


def test_doctor_fix_subclass_plugin_makes_vllm_serve_and_capture_glm4(engine, setup, tmp_path, capsys, monkeypatch):
    """doctor says NOT SUPPORTED (exit 3) -> --fix writes the subclass plugin -> pip-installed into a throwaway
    --target dir on the worker's path (the real vllm.general_plugins entry point, vLLM's venv untouched) -> vLLM's
    registry resolves the plugin's class with the interface, serves the drafter (drafts counted) and captures the
    hidden states through `extract backend=vllm`, whose pre-flight now passes."""
    glm4, source = setup["glm4"], engine_source(engine)
    base = ["doctor", "--engine", "vllm", "--target", glm4, "--engine_source", source, "installed_plugins=false"]
    assert main(base) == 3
    capsys.readouterr()
    report = doctor.run(load_config(doctor.Config, None, [f"target={glm4}", "engine=vllm", f"engine_source={source}",
                                                          "installed_plugins=false", "fix=true",
                                                          f"fix_output={tmp_path / 'plugins'}"]))
    assert report["subclass"]["fits"] and report["subclass"]["decoder"] == "Glm4Model"
    site = tmp_path / "site"
    subprocess.run([engine.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), report["plugin_written"]], check=True, timeout=300)
    assert main([*base, "--plugins", str(tmp_path / "plugins")]) == 0
    capsys.readouterr()
    env = {"PYTHONPATH": str(site)}
    checked = ve.run_worker(engine, {"kind": "supports_eagle3", "architectures": ["Glm4ForCausalLM"]}, tmp_path,
                            "supports", env=env)["architectures"]["Glm4ForCausalLM"]
    assert checked["supports_eagle3"] and checked["class"].startswith("eaglekit_eagle3_glm4forcausallm"), checked
    run = {"name": "glm4", "model": glm4, "speculative_config": ve.speculative_config(setup["drafter"], DRAFTS),
           "prompts": [[1, 17, 33, 250, 9]], "max_new_tokens": 6, "warmup": False,
           "engine_args": ve.engine_args(64, glm4, engine.device_type)}
    served = ve.run_worker(engine, {"kind": "generate", "runs": [run]}, tmp_path, "serve", env=env)["runs"][0]
    assert "error" not in served, served["error"]
    assert served["counters"]["spec_decode_num_drafts"] > 0

    monkeypatch.setenv("PYTHONPATH", str(site))  # where vLLM's Python, started from here, loads the plugin
    config = load_config(extract.Config, None, [f"data={engines.PROMPTS}", f"output={tmp_path / 'store'}",
                                                f"target={glm4}", "backend=vllm", f"vllm_python={engine.python}",
                                                "limit=3", "dtype=fp32"])
    stats = extract.run(config).stats
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["backend"] == "vllm" and manifest["num_records"] == 3 and stats["engine_layer_ids"] == [1, 2, 3, 4]
