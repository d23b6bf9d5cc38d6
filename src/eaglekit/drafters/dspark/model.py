"""The DSpark drafter (DeepSeek's DeepSpec): DFlash's backbone (one non-causal forward over a block, the target's
states injected as context keys/values, `eaglekit.drafters.dflash.model`) plus two small heads that keep the drafts
coherent and say how far they will survive.

- Layout. With `sample_from_anchor` (DeepSpec's and vLLM's default) every block slot drafts: the block [x_a, mask,
  ..., mask] at positions a .. a+S-1 drafts x_{a+1} .. x_{a+S} from slots 0 .. S-1 (S drafts). Without it, DFlash's
  fill-in layout: slot j >= 1 drafts x_{a+j}, the anchor's own output is unused (S - 1 drafts). Either way drafted
  position k (0-based) drafts x_{a+1+k} from the post-norm hidden state h_k of its slot.
- Markov head (rank r = `markov_rank`; 0 = none, a DFlash drafter in this layout): logits_k = lm_head(h_k) +
  W2 · z_k, with W1 = `markov_head.markov_w1` (V, r) indexed by the TARGET id of the previous token x_prev(k) and
  W2 = `markov_head.markov_w2` (Vd, r). x_prev(0) is the anchor, x_prev(k) the token drafted at position k - 1 (the
  ground-truth x_{a+k} in training: teacher forcing). z_k by `markov_head_type`:
    vanilla  z_k = e_k                                     with e_k = W1[x_prev(k)]
    gated    z_k = sigmoid(gate_proj([h_k ; e_k])) * e_k    (`gate_proj`: Linear(H + r, r))
    rnn      gate, cand, out = joint_proj([s_{k-1} ; e_k ; h_k]) (Linear(2r + H, 3r)), s_k = sigmoid(gate) s_{k-1}
             + (1 - sigmoid(gate)) tanh(cand), s_{-1} = 0, z_k = tanh(out)
  (the formulas and tensor names of speculators 0.9's `speculators.models.dspark` and DeepSpec; vLLM 0.32 loads the
  vanilla head only). The bias is added before any temperature.
- Confidence head: c_k = sigmoid(proj([h_k ; e_k])) (`confidence_head.proj`: Linear(H + r, 1); [h_k] alone without
  `confidence_head_with_markov`), the probability that draft k is accepted given that its prefix was. Calibrated
  per position after training (`eaglekit.drafters.dspark.calibration`): c_k = sigmoid(logit_k / T_k) with the
  `confidence_temperatures` T_k stored in the config (empty: the raw head, T_k = 1).

Tensor names are vLLM's and speculators' checkpoint names, so export is a key filter (`formats`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.errors import EaglekitError

FORMAT = "eaglekit-dspark"
DRAFTER_TYPE = "dspark"
MARKOV_HEADS = ("vanilla", "gated", "rnn")
DEFAULT_BLOCK_SIZE = 7  # DeepSpec's published drafters
W1_STD = 0.01  # a fresh W1: normal, as speculators' and DeepSpec's


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """A DFlash drafter's shape (`DFlashConfig`) and DSpark's heads and layout."""

    markov_rank: int = 256  # r; 0 = no Markov head
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head also reads W1[x_prev]
    sample_from_anchor: bool = True  # every slot drafts (DeepSpec); False: DFlash's fill-in layout
    confidence_temperatures: tuple[float, ...] = ()  # calibration, one per drafted position; empty = raw

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 0:
            raise EaglekitError(f"markov_rank={self.markov_rank}: use 0 (no Markov head: a DFlash drafter) or a rank "
                                "such as 256 (DeepSpec's)")
        if self.markov_head_type not in MARKOV_HEADS:
            raise EaglekitError(f"markov_head_type={self.markov_head_type!r}: use one of {', '.join(MARKOV_HEADS)}")
        if self.confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise EaglekitError("confidence_head_with_markov reads the Markov head's embedding, and markov_rank=0 has "
                                "none: set confidence_head_with_markov=false, or markov_rank > 0")
        if any(t <= 0 for t in self.confidence_temperatures):
            raise EaglekitError(f"confidence_temperatures {list(self.confidence_temperatures)} must all be > 0")

    @property
    def drafter_type(self) -> str:
        return DRAFTER_TYPE

    @property
    def first_slot(self) -> int:
        """The block slot of the first draft: 0 when every slot drafts, 1 in DFlash's fill-in layout."""
        return 0 if self.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        """Drafts one block makes: block_size with `sample_from_anchor`, else block_size - 1."""
        return self.block_size - self.first_slot

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["confidence_temperatures"] = list(self.confidence_temperatures)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSparkConfig:
        data = {**data, "confidence_temperatures": tuple(data.get("confidence_temperatures", ()))}
        return super().from_dict(data)


def check_drafts(num_drafts: int, config: DSparkConfig) -> None:
    """Refuse more drafts per step than one block of this drafter makes (eaglekit's decoder and vLLM alike)."""
    if not 1 <= num_drafts <= config.max_drafts:
        layout = "every slot drafts" if config.sample_from_anchor else "the anchor's slot does not draft"
        most = config.max_drafts
        raise EaglekitError(f"chain_length={num_drafts}: this DSpark drafter's block makes at most {most} drafts "
                            f"(block_size {config.block_size}, {layout}); pass chain_length=1..{most}")


class MarkovHead(nn.Module):
    """The rank-r logit bias from the previous token (module docstring), one position at a time (`step`) or over
    teacher-forced blocks (`block_bias`)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        r, h = config.markov_rank, config.hidden_size
        self.kind = config.markov_head_type
        self.markov_w1 = nn.Embedding(config.vocab_size, r)
        self.markov_w2 = nn.Linear(r, config.draft_vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)

    def step(
        self,
        prev: torch.Tensor,  # (...,) target ids of the previous tokens
        hidden: torch.Tensor,  # (..., H) post-norm hidden states of the drafted positions
        state: torch.Tensor | None = None,  # (..., r) rnn: the state after the position before; None at the first
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (bias (..., Vd), e = W1[prev] (..., r), the rnn's new state or None)."""
        z, e, state = self.latent(prev, hidden, state)
        return self.markov_w2(z), e, state

    def latent(
        self,
        prev: torch.Tensor,  # (...,) target ids of the previous tokens
        hidden: torch.Tensor,  # (..., H)
        state: torch.Tensor | None = None,  # (..., r) rnn: the state after the position before
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (z (..., r): the bias is W2 z, e = W1[prev] (..., r), the rnn's new state or None)."""
        e = self.markov_w1(prev).to(hidden.dtype)  # (..., r)
        if self.kind == "gated":
            z = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1))) * e
        elif self.kind == "rnn":
            state = torch.zeros_like(e) if state is None else state
            gate, cand, out = self.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, -1)  # 3 x (..., r)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
            z = torch.tanh(out)
        else:
            z = e
        return z, e, state if self.kind == "rnn" else None

    def block_bias(
        self,
        prev: torch.Tensor,  # (..., K) target ids of the previous token of each drafted position
        hidden: torch.Tensor,  # (..., K, H)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over K positions -> (bias (..., K, Vd), e (..., K, r)); the rnn runs left to right."""
        if self.kind != "rnn":
            bias, e, _ = self.step(prev, hidden)
            return bias, e
        biases, embeddings, state = [], [], None
        for k in range(prev.shape[-1]):
            bias, e, state = self.step(prev[..., k], hidden[..., k, :], state)
            biases.append(bias)
            embeddings.append(e)
        return torch.stack(biases, -2), torch.stack(embeddings, -2)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; e_k])) before calibration (module docstring); `forward` gives the logit."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        width = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
        self.with_markov = config.confidence_head_with_markov
        self.proj = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """hidden (..., H), e (..., r) -> raw confidence logits (...,)."""
        x = torch.cat([hidden, e.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(x.to(self.proj.weight.dtype))[..., 0].float()


class DSparkDrafter(DFlashDrafter):
    """DSpark draft model: `context` then `hidden_states` (DFlash's backbone), then `position_logits` (the Markov
    correction) and `confidence` per drafted position."""

    FORMAT = FORMAT
    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.markov_rank > 0:
            self.markov_head = MarkovHead(config)
            nn.init.normal_(self.markov_head.markov_w1.weight, std=W1_STD)
            nn.init.zeros_(self.markov_head.markov_w2.weight)  # starts as its backbone: no bias until W2 learns
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(config)

    def position_logits(
        self,
        hidden: torch.Tensor,  # (..., H) post-norm hidden state of one drafted position
        prev: torch.Tensor,  # (...,) target id of its previous token
        state: torch.Tensor | None = None,  # (..., r) the rnn head's state after the position before
        base: torch.Tensor | None = None,  # (..., Vd) lm_head(hidden), when the caller has it
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One drafted position -> (logits (..., Vd) with the Markov bias, e = W1[prev] (..., r) or None, state)."""
        logits = self.lm_head(hidden) if base is None else base
        if self.config.markov_rank == 0:
            return logits, None, None
        bias, e, state = self.markov_head.step(prev, hidden, state)
        return logits + bias, e, state

    def candidate_logits(
        self,
        hidden: torch.Tensor,  # (1, H) post-norm hidden state of one drafted position
        prev: torch.Tensor,  # (1,) target id of its previous token
        state: torch.Tensor | None,  # (1, r) the rnn head's state after the position before
        values: torch.Tensor,  # (1, K) its base logits at its K candidates
        candidates: torch.Tensor,  # (1, K) draft ids of the candidates (the base logits' top K)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`position_logits` on K candidate draft ids only (`draft_topk`: K rows of W2 read, not Vd) -> (logits
        (1, K) with the Markov bias, the rnn's new state or None)."""
        if self.config.markov_rank == 0:
            return values, None
        z, _, state = self.markov_head.latent(prev, hidden, state)  # (1, r)
        rows = F.embedding(candidates, self.markov_head.markov_w2.weight)  # (1, K, r)
        return values + (rows @ z[..., None].to(rows.dtype))[..., 0].to(values.dtype), state

    def markov_logits(
        self,
        hidden: torch.Tensor,  # (..., K, H) post-norm hidden states of K drafted positions
        prev: torch.Tensor,  # (..., K) teacher-forced previous tokens (target ids)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits (..., K, Vd) with the Markov bias, e (..., K, r) or None)."""
        logits = self.lm_head(hidden)
        if self.config.markov_rank == 0:
            return logits, None
        bias, e = self.markov_head.block_bias(prev, hidden)
        return logits + bias, e

    def confidence_logits(self, hidden: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor | None:
        """(..., H), (..., r) -> raw confidence logits (...,); None without a confidence head."""
        return self.confidence_head(hidden, e) if self.config.confidence_head else None

    def calibrated(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits (..., K) of drafted positions 0..K-1 -> calibrated confidences c_k (..., K)."""
        temperatures = self.config.confidence_temperatures
        if not temperatures:
            return torch.sigmoid(logits)
        k = logits.shape[-1]
        scale = torch.tensor([temperatures[min(i, len(temperatures) - 1)] for i in range(k)], device=logits.device)
        return torch.sigmoid(logits / scale)

    def with_temperatures(self, temperatures: tuple[float, ...]) -> None:
        """Store a calibration (one temperature per drafted position) in the config."""
        self.config = dataclasses.replace(self.config, confidence_temperatures=tuple(float(t) for t in temperatures))
