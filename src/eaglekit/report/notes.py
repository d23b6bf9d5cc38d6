"""What the run report's numbers mean: a note beside each headline number, and warnings a reader must not miss.

- tau and speed-up: what they measure, and why a small target on a CPU shows no speed-up (a drafting step
  costs about as much as the target step it is meant to save: compute follows parameter counts there);
- validation loss: the TTT loss is a 0.8^k-weighted SUM over draft positions, so it reads larger than each
  position's own loss;
- a drafter that learned nothing (position-1 accuracy near 0, or tau near 1) gets a warning with the fixes; one
  that validation says is often right but decoding hardly accepts, another warning (training longer will not help).

Pure functions of the `eaglekit.report.collect` dictionary; parameter counts are estimated from config fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The two "learned nothing" thresholds say the same thing: tau = 1 + acceptance at position 1 + ..., so a drafter
# right at most once in ten first drafts (validation) accepts at most about one token per ten forwards (tau 1.1).
LEARNED_NOTHING_ACCURACY = 0.10  # validation accuracy at draft position 1 at or below this: nothing learned
LEARNED_NOTHING_TAU = 1.10  # measured tau at or below this: at most one accepted draft token per ten target forwards
HEAVY_DRAFTER = 0.05  # a drafting step above this share of a target step makes deep trees cost more than they save


def step_parameters(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                    layers: int, attention_input: int | None = None) -> int:
    """Weights one token's forward multiplies by (embedding lookups excluded, lm_head included)."""
    width = attention_input or hidden
    attention = width * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    return layers * (attention + 3 * hidden * intermediate) + vocab * hidden


def target_step_parameters(target: str) -> int | None:
    """Per-token parameters of a local target directory (None for a hub id or an unreadable config)."""
    path = Path(target) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = data.get("text_config") or data
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        kv_heads, head_dim = int(text.get("num_key_value_heads") or heads), int(text.get("head_dim") or hidden // heads)
        return step_parameters(hidden, int(text["intermediate_size"]), heads, kv_heads, head_dim,
                               int(text["vocab_size"]), int(text["num_hidden_layers"]))
    except (KeyError, TypeError, ValueError):
        return None


def drafter_step_parameters(config: dict[str, Any]) -> int | None:
    """Per-step parameters of a drafter from its DrafterConfig dictionary (fc + one 2H-input layer + lm_head)."""
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layer = step_parameters(hidden, int(config["intermediate_size"]), heads, int(config["num_key_value_heads"]),
                                int(config.get("head_dim") or hidden // heads), int(config["draft_vocab_size"]), 1,
                                attention_input=2 * hidden)
        return layer + 3 * int(config["target_hidden_size"]) * hidden
    except (KeyError, TypeError, ValueError):
        return None


def _on_gpu(bench: dict[str, Any]) -> bool:
    device = str((bench.get("config") or {}).get("device", "auto"))
    return device.startswith("cuda") or (device == "auto" and "gpu" in (bench.get("environment") or {}))


def speedup_note(numbers: dict[str, Any], bench: dict[str, Any], target: int | None, drafter: int | None) -> str | None:
    """Why the speed-up is what it is, when it is below 1.2x and the sizes explain it."""
    speedup = numbers.get("speedup")
    if speedup is None or speedup >= 1.2 or not target or not drafter:
        return None
    share = drafter / target
    where = "a GPU" if _on_gpu(bench) else "a CPU"
    text = (f"The speed-up of {speedup:.2f}x is no verdict on the drafter: the target has about {target / 1e6:.1f}M "
            f"parameters per token and one drafting step about {drafter / 1e6:.1f}M ({share:.0%} of a target step)")
    if share < HEAVY_DRAFTER and _on_gpu(bench):
        return text + "; on a GPU a step this small is bound by kernel launches, not by the model's size."
    config, method = bench.get("config") or {}, numbers.get("method", "tree")
    steps = int(config.get("chain_length" if method == "chain" else "depth") or 0)
    even = 1 + steps * share  # target-step costs of one verification with its drafting steps, weights alone
    cost = (f" a {method} of {steps} drafting steps costs at least 1 + {steps} x {share:.0%} = {even:.1f} target steps "
            f"per verification, so tau must pass {even:.1f} just to break even;") if steps else ""
    tau = numbers.get("tau")
    measured = (f" Measured here: tau / speed-up = {tau:.2f} / {speedup:.2f} = {tau / speedup:.1f} plain steps per "
                "verification (drafting, verifying and their per-step overhead).") if tau and speedup > 0 else ""
    return (text + f". On {where}, where time follows the weights each step reads,{cost} speculative decoding pays "
            "when the target is large beside its drafter (an 8B target is about 18x its drafter) and memory-bound "
            f"(a GPU).{measured} Judge this drafter by tau.")


def learned_nothing(numbers: dict[str, Any]) -> str | None:
    """A warning when the drafter's predictions are hardly ever right (validation accuracy at draft position 1 or
    measured tau at their threshold or below), or right in validation only (decoding accepts under half of the
    first drafts that validation accuracy promises: tau - 1 < accuracy / 2)."""
    accuracy, tau = numbers.get("val_accuracy"), numbers.get("tau")
    learned = accuracy is not None and accuracy > LEARNED_NOTHING_ACCURACY
    if learned and tau is not None and tau - 1 < accuracy / 2:
        return (f"**Warning: the drafter is right in validation but not when decoding** — validation accuracy at "
                f"draft position 1 is {accuracy:.3f}, so about {accuracy:.0%} of first drafts should be accepted "
                f"(tau of {1 + accuracy:.2f} or more), but measured tau is {tau:.2f}. Training learned its data, so "
                "what the target generates here differs from that data: the training answers retokenise into other "
                "ids than the target emits (compare `eaglekit inspect` of the training data with `eaglekit generate` "
                "on one prompt), another chat template or system prompt when decoding, or bench prompts unlike the "
                "training prompts. Training longer will not help.")
    signs = []
    if accuracy is not None and accuracy <= LEARNED_NOTHING_ACCURACY:
        signs.append(f"validation accuracy at draft position 1 is {accuracy:.3f}")
    if tau is not None and tau <= LEARNED_NOTHING_TAU:
        signs.append(f"measured tau is {tau:.2f} (1.00 = no draft token ever accepted)")
    if not signs:
        return None
    return ("**Warning: this drafter learned (next to) nothing** — " + "; ".join(signs) + ". Train longer (more "
            "steps, epochs or data), check with `eaglekit inspect` that the loss mask covers the assistant answers, "
            "and check that the training data is the target's own output (`eaglekit regen`).")


def headline_notes(numbers: dict[str, Any], info: dict[str, Any], target: str) -> list[str]:
    """Lines under the headline: what tau and speed-up mean, the speed-up note and the learned-nothing warning."""
    lines = []
    if "tau" in numbers:
        lines.append("tau = tokens produced per target forward (accepted drafts + the one the target adds; 1.00 = "
                     "nothing accepted); speed-up = tokens/s against plain decoding of the same target on the same "
                     "device, run beside it prompt by prompt (median over the repeats, with their min-max). At T=0 "
                     "it cannot pass tau: one that does is load or a bug, and is not shown as a result.")
    drafter_config = (info.get("train") or {}).get("drafter_config") or {}
    note = speedup_note(numbers, info.get("bench") or {}, target_step_parameters(target),
                        drafter_step_parameters(drafter_config))
    warning = learned_nothing(numbers)
    return [line for line in (*lines, note, warning) if line]


def loss_note(val: dict[str, Any], decay: float) -> str | None:
    """The validation loss as the weighted sum of the per-position losses shown beside it."""
    losses = val.get("loss_k") or []
    if not losses or val.get("loss") is None:
        return None
    terms = " + ".join(f"{decay:g}^{k} x {v:.2f}" for k, v in enumerate(losses[:3]))
    terms += " + ..." if len(losses) > 3 else ""
    return (f"The validation loss {val['loss']:.2f} is the TTT loss: the sum over the {len(losses)} draft positions of "
            f"{decay:g}^k times position k's loss ({terms}), so it is larger than any one position's loss; "
            "compare runs by the per-position rows.")
