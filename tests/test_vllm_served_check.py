"""bench engine=vllm and `run ... bench.engine=vllm` refuse a target the doctor says the installed vLLM will not
run with a drafter (StableLM: vLLM 0.32's class has no EAGLE-3 interface) before measuring or training anything;
the real vLLM refuses it too ("Model does not support EAGLE3 interface"), a check run by hand on a tiny StableLM."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import transformers

from eaglekit.cli import main
from eaglekit.targets.loading import tiny_target_path
from engines import EVAL_PROMPTS, vllm_python


@pytest.fixture(scope="module")
def stablelm(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("stablelm")
    transformers.StableLmConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2,
                                architectures=["StableLmForCausalLM"]).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the tiny target's tokenizer
        shutil.copy(tiny_target_path() / name, directory / name)
    return directory


def test_bench_and_run_refuse_a_target_vllm_will_not_serve(stablelm, tmp_path, capsys):
    python = vllm_python()
    (tmp_path / "drafter").mkdir()
    code = main(["bench", str(EVAL_PROMPTS), f"target={stablelm}", f"drafter={tmp_path / 'drafter'}", "engine=vllm",
                 f"vllm_python={python}", "methods=plain", f"output={tmp_path / 'bench'}"])
    error = capsys.readouterr().err
    assert code == 1 and "Traceback" not in error
    assert f"vLLM 0.32.0 will not run {stablelm} with a drafter: the doctor" in error
    assert "StablelmForCausalLM" in error and "or leave engine=vllm out" in error
    assert not (tmp_path / "bench").exists()
    code = main(["run", "--target", str(stablelm), "--data", "tiny", "--out", str(tmp_path / "run"),
                 "bench.engine=vllm", f"bench.vllm_python={python}"])
    error = capsys.readouterr().err
    assert code == 1 and "bench would refuse this run after training, so nothing ran: vLLM 0.32.0 will not run" in error
    assert not (tmp_path / "run").exists()
