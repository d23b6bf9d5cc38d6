"""What vLLM's EAGLE proposer needs of the target when it loads a drafter, read from vLLM's source.

The proposer's `load_model` (vllm/v1/spec_decode/) takes the target's language model (a multimodal wrapper's
`get_language_model()`), reads its decoder as `getattr(language_model, "model", None)` and looks the target's
embedding up on that decoder by the names it tests with `hasattr` (`embed_tokens`, `embedding` in vLLM 0.32),
raising otherwise. The lookup comes before any look at the drafter, so a drafter that carries its own embedding
does not avoid it. Classes that implement `SupportsEagle3` still fail there: the Transformers backend
(`TransformersForCausalLM`) holds Hugging Face's base model as `self.model`, and GPT-NeoX's names its embedding
`embed_in`. The fix (`doctor --fix`'s plugin) exposes that module under a name the proposer looks up.

The names are read from the proposer, not assumed; a release without such a lookup has nothing to check here.
The decoder is the class `self.<holder> = ...` builds; for `AutoModel.from_config(...)` it is the base model that
Hugging Face's auto mapping gives for the target's model type, read from the transformers source beside the vLLM
read (else this environment's).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from eaglekit.doctor.facts import Target, class_of_value
from eaglekit.doctor.source import DirectorySource, EngineSource, installed_root
from eaglekit.doctor.pysource import ClassInfo, ModuleIndex

PROPOSER_DIR = "vllm/v1/spec_decode"
AUTO_MODULE = "transformers.models.auto.modeling_auto"
SETTERS = ("object.__setattr__", "setattr")


def embedding_lookup(source: EngineSource) -> dict[str, Any] | None:
    """The proposer function that looks the target's embedding up: {file, line, function, holder, names}."""
    if "embedding_lookup" not in source.memo:
        source.memo["embedding_lookup"] = _find_embedding_lookup(source)
    return source.memo["embedding_lookup"]


def _find_embedding_lookup(source: EngineSource) -> dict[str, Any] | None:
    for path in source.python_files(PROPOSER_DIR):
        text = source.read(path) or ""
        if "embed_tokens" not in text or "hasattr" not in text:
            continue
        for function in ast.walk(ast.parse(text)):
            if isinstance(function, ast.FunctionDef):
                found = _lookup_in(function)
                if found is not None:
                    return {"file": path, "line": function.lineno, "function": function.name, **found}
    return None


def _lookup_in(function: ast.FunctionDef) -> dict[str, Any] | None:
    """`inner = getattr(x, "model", None)` then `hasattr(inner, "embed_tokens")`... and a raise, in one function."""
    holders = {}  # variable -> attribute name it was read from
    for node in ast.walk(function):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and _string_call(node.value, "getattr")):
            holders[node.targets[0].id] = node.value.args[1].value
    for variable, holder in holders.items():
        names = [call.args[1].value for call in ast.walk(function) if _string_call(call, "hasattr")
                 and isinstance(call.args[0], ast.Name) and call.args[0].id == variable]
        raises = any(isinstance(node, ast.Raise) for node in ast.walk(function))
        if names and raises and any("embed" in name for name in names):
            return {"holder": holder, "names": list(dict.fromkeys(names))}
    return None


def _string_call(node: ast.AST, function: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))


# --- the target's side ------------------------------------------------------------------------
def check_embedding(index: ModuleIndex, language_model: ClassInfo, lookup: dict[str, Any], target: Target,
                    source: EngineSource) -> dict[str, Any]:
    """Does `language_model.<holder>` have one of the proposer's embedding names? status ok | missing | unknown."""
    holder, names = lookup["holder"], lookup["names"]
    fact: dict[str, Any] = {"proposer": f"{lookup['file']}:{lookup['line']} ({lookup['function']})",
                            "holder": holder, "names": names, "language_model": language_model.name,
                            "decoder": None, "embedding_attribute": None, "provided_by": None}
    aliased = _aliases(index, language_model, names)
    if aliased:
        fact.update(status="ok", provided_by=aliased)
        return fact
    assignments = index.self_assignments(language_model, holder)
    if not assignments:
        fact.update(status="missing", why=f"{language_model.name} ({language_model.where}) has no self.{holder}")
        return fact
    decoder, how = None, ""
    for owner, value in assignments:
        decoder, how = class_of_value(index, owner, value, None, None, language_model)
        if decoder is None and _is_auto_model(value):
            decoder, how = _hugging_face_decoder(target, source)
        if decoder is not None:
            break
    if decoder is None:
        fact.update(status="unknown", why=f"the class of self.{holder} is not known: {how}")
        return fact
    decoder_index = index if index.find_class(decoder.module, decoder.name) is decoder else _hf_index(source)
    fact.update(decoder=f"{decoder.name} ({decoder.where})", decoder_how=how,
                embedding_attribute=_embedding_attribute(decoder_index, decoder))
    present = [name for name in names if decoder_index.self_assignments(decoder, name)]
    fact["status"] = "ok" if present else "missing"
    if present:
        fact["provided_by"] = f"{decoder.name}.{present[0]}"
    else:
        fact["why"] = (f"{decoder.name} ({decoder.where}) has no {' or '.join(names)}"
                       + (f"; it names its embedding {fact['embedding_attribute']}" if fact["embedding_attribute"]
                          else ""))
    return fact


def _aliases(index: ModuleIndex, cls: ClassInfo, names: list[str]) -> str | None:
    """`object.__setattr__(self.<holder>, "embed_tokens", ...)` in a method along the MRO (a --fix plugin's)."""
    for entry in index.mro(cls):
        if not isinstance(entry, ClassInfo):
            continue
        for method in entry.methods().values():
            for node in ast.walk(method):
                if (isinstance(node, ast.Call) and ast.unparse(node.func) in SETTERS and len(node.args) == 3
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                    return f"{entry.name}.{method.name} ({entry.relative}:{node.lineno})"
    return None


def _embedding_attribute(index: ModuleIndex, decoder: ClassInfo) -> str | None:
    """The attribute the decoder's token embedding is built under (`self.embed_in = nn.Embedding(...)`)."""
    for entry in index.mro(decoder):
        init = entry.methods().get("__init__") if isinstance(entry, ClassInfo) else None
        for node in ast.walk(init) if init else []:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func).split(".")[-1].endswith("Embedding")):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        return target.attr
    return None


def _is_auto_model(value: ast.expr) -> bool:
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "from_config"
            and ast.unparse(value.func.value).startswith("AutoModel"))


# --- Hugging Face's base model (vLLM's Transformers backend) ------------------------------------
_HF_INDEXES: dict[str, ModuleIndex] = {}


def _hf_index(source: EngineSource) -> ModuleIndex:
    """transformers' source: beside the vLLM read when it is an installed one, else this environment's."""
    root = source.root if isinstance(source, DirectorySource) else None
    if root is None or not (root / "transformers" / "__init__.py").is_file():
        root = installed_root("transformers") or Path("/nonexistent")
    if str(root) not in _HF_INDEXES:
        _HF_INDEXES[str(root)] = ModuleIndex([DirectorySource("transformers", root)])
    return _HF_INDEXES[str(root)]


def _mapping(index: ModuleIndex, name: str) -> dict[str, str]:
    """A `NAME = OrderedDict([("model_type", "ClassName"), ...])` of transformers' auto module."""
    info = index.module(AUTO_MODULE)
    for node in info.tree.body if info else []:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Call) and node.value.args):
            pairs = [[e.value for e in item.elts if isinstance(e, ast.Constant)]
                     for item in getattr(node.value.args[0], "elts", []) if isinstance(item, ast.Tuple)]
            return {pair[0]: pair[1] for pair in pairs if len(pair) == 2 and isinstance(pair[1], str)}
    return {}


def _hugging_face_decoder(target: Target, source: EngineSource) -> tuple[ClassInfo | None, str]:
    """The base model `AutoModel.from_config` builds for the target (by its model type, else its architecture)."""
    index = _hf_index(source)
    model_type = target.model_type or next(
        (kind for kind, name in _mapping(index, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES").items()
         if name == target.architecture), None)
    base = _mapping(index, "MODEL_MAPPING_NAMES").get(model_type or "")
    if base is None:
        return None, (f"AutoModel.from_config builds the base model of model_type {model_type!r}, which transformers' "
                      "auto mapping does not list" if model_type else "AutoModel.from_config: pass the target's "
                      "config.json so its model type can be read")
    directory = model_type.replace("-", "_")
    cls = index.find_class(f"transformers.models.{directory}.modeling_{directory}", base)
    how = f"AutoModel.from_config -> {base} (transformers' MODEL_MAPPING_NAMES[{model_type!r}])"
    return cls, how if cls is not None else f"{how}, whose source was not found"
