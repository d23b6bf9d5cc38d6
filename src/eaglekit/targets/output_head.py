"""What a target's forward does to `final @ lm_head.T` before it returns its logits, read from its config.

Training's soft labels are the target's next-token distribution computed from its stored final hidden state
(`eaglekit.training.objective.soft_labels_from_hidden`), so they must apply the same steps as the model class:
- Granite (granite, granitemoe, granitemoehybrid, ...): logits / `logits_scaling`
- Cohere (cohere, cohere2): logits * `logit_scale`
- Gemma-2/3 and others with `final_logit_softcapping` c: c * tanh(logits / c)
- an lm_head with a bias (Phi): + bias, first (`LogitTransform.bias`)
Each is monotone, so the greedy token is unchanged; the distribution (what the drafter learns, and what T > 0
sampling accepts against) is not: Granite-3's logits_scaling of 8 flattens it eightfold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class LogitTransform:
    """logits = softcap(scale * final @ lm_head.T); softcap(x) = c * tanh(x / c), none when `softcap` is None."""

    scale: float = 1.0
    softcap: float | None = None
    bias: torch.Tensor | None = field(default=None, compare=False)  # (V,) the lm_head's bias

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:  # (..., V) -> (..., V)
        if self.bias is not None:
            logits = logits + self.bias.to(logits)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_transform(config: Any, bias: torch.Tensor | None = None) -> LogitTransform:
    """The transform a target's causal-LM class applies to its lm_head output (`config`: its HF config; `bias`:
    its lm_head's bias (V,), if it has one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", ""))
    scale = 1.0
    if model_type.startswith("granite") and getattr(text, "logits_scaling", None):
        scale = 1.0 / float(text.logits_scaling)
    elif model_type.startswith("cohere") and getattr(text, "logit_scale", None):
        scale = float(text.logit_scale)
    softcap = getattr(text, "final_logit_softcapping", None)
    return LogitTransform(scale, float(softcap) if softcap else None, bias)
