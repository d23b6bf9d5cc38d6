"""Always-on verification of hidden-state capture: did the hooks tap the decoder that really runs?

The seed failure of this project: a patch on the language-model class never ran because the engine
loaded a multimodal wrapper. `verify_capture` runs one probe forward through the model object that
is actually loaded and checks that
  1. every hook fired exactly once (zero = the hooked layers are not on the executing path;
     more = the stack is called twice per forward, so "the state entering layer i" is ambiguous);
  2. every captured tensor is [batch, seq, hidden] for the probe's batch and sequence;
  3. the captured states equal `output_hidden_states=True` (index i = input to layer i, the last
     entry = the final-norm output), where the class returns hidden states.
Any failure raises EaglekitError naming the loaded class, the decoder path hooked and what was found.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import HiddenStateCapture, describe_stacks, forward_target, text_config

log = logging.getLogger(__name__)

# bf16 targets: two kernels computing the same value may differ by an ulp; the hook and the
# recorder see the SAME tensor, so anything beyond this is a different tap point.
_TOLERANCE = 1e-3


@dataclass
class VerificationResult:
    """What the probe forward showed; `ok` is True only when every check passed."""

    model_class: str
    decoder_path: str
    norm_path: str | None
    aux_layers: tuple[int, ...]  # input-of-layer convention
    hook_calls: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    compared: list[str] = field(default_factory=list)  # captures checked against output_hidden_states
    max_abs_diff: float = 0.0
    reference: str = "output_hidden_states"  # or why the comparison was skipped
    ok: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["aux_layers"] = list(self.aux_layers)
        return data


def _where(capture: HiddenStateCapture) -> str:
    return (f"loaded class {type(capture.model).__name__}, decoder path searched/hooked "
            f"'{capture.stack.path}' ({capture.stack.num_layers} x {type(capture.stack.layers[0]).__name__})")


def check_hook_calls(capture: HiddenStateCapture) -> None:
    """Each hook must have fired exactly once since the last `reset()`."""
    expected = [f"aux{i}" for i in capture.aux_layers] + (["final"] if capture.capture_final else [])
    wrong = {key: capture.calls.get(key, 0) for key in expected if capture.calls.get(key, 0) != 1}
    if not wrong:
        return
    if all(count == 0 for count in wrong.values()):
        raise EaglekitError(
            f"capture hooks did not fire ({wrong}): {_where(capture)} is not on the path the forward executed. "
            f"Layer lists found: {describe_stacks(capture.model)}. Pass decoder_path= naming the stack that runs."
        )
    raise EaglekitError(
        f"capture hooks fired the wrong number of times ({wrong}, expected 1 each): {_where(capture)}; the decoder "
        "stack is called more than once per forward, so captured states are ambiguous. Pass decoder_path= explicitly."
    )


def check_shapes(capture: HiddenStateCapture, batch: int, seq: int, hidden: int | None) -> dict[str, list[int]]:
    """Captured tensors must be (batch, seq, hidden); returns the shapes seen."""
    shapes = {f"aux{i}": list(capture.states[i].shape) for i in capture.aux_layers}
    if capture.capture_final and capture.final_state is not None:
        shapes["final"] = list(capture.final_state.shape)
    for key, shape in shapes.items():
        if len(shape) != 3 or shape[:2] != [batch, seq] or (hidden is not None and shape[2] != hidden):
            raise EaglekitError(
                f"captured {key} has shape {shape}, expected [batch={batch}, seq={seq}, "
                f"hidden={hidden}]: {_where(capture)}; the hooked module does not carry the decoder's residual stream. "
                "Pass decoder_path= explicitly."
            )
    return shapes


def _close(captured: torch.Tensor, reference: torch.Tensor) -> bool:
    if captured.shape != reference.shape:
        return False
    diff = (captured.float() - reference.to(captured.device).float()).abs().max().item()
    return diff <= _TOLERANCE * (reference.float().abs().max().item() + 1e-6)


def _compare(capture: HiddenStateCapture, hidden_states: tuple[torch.Tensor, ...], result: VerificationResult) -> None:
    num_layers = capture.stack.num_layers
    pairs = [(f"aux{i}", capture.states[i], hidden_states[i]) for i in sorted(set(capture.aux_layers))
             if i < num_layers]
    if capture.capture_final:
        last = hidden_states[-1]
        if not _close(capture.final_state, last) and capture.stack.norm is not None:
            with torch.inference_mode():  # versions whose last entry is the pre-norm output of the last layer
                normed = capture.stack.norm(last.to(capture.final_state.device))
            if _close(capture.final_state, normed):
                last = normed
                result.reference = "output_hidden_states (last entry before the final norm; compared after it)"
        pairs.append(("final", capture.final_state, last))
    for key, captured, reference in pairs:
        diff = (captured.float() - reference.to(captured.device).float()).abs().max().item()
        scale = reference.float().abs().max().item() + 1e-6
        result.max_abs_diff = max(result.max_abs_diff, diff)
        result.compared.append(key)
        if diff > _TOLERANCE * scale:
            raise EaglekitError(
                f"captured {key} differs from output_hidden_states (max abs diff {diff:.3g}, scale {scale:.3g}): "
                f"{_where(capture)}; the hooks tap a different point than 'input to decoder layer i'."
            )


def verify_capture(
    model: torch.nn.Module,
    capture: HiddenStateCapture,
    input_ids: torch.Tensor,  # (B, T) probe
    attention_mask: torch.Tensor | None = None,  # (B, T)
) -> VerificationResult:
    """Run one probe forward inside an active `capture` and check it; raises EaglekitError on failure."""
    result = VerificationResult(type(model).__name__, capture.stack.path, capture.stack.norm_path, capture.aux_layers)
    hidden = getattr(text_config(model.config), "hidden_size", None)
    capture.reset()
    with torch.inference_mode():
        output = forward_target(model, input_ids, attention_mask, output_hidden_states=True)
    result.hook_calls = dict(capture.calls)
    check_hook_calls(capture)
    result.shapes = check_shapes(capture, input_ids.shape[0], input_ids.shape[1], hidden)
    hidden_states = getattr(output, "hidden_states", None)
    if not hidden_states or len(hidden_states) != capture.stack.num_layers + 1:
        count = len(hidden_states) if hidden_states else 0
        result.reference = (f"skipped: {type(model).__name__} returned {count} hidden states, expected "
                            f"{capture.stack.num_layers + 1}")
        log.warning("capture verification: %s", result.reference)
    else:
        _compare(capture, tuple(hidden_states), result)
    capture.reset()
    result.ok = True
    log.info("capture verified on %s at %s: hooks %s, max diff %.2g", result.model_class, result.decoder_path,
             result.hook_calls, result.max_abs_diff)
    return result
