"""What eaglekit sees in a target: the class really loaded, where its decoder is, and whether capture
verifies on it. `eaglekit doctor --target PATH` prints `format_target_report(target_report(PATH))`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import HiddenStateCapture, default_aux_layers, find_decoder, text_config
from eaglekit.targets.identity import target_config_hash
from eaglekit.targets.loading import load_target
from eaglekit.targets.verify import verify_capture


def _probe_ids(model: nn.Module, length: int = 8) -> torch.Tensor:  # (1, length)
    vocab = getattr(text_config(model.config), "vocab_size", 32) or 32
    generator = torch.Generator().manual_seed(0)
    # stay below any image/video placeholder ids that multimodal configs put at the top of the vocab
    return torch.randint(1, max(2, min(vocab, 1000) - 16), (1, length), generator=generator)


def model_report(model: nn.Module, decoder_path: str | None = None) -> dict[str, Any]:
    """The report for an already-loaded model (verification runs one probe forward on its device)."""
    config = text_config(model.config)
    report: dict[str, Any] = {
        "class": type(model).__name__,
        "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__ if c not in (object, nn.Module)],
        "architectures": list(getattr(model.config, "architectures", None) or []),
        "model_type": getattr(model.config, "model_type", None),
        "text_model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "config_hash": target_config_hash(model.config),
    }
    try:
        stack = find_decoder(model, decoder_path)
    except EaglekitError as error:
        return {**report, "decoder_path": None, "verification": {"ok": False, "error": str(error)}}
    report.update(decoder_path=stack.path, layer_class=type(stack.layers[0]).__name__, num_layers=stack.num_layers,
                  final_norm_path=stack.norm_path)
    try:
        report["default_aux_layer_ids"] = list(default_aux_layers(stack.num_layers))
        device = next(model.parameters()).device
        with HiddenStateCapture(model, default_aux_layers(stack.num_layers), decoder_path=stack.path) as capture:
            result = verify_capture(model, capture, _probe_ids(model).to(device))
        report["verification"] = result.to_dict()
    except EaglekitError as error:
        report.setdefault("default_aux_layer_ids", None)
        report["verification"] = {"ok": False, "error": str(error)}
    return report


def target_report(name_or_path: str, trust_remote_code: bool = False, device: str = "cpu",
                  decoder_path: str | None = None) -> dict[str, Any]:
    """Load `name_or_path` (float32 on `device`) and report on it; load errors raise EaglekitError."""
    model = load_target(name_or_path, device=device, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return {"target": name_or_path, **model_report(model, decoder_path)}


def format_target_report(report: dict[str, Any]) -> str:
    """Human-readable lines for `eaglekit doctor`."""
    verification = report.get("verification", {})
    lines = [
        f"target:           {report.get('target', '?')}",
        f"loaded class:     {report['class']}  (architectures in config: "
        f"{', '.join(report['architectures']) or 'none'})",
        "class MRO:        " + " -> ".join(name.rsplit(".", 1)[-1] for name in report["mro"]),
        f"decoder path:     {report.get('decoder_path')}  ({report.get('num_layers')} x {report.get('layer_class')}), "
        f"final norm {report.get('final_norm_path')}",
        f"hidden size:      {report['hidden_size']}   vocab: {report['vocab_size']}   config hash: "
        f"{report['config_hash']}",
        f"default aux ids:  {report.get('default_aux_layer_ids')}  (input_of_layer convention: id i = "
        "state entering layer i)",
    ]
    if verification.get("ok"):
        lines.append(f"verification:     OK - hooks fired once each {verification['hook_calls']}, shapes "
                     f"{sorted(set(tuple(s) for s in verification['shapes'].values()))}, vs output_hidden_states: "
                     f"{verification['reference']} (compared {', '.join(verification['compared']) or 'none'}, "
                     f"max diff {verification['max_abs_diff']:.2g})")
    else:
        lines.append(f"verification:     FAILED - {verification.get('error')}")
    return "\n".join(lines)
