"""Loading a target model and its tokenizer through the same `from_pretrained` path for every model.

`tiny_target_path()` is the built-in tiny target committed with the package (the demo's default). A hub id is
located before any loader runs (`locate_target`): one request to the hub, no retries, else its cached snapshot,
else one error line naming what was looked for, where, and the fix.
"""

from __future__ import annotations

import difflib
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

TINY_TARGET = "tiny"  # the name that selects the built-in tiny target


def tiny_target_path() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "tiny_target"


def is_hub_id(name: str) -> bool:
    """A valid hub repo id ("name" or "org/name"), as huggingface_hub defines one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def looks_local(name: str) -> bool:
    """A name that can only mean a path: starts with '.', '/' or '~', has a backslash or two slashes, is no valid
    hub id, or its parent folder exists here (`runs/trian` when `runs/` exists)."""
    if name.startswith((".", "/", "~")) or "\\" in name or not is_hub_id(name):
        return True
    parent = Path(name).parent
    return parent != Path(".") and parent.is_dir()


def _sibling_hint(name: str) -> str:
    path = Path(name).expanduser()
    siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, siblings, n=1)
    return f" (did you mean {path.parent / close[0]}?)" if close else ""


def missing_path_error(name: str, what: str, fix: str) -> EaglekitError:
    """'<what> NAME does not exist (did you mean SIBLING?); <fix>' for a path that is not there."""
    return EaglekitError(f"{what} {name} does not exist{_sibling_hint(name)}; {fix}")


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


def _cached_snapshot(repo_id: str) -> str | None:
    """The folder of `repo_id`'s snapshot in the local Hugging Face cache, or None (never touches the network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):  # not cached, or no valid repo id
        return None


def local_model_dir(name_or_path: str) -> str:
    """The target as a folder on this disk, for an engine that loads it itself: a directory as it is, a hub id as
    its snapshot in the Hugging Face cache (what eaglekit's own loading left there; nothing is downloaded)."""
    resolved = resolve_target(name_or_path)
    if Path(resolved).is_dir():
        return resolved
    cached = _cached_snapshot(resolved)
    if cached is None:
        raise EaglekitError(f"target {name_or_path} is no local directory and not in the Hugging Face cache: "
                            f"download it first (`hf download {name_or_path}`), or pass target= its directory")
    return cached


def _transport_errors() -> tuple[type[Exception], ...]:
    """The exceptions of the HTTP client huggingface_hub sends its requests with (httpx2 from 2.0, httpx before)."""
    try:
        import httpx2 as client
    except ImportError:
        import httpx as client
    return (client.TransportError,)


@functools.cache
def hub_problem(repo_id: str) -> str | None:
    """One request to the hub, no retries: None when it serves `repo_id` with this token, else what is wrong:
    "gated", "missing" (no such model, or a private one), "unreachable" (no network) or an HTTP status."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    api = HfApi()
    try:
        if api.model_info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT).gated:
            api.auth_check(repo_id)
    except GatedRepoError:
        return "gated"
    except RepositoryNotFoundError:
        return "missing"
    except HfHubHTTPError as error:
        return f"HTTP {error.response.status_code}"
    except _transport_errors():
        return "unreachable"
    return None


def _not_found(name: str, problem: str) -> EaglekitError:
    from huggingface_hub import constants

    where = f"target {name} is no local directory{_sibling_hint(name)} and not in the Hugging Face cache"
    if problem == "offline":
        return EaglekitError(f"{where} ({constants.HF_HUB_CACHE}), and offline mode is on (HF_HUB_OFFLINE=1): "
                             "fix the path, or unset HF_HUB_OFFLINE to download it")
    if problem == "unreachable":
        return EaglekitError(f"{where} ({constants.HF_HUB_CACHE}), and {constants.ENDPOINT} cannot be reached: "
                             f"fix the path, or download it where there is a network (`hf download {name}`)")
    if problem == "gated":
        return EaglekitError(f"{where}, and it is gated on the hub: accept its terms on its hub page, then set "
                             "HF_TOKEN (or run `hf auth login`)")
    if problem == "missing":
        return EaglekitError(f"{where}, and the hub has no model of that name (a private one needs HF_TOKEN or "
                             "`hf auth login`): fix the path or the name")
    return EaglekitError(f"{where}, and the hub answered {problem}: try again later, or give the model's directory")


def locate_target(name_or_path: str) -> str:
    """`resolve_target`, and for a hub id where its files come from, decided before any loader runs (one request,
    no retries): the hub when it serves the model, else its snapshot in the local cache; neither is one
    EaglekitError naming what was looked for, where, and the fix."""
    from huggingface_hub import is_offline_mode

    resolved = resolve_target(name_or_path)
    if Path(resolved).exists():
        return resolved
    cached = _cached_snapshot(resolved)
    if is_offline_mode():
        if cached is None:
            raise _not_found(name_or_path, "offline")
        return resolved  # the loaders read the cache themselves in offline mode
    problem = hub_problem(resolved)
    if problem is None:
        return resolved
    if cached is None:
        raise _not_found(name_or_path, problem)
    log.info("target %s: the hub answered %s; using its snapshot in the Hugging Face cache, %s", name_or_path,
             problem, cached)
    return cached


# the files a model folder keeps its tokenizer in (one of them at least)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tiktoken.model")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer; a folder without tokenizer files, or one transformers cannot load, is one error line
    naming the fix (transformers' own message runs over several lines)."""
    from transformers import AutoTokenizer

    path = locate_target(name_or_path)
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise EaglekitError(f"target {name_or_path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): "
                            f"copy the tokenizer files of the model it was made from into {path}, or pass a target "
                            "that has them")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise EaglekitError(f"cannot load the tokenizer of {name_or_path} ({reason}): check its tokenizer files "
                            f"({', '.join(TOKENIZER_FILES[:3])}, ...), or pass trust_remote_code=true if the model "
                            "ships its own tokenizer code") from None


def load_target_config(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The target's HF config; a checkpoint that needs its own code is refused unless trust_remote_code."""
    import json

    from transformers import AutoConfig

    path = locate_target(name_or_path)
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

    if device_map:  # transformers places the layers through accelerate
        from eaglekit.extras import require

        require("accelerate", f"device_map={device_map}")
    path = locate_target(name_or_path)
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
