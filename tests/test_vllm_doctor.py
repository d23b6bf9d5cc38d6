"""The doctor's verdict, read from vLLM's installed source, against vLLM's runtime `supports_eagle3(model_class)`."""

from __future__ import annotations

import subprocess

import pytest

import engines
from eaglekit.vllm import engine as ve
from eaglekit.doctor.diagnose import diagnose

pytestmark = pytest.mark.engine

# supported and refused ones, dense, MoE, MLA and multimodal wrappers (each imports on the CPU build)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "MistralForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM", "DeepseekV2ForCausalLM",
                 "DeepseekV3ForCausalLM",
                 "KimiK25ForConditionalGeneration", "KimiVLForConditionalGeneration", "MixtralForCausalLM",
                 "Gemma2ForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "FalconForCausalLM")


def test_doctor_verdicts_match_vllms_runtime_check(tmp_path):
    engine = ve.find_engine(engines.vllm_python())
    source = subprocess.run([engine.python, "-c", "import importlib.util, os; "
                             "print(os.path.dirname(importlib.util.find_spec('vllm').origin))"],
                            capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    runtime = ve.run_worker(engine, {"kind": "supports_eagle3", "architectures": list(ARCHITECTURES)}, tmp_path,
                            "supports")["architectures"]
    compared, disagreements = [], []
    for architecture in ARCHITECTURES:
        fact = runtime[architecture]
        if not fact["imports"]:
            continue
        verdict = diagnose("vllm", architecture, source, installed_plugins=False)["verdict"]
        compared.append(architecture)
        if (verdict == "supported") != fact["supports_eagle3"]:
            disagreements.append(f"{architecture}: doctor {verdict}, runtime supports_eagle3={fact['supports_eagle3']}")
    assert not disagreements, disagreements
    assert len(compared) >= 12, f"only {compared} import in this vLLM"
    assert runtime["KimiK25ForConditionalGeneration"]["supports_eagle3"]
    assert not runtime["KimiVLForConditionalGeneration"]["supports_eagle3"]
    assert not runtime["GPT2LMHeadModel"]["supports_eagle3"]
