"""The out-of-tree vLLM plugin of `eaglekit doctor --fix`, and reading plugin registrations back.

When a multimodal wrapper holds a language model that implements `SupportsEagle3` (and whose decoder
collects the aux states) but the wrapper itself does not, vLLM refuses EAGLE-3 for the wrapper. The
plugin registers, for that architecture, a subclass of the wrapper that adds `SupportsEagle3` and
delegates both interface methods to `self.language_model`, through vLLM's `vllm.general_plugins`
entry point and `ModelRegistry.register_model`. Nothing in site-packages is edited.

When the target's decoder names its embedding otherwise than vLLM's EAGLE proposer looks it up (GPT-NeoX's
`embed_in` under the Transformers backend: see `serving`), the plugin's subclass also makes the same
module reachable under the name the proposer reads. Both can be needed at once; the plugin writes what is.

When the class itself lacks the interface but its decoder (`self.model`) already collects the aux states, mostly
by inheritance (vLLM 0.32's `Glm4Model` is a `LlamaModel`, whose forward collects them), the plugin's subclass adds
`SupportsEagle3` with `set_aux_hidden_state_layers` handing the layers to the decoder (through the setter the doctor
found there) and the default-layers getter counting the decoder's layers.

What it does not cover: a decoder that does not collect aux states (a model change), a class or
wrapper whose forward post-processes the decoder's or language model's output (the aux states would be
dropped), and pipeline parallelism across a wrapper (aux tensors between ranks are the model's business).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError
from eaglekit.doctor.source import DirectorySource, EngineSource
from eaglekit.manifest import atomic_write_text, claim_output

GROUP = "vllm.general_plugins"
GETTERS = ("get_eagle3_default_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers")

MODEL_TEMPLATE = '''"""{target_class} {summary}

Written by `eaglekit doctor --engine vllm --fix` for vLLM {version}. Registered for architecture
{architecture!r} by `register()` in __init__.py (entry point group `vllm.general_plugins`).
"""

from vllm.model_executor.models.interfaces import SupportsEagle3
from {module} import {target_class} as _Target
{constants}

class {name}(_Target, SupportsEagle3):
    """{target_class} {summary}"""

    supports_eagle3 = True

    def __init__(self, *, vllm_config, prefix: str = ""):  # the signature vLLM inspects to call models
        super().__init__(vllm_config=vllm_config, prefix=prefix)
{init_body}{methods}'''

# A wrapper whose inner language model implements SupportsEagle3: delegate the interface to it.
DELEGATION_SUMMARY = "with EAGLE-3 delegated to its inner language model ({inner})"
DELEGATION_CONSTANTS = '''
GETTERS = {getters!r}
# vLLM's EAGLE proposer reads `image_token_index` from a multimodal target's config when it loads the drafter
# (before any EAGLE-3 check); wrappers that name their image placeholder otherwise get it under that name too
PLACEHOLDER_NAMES = ("image_token_id", "media_placeholder_token_id")
'''
DELEGATION_INIT = '''        config = getattr(self, "config", None)
        if config is not None and not hasattr(config, "image_token_index"):
            for placeholder in PLACEHOLDER_NAMES:
                if hasattr(config, placeholder):
                    config.image_token_index = getattr(config, placeholder)
                    break
'''
DELEGATION_METHODS = '''
    def set_aux_hidden_state_layers(self, layers):
        self.language_model.set_aux_hidden_state_layers(layers)

    def _inner_default_layers(self):
        for getter in GETTERS:
            if hasattr(self.language_model, getter):
                return getattr(self.language_model, getter)()
        raise RuntimeError("{inner} has no EAGLE-3 default-layer getter; this plugin does not fit this vLLM")

    def get_eagle3_aux_hidden_state_layers(self):
        return self._inner_default_layers()

    def get_eagle3_default_aux_hidden_state_layers(self):
        return self._inner_default_layers()
'''

# A decoder whose embedding has a name vLLM's EAGLE proposer does not look up: expose it under one it does.
ALIAS_SUMMARY = "with its decoder's embedding ({attribute}) also reachable as {alias}"
ALIAS_CONSTANTS = '''
# vLLM's EAGLE proposer looks the target's embedding up as `language_model.{holder}.{alias}` when it loads a
# drafter ({proposer}); this decoder names it `{attribute}`
'''
ALIAS_INIT = '''        decoder = {decoder_path}
        if not hasattr(decoder, {alias!r}):  # object.__setattr__: the same module, not registered (nor loaded) twice
            object.__setattr__(decoder, {alias!r}, decoder.{attribute})
'''

# A class whose decoder collects the aux states already (by inheritance, mostly): the interface over that decoder.
SUBCLASS_SUMMARY = ("with the EAGLE-3 interface over its decoder {decoder} (self.{holder}), which collects the aux "
                    "states")
SUBCLASS_CONSTANTS = '''
# {decoder} ({decoder_where}) collects the aux hidden states in its forward already;
# {target_class} only lacks the interface by which vLLM asks for them
'''
SUBCLASS_SETTERS = {
    "_set_aux_hidden_state_layers": "self.{holder}._set_aux_hidden_state_layers(tuple(layers))",
    "aux_hidden_state_layers": "self.{holder}.aux_hidden_state_layers = tuple(layers)",
}
SUBCLASS_METHODS = '''
    def set_aux_hidden_state_layers(self, layers):
        {set_layers}

    def get_eagle3_default_aux_hidden_state_layers(self):  # vLLM's default: (2, L // 2, L - 3)
        num_layers = len(self.{holder}.layers)
        return (2, num_layers // 2, num_layers - 3)

    def get_eagle3_aux_hidden_state_layers(self):  # the same, by the getter's name before 2026-03
        num_layers = len(self.{holder}.layers)
        return (2, num_layers // 2, num_layers - 3)
'''

INIT_TEMPLATE = '''"""vLLM plugin written by eaglekit: EAGLE-3 for {architecture} ({target_class} {summary})."""

ARCHITECTURE = {architecture!r}
MODEL_CLASS = "{package}.model:{name}"


def register():
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
'''

PYPROJECT_TEMPLATE = '''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{distribution}"
version = "0.1.0"
description = "EAGLE-3 for {architecture} in vLLM (eaglekit doctor --fix)"
requires-python = ">=3.9"

[project.entry-points."vllm.general_plugins"]
{package} = "{package}:register"

[tool.setuptools]
packages = ["{package}"]
'''


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def write_vllm_plugin(report: dict[str, Any], output: str | Path, overwrite: bool = False) -> Path:
    """Write the plugin package for the target in `report` (a vLLM doctor report) under `output`: a project
    folder named after the package, which an earlier `--fix` may have written (it is rewritten) and nothing else
    may have, unless `overwrite`."""
    if report["engine"] != "vllm":
        raise EaglekitError("--fix writes a vLLM plugin; SGLang has no out-of-tree model registration hook to use")
    if report["verdict"] == "supported":
        raise EaglekitError(f"{report['target']['architecture']} is already supported by this vLLM: nothing to fix")
    if not report.get("plugin_fix_possible"):
        why = "; ".join(report["reasons"]) or "the doctor could not establish the facts"
        raise EaglekitError(f"the plugins --fix writes cannot fix this: {why}. Needed instead: "
                            f"{'; '.join(report['fix'])}")
    architecture = report["target"]["architecture"]
    package = f"eaglekit_eagle3_{_slug(architecture)}"
    fields = {"architecture": architecture, "package": package, "name": f"Eagle3{report['class']['class']}",
              "target_class": report["class"]["class"], "module": report["class"]["module"],
              "version": report["engine_version"], "distribution": package.replace("_", "-")}
    parts = _plugin_parts(report)
    model = MODEL_TEMPLATE.format(**fields, **parts)
    root = claim_output(Path(output) / package.replace("_", "-"), "doctor", overwrite)
    atomic_write_text(root / "pyproject.toml", PYPROJECT_TEMPLATE.format(**fields))
    atomic_write_text(root / package / "model.py", model)
    atomic_write_text(root / package / "__init__.py", INIT_TEMPLATE.format(**fields, summary=parts["summary"]))
    return root


def _plugin_parts(report: dict[str, Any]) -> dict[str, str]:
    """The plugin class's summary, constants, __init__ lines and methods: delegation to a wrapper's language model, or
    the interface over the class's own decoder (`subclass`), an alias for the decoder's embedding, or both."""
    wrapper = report.get("wrapper") or {}
    delegate = bool(wrapper) and not report["interface"]["implements"]
    subclass = (report.get("subclass") or {}) if not wrapper and not report["interface"]["implements"] else {}
    embedding = (report.get("serving") or {}).get("embedding") or {}
    alias = embedding.get("status") == "missing" and embedding.get("embedding_attribute")
    summaries, constants, init, methods = [], "", "", ""
    if delegate:
        if wrapper.get("forward_passthrough") is not True:
            raise EaglekitError(f"{report['class']['class']}.forward does not visibly return the "
                                "language model's output, so the aux states could be dropped on the way out; the "
                                "plugin would not be enough")
        inner = wrapper["inner"]["class"]
        summaries.append(DELEGATION_SUMMARY.format(inner=inner))
        constants += DELEGATION_CONSTANTS.format(getters=GETTERS)
        init += DELEGATION_INIT
        methods += DELEGATION_METHODS.format(inner=inner)
    if subclass:
        if not subclass["fits"]:
            raise EaglekitError(f"{report['class']['class']} lacks the EAGLE-3 interface and a subclass cannot add it: "
                                f"{'; '.join(subclass['why'])}")
        names = {"holder": subclass["holder"], "decoder": subclass["decoder"],
                 "decoder_where": subclass["decoder_where"], "target_class": report["class"]["class"]}
        summaries.append(SUBCLASS_SUMMARY.format(**names))
        constants += SUBCLASS_CONSTANTS.format(**names)
        methods += SUBCLASS_METHODS.format(set_layers=SUBCLASS_SETTERS[subclass["setter"]].format(**names), **names)
    if alias:
        names = {"attribute": embedding["embedding_attribute"], "alias": embedding["names"][0],
                 "holder": embedding["holder"], "proposer": embedding["proposer"],
                 "decoder_path": f"self.language_model.{embedding['holder']}" if wrapper.get("inner")
                 else f"self.{embedding['holder']}"}
        summaries.append(ALIAS_SUMMARY.format(**names))
        constants += ALIAS_CONSTANTS.format(**names)
        init += ALIAS_INIT.format(**names)
    assert summaries, "plugin_fix_possible without a delegation, an interface or an alias to write"
    return {"summary": " and ".join(summaries), "constants": constants, "init_body": init, "methods": methods}


# --- reading registrations -------------------------------------------------------------------
def _registrations_in(module: str, tree: ast.Module, function: str, plugin: str, where: str) -> list[dict[str, Any]]:
    """`register_model("Arch", "module:Class" | Class)` calls in the entry-point function (module constants
    resolved)."""
    constants = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == function):
            continue
        for call in ast.walk(node):
            if not (isinstance(call, ast.Call) and ast.unparse(call.func).endswith("register_model")
                    and len(call.args) >= 2):
                continue
            arch, target = (constants.get(a.id, a) if isinstance(a, ast.Name) else a for a in call.args[:2])
            if not (isinstance(arch, ast.Constant) and isinstance(arch.value, str)):
                continue
            if isinstance(target, ast.Constant) and isinstance(target.value, str) and ":" in target.value:
                target_module, target_class = target.value.split(":", 1)
            elif isinstance(target, ast.Name):
                target_module, target_class = module, target.id
            else:
                continue
            found.append({"architecture": arch.value, "module": target_module, "class": target_class,
                          "plugin": plugin, "where": f"{where}:{call.lineno}"})
    return found


def _module_file(roots: list[Path], module: str) -> tuple[Path, Path] | None:
    base = module.replace(".", "/")
    for root in roots:
        for candidate in (root / f"{base}.py", root / base / "__init__.py"):
            if candidate.is_file():
                return root, candidate
    return None


def parse_toml(text: str) -> dict[str, Any]:
    """TOML text as a dict: the standard library's tomllib (Python >= 3.11), else tomli (the same parser)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli, a dependency there
        import tomli as tomllib
    return tomllib.loads(text)


def plugin_entry_points(pyproject: str) -> dict[str, str]:
    """name -> "module:function" of the `vllm.general_plugins` entry points declared in pyproject.toml text."""
    return parse_toml(pyproject).get("project", {}).get("entry-points", {}).get(GROUP, {})


def _scan_project(project: Path) -> tuple[list[dict[str, Any]], list[EngineSource]]:
    entry_points = plugin_entry_points((project / "pyproject.toml").read_text())
    registrations, sources = [], []
    for name, value in entry_points.items():
        module, _, function = value.partition(":")
        located = _module_file([project, project / "src"], module)
        if located is None:
            continue
        root, path = located
        registrations += _registrations_in(module, ast.parse(path.read_text()), function or "register", name, str(path))
        sources.append(DirectorySource(module.split(".")[0], root))
    return registrations, sources


def find_registrations(plugin_dirs: tuple[str, ...] = (), installed: bool = True,
                       site: Path | None = None) -> tuple[list[dict[str, Any]], list[EngineSource]]:
    """vLLM plugin registrations from plugin project dirs and installed entry points, read without importing.
    Installed ones: those of the distributions in `site` (the site-packages vLLM itself is read from) and in the
    PYTHONPATH entries (a vLLM started from here has them on its path before its own site-packages), else of this
    environment."""
    registrations: list[dict[str, Any]] = []
    sources: list[EngineSource] = []
    for directory in plugin_dirs:
        path = Path(directory).expanduser()
        if not path.is_dir():
            raise EaglekitError(f"plugins directory {path} does not exist")
        projects = sorted({p.parent for p in [*path.glob("pyproject.toml"), *path.glob("*/pyproject.toml"),
                                              *path.glob("*/*/pyproject.toml")]})
        for project in projects:
            found, roots = _scan_project(project)
            registrations += found
            sources += roots
    if installed:
        if site is None:
            entry_points = list(importlib.metadata.entry_points(group=GROUP))
        else:
            paths = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry] + [str(site)]
            entry_points = [entry_point for dist in importlib.metadata.distributions(path=paths)
                            for entry_point in dist.entry_points if entry_point.group == GROUP]
        for entry_point in entry_points:
            dist = entry_point.dist
            if dist is None or not dist.files:
                continue
            base = entry_point.module.replace(".", "/")
            for file in dist.files:
                if str(file) in (f"{base}.py", f"{base}/__init__.py"):
                    path = Path(dist.locate_file(file))
                    root = Path(str(dist.locate_file("")))
                    registrations += _registrations_in(entry_point.module, ast.parse(path.read_text()),
                                                       entry_point.attr or "register", entry_point.name, str(path))
                    sources.append(DirectorySource(entry_point.module.split(".")[0], root))
    return registrations, sources
