"""Facts about a serving engine's source for `eaglekit doctor --engine`: the target as the engine sees it, the
engine's registries, and what a class, its MRO, its decoder and its default-layers getter say, each with the file
and line it was read from. `checks` turns these into per-engine checks, `diagnose` into the report.
"""

from __future__ import annotations

import ast
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError
from eaglekit.doctor.source import EngineSource
from eaglekit.doctor.pysource import ClassInfo, ModuleIndex, evaluate_layers, is_stub, mentions, string_lists

VLLM_MODELS = "vllm.model_executor.models"
VLLM_INTERFACES = "vllm.model_executor.models.interfaces"
VLLM_ALLOW_LIST_MODULES = ("vllm.config.speculative", "vllm.config", "vllm.config.__init__")
SGLANG_MODELS = "sglang/srt/models"
AUX_NEEDLES = ("aux_hidden_state", "_maybe_add_hidden_state", "layers_to_capture")
SUPPORTED, NOT_SUPPORTED, UNKNOWN = "supported", "not supported", "unknown"


@dataclass(frozen=True)
class Target:
    architecture: str
    model_type: str | None = None
    num_layers: int | None = None
    text_architecture: str | None = None  # text_config.architectures[0] of a multimodal config
    source: str = ""
    head_size: int | None = None  # what an attention backend's KV cache holds per head (see `attention_head_size`)
    mla: bool = False  # latent attention (DeepSeek): the head is the compressed latent plus its rope part


def read_target(target: str) -> Target:
    """A config.json, a model directory holding one, `tiny`, a hub id (its config.json), or an architecture name."""
    if not target:
        raise EaglekitError("no target given: pass target=<config.json | model dir | hub id | architecture name>")
    path = Path(target).expanduser()
    if not path.exists() and (target == "tiny" or "/" in target):
        path = _hub_or_tiny_config(target)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise EaglekitError(f"{target} is a directory without config.json; pass the model directory or an "
                                "architecture name")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise EaglekitError(f"{path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise EaglekitError(f"{path} is not valid JSON: {error}") from None
        architectures = data.get("architectures") or []
        if not architectures:
            raise EaglekitError(f"{path} has no 'architectures' list, so no engine can tell which class to load; add "
                                "\"architectures\": [\"<ClassName>\"] to it or pass the architecture name as target")
        text = data.get("text_config") or data.get("language_config") or data.get("llm_config") or {}
        head_size, mla = attention_head_size({**data, **text})
        return Target(architectures[0], text.get("model_type") or data.get("model_type"),
                      text.get("num_hidden_layers") or data.get("num_hidden_layers"),
                      (text.get("architectures") or [None])[0], str(path), head_size, mla)
    if not target.replace("_", "").isalnum():
        raise EaglekitError(f"target '{target}' is neither an existing config.json/model directory, a hub id nor an "
                            "architecture name (such as LlamaForCausalLM)")
    return Target(target, source="architecture name")


def attention_head_size(config: dict[str, Any]) -> tuple[int | None, bool]:
    """(size per head of the attention's KV cache, MLA?) from a (text) config dict: `head_dim`, else hidden size /
    heads; for latent attention (`kv_lora_rank`) the latent plus its rope part, which is what vLLM's MLA backends
    cache per token. None when the config does not say."""
    if config.get("kv_lora_rank"):
        return int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0), True
    if config.get("head_dim"):
        return int(config["head_dim"]), False
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return (int(hidden) // int(heads) if hidden and heads else None), False


def _hub_or_tiny_config(target: str) -> Path:
    """The config.json of the built-in tiny target or of a hub model (its cached snapshot's, else downloaded); a
    local-looking path that is not there, or a hub model that cannot be had, is one EaglekitError with the fix."""
    from eaglekit.targets.loading import locate_target

    try:
        located = locate_target(target)
    except EaglekitError as error:
        raise EaglekitError(f"{error}; or give the doctor the architecture name (such as --target "
                            "LlamaForCausalLM)") from None
    if Path(located).is_dir():
        return Path(located) / "config.json"
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(located, "config.json"))


# --- registries -------------------------------------------------------------------------------
def vllm_registry(index: ModuleIndex) -> dict[str, tuple[str, str]] | None:
    """architecture -> (module, class) from every dict literal of (module, class) pairs in registry.py."""
    info = index.module(f"{VLLM_MODELS}.registry")
    if info is None:
        return None
    entries: dict[str, tuple[str, str]] = {}
    for node in info.tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, item in zip(value.keys, value.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(item, ast.Tuple)):
                continue
            parts = [e.value for e in item.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(parts) == 2 == len(item.elts):
                # newer registries may name fully qualified modules (`vllm.models.deepseek_v4`)
                module = parts[0] if parts[0].startswith("vllm.") else f"{VLLM_MODELS}.{parts[0]}"
                entries[key.value] = (module, parts[1])
    return entries or None


def sglang_registry(source: EngineSource, index: ModuleIndex,
                    only: str | None = None) -> dict[str, tuple[str, str]] | None:
    """class name -> (module, local name) for every class named in a module's `EntryClass`.

    With `only`, modules whose text does not mention that name are not parsed (a fast first pass).
    """
    files = [f for f in source.list_dir(SGLANG_MODELS) if f.endswith(".py")]
    if not files:
        return None
    entries: dict[str, tuple[str, str]] = {}
    for name in files:
        text = source.read(f"{SGLANG_MODELS}/{name}") or ""
        if "EntryClass" not in text or (only and only not in text):
            continue
        module = f"{SGLANG_MODELS.replace('/', '.')}.{name[:-3]}"
        info = index.module(module)
        for node in info.tree.body if info else []:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass"
                                                    for t in node.targets):
                items = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                for item in items:
                    if isinstance(item, ast.Name):
                        entries.setdefault(item.id, (module, item.id))
    return entries or None


def lookup(registry: dict[str, tuple[str, str]], architecture: str, engine: str) -> tuple[str, str]:
    if architecture in registry:
        return registry[architecture]
    close = difflib.get_close_matches(architecture, list(registry), n=5, cutoff=0.5)
    hint = f"closest names: {', '.join(close)}" if close else "no similar name registered"
    raise EaglekitError(f"{engine}'s registry has no architecture '{architecture}' ({hint}); check architectures[0] "
                        "of the target's config.json, or the engine version")


# --- class facts --------------------------------------------------------------------------------
def in_mro(index: ModuleIndex, cls: ClassInfo, name: str) -> ClassInfo | str | None:
    for entry in index.mro(cls):
        if (entry.name if isinstance(entry, ClassInfo) else entry.split(".")[-1]) == name:
            return entry
    return None


def method_facts(index: ModuleIndex, cls: ClassInfo, names: list[str], protocols: tuple[str, ...]) -> dict[str, Any]:
    """name -> where it is implemented: own/inherited definition, a protocol's (non-stub) default, or missing."""
    facts = {}
    for name in names:
        found = index.find_method(cls, name, skip=protocols)
        if found is not None:
            owner, node = found
            facts[name] = {"status": "defined", "class": owner.name, "where": f"{owner.relative}:{node.lineno}"}
            continue
        default = index.find_method(cls, name)
        if default is not None and not is_stub(default[1]):
            facts[name] = {"status": "protocol default", "class": default[0].name,
                           "where": f"{default[0].relative}:{default[1].lineno}"}
        else:
            facts[name] = {"status": "missing"}
    return facts


def class_of_value(index: ModuleIndex, owner: ClassInfo, value: ast.expr, registry: dict | None,
                   fallback_architecture: str | None,
                   instance: ClassInfo | None = None) -> tuple[ClassInfo | None, str]:
    """The class a `self.x = <value>` builds: a direct constructor, a registry lookup, or a factory method.

    `owner` wrote the statement; `instance` is the class really instantiated (overrides are looked up on it).
    """
    instance = instance or owner
    if isinstance(value, ast.Call):
        direct = index.resolve_in_class(owner, value.func)
        if direct is not None:
            return direct, f"constructed directly at {owner.relative}:{value.lineno}"
        func = value.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            # a `model_cls = DeepseekV2Model` class attribute, called as self.model_cls(...)
            for entry in index.mro(instance):
                attribute = entry.class_attributes().get(func.attr) if isinstance(entry, ClassInfo) else None
                if attribute is not None:
                    found = index.resolve_expr(entry.module, attribute)
                    if found is not None:
                        return found, f"{entry.name}.{func.attr} = {ast.unparse(attribute)} ({entry.relative})"
            factory = index.find_method(instance, func.attr)
            if factory is not None:
                for node in ast.walk(factory[1]):
                    if isinstance(node, ast.Return) and node.value is not None:
                        found, how = class_of_value(index, factory[0], node.value, registry, fallback_architecture,
                                                    instance)
                        if found is not None:
                            return found, f"returned by {factory[0].name}.{func.attr}: {how}"
        for names in string_lists(value):
            if registry and names[0] in registry:
                cls = index.find_class(*registry[names[0]])
                return cls, f"registry architecture {names[0]!r} named at {owner.relative}:{value.lineno}"
    if fallback_architecture and registry and fallback_architecture in registry:
        cls = index.find_class(*registry[fallback_architecture])
        return cls, f"registry architecture {fallback_architecture!r} from the target's text_config"
    return None, (f"built at {owner.relative}:{value.lineno} by `{ast.unparse(value)[:120]}`; the class is chosen "
                  "at run time")


def decoder_facts(index: ModuleIndex, cls: ClassInfo) -> dict[str, Any]:
    """The decoder that `cls` runs (`self.model = X(...)`, else itself) and whether its forward collects aux states."""
    decoder, how = cls, "the class itself"
    for owner, value in index.self_assignments(cls, "model"):
        found, how_found = class_of_value(index, owner, value, None, None, cls)
        if found is not None:
            decoder, how = found, how_found
            break
    forward = index.find_method(decoder, "forward")
    if forward is None:
        return {"class": decoder.name, "where": decoder.where, "how": how, "collects_aux": None,
                "evidence": "no forward found", "_class": decoder}
    hits = _forward_mentions(index, decoder, forward)
    return {"class": decoder.name, "where": decoder.where, "how": how, "collects_aux": bool(hits),
            "forward": f"{forward[0].relative}:{forward[1].lineno}", "evidence": hits, "_class": decoder}


def _forward_mentions(index: ModuleIndex, decoder: ClassInfo, forward: tuple[ClassInfo, ast.FunctionDef]) -> list[str]:
    """Aux-state names in forward, following `super().forward(...)` and `self.<helper>(...)` calls one level each."""
    owner, node = forward
    hits = mentions(node, AUX_NEEDLES)
    for call in ast.walk(node):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        target = call.func.value
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
            mro = [e for e in index.mro(owner)[1:] if isinstance(e, ClassInfo)]
            parent = next(((e, e.methods()[call.func.attr]) for e in mro if call.func.attr in e.methods()), None)
        elif isinstance(target, ast.Name) and target.id == "self" and call.func.attr != "forward":
            parent = index.find_method(decoder, call.func.attr)
        else:
            parent = None
        if parent is not None:
            hits += mentions(parent[1], AUX_NEEDLES)
    return sorted(set(hits))


def forward_passthrough(index: ModuleIndex, wrapper: ClassInfo, attribute: str = "language_model") -> bool | None:
    """Does the class's forward return what `self.<attribute>...(...)` returned (aux states included)?

    `language_model` (a wrapper's): any call that names it. Another attribute (a decoder's `model`): a call of
    `self.<attribute>` itself, returned at once or through a name nothing else is assigned to."""
    found = index.find_method(wrapper, "forward")
    if found is None:
        return None

    def inner(call: ast.expr, whole: ast.expr) -> bool:
        if not isinstance(call, ast.Call):
            return False
        if attribute == "language_model":
            return attribute in ast.unparse(whole)
        return ast.unparse(call.func) == f"self.{attribute}"

    assigned: set[str] = set()
    other: set[str] = set()  # names also assigned something else (`hidden = hidden * scale`): not passed through
    for node in ast.walk(found[1]):
        if isinstance(node, ast.Assign) and inner(node.value, node.value):
            assigned.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and attribute != "language_model":
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            other.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(found[1]):
        if isinstance(node, ast.Return) and node.value is not None:
            if inner(node.value, getattr(node.value, "func", node.value)):
                return True
            if isinstance(node.value, ast.Name) and node.value.id in assigned - other:
                return True
    return None


def subclass_facts(index: ModuleIndex, cls: ClassInfo, decoder: dict[str, Any]) -> dict[str, Any]:
    """Can a subclass of `cls` (which lacks the EAGLE-3 interface) add it over its decoder? It can when the decoder is
    `self.model`, already collects the aux states (its forward, own or inherited: vLLM's Glm4Model is a LlamaModel),
    takes the layers to collect by a method or attribute the subclass can set, iterates `self.layers` (the default
    getter counts them), and `cls.forward` returns the decoder's output as it is."""
    decoder_class: ClassInfo = decoder["_class"]
    holder = "model" if decoder.get("how") != "the class itself" else None
    if index.find_method(decoder_class, "_set_aux_hidden_state_layers") is not None:
        setter = "_set_aux_hidden_state_layers"  # vLLM's EagleModelMixin: its bookkeeping (pipeline slots) too
    elif "aux_hidden_state_layers" in (decoder.get("evidence") or []):
        setter = "aux_hidden_state_layers"
    else:
        setter = None
    forward = index.find_method(decoder_class, "forward")
    layers = forward is not None and any(
        isinstance(n, ast.Attribute) and n.attr == "layers" and isinstance(n.value, ast.Name) and n.value.id == "self"
        for n in ast.walk(forward[1]))
    passthrough = forward_passthrough(index, cls, holder) if holder else None
    why = [text for failed, text in (
        (holder is None, f"{cls.name} has no decoder of its own in self.model"),
        (decoder.get("collects_aux") is not True, f"{decoder_class.name}.forward does not collect the aux states"),
        (setter is None, f"{decoder_class.name} has neither _set_aux_hidden_state_layers nor an "
                         "aux_hidden_state_layers attribute its forward reads"),
        (not layers, f"{decoder_class.name}.forward does not iterate self.layers (the default getter counts them)"),
        (holder is not None and passthrough is not True,
         f"{cls.name}.forward does not visibly return self.{holder}(...)'s output as it is")) if failed]
    return {"holder": holder, "decoder": decoder_class.name, "decoder_where": decoder_class.where, "setter": setter,
            "forward_passthrough": passthrough, "fits": not why, "why": why}


def default_layers(index: ModuleIndex, cls: ClassInfo, method: str, num_layers: int | None,
                   attribute: str | None = None) -> dict[str, Any] | None:
    """Evaluate the default-layer expression in `method` (a return value, or an assignment to `attribute`)."""
    found = index.find_method(cls, method)
    if found is None:
        return None
    owner, node = found
    candidates: list[ast.expr] = []
    for child in ast.walk(node):
        if attribute is None and isinstance(child, ast.Return) and isinstance(child.value, (ast.Tuple, ast.List)):
            candidates.append(child.value)
        assigns_attribute = attribute and isinstance(child, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == attribute for t in child.targets)
        if assigns_attribute and isinstance(child.value, (ast.List, ast.Tuple)):
            candidates.append(child.value)
    for expr in candidates:
        if any(isinstance(n, ast.Name) and n.id in ("val", "layer_ids", "layers", "i") for n in ast.walk(expr)):
            continue
        return {"expression": ast.unparse(expr), "where": f"{owner.relative}:{expr.lineno}",
                "ids": list(evaluate_layers(expr, num_layers) or []) or None}
    return None
