"""eaglekit's own saved drafters: which type a directory holds, loading it by that type's class, reading a drafter in
any layout (`train init_from=`), and checking a drafter against the target it is used with."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eaglekit import registry
from eaglekit.errors import EaglekitError
from eaglekit.formats.files import read_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImportOptions:
    """How to read an engine-layout checkpoint (`DrafterType.read_checkpoint`), and the target it is for."""

    from_format: str = "auto"  # the layout/engine that wrote it (EAGLE-3 ids: which convention)
    target_num_layers: int | None = None  # the target's layer count (default aux layers; range checks)
    aux_layer_ids: tuple[int, ...] = ()  # override the aux layer ids (input-of-layer)
    target_name: str = ""
    target_architecture: str = ""
    lm_head: Callable[[], Any] | None = None  # the target's lm_head (V, H), for a checkpoint that drafts with it


def saved_drafter_type(directory: str | Path) -> str:
    """The `drafter_type` an eaglekit drafter directory was saved as: its config.json's `drafter_type`, or the type
    whose `saved_formats` name its `format` (an EAGLE-3 drafter written before that key existed)."""
    config_path = Path(directory) / "config.json"
    if not Path(directory).exists():
        from eaglekit.targets.loading import missing_path_error

        raise missing_path_error(str(directory), "drafter", "give a drafter directory (`eaglekit train` or "
                                 "`eaglekit import` output)")
    if not config_path.is_file():
        raise EaglekitError(f"{directory}: no config.json there; give a drafter directory (`eaglekit train` or "
                            "`eaglekit import` output)")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise EaglekitError(f"{config_path} is not valid JSON ({error}); re-run the stage that wrote it") from None
    if "drafter_type" in data:
        return str(data["drafter_type"])
    legacy = [name for name in registry.names() if data.get("format") in registry.get(name).saved_formats]
    if legacy:
        return legacy[0]
    raise EaglekitError(f"{directory} is not an eaglekit drafter; convert it with `eaglekit import --source "
                        f"{directory}` first")


def saved_drafter_config(directory: str | Path) -> Any:
    """The config of an eaglekit drafter directory, read without its weights."""
    kind = registry.get(saved_drafter_type(directory))
    return kind.drafter_class().config_class.from_dict(read_config(Path(directory)))


def load_saved_drafter(directory: str | Path, device: Any = "cpu", dtype: Any = None) -> Any:
    """Any eaglekit drafter directory, loaded by the class of its saved drafter type."""
    kind = registry.get(saved_drafter_type(directory))
    return kind.drafter_class().from_pretrained(directory, device=device, dtype=dtype)


def is_saved_drafter(data: dict[str, Any]) -> bool:
    """True for the config.json of an eaglekit drafter (any type)."""
    return "drafter_type" in data or any(data.get("format") in registry.get(name).saved_formats
                                         for name in registry.names())


def load_drafter(path: str | Path, target_num_layers: int | None = None) -> Any:
    """A drafter directory in any layout a drafter type reads: eaglekit's own, or an engine's (vLLM, SGLang,
    speculators, EAGLE). What `eaglekit train init_from=` loads."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise EaglekitError(f"init_from={path}: no config.json there; give a drafter directory")
    data = read_config(path)
    if is_saved_drafter(data):
        return load_saved_drafter(path)
    return checkpoint_type(data, path).read_checkpoint(path, ImportOptions(target_num_layers=target_num_layers))


def checkpoint_type(data: dict[str, Any], source: Path) -> Any:
    """The drafter type whose layouts hold the checkpoint of config.json `data` (one error otherwise)."""
    kind = registry.checkpoint_type(data)
    if kind is None:
        architectures = data.get("architectures") or []
        raise EaglekitError(f"{source}: config.json with architectures {architectures} is not a drafter in a layout "
                            f"eaglekit reads (drafter types: {', '.join(registry.names())}); check the path, or "
                            "convert the checkpoint with the tool that trained it")
    return kind


# --- a drafter against the target it is used with -------------------------------------------------------------
def _short_name(name: str) -> str:
    """A target's name for comparison: the built-in 'tiny' as its folder, then the last path/hub-id part."""
    from eaglekit.targets.loading import TINY_TARGET, tiny_target_path

    name = str(tiny_target_path()) if name == TINY_TARGET else name
    return Path(name.rstrip("/")).name.lower()


def target_mismatches(drafter_config: Any, target_config: Any) -> list[str]:
    """What differs structurally between the target a drafter records (DrafterConfig's target_* fields) and
    `target_config`; unrecorded fields (empty, 0) are not compared."""
    from eaglekit.targets.capture import text_config, to_input_convention

    text = text_config(target_config)
    layers, problems = int(text.num_hidden_layers), []
    architecture = (getattr(target_config, "architectures", None) or [""])[0]
    if drafter_config.target_architecture and architecture and drafter_config.target_architecture != architecture:
        problems.append(f"architecture {drafter_config.target_architecture} vs {architecture}")
    if drafter_config.target_num_layers and drafter_config.target_num_layers != layers:
        problems.append(f"{drafter_config.target_num_layers} layers vs {layers}")
    if drafter_config.target_hidden_size != int(text.hidden_size):
        problems.append(f"hidden size {drafter_config.target_hidden_size} vs {text.hidden_size}")
    if drafter_config.vocab_size != int(text.vocab_size):
        problems.append(f"vocabulary {drafter_config.vocab_size} vs {text.vocab_size}")
    aux = to_input_convention(tuple(drafter_config.aux_layer_ids), drafter_config.aux_layer_convention)
    if max(aux) > layers:
        problems.append(f"aux layers {list(aux)} beyond the target's {layers} layers")
    return problems


def check_drafter_target(drafter_config: Any, target_config: Any, source: str, target_name: str,
                         target_weights: str = "") -> None:
    """Refuse a drafter made for a structurally different target (the fix named). Of the same shape: warn, with both
    names, when the target's weights differ from those the drafter was trained on (`target_weights`, the target's
    `targets.identity.target_weights_hash`, against the drafter's `target_weights_hash`; a drafter saved without one
    is not compared), else when only the name differs."""
    recorded = drafter_config.target_name_or_path or "an unnamed target"
    problems = target_mismatches(drafter_config, target_config)
    if problems:
        raise EaglekitError(f"drafter {source} was made for another target ({recorded}; drafter vs this target: "
                            f"{'; '.join(problems)}): pass the target it was made for, or train/import a drafter "
                            f"for {target_name}")
    trained_on = getattr(drafter_config, "target_weights_hash", "")
    if trained_on and target_weights:
        if trained_on != target_weights:
            log.warning("drafter %s was trained on the weights of %s (fingerprint %s), this target %s has other "
                        "weights (fingerprint %s): same architecture and shapes, so it is used, but it will accept "
                        "few drafts; pass the target it was trained on, or train a drafter for %s", source,
                        recorded, trained_on, target_name or "an unnamed target", target_weights,
                        target_name or "this target")
        return  # the weights it was trained on, under whatever name
    if drafter_config.target_name_or_path and target_name and _short_name(recorded) != _short_name(target_name):
        log.warning("drafter %s was trained for %s, this target is %s: same architecture and shapes, so it is used; "
                    "acceptance will be low if the weights differ", source, recorded, target_name)
