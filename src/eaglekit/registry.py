"""Drafter types: the one registry that maps `drafter_type` to its folder under `eaglekit/drafters/`.

A drafter type is one folder, `eaglekit/drafters/<type>/`, whose `__init__.py` defines `TYPE`, an instance of a
`DrafterType` subclass. Its fields (names of its decode methods, checkpoint layouts, vLLM method, engine markers)
are plain data that `--help` and the option checks read without torch; its hooks (model class, training objective,
drafting, export, import) import the folder's own modules when they are called. Everything outside
`eaglekit/drafters/` is type-agnostic: it asks this registry, and never compares a drafter type's name.

    TYPES = {"dspark": "eaglekit.drafters.dspark", ...}   # a new type: its folder, and one line here

Folders are imported by name on first use, as vLLM's model registry does, so that this module imports nothing of
eaglekit's but its errors (the option modules read it; a drafter folder builds on the shared machinery, which reads
it too). `tests/test_registry.py` imports every folder and checks its `TYPE`.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError

SERVED_DRAFTS = 3  # vLLM's and SGLang's usual EAGLE-3 chain length, in the serve commands eaglekit prints

TYPES = {  # drafter_type -> the package of its folder (its `TYPE`)
    "eagle3": "eaglekit.drafters.eagle3",
    "p-eagle": "eaglekit.drafters.p_eagle",
    "dflash": "eaglekit.drafters.dflash",
    "dspark": "eaglekit.drafters.dspark",
}


@dataclass(frozen=True)
class Method:
    """A speculative decode method, defined by one drafter type (`DrafterType.defines`)."""

    name: str  # what `method=` / `methods=` take
    chain: bool  # drafts a chain of `chain_length` tokens (else an EAGLE-2 tree of `depth` levels)
    summary: str  # one line for --help


@dataclass(frozen=True)
class EngineMarker:
    """Text present in an engine release's source only when it serves a drafter type (`eaglekit doctor`)."""

    path: str  # source file, relative to the engine's package root
    text: str
    how: str  # how that engine is told to serve it


@dataclass(frozen=True)
class DrafterType:
    """What a drafter type is, as data; subclasses implement the hooks below (each imports the folder's modules)."""

    name: str
    summary: str  # one line for `eaglekit train --help`
    methods: tuple[str, ...]  # decode methods its drafters draft with (the first is what bench measures by default)
    defines: tuple[Method, ...] = ()  # methods this type brings (a type may draft with another type's methods)
    export_formats: tuple[str, ...] = ()  # checkpoint layouts it exports to
    vllm_method: str = ""  # vLLM's speculative_config method that serves it ("" = none)
    engines: dict[str, EngineMarker] = field(default_factory=dict)  # engine -> the marker of its support
    starts_from: str = ""  # `eaglekit run drafter_types=`: a further drafter of this type starts from the run's
    # drafter of that type (P-EAGLE from EAGLE-3)
    saved_formats: tuple[str, ...] = ()  # `format` of this type's eaglekit drafters saved without `drafter_type`

    # ---- hooks -------------------------------------------------------------------------------------------------
    def drafter_class(self) -> Any:
        """The class that builds (`cls(config)`), saves (`save_pretrained`) and loads (`cls.from_pretrained(dir,
        device=, dtype=)`) this type's drafters."""
        raise NotImplementedError

    def prepare(self, options: Any, target: Any) -> tuple[Any, str]:
        """The drafter a training run starts from (fresh, or `init_from`) and a note on its vocabulary.
        `options`: `eaglekit.config.train.TrainConfig`; `target`: `eaglekit.training.setup.TrainingTarget`."""
        raise NotImplementedError

    def objective(self, options: Any, drafter: Any, attention: str) -> Any:
        """The training module (the contract of `eaglekit.training.objective`) over `drafter`."""
        raise NotImplementedError

    def after_training(self, options: Any, drafter: Any, batches: Any) -> dict[str, Any]:
        """Runs once a training run is done, on the final drafter (its config may be updated: what is saved) over the
        validation batches (`batches()` gives them afresh) -> what the manifest records (DSpark: its calibration)."""
        return {}

    def speculative_method(self, name: str) -> Any:
        """`eaglekit.decode.methods.SpeculativeMethod` of one of the methods this type `defines`."""
        raise NotImplementedError

    def check_drafts(self, config: Any, num_drafts: int) -> None:
        """Refuse more drafts per step than a drafter of `config` can make (an engine would draft past its
        training)."""

    def check_exportable(self, config: Any, fmt: str) -> None:
        """Refuse a layout that cannot hold this drafter config (the engine would load it with other behaviour)."""

    def export(self, drafter: Any, output: Path, fmt: str, dtype: Any = None, include_embedding: bool = True,
               speculative_tokens: int = 3) -> dict[str, Any]:
        """Write `drafter` in layout `fmt` (one of `export_formats`) into `output`, verified by re-import -> a
        summary (`format`, `output`, `tensors`, `max_logit_difference`, `dtype`, ...)."""
        raise NotImplementedError

    def export_note(self, summary: dict[str, Any], source: Path, output: Path) -> str:
        """What `eaglekit export` prints of the export of `source` into `output` (`summary`: `export`'s)."""
        return f"exported {source} -> {output} ({summary['format']}); re-import matched the source logits"

    def vllm_speculative_config(self, checkpoint: dict[str, Any], model: str) -> dict[str, Any]:
        """vLLM's `--speculative-config` that serves this type's export at `model` (`checkpoint`: its config.json);
        {} for a type vLLM does not serve. Chain drafters draft SERVED_DRAFTS tokens, what vLLM serves EAGLE-3 with."""
        if not self.vllm_method:
            return {}
        return {"method": self.vllm_method, "model": model, "num_speculative_tokens": SERVED_DRAFTS}

    def is_checkpoint(self, data: dict[str, Any]) -> bool:
        """True when a checkpoint's config.json (any layout) holds a drafter of this type."""
        return False

    def read_checkpoint(self, source: Path, options: Any) -> Any:
        """An engine-layout checkpoint (one `is_checkpoint` claims) as an eaglekit drafter; `options`:
        `eaglekit.formats.saved.ImportOptions` (what `train init_from=` passes: the target's layer count)."""
        raise NotImplementedError

    def import_checkpoint(self, source: Path, output: Path, options: Any) -> tuple[Any, dict[str, Any], str]:
        """`eaglekit import`: the drafter of `read_checkpoint`, made to record the target of `options` and checked
        against it -> (drafter, summary fields, the line the stage prints)."""
        raise NotImplementedError

    def planned_config(self, train: Any, target_config: Any, aux_layers: tuple[int, ...]) -> Any | None:
        """The drafter config `eaglekit train` (options `train`) will build for this target, without data; None where
        it cannot be told beforehand."""
        return None

    def bench_options(self, train: Any) -> dict[str, Any]:
        """bench options a run sets for this type's drafter (DFlash: chain_length over its whole block)."""
        return {}


# ---- lookups -------------------------------------------------------------------------------------------------------
def names() -> tuple[str, ...]:
    """Every registered drafter type, in registry order."""
    return tuple(TYPES)


@functools.cache
def get(name: str) -> DrafterType:
    """The `DrafterType` of `name` (one error naming the known ones otherwise)."""
    if name not in TYPES:
        raise EaglekitError(f"drafter type {name!r} is not one this eaglekit knows ({', '.join(TYPES)}); upgrade "
                            "eaglekit, or re-train the drafter")
    kind = importlib.import_module(TYPES[name]).TYPE
    assert kind.name == name, f"{TYPES[name]}.TYPE is {kind.name!r}, registered as {name!r}"
    return kind


def of(drafter: Any) -> DrafterType:
    """The type of a loaded drafter (its config's `drafter_type`; "eagle3" for a config without the field)."""
    return of_config(drafter.config)


def of_config(config: Any) -> DrafterType:
    """The type of a drafter config (`of` before the drafter is loaded)."""
    return get(str(getattr(config, "drafter_type", "eagle3")))


def all_methods() -> dict[str, tuple[Method, DrafterType]]:
    """Every speculative decode method -> (its definition, the type that defines it), in registry order."""
    found: dict[str, tuple[Method, DrafterType]] = {}
    for name in TYPES:
        kind = get(name)
        for method in kind.defines:
            assert method.name not in found, f"method {method.name} is defined twice"
            found[method.name] = (method, kind)
    return found


def method_names() -> tuple[str, ...]:
    return tuple(all_methods())


def chain_method_names() -> tuple[str, ...]:
    """The methods that draft a chain of `chain_length` tokens."""
    return tuple(name for name, (method, _) in all_methods().items() if method.chain)


def types_drafting(method: str) -> tuple[str, ...]:
    """The drafter types whose drafters draft with `method`."""
    return tuple(name for name in TYPES if method in get(name).methods)


def speculative_method(name: str) -> Any:
    """`eaglekit.decode.methods.SpeculativeMethod` of any registered method."""
    if name not in all_methods():
        raise EaglekitError(f"method={name} is not a speculative method this eaglekit decodes")
    return all_methods()[name][1].speculative_method(name)


def check_method(method: str, drafter: Any) -> None:
    """Refuse a method the drafter's type cannot draft with, naming the types that can and the methods it has."""
    check_type_method(method, of(drafter))


def check_type_method(method: str, kind: DrafterType) -> None:
    """`check_method` for a drafter of type `kind` (a saved drafter's type, read before it is loaded)."""
    if method not in kind.methods:
        raise EaglekitError(f"method={method} needs a drafter of type {' or '.join(types_drafting(method)) or 'none'}; "
                            f"this drafter is {kind.name}: use method={' or '.join(kind.methods) or 'plain'}")


def checkpoint_type(data: dict[str, Any]) -> DrafterType | None:
    """The type whose engine layouts hold the checkpoint of config.json `data`; None when no type claims it."""
    return next((get(name) for name in TYPES if get(name).is_checkpoint(data)), None)
