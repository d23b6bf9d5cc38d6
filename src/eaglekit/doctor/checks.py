"""The per-engine EAGLE-3 checks of `eaglekit doctor --engine`, and their verdict with the fix to make.

Every fact in a report names the file and line it was read from, so a user can check it.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from eaglekit.doctor.facts import (
    NOT_SUPPORTED, SUPPORTED, UNKNOWN, VLLM_ALLOW_LIST_MODULES, VLLM_INTERFACES, Target, class_of_value, in_mro,
    method_facts, decoder_facts, default_layers, forward_passthrough, lookup, sglang_registry, subclass_facts,
    vllm_registry,
)
from eaglekit.doctor.limits import cpu_attention, head_size_reason
from eaglekit.doctor.serving import check_embedding, embedding_lookup
from eaglekit.doctor.source import EngineSource
from eaglekit.doctor.pysource import ClassInfo, ModuleIndex

ALLOW_LIST_NAME = re.compile(r"eagle3.*supported")  # vLLM's list names: eagle3_target_supported, ...
SGLANG_METHODS = ("set_eagle3_layers_to_capture", "get_embed_and_head")


def _report(engine: str, source: EngineSource, target: Target) -> dict[str, Any]:
    return {"engine": engine, "engine_version": source.version(), "engine_source": source.description,
            "target": {"architecture": target.architecture, "model_type": target.model_type,
                       "num_layers": target.num_layers, "source": target.source, "head_size": target.head_size},
            "verdict": UNKNOWN, "reasons": [], "fix": [], "plugin_fix_possible": False, "serving_only": []}


def _unknown(report: dict[str, Any], reason: str) -> dict[str, Any]:
    report["verdict"] = UNKNOWN
    report["reasons"].append(reason)
    return report


def _class_entry(cls: ClassInfo, source: EngineSource) -> dict[str, Any]:
    return {"module": cls.module, "class": cls.name, "file": cls.relative, "line": cls.line}


# --- vLLM -----------------------------------------------------------------------------------
def vllm_interface(index: ModuleIndex, cls: ClassInfo, protocol: ClassInfo) -> dict[str, Any]:
    required: list[str] = []  # the protocol's public methods, its parent protocols' included
    for entry in index.mro(protocol):
        if isinstance(entry, ClassInfo):
            required += [m for m in entry.methods() if not m.startswith("_") and m not in required]
    protocols = tuple(e.name for e in index.mro(protocol) if isinstance(e, ClassInfo))
    methods = method_facts(index, cls, required, protocols)
    found_in_mro = in_mro(index, cls, protocol.name) is not None
    flag = found_in_mro or any(isinstance(e, ClassInfo) and "supports_eagle3" in e.class_attributes()
                               for e in index.mro(cls))
    implements = flag and all(m["status"] != "missing" for m in methods.values())
    return {"interface": protocol.name, "in_mro": found_in_mro, "flag": flag, "methods": methods,
            "implements": implements,
            "getter": next((m for m in required if m.startswith("get_eagle3")), None)}


def vllm_allow_list(index: ModuleIndex, target: Target) -> dict[str, Any] | None:
    """The model-type allow-list for EAGLE-3 targets that some vLLM releases had in vllm/config."""
    if "allow_list" not in index.memo:
        index.memo["allow_list"] = _allow_list(index)
    found = index.memo["allow_list"]
    if found is None:
        return None
    passes = None if target.model_type is None else any(v in target.model_type for v in found["model_types"])
    return {**found, "model_type": target.model_type, "passes": passes}


def _allow_list(index: ModuleIndex) -> dict[str, Any] | None:
    for module in VLLM_ALLOW_LIST_MODULES:
        info = index.module(module)
        if info is None:
            continue
        for node in ast.walk(info.tree):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, (ast.List, ast.Tuple)):
                continue
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if not any(ALLOW_LIST_NAME.search(n) for n in names):
                continue
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            return {"file": info.relative, "line": node.lineno, "name": names[0], "model_types": values}
    return None


def _inner_model(index: ModuleIndex, assignments: list, registry: dict, target: Target) -> tuple:
    """(owner, value, inner class or None, how) from the `self.language_model = ...` statements (None ones skipped)."""
    real = [(o, v) for o, v in assignments if not (isinstance(v, ast.Constant) and v.value is None)] or assignments
    first = None
    for owner, value in real:
        inner, how = class_of_value(index, owner, value, registry, target.text_architecture)
        first = first or (owner, value, inner, how)
        if inner is not None:
            return owner, value, inner, how
    return first


def _vllm_wrapper(index: ModuleIndex, cls: ClassInfo, registry: dict, protocol: ClassInfo,
                  target: Target) -> dict[str, Any] | None:
    assignments = index.self_assignments(cls, "language_model")
    if not assignments:
        return None
    owner, value, inner, how = _inner_model(index, assignments, registry, target)
    wrapper = {"attribute": "language_model", "assigned_at": f"{owner.relative}:{value.lineno}", "inner_how": how,
               "inner": None, "inner_interface": None, "forward_passthrough": forward_passthrough(index, cls)}
    if inner is not None:
        wrapper["inner"] = _class_entry(inner, None)
        wrapper["inner_interface"] = vllm_interface(index, inner, protocol)
        wrapper["_inner_class"] = inner
    return wrapper


def check_vllm(index: ModuleIndex, source: EngineSource, target: Target, registrations: list[dict[str, Any]],
               device_type: str | None = None) -> dict[str, Any]:
    """The vLLM report; `device_type` "cpu": the build's CPU attention must take the target's head size."""
    report = _report("vllm", source, target)
    report["device_type"] = device_type
    report["capture"] = {"verdict": UNKNOWN, "reasons": report["reasons"]}  # until the class is read
    if "registry" not in index.memo:
        index.memo["registry"] = vllm_registry(index)
    registry = index.memo["registry"]
    if registry is None:
        return _unknown(report, "vllm/model_executor/models/registry.py is missing or holds no (module, class) dict: "
                                "this vLLM layout is not recognised")
    plugin = next((r for r in registrations if r["architecture"] == target.architecture), None)
    module, name = (plugin["module"], plugin["class"]) if plugin else lookup(registry, target.architecture, "vLLM")
    report["registry"] = {"file": "vllm/model_executor/models/registry.py", "module": module, "class": name,
                          "registered_by": plugin["plugin"] if plugin else "vllm"}
    cls = index.find_class(module, name)
    if cls is None:
        return _unknown(report,
                        f"the registry maps {target.architecture} to {module}.{name}, which is not in the source read")
    report["class"] = _class_entry(cls, source)
    protocol = index.find_class(VLLM_INTERFACES, "SupportsEagle3")
    if protocol is None:
        return _unknown(report,
                        "vllm/model_executor/models/interfaces.py has no SupportsEagle3: this vLLM predates EAGLE-3 "
                                "or moved the interface; the doctor does not recognise the layout")
    report["interface"] = vllm_interface(index, cls, protocol)
    report["allow_list"] = vllm_allow_list(index, target)
    wrapper = _vllm_wrapper(index, cls, registry, protocol, target)
    inner = wrapper.pop("_inner_class", None) if wrapper else None
    report["wrapper"] = wrapper
    decoder = decoder_facts(index, inner or cls) if (inner or not wrapper) else None
    report["decoder"] = decoder
    if decoder is not None and not wrapper and not report["interface"]["implements"]:
        report["subclass"] = subclass_facts(index, cls, decoder)  # the interface over a decoder that collects
    if decoder is not None:
        decoder.pop("_class")
    getter = report["interface"]["getter"]
    holder = cls if report["interface"]["implements"] or inner is None else inner
    layers = default_layers(index, holder, getter, target.num_layers) if getter else None
    if layers is None and getter and inner is not None:  # a delegating wrapper: the inner model's getter decides
        layers = default_layers(index, inner, getter, target.num_layers)
    report["default_aux_layers"] = layers
    proposer = embedding_lookup(source)  # what the EAGLE proposer reads of the target when it loads a drafter
    report["serving"] = ({"embedding": check_embedding(index, inner or cls, proposer, target, source)} if proposer
                         else None)
    report["cpu_attention"] = cpu_attention(index, source, target)
    _vllm_verdict(report, cls, inner)
    report["capture"] = _capture_verdict(report)
    return report


def _vllm_verdict(report: dict[str, Any], cls: ClassInfo, inner: ClassInfo | None) -> None:
    interface, wrapper, decoder, allow = report["interface"], report["wrapper"], report["decoder"], report["allow_list"]
    reasons, fix = report["reasons"], report["fix"]
    methods = ", ".join(interface["methods"])
    if allow and allow["passes"] is False:
        reasons.append(f"model_type {allow['model_type']!r} is not in {allow['name']} {allow['model_types']} "
                       f"({allow['file']}:{allow['line']}): the speculative config rejects EAGLE-3 for it")
        fix.append("use a vLLM release without that allow-list, or add the model type to it in "
                   f"{allow['file']}:{allow['line']}")
    collects = decoder["collects_aux"] if decoder else None
    if decoder and collects is False:
        reasons.append(f"{decoder['class']}.forward ({decoder.get('forward', decoder['where'])}) does not collect aux "
                       "hidden states")
        fix.append(f"make {decoder['class']}.forward collect the aux states and return (hidden_states, "
                   "aux_hidden_states) as vLLM's LlamaModel does: a model change that no plugin can make")
    if interface["implements"]:
        reasons.insert(0, f"{cls.name} implements {interface['interface']} ({methods})")
        _embedding_verdict(report, wrapper_fixable=False)
    elif wrapper:
        inner_ok = bool(wrapper["inner_interface"] and wrapper["inner_interface"]["implements"])
        inner_name = wrapper["inner"]["class"] if wrapper["inner"] else "the inner language model"
        reasons.insert(0, f"{cls.name} ({cls.where}) holds {inner_name} as self.language_model but does not implement "
                          f"{interface['interface']}, so vLLM refuses EAGLE-3 for it "
                          + ("(inner model: unknown)" if wrapper["inner"] is None
                             else f"(inner model {'implements' if inner_ok else 'does not implement'} it)"))
        fix.insert(0, f"in {cls.relative}, add {interface['interface']} to the bases of {cls.name} and implement "
                      f"{methods} delegating to self.language_model")
        if inner_ok and collects:
            report["plugin_fix_possible"] = True
            _embedding_verdict(report, wrapper_fixable=True)
            fix.append("or run `eaglekit doctor --engine vllm --fix` to write an out-of-tree plugin that does this "
                       "delegation")
        if wrapper["inner"] is None:
            reasons.append(f"inner class unknown: {wrapper['inner_how']}")
    else:
        reasons.insert(0, f"{cls.name} ({cls.where}) does not implement {interface['interface']} "
                          f"(in MRO: {interface['in_mro']}; methods: "
                          + ", ".join(f"{k} {v['status']}" for k, v in interface["methods"].items()) + ")")
        fix.insert(0, f"in {cls.relative}, add {interface['interface']} to {cls.name}'s bases and implement {methods}")
        subclass = report.get("subclass") or {}
        if subclass.get("fits"):
            report["plugin_fix_possible"] = True
            _embedding_verdict(report, wrapper_fixable=True)
            fix.append(f"or run `eaglekit doctor --engine vllm --target {_target_argument(report)} --fix`: it writes "
                       f"an out-of-tree plugin registering a subclass of {cls.name} with the interface over "
                       f"self.{subclass['holder']} ({subclass['decoder']}, which collects the aux states already)")
    limit = report.get("cpu_attention") or {}
    if report.get("device_type") == "cpu" and limit.get("takes") is False:
        reasons.append(head_size_reason(limit))
        fix.append(f"run vLLM on a GPU build, or a target whose head size is one of {limit['sizes']}")
    embedding = (report.get("serving") or {}).get("embedding") or {}
    if fix:
        report["verdict"] = NOT_SUPPORTED
    elif collects is None or (allow and allow["passes"] is None) or embedding.get("status") == "unknown":
        report["verdict"] = UNKNOWN
        if embedding.get("status") == "unknown":
            reasons.append(f"could not tell whether vLLM's EAGLE proposer ({embedding['proposer']}) finds the "
                           f"target's embedding: {embedding['why']}")
            report["serving_only"].append(reasons[-1])
        if allow and allow["passes"] is None:
            reasons.append(f"{allow['file']}:{allow['line']} limits EAGLE-3 to model types {allow['model_types']}; "
                           "pass the target's config.json so its model_type can be checked")
        if collects is None:
            reasons.append("could not tell whether the decoder collects aux hidden states"
                           + (f" ({decoder['evidence']})" if decoder else ""))
    else:
        report["verdict"] = SUPPORTED
        reasons.append(f"decoder {decoder['class']} collects aux states in forward ({', '.join(decoder['evidence'])})")


def _embedding_verdict(report: dict[str, Any], wrapper_fixable: bool) -> None:
    """The proposer's embedding lookup (`serving`): a class with the interface can still fail to serve."""
    embedding = (report.get("serving") or {}).get("embedding") or {}
    if embedding.get("status") != "missing":
        return
    names = " or ".join(embedding["names"])
    where = f"{embedding['language_model']}.{embedding['holder']}.{' or .'.join(embedding['names'])}"
    report["reasons"].append(
        f"vLLM's EAGLE proposer ({embedding['proposer']}) looks the target's embedding up as {where} before it "
        f"looks at the drafter, and refuses to load any drafter otherwise (\"Target model does not have ...\"): "
        f"{embedding['why']}; a drafter that carries its own embedding does not avoid this")
    attribute, target = embedding["embedding_attribute"], report["target"]
    report["serving_only"].append(report["reasons"][-1])
    if not attribute:
        report["fix"].append(f"give the decoder's embedding one of the names {names}: a model change")
        return
    fixable = wrapper_fixable or not report["fix"]
    argument = _target_argument(report)
    report["fix"].append(f"run `eaglekit doctor --engine vllm --target {argument} --fix`: it writes a plugin that "
                         f"registers {target['architecture']} as a subclass of {report['class']['class']} exposing "
                         f"self.{embedding['holder']}.{attribute} as {embedding['names'][0]} too"
                         + ("" if fixable else " (once the other fixes are made)"))
    report["plugin_fix_possible"] = report["plugin_fix_possible"] or fixable


def _target_argument(report: dict[str, Any]) -> str:
    target = report["target"]
    return target["source"] if target["source"] != "architecture name" else target["architecture"]


def _capture_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Can vLLM capture hidden states from the target (`extract backend=vllm`: its `extract_hidden_states` method)?
    It asks of the target class what a drafter does (vLLM's model runner checks `supports_eagle3` for both: the
    EAGLE-3 interface, a decoder that collects), the allow-list and the build's attention too, but not the EAGLE
    proposer's embedding lookup (`serving`), which is the drafter's business."""
    interface, decoder, allow = report["interface"], report["decoder"], report["allow_list"]
    limit = report.get("cpu_attention") or {}
    collects = decoder["collects_aux"] if decoder else None
    reasons = [r for r in report["reasons"] if r not in report["serving_only"]]
    if (not interface["implements"] or collects is False or (allow and allow["passes"] is False)
            or (report.get("device_type") == "cpu" and limit.get("takes") is False)):
        return {"verdict": NOT_SUPPORTED, "reasons": reasons}
    if collects is None or (allow and allow["passes"] is None):
        return {"verdict": UNKNOWN, "reasons": reasons}
    return {"verdict": SUPPORTED, "reasons": reasons}


# --- SGLang ---------------------------------------------------------------------------------
def check_sglang(index: ModuleIndex, source: EngineSource, target: Target) -> dict[str, Any]:
    report = _report("sglang", source, target)
    registry = sglang_registry(source, index, only=target.architecture)
    if not registry or target.architecture not in registry:
        registry = sglang_registry(source, index)
    if registry is None:
        return _unknown(report,
                        "sglang/srt/models/ has no module with an EntryClass: this SGLang layout is not recognised")
    module, name = lookup(registry, target.architecture, "SGLang")
    report["registry"] = {"file": f"{module.replace('.', '/')}.py", "module": module, "class": name,
                          "registered_by": "EntryClass"}
    cls = index.find_class(module, name)
    if cls is None:
        return _unknown(report, f"EntryClass of {module} names {name}, which the doctor could not resolve")
    report["class"] = _class_entry(cls, source)
    methods = method_facts(index, cls, list(SGLANG_METHODS), ())
    report["interface"] = {"interface": "set_eagle3_layers_to_capture", "methods": methods,
                           "implements": all(m["status"] != "missing" for m in methods.values())}
    wrapper, inner = None, None
    assignments = index.self_assignments(cls, "language_model")
    if assignments:
        owner, value, inner, how = _inner_model(index, assignments, registry, target)
        wrapper = {"attribute": "language_model", "assigned_at": f"{owner.relative}:{value.lineno}", "inner_how": how,
                   "inner": _class_entry(inner, source) if inner else None,
                   "inner_interface": ({"methods": method_facts(index, inner, list(SGLANG_METHODS), ())} if inner
                                       else None)}
    report["wrapper"] = wrapper
    report["decoder"] = decoder_facts(index, inner or cls) if (inner or not wrapper) else None
    if report["decoder"] is not None:
        report["decoder"].pop("_class")
    layers = default_layers(index, cls, "set_eagle3_layers_to_capture", target.num_layers,
                            attribute="layers_to_capture")
    if layers is None and inner is not None:
        layers = default_layers(index, inner, "set_eagle3_layers_to_capture", target.num_layers,
                                attribute="layers_to_capture")
    report["default_aux_layers"] = layers
    _sglang_verdict(report, cls)
    return report


def _sglang_verdict(report: dict[str, Any], cls: ClassInfo) -> None:
    interface, decoder, wrapper = report["interface"], report["decoder"], report["wrapper"]
    reasons, fix = report["reasons"], report["fix"]
    missing = [k for k, v in interface["methods"].items() if v["status"] == "missing"]
    if missing:
        reasons.append(f"{cls.name} ({cls.where}) lacks {', '.join(missing)}")
        target = "self.language_model" if wrapper else "self.model (setting layers_to_capture)"
        fix.append(f"in {cls.relative}, implement {', '.join(missing)} on {cls.name}, delegating to {target}")
    else:
        reasons.append(f"{cls.name} has " + ", ".join(f"{k} ({v['class']})" for k, v in interface["methods"].items()))
    collects = decoder["collects_aux"] if decoder else None
    if collects is False:
        reasons.append(f"{decoder['class']}.forward does not collect aux hidden states")
        fix.append(f"make {decoder['class']}.forward capture the states of layers_to_capture and return them")
    if fix:
        report["verdict"] = NOT_SUPPORTED
    elif collects is None:
        report["verdict"] = UNKNOWN
        reasons.append("could not tell whether the decoder collects aux hidden states")
    else:
        report["verdict"] = SUPPORTED
        reasons.append(f"decoder {decoder['class']} collects aux states in forward ({', '.join(decoder['evidence'])})")
