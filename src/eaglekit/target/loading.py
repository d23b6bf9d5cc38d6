"""Loading a target model and its tokenizer through the same `from_pretrained` path for every model.

`tiny_target_path()` is the built-in tiny target committed with the package (the demo's default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglekit.errors import EaglekitError

TINY_TARGET = "tiny"  # the name that selects the built-in tiny target


def tiny_target_path() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "tiny_target"


def resolve_target(name_or_path: str) -> str:
    """'tiny' -> the built-in target's directory; a path must exist; anything else is a hub id."""
    if not name_or_path:
        raise EaglekitError("no target given: pass target=PATH (a model directory or hub id), or target=tiny")
    if name_or_path == TINY_TARGET:
        return str(tiny_target_path())
    path = Path(name_or_path).expanduser()
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise EaglekitError(f"target {name_or_path} is not a model directory (no config.json in it)")
        return str(path)
    return name_or_path


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_target(name_or_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise EaglekitError(f"cannot load the tokenizer of {name_or_path}: {error}") from None


def load_target_config(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The target's HF config; a checkpoint that needs its own code is refused unless trust_remote_code."""
    import json

    from transformers import AutoConfig

    path = resolve_target(name_or_path)
    config_file = Path(path) / "config.json"
    if not trust_remote_code and config_file.is_file():
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise EaglekitError(f"{config_file} is not valid JSON ({error}); fix or re-download the checkpoint") from None
        if raw.get("auto_map"):
            from transformers import CONFIG_MAPPING

            if raw.get("model_type") not in CONFIG_MAPPING:
                raise EaglekitError(
                    f"target {name_or_path} needs its own modelling code (config.json has auto_map, model_type "
                    f"{raw.get('model_type')!r} is not built into transformers); pass trust_remote_code=true if you trust it"
                )
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        hint = " (or pass trust_remote_code=true if the model ships its own code)" if not trust_remote_code else ""
        raise EaglekitError(f"cannot read the config of target {name_or_path}: {error}{hint}") from None


def load_target(
    name_or_path: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    device_map: str | None = None,
) -> torch.nn.Module:
    """The target model in eval mode, frozen. Multimodal wrappers load through their own auto class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = resolve_target(name_or_path)
    config = load_target_config(name_or_path, trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if device_map:
        kwargs["device_map"] = device_map
    model = None
    errors = []
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            model = auto.from_pretrained(path, config=config, **kwargs)
            break
        except ValueError as error:  # the auto class does not know this config type
            errors.append(f"{auto.__name__}: {error}")
        except OSError as error:
            raise EaglekitError(f"cannot load target weights from {name_or_path}: {error}") from None
    if model is None:
        raise EaglekitError(f"no causal-LM class for target {name_or_path} ({type(config).__name__}): " + "; ".join(errors))
    if not device_map:
        model.to(device)
    model.eval().requires_grad_(False)
    return model
