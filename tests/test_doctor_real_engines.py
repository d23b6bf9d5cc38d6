"""`eaglekit doctor --engine` on REAL engine releases (wheels fetched with `pip download --no-deps`).

Marked `network`: the wheels (vLLM ~250-450 MB each, SGLang ~40 MB) are cached in
~/.cache/eaglekit-test-wheels (or $EAGLEKIT_TEST_WHEELS). Tests run offline by default: a wheel
missing from the cache is downloaded only with EAGLEKIT_NETWORK_TESTS=1, else its test is skipped.
The engines are never installed or imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglekit.doctor.diagnose import diagnose, format_report
from eaglekit.doctor.plugin import write_vllm_plugin

pytestmark = pytest.mark.network
CACHE = Path(os.environ.get("EAGLEKIT_TEST_WHEELS", "~/.cache/eaglekit-test-wheels")).expanduser()
OLD_VLLM, NEW_VLLM, SGLANG = ("vllm", "0.11.0"), ("vllm", "0.34.0"), ("sglang", "0.5.23")


def wheel(package: str, version: str) -> str:
    found = sorted(CACHE.glob(f"{package}-{version}-*.whl"))
    if not found and os.environ.get("EAGLEKIT_NETWORK_TESTS") != "1":
        pytest.skip(f"{package}=={version} is not in {CACHE}; set EAGLEKIT_NETWORK_TESTS=1 to download it (~0.3 GB)")
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{package}=={version}", "-d", str(CACHE)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
            error = result.stderr.strip().splitlines()[-1:] if result.returncode else []
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = [str(exc)]
        found = sorted(CACHE.glob(f"{package}-{version}-*.whl"))
        if not found:
            pytest.skip(f"could not download {package}=={version}: {' '.join(error) or 'no wheel'}")
    return str(found[0])


def config(tmp_path: Path, architecture: str, model_type: str, layers: int, text: dict | None = None) -> str:
    data = {"architectures": [architecture], "model_type": model_type, "num_hidden_layers": layers}
    if text is not None:
        data["text_config"] = text
    path = tmp_path / f"{architecture}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_old_vllm_llama_supported_with_allow_list(tmp_path):
    report = diagnose("vllm", config(tmp_path, "LlamaForCausalLM", "llama", 32), wheel(*OLD_VLLM), installed_plugins=False)
    assert report["verdict"] == "supported", format_report(report)
    assert report["registry"]["module"] == "vllm.model_executor.models.llama"
    assert report["interface"]["getter"] == "get_eagle3_aux_hidden_state_layers"  # the pre-2026-03 name
    assert report["allow_list"]["file"] == "vllm/config/speculative.py" and report["allow_list"]["passes"] is True
    assert report["decoder"]["class"] == "LlamaModel"
    assert report["default_aux_layers"]["input_of_layer_ids"] == [2, 16, 29]
    assert report["explicit_aux_ids_read_by"] == []  # 0.11 always asks the target for its default layers


def test_old_vllm_rejects_model_type_outside_allow_list(tmp_path):
    report = diagnose("vllm", config(tmp_path, "Gemma2ForCausalLM", "gemma2", 26), wheel(*OLD_VLLM), installed_plugins=False)
    assert report["verdict"] == "not supported"
    assert report["allow_list"]["passes"] is False


def test_old_vllm_qwen25_vl_wrapper_does_not_delegate_and_plugin_fixes_it(tmp_path):
    text = {"model_type": "qwen2_5_vl_text", "num_hidden_layers": 28}
    target = config(tmp_path, "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", 28, text)
    source = wheel(*OLD_VLLM)
    report = diagnose("vllm", target, source, installed_plugins=False)
    assert report["verdict"] == "not supported", format_report(report)
    assert report["wrapper"]["inner"]["class"] == "Qwen2ForCausalLM"
    assert report["wrapper"]["inner_interface"]["implements"] is True and report["plugin_fix_possible"] is True
    write_vllm_plugin(report, tmp_path / "plugins")
    fixed = diagnose("vllm", target, source, plugins=(str(tmp_path / "plugins"),), installed_plugins=False)
    assert fixed["verdict"] == "supported", format_report(fixed)
    assert fixed["default_aux_layers"]["input_of_layer_ids"] == [2, 14, 25]


def test_new_vllm_llama_and_multimodal_wrappers(tmp_path):
    source = wheel(*NEW_VLLM)
    llama = diagnose("vllm", config(tmp_path, "LlamaForCausalLM", "llama", 32), source, installed_plugins=False)
    assert llama["verdict"] == "supported" and llama["allow_list"] is None
    assert "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py" in llama["explicit_aux_ids_read_by"]
    assert llama["interface"]["getter"] == "get_eagle3_default_aux_hidden_state_layers"  # the post-2026-03 name
    kimi = diagnose("vllm", "KimiK25ForConditionalGeneration", source, installed_plugins=False)
    assert kimi["verdict"] == "supported", format_report(kimi)
    assert kimi["wrapper"]["inner"]["class"] == "DeepseekV2ForCausalLM"
    assert kimi["decoder"]["class"] == "DeepseekV2Model" and kimi["decoder"]["collects_aux"] is True
    qwen2_vl = diagnose("vllm", "Qwen2VLForConditionalGeneration", source, installed_plugins=False)
    assert qwen2_vl["verdict"] == "not supported" and qwen2_vl["plugin_fix_possible"] is True
    gpt2 = diagnose("vllm", "GPT2LMHeadModel", source, installed_plugins=False)
    assert gpt2["verdict"] == "not supported" and gpt2["plugin_fix_possible"] is False


def test_sglang_release(tmp_path):
    source = wheel(*SGLANG)
    llama = diagnose("sglang", config(tmp_path, "LlamaForCausalLM", "llama", 32), source)
    assert llama["verdict"] == "supported"
    assert llama["default_aux_layers"]["input_of_layer_ids"] == [2, 16, 29]
    assert llama["default_aux_layers"]["engine_explicit_ids"] == [1, 15, 28]
    kimi = diagnose("sglang", "KimiK25ForConditionalGeneration", source)
    assert kimi["verdict"] == "supported" and kimi["wrapper"]["inner"]["class"] == "DeepseekV3ForCausalLM"
    gpt2 = diagnose("sglang", "GPT2LMHeadModel", source)
    assert gpt2["verdict"] == "not supported"


def test_export_layout_matches_the_real_loaders():
    """What `eaglekit export` writes is what these releases' loaders read (architecture, tensor prefix, id keys)."""
    from eaglekit.drafters.eagle3 import formats
    from eaglekit.doctor.facts import sglang_registry, vllm_registry
    from eaglekit.doctor.source import open_source
    from eaglekit.doctor.pysource import ModuleIndex

    for version in (OLD_VLLM, NEW_VLLM):
        source = open_source("vllm", wheel(*version))
        registry = vllm_registry(ModuleIndex([source]))
        assert registry[formats.EAGLE3_ARCHITECTURES[0]] == ("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM")
        loader = source.read("vllm/model_executor/models/llama_eagle3.py")
        assert '"midlayer."' in loader.replace("'", '"') and '"d2t"' in loader.replace("'", '"')
    new = open_source("vllm", wheel(*NEW_VLLM))
    ids_reader = new.read("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py")
    assert 'getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)' in ids_reader  # top level, not eagle_config
    speculators_reader = new.read("vllm/transformers_utils/configs/speculators/algos.py")
    assert '"norm_before_residual", True' in speculators_reader  # why the speculators export writes it explicitly
    sglang = open_source("sglang", wheel(*SGLANG))
    assert formats.EAGLE3_ARCHITECTURES[0] in sglang_registry(sglang, ModuleIndex([sglang]))
    loader = sglang.read("sglang/srt/models/llama_eagle3.py")
    assert '"midlayer": "layers.0"' in loader and "norm_before_residual" not in loader
    runner = sglang.read("sglang/srt/models/llama.py")
    assert "[val + 1 for val in layer_ids]" in runner  # SGLang's explicit ids are output-of-layer
