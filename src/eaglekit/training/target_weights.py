"""The target's weights a drafter trains against without loading the whole model: its input embedding, lm_head and
lm_head bias, read from its checkpoint (the whole model is loaded on the CPU only where that fails)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _checkpoint_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor] | None:
    """Read `names` (or keys ending with them) from a local safetensors checkpoint; None if not possible."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
            weight_map = {key: "model.safetensors" for key in handle.keys()}
    else:
        return None
    found = {}
    for name in names:
        keys = [k for k in weight_map if k == name] or [k for k in weight_map if k.endswith(name.split(".", 1)[-1])]
        if len(keys) != 1:
            return None
        with safe_open(str(directory / weight_map[keys[0]]), framework="pt") as handle:
            found[name] = handle.get_tensor(keys[0])
    return found


def load_target_embeddings(name_or_path: str, trust_remote_code: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding (V, H), lm_head (V, H)) of a target, read from its checkpoint without loading the
    model where possible (offline training needs only these two)."""
    from transformers import AutoModelForCausalLM

    from eaglekit.targets.loading import load_target, load_target_config, locate_target

    path = locate_target(name_or_path)  # a hub id: one request, else its cached snapshot, else one error line
    config = load_target_config(name_or_path, trust_remote_code)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        names = {id(p): n for n, p in skeleton.named_parameters(remove_duplicate=False)}
        embed_name = names[id(skeleton.get_input_embeddings().weight)]
        head = skeleton.get_output_embeddings().weight
        tied = head is skeleton.get_input_embeddings().weight
        wanted = [embed_name] if tied else [embed_name, names[id(head)]]
        tensors = _checkpoint_tensors(Path(path), wanted) if Path(path).is_dir() else None
    except (ValueError, KeyError, AttributeError):
        tensors = None
    if tensors is not None:
        embed = tensors[embed_name]
        return embed, embed if tied else tensors[wanted[1]]
    log.info("reading embedding and lm_head by loading the whole target %s on the CPU", name_or_path)
    model = load_target(name_or_path, "cpu", torch.float32, trust_remote_code=trust_remote_code)
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


def load_target_head_bias(name_or_path: str, trust_remote_code: bool = False) -> torch.Tensor | None:
    """The bias (V,) of a target's lm_head (Phi has one), read from its checkpoint; None when it has none."""
    from transformers import AutoModelForCausalLM

    from eaglekit.targets.loading import load_target, load_target_config, locate_target

    path = locate_target(name_or_path)  # a hub id: one request, else its cached snapshot, else one error line
    config = load_target_config(name_or_path, trust_remote_code)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        bias = getattr(skeleton.get_output_embeddings(), "bias", None)
        if bias is None:
            return None
        name = {id(p): n for n, p in skeleton.named_parameters()}[id(bias)]
        tensors = _checkpoint_tensors(Path(path), [name]) if Path(path).is_dir() else None
    except (ValueError, KeyError, AttributeError):
        tensors, name = None, ""
    if tensors is not None:
        return tensors[name]
    log.info("reading the lm_head's bias by loading the whole target %s on the CPU", name_or_path)
    model = load_target(name_or_path, "cpu", torch.float32, trust_remote_code=trust_remote_code)
    bias = getattr(model.get_output_embeddings(), "bias", None)
    return None if bias is None else bias.detach()
