"""Can a serving engine run EAGLE-3 for this target? Answered from the engine's own source, read with `ast`.

For vLLM: the registry (`vllm/model_executor/models/registry.py`) maps `architectures[0]` to a module
and class; that class must have `SupportsEagle3` in its MRO with `set_aux_hidden_state_layers` and the
default-layers getter (named `get_eagle3_aux_hidden_state_layers` before 2026-03 and
`get_eagle3_default_aux_hidden_state_layers` after; the protocol in `interfaces.py` says which this
release wants), its decoder must collect the aux states in `forward`, and releases that have the
model-type allow-list in `vllm/config` must list the target's model type.
For SGLang: the class in some module's `EntryClass` must have `set_eagle3_layers_to_capture` and
`get_embed_and_head`, and its decoder must collect the aux states.

Multimodal wrappers hold the language model by composition (`self.language_model = ...`): the doctor
finds the inner class and says whether the wrapper delegates. Nothing here is a table of known models.
The facts are read by `facts`, checked per engine by `checks`; this module runs them and words the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError
from eaglekit.doctor.checks import check_sglang, check_vllm
from eaglekit.doctor.facts import read_target
from eaglekit.doctor.source import EngineSource
from eaglekit.doctor.pysource import ModuleIndex


# --- entry point ------------------------------------------------------------------------------
def diagnose(engine: str, target: str, engine_source: str = "", plugins: tuple[str, ...] = (),
             installed_plugins: bool = True, device_type: str = "") -> dict[str, Any]:
    """The full report for `target` on `engine` (see the module docstring). `device_type`: what the vLLM read runs on
    ("cpu": its CPU attention must take the target's head size); empty: "cpu" for the CPU build's distribution."""
    from eaglekit.doctor.limits import build_device
    from eaglekit.doctor.source import DirectorySource, open_source
    from eaglekit.doctor.plugin import find_registrations

    parsed = read_target(target)
    source = open_source(engine, engine_source)
    if engine == "vllm":
        # a plugin counts where vLLM would load it: beside the vLLM read, when that is an installed one
        site = source.root if isinstance(source, DirectorySource) and any(source.root.glob("*.dist-info")) else None
        registrations, plugin_sources = find_registrations(plugins, installed_plugins, site)
        index = ModuleIndex([source, *plugin_sources])
        report = check_vllm(index, source, parsed, registrations, device_type or build_device(source))
        report["plugins"] = registrations
    else:
        report = check_sglang(ModuleIndex([source]), source, parsed)
    _convert_defaults(report)
    report["explicit_aux_ids_read_by"] = explicit_id_readers(engine, source)
    return report


def vllm_serving_note(target: str, architecture: str = "") -> str | None:
    """For `export --to vllm`: one line when the vLLM this environment reads (installed, else .venv-vllm) would not
    serve a drafter for `target` (its folder, else its architecture name), with the doctor's fix; None when it
    would, or when there is no vLLM or no target to read."""
    report = None
    local = target == "tiny" or Path(target).expanduser().exists()  # a hub id is not looked up on the network here
    for candidate in (target if local else "", architecture):
        try:
            report = diagnose("vllm", candidate, installed_plugins=True) if candidate else None
        except EaglekitError:
            continue
        if report is not None:
            break
    if report is None or report["verdict"] == "supported":
        return None
    return (f"vLLM {report['engine_version']} would not serve this drafter for {report['target']['architecture']}: "
            f"{report['reasons'][-1]}; {report['fix'][-1] if report['fix'] else 'see eaglekit doctor --engine vllm'}")


# Where an engine's runtime (not its models) would read a drafter's explicit aux ids.
RUNTIME_DIRS = {"vllm": ("vllm/v1", "vllm/config", "vllm/spec_decode"),
                "sglang": ("sglang/srt/model_executor", "sglang/srt/speculative")}


def explicit_id_readers(engine: str, source: EngineSource) -> list[str]:
    """Runtime files that read `eagle_aux_hidden_state_layer_ids` from the drafter config (empty: the engine
    ignores explicit ids and always uses the target's default layers)."""
    readers = []
    for prefix in RUNTIME_DIRS[engine]:
        for path in source.python_files(prefix):
            if "eagle_aux_hidden_state_layer_ids" in (source.read(path) or ""):
                readers.append(path)
    return readers


def _convert_defaults(report: dict[str, Any]) -> None:
    """Say the default ids in eaglekit's (input-of-layer) convention and the engine's explicit-id one."""
    layers = report.get("default_aux_layers")
    if not layers or not layers.get("ids"):
        return
    ids = layers["ids"]
    layers["input_of_layer_ids"] = ids  # vLLM getters and SGLang's layers_to_capture both index "before layer i"
    layers["engine_explicit_ids"] = ids if report["engine"] == "vllm" else [i - 1 for i in ids]


def format_report(report: dict[str, Any]) -> str:
    """Human-readable report: verdict first, then the facts with the file and line they came from."""
    target = report["target"]
    lines = [f"{report['engine']} {report['engine_version']} ({report['engine_source']})",
             f"target: {target['architecture']} (model_type {target['model_type']}, {target['num_layers']} layers; "
             f"{target['source']})",
             f"verdict: {report['verdict'].upper()}"]
    if "capture" in report:
        lines.append(f"capture (extract backend=vllm): {report['capture']['verdict'].upper()}")
    registry = report.get("registry")
    if registry:
        lines.append(f"registry: {target['architecture']} -> {registry['module']}.{registry['class']} (registered by "
                     f"{registry['registered_by']})")
    if report.get("class"):
        lines.append(f"class: {report['class']['class']} at {report['class']['file']}:{report['class']['line']}")
    interface = report.get("interface")
    if interface:
        for name, fact in interface["methods"].items():
            where = f" in {fact['class']} ({fact['where']})" if fact["status"] != "missing" else ""
            lines.append(f"  {name}: {fact['status']}{where}")
    if report.get("allow_list"):
        allow = report["allow_list"]
        lines.append(f"allow-list {allow['name']} {allow['model_types']} at {allow['file']}:{allow['line']}: "
                     f"{ {True: 'passes', False: 'REJECTS', None: 'needs model_type'}[allow['passes']] }")
    wrapper = report.get("wrapper")
    if wrapper:
        inner = wrapper["inner"]["class"] if wrapper["inner"] else "unknown"
        lines.append(f"wrapper: self.language_model = {inner} ({wrapper['inner_how']}); forward passes its output "
                     f"through: {wrapper.get('forward_passthrough')}")
    decoder = report.get("decoder")
    if decoder:
        lines.append(f"decoder: {decoder['class']} ({decoder['where']}), collects aux states: "
                     f"{decoder['collects_aux']} {decoder['evidence']}")
    layers = report.get("default_aux_layers")
    if layers:
        lines.append(f"default aux layers: {layers['expression']} at {layers['where']} -> input-of-layer ids "
                     f"{layers.get('input_of_layer_ids') or '(needs the layer count: pass config.json)'}"
                     + (f", engine explicit ids {layers['engine_explicit_ids']}" if layers.get("engine_explicit_ids")
                        else ""))
    subclass = report.get("subclass")
    if subclass:
        lines.append(f"subclass plugin: the interface over self.{subclass['holder']} ({subclass['decoder']}, setter "
                     f"{subclass['setter']}): " + ("fits" if subclass["fits"] else "does not fit: "
                                                   + "; ".join(subclass["why"])))
    limit = report.get("cpu_attention")
    if limit and limit["head_size"] is not None:
        build = {"cpu": "this CPU build", None: "vLLM's CPU build (if this is it)"}.get(report.get("device_type"),
                                                                                      "not this build")
        lines.append(f"CPU attention ({build}): {limit['backend']} takes head sizes {limit['sizes']} "
                     f"({limit['where']}): the target's {limit['head_size']} "
                     + ("is one" if limit["takes"] else "is NOT one"))
    embedding = (report.get("serving") or {}).get("embedding")
    if embedding:
        found = {"ok": f"found ({embedding['provided_by']})", "missing": "MISSING", "unknown": "unknown"}
        lines.append(f"drafter loading: {embedding['proposer']} needs {embedding['language_model']}."
                     f"{embedding['holder']}.{' or .'.join(embedding['names'])}: {found[embedding['status']]}")
    if "explicit_aux_ids_read_by" in report:
        readers = report["explicit_aux_ids_read_by"]
        lines.append(f"drafter's explicit aux ids read by: {', '.join(readers)}" if readers else
                     "drafter's explicit aux ids: IGNORED by this release (it always uses the default layers above; "
                     "train the drafter on them)")
    lines += [f"why: {r}" for r in report["reasons"]] + [f"fix: {f}" for f in report["fix"]]
    return "\n".join(lines)
