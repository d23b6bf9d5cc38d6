"""Loading a target model and its tokenizer through the same `from_pretrained` path for every model.

`tiny_target_path()` is the built-in tiny target committed with the package (the demo's default).
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import torch

from eaglekit.errors import EaglekitError

TINY_TARGET = "tiny"  # the name that selects the built-in tiny target


def tiny_target_path() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "tiny_target"


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")  # "name" or "org/name"


def offline_mode() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids downloads."""
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def looks_local(name: str) -> bool:
    """A name that can only mean a path: starts with '.', '/' or '~', has a backslash or two slashes, is no valid
    hub id, or its parent folder exists here (`runs/trian` when `runs/` exists)."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or not _HUB_ID.match(name):
        return True
    parent = Path(name).parent
    return parent != Path(".") and parent.is_dir()


def missing_path_error(name: str, what: str, fix: str) -> EaglekitError:
    """'<what> NAME does not exist (did you mean SIBLING?); <fix>' for a path that is not there."""
    path = Path(name).expanduser()
    siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, siblings, n=1)
    hint = f" (did you mean {path.parent / close[0]}?)" if close else ""
    return EaglekitError(f"{what} {name} does not exist{hint}; {fix}")


def _check_cached(name: str) -> None:
    """In offline mode a hub id must be in the local Hugging Face cache: one error instead of retries."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # huggingface_hub's HFValidationError: not a valid repo id at all
        cached = None
    if not isinstance(cached, str):
        raise EaglekitError(
            f"target {name} is no local directory and is not in the Hugging Face cache, and offline mode "
            "is on (HF_HUB_OFFLINE=1): give the model's directory, or unset HF_HUB_OFFLINE to download it"
        )


def resolve_target(name_or_path: str) -> str:
    """'tiny' -> the built-in target's directory; a path must exist (a name that looks local and does not is an
    error at once); anything else is a hub id (the loaders check it against the cache in offline mode)."""
    if not name_or_path:
        raise EaglekitError("no target given: pass target=PATH (a model directory or hub id), or target=tiny")
    if name_or_path == TINY_TARGET:
        return str(tiny_target_path())
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            kind = "a file" if path.is_file() else "a directory without config.json"
            raise EaglekitError(
                f"target {name_or_path} is {kind}, not a model directory; give the folder that holds "
                "the model's config.json, or target=tiny"
            )
        return str(path)
    if looks_local(name_or_path):
        raise missing_path_error(
            name_or_path,
            "target",
            "give an existing model directory (a folder with config.json), a hub id such as org/name, or target=tiny",
        )
    return name_or_path


def local_model_dir(name_or_path: str) -> str:
    """The target as a folder on this disk, for an engine that loads it itself: a directory as it is, a hub id as
    its snapshot in the Hugging Face cache (what eaglekit's own loading left there; nothing is downloaded)."""
    resolved = resolve_target(name_or_path)
    if Path(resolved).is_dir():
        return resolved
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(resolved, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):  # not cached, or no valid repo id
        raise EaglekitError(f"target {name_or_path} is no local directory and not in the Hugging Face cache: "
                            f"download it first (`hf download {name_or_path}`), or pass target= its "
                            "directory") from None


def _loadable(name_or_path: str) -> str:
    """`resolve_target`, and in offline mode a hub id must be in the cache: what the loaders below read from."""
    resolved = resolve_target(name_or_path)
    if resolved == name_or_path and not Path(resolved).expanduser().exists() and offline_mode():
        _check_cached(name_or_path)
    return resolved


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_loadable(name_or_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise EaglekitError(f"cannot load the tokenizer of {name_or_path}: {error}") from None


def load_target_config(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The target's HF config; a checkpoint that needs its own code is refused unless trust_remote_code."""
    import json

    from transformers import AutoConfig

    path = _loadable(name_or_path)
    config_file = Path(path) / "config.json"
    if not trust_remote_code and config_file.is_file():
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise EaglekitError(
                f"{config_file} is not valid JSON ({error}); fix or re-download the checkpoint"
            ) from None
        if raw.get("auto_map"):
            from transformers import CONFIG_MAPPING

            if raw.get("model_type") not in CONFIG_MAPPING:
                raise EaglekitError(
                    f"target {name_or_path} needs its own modelling code (config.json has auto_map, model_type "
                    f"{raw.get('model_type')!r} is not built into transformers); pass trust_remote_code=true if "
                    "you trust it"
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
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = _loadable(name_or_path)
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
        except (OSError, SafetensorError) as error:
            raise EaglekitError(
                f"cannot load target weights from {name_or_path}: {error}; re-download or re-save the checkpoint"
            ) from None
    if model is None:
        raise EaglekitError(
            f"no causal-LM class for target {name_or_path} ({type(config).__name__}): " + "; ".join(errors)
        )
    if not device_map:
        model.to(device)
    model.eval().requires_grad_(False)
    return model
