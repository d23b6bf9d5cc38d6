"""Training-time test (TTT): the unrolled K-step drafter loss, as pure tensor functions.

Alignment (raw tokens x_0..x_{T-1}; target logits L_t at position t predict x_{t+1}; m_t = 1 on
assistant tokens). At TTT step k (k = 0..K-1) position t:
- the feature is the fused target state f_t (step 0) or the drafter's own output of step k-1 at t (its
  post-norm output with `norm_output`, see `Eagle3Drafter.head`);
- the input token is x_{t+1+k} (ids shifted left by 1+k);
- the soft label is softmax(L_{t+1+k}[t2d]) (targets shifted left by 1+k), the distribution of x_{t+2+k};
- the loss mask is m_{t+2+k} (the PREDICTED token is an assistant token) AND argmax L_{t+1+k} is in the
  draft vocabulary. (The EAGLE reference shifts its loss mask from m_t, i.e. it masks by the token two to
  the left of the predicted one; the two differ only at the edges of assistant spans.)
- the position id is t+k, so that relative positions between a query and the keys of earlier steps
  equal those seen in decoding, where the k-th draft token sits k places right of its root. The EAGLE
  reference keeps position t for every step.
- attention: the query of step k at t sees step-0 keys at positions <= t (causal) and the keys of steps
  1..k at position t only -- the reference's `cache_hidden` lists.

The loss of step k is a soft cross-entropy averaged over its mask, weighted by `decay ** k` (0.8^k).
`ttt_forward` runs the K steps through `Eagle3Drafter.forward` with one attention call per step over the
concatenated keys of steps 0..k (SDPA with a boolean mask, or flex attention with a block mask).
`naive_ttt_forward` is the reference: explicit per-step caches and `reference_step`, a hand-written
forward of one drafter step; tests check that both agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.training.data import mean_mask_counts
from eaglekit.training.objective import (
    DEFAULT_DECAY,
    TTTResult,
    combine_steps,
    correct_count,
    soft_cross_entropy_sum,
)

DEFAULT_STEPS = 7


# --- alignment ------------------------------------------------------------------------------
def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """Shift along dim 1 by n: out[:, t] = x[:, t + n], the last n positions filled with `fill`."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def step_masks(loss_mask: torch.Tensor, in_vocab: torch.Tensor, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask (B, T), in_vocab (B, T)) bool -> (train masks, accuracy masks), each (K, B, T).

    accuracy mask k = m_{t+2+k} (assistant token predicted, label exists); train mask additionally needs
    the target argmax of L_{t+1+k} inside the draft vocabulary.
    """
    accuracy = torch.stack([shift_left(loss_mask, 2 + k, False) for k in range(num_steps)])
    train = accuracy & torch.stack([shift_left(in_vocab, 1 + k, False) for k in range(num_steps)])
    return train, accuracy


def position_ids(batch: int, seq_len: int, step: int, device: Any = None) -> torch.Tensor:
    """(B, T) position ids t + step (see module docstring)."""
    return (torch.arange(seq_len, device=device) + step).expand(batch, seq_len)


def ttt_attention_mask(seq_len: int, step: int, device: Any = None) -> torch.Tensor:
    """(T, (step+1)*T) bool over the keys of steps 0..step concatenated; True = attend.

    Step-0 keys: causal (key position <= query position); keys of steps 1..step: same position only.
    """
    query = torch.arange(seq_len, device=device)[:, None]  # (T, 1)
    key = torch.arange((step + 1) * seq_len, device=device)[None, :]  # (1, S)
    block, key_pos = key // seq_len, key % seq_len
    return torch.where(block == 0, key_pos <= query, key_pos == query)


def ttt_block_mask(seq_len: int, step: int, device: Any = None) -> Any:
    """The same mask as `ttt_attention_mask`, as a flex-attention BlockMask (fully masked blocks skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        key_pos = kv % seq_len
        return ((kv < seq_len) & (key_pos <= q)) | ((kv >= seq_len) & (key_pos == q))

    return create_block_mask(mask_mod, None, None, seq_len, (step + 1) * seq_len, device=device)


# --- labels and loss ------------------------------------------------------------------------


def step_attention_mask(attention: str, length: int, step: int, device: torch.device) -> Any:
    """The mask of step `step` over the keys of steps 0..step: a flex block mask, or (1, 1, T, (k+1)T) booleans."""
    if attention == "flex":
        return ttt_block_mask(length, step, device)
    return ttt_attention_mask(length, step, device)[None, None]


def score_step(logits: torch.Tensor, probs: torch.Tensor, train: torch.Tensor,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, Vd) of step k, probs (B, T, Vd) soft labels, train (B, T) step k's mask -> (summed soft
    cross-entropy, top-1 matches) over the T - 1 - k positions with a label; views, not shifted copies."""
    n = max(logits.shape[1] - 1 - step, 0)  # positions with a label
    logits_k, probs_k, mask_k = logits[:, :n], probs[:, 1 + step : 1 + step + n], train[:, :n]
    with torch.no_grad():
        hits = correct_count(logits_k, probs_k, mask_k)
    return soft_cross_entropy_sum(logits_k, probs_k, mask_k), hits


# --- efficient TTT --------------------------------------------------------------------------
StepInput = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (k, last hidden) -> (hidden, ids)


def unrolled_forward(
    drafter: Any,  # Eagle3Drafter
    feature: torch.Tensor,  # (B, T, H) fused target features
    step_input: StepInput,  # step k's inputs (hidden (B, T, H), ids (B, T)) from the hidden step k-1 returned
    input_ids: torch.Tensor,  # (B, T) raw token ids x_t
    loss_mask: torch.Tensor,  # (B, T) bool, assistant tokens (False on padding)
    probs: torch.Tensor,  # (B, T, Vd) soft labels at each position (softmax of L_t over draft columns)
    in_vocab: torch.Tensor,  # (B, T) bool, argmax L_t in the draft vocabulary
    num_steps: int,
    decay: float,
    attention: str,  # "sdpa" (boolean mask) or "flex" (block mask)
    denominators: torch.Tensor | None,  # (K,) loss normalisers; None: local train counts
) -> TTTResult:
    """K drafter steps laid out as TTT's (masks, labels, positions), one attention call per step over the keys of
    steps 0..k; what a step reads is `step_input`'s (TTT: its own last output; P-EAGLE: the mask slot)."""
    b, t = input_ids.shape
    train, accuracy = step_masks(loss_mask, in_vocab, num_steps)
    hidden = feature
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    loss_sums, correct = [], []
    for k in range(num_steps):
        mask = step_attention_mask(attention, t, k, input_ids.device)
        past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None  # 2 x (B, nkv, kT, D)
        hidden_k, ids_k = step_input(k, hidden)
        hidden, logits, (key, value) = drafter(hidden_k, ids_k, position_ids(b, t, k, input_ids.device), past, mask)
        keys.append(key)
        values.append(value)
        loss_sum, hits = score_step(logits, probs, train[k], k)
        loss_sums.append(loss_sum)
        correct.append(hits)
    return combine_steps(loss_sums, correct, train, accuracy, decay, denominators)


def ttt_forward(
    drafter: Any,  # Eagle3Drafter
    aux: torch.Tensor,  # (B, T, 3*H_target) target aux states
    input_ids: torch.Tensor,  # (B, T) raw token ids x_t
    loss_mask: torch.Tensor,  # (B, T) bool, assistant tokens (False on padding)
    probs: torch.Tensor,  # (B, T, Vd) soft labels at each position (softmax of L_t over draft columns)
    in_vocab: torch.Tensor,  # (B, T) bool, argmax L_t in the draft vocabulary
    num_steps: int = DEFAULT_STEPS,
    decay: float = DEFAULT_DECAY,
    attention: str = "sdpa",  # "sdpa" (boolean mask) or "flex" (block mask)
    denominators: torch.Tensor | None = None,  # (K,) loss normalisers; default: local train counts
) -> TTTResult:
    """K unrolled drafter steps: step k reads step k-1's output and the ids shifted left by 1 + k."""
    return unrolled_forward(drafter, drafter.fuse(aux), lambda k, hidden: (hidden, shift_left(input_ids, 1 + k, 0)),
                            input_ids, loss_mask, probs, in_vocab, num_steps, decay, attention, denominators)


# --- the training module ----------------------------------------------------------------------
class TTTModule(nn.Module):
    """The unit DDP/FSDP/compile wrap: one forward = all K TTT steps of a micro-batch (the objective contract of
    `eaglekit.training.objective`)."""

    steps_forward = staticmethod(ttt_forward)  # the objective's own forward over all K steps

    def __init__(self, drafter: nn.Module, num_steps: int, decay: float, attention: str):
        super().__init__()
        self.drafter, self.num_steps, self.decay, self.attention = drafter, num_steps, decay, attention

    @property
    def num_positions(self) -> int:
        return self.num_steps

    def masks(self, loss_mask: torch.Tensor, in_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return step_masks(loss_mask, in_vocab, self.num_steps)

    def mean_counts(self, tokens: list[tuple[torch.Tensor, torch.Tensor]], indices: list[int],
                    max_length: int) -> torch.Tensor:
        """(K,) mean positions per record in each step's mask (`step_weighting=tokens`)."""
        return mean_mask_counts(tokens, indices, max_length, self.num_steps)

    def forward(self, aux, input_ids, loss_mask, probs, in_vocab, denominators):  # noqa: ANN001 (see ttt_forward)
        r = self.steps_forward(self.drafter, aux, input_ids, loss_mask, probs, in_vocab, self.num_steps, self.decay,
                               self.attention, denominators)
        return r.loss, r.loss_sums, r.correct, r.train_counts, r.accuracy_counts


# --- naive reference ------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _cos_sin(drafter: Any, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = drafter.rotary_emb
    freqs = pos[..., None].float() * rotary.inv_freq.float()  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
    scale = getattr(rotary, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]  # (B, 1, T, D)


def reference_step(
    drafter: Any,
    hidden: torch.Tensor,  # (B, T, H)
    input_ids: torch.Tensor,  # (B, T) shifted ids of this step
    pos: torch.Tensor,  # (B, T)
    cache: list[tuple[torch.Tensor, torch.Tensor]],  # keys/values (B, nkv, T, D) of steps 0..k-1
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One TTT step written out by hand (norms, RoPE, attention over step caches, SwiGLU, head) -> (the hidden
    state the next step gets, logits (B, T, Vd), this step's (k, v))."""
    cfg, layer = drafter.config, drafter.midlayer
    attn, eps = layer.self_attn, cfg.rms_norm_eps
    assert cfg.hidden_act == "silu", "the reference step implements SwiGLU only"
    b, t, _ = hidden.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    embeds = drafter.embed_tokens.weight[input_ids].to(hidden.dtype)  # (B, T, H)
    normed_hidden = _rms_norm(hidden, layer.hidden_norm.weight, eps)
    residual = normed_hidden if layer.norm_before_residual else hidden
    x = torch.cat([_rms_norm(embeds, layer.input_layernorm.weight, eps), normed_hidden], dim=-1)  # (B, T, 2H)
    cos, sin = _cos_sin(drafter, pos, x.dtype)
    q = _rotate((x @ attn.q_proj.weight.T).view(b, t, nh, d).transpose(1, 2), cos, sin)  # (B, nh, T, D)
    k = _rotate((x @ attn.k_proj.weight.T).view(b, t, nkv, d).transpose(1, 2), cos, sin)  # (B, nkv, T, D)
    v = (x @ attn.v_proj.weight.T).view(b, t, nkv, d).transpose(1, 2)  # (B, nkv, T, D)
    steps = [*cache, (k, v)]
    group = nh // nkv
    keys = [s[0].repeat_interleave(group, dim=1) for s in steps]  # each (B, nh, T, D)
    values = [s[1].repeat_interleave(group, dim=1) for s in steps]
    causal = (q @ keys[0].transpose(-1, -2)) / math.sqrt(d)  # (B, nh, T, T) step-0 keys
    causal = causal.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    diagonal = [(q * key).sum(-1, keepdim=True) / math.sqrt(d) for key in keys[1:]]  # each (B, nh, T, 1)
    scores = torch.cat([causal, *diagonal], dim=-1)  # (B, nh, T, T + k)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    out = weights[..., :t] @ values[0]  # (B, nh, T, D)
    for j, value in enumerate(values[1:]):
        out = out + weights[..., t + j : t + j + 1] * value
    out = out.transpose(1, 2).reshape(b, t, nh * d) @ attn.o_proj.weight.T  # (B, T, H)
    hidden_out = residual + out
    mlp = layer.mlp
    y = _rms_norm(hidden_out, layer.post_attention_layernorm.weight, eps)
    hidden_out = hidden_out + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    normed = _rms_norm(hidden_out, drafter.norm.weight, eps)  # (B, T, H)
    logits = normed @ drafter.lm_head.weight.T  # (B, T, Vd)
    return (normed if cfg.norm_output else hidden_out), logits, (k, v)  # norm_output: the next step gets norm(h)


def reference_fuse(drafter: Any, aux: torch.Tensor) -> torch.Tensor:
    """(B, T, 3*H_t) aux -> (B, T, H) feature, written out: norm_before_fc = one RMSNorm over the whole
    concatenation, fc_norm = one RMSNorm per H_t chunk, then fc."""
    cfg = drafter.config
    if cfg.norm_before_fc:
        aux = _rms_norm(aux, drafter.input_norm.weight, cfg.rms_norm_eps)
    elif cfg.fc_norm:
        chunks = aux.split(cfg.target_hidden_size, dim=-1)  # 3 x (B, T, H_t)
        aux = torch.cat([_rms_norm(c, n.weight, cfg.rms_norm_eps) for c, n in zip(chunks, drafter.fc_norm)], dim=-1)
    return aux @ drafter.fc.weight.T


def naive_ttt_forward(
    drafter: Any, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, probs: torch.Tensor,
    in_vocab: torch.Tensor, num_steps: int = DEFAULT_STEPS, decay: float = DEFAULT_DECAY,
    denominators: torch.Tensor | None = None,
) -> TTTResult:
    """Reference TTT: explicit per-step shifting and key/value caches, `reference_step` for the math."""
    b, t = input_ids.shape
    train, accuracy = step_masks(loss_mask, in_vocab, num_steps)
    hidden = reference_fuse(drafter, aux)  # (B, T, H)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    ids, labels = input_ids, probs
    loss_sums, correct = [], []
    for k in range(num_steps):
        ids, labels = shift_left(ids, 1, 0), shift_left(labels, 1, 0.0)  # one more place each step
        hidden, logits, kv = reference_step(drafter, hidden, ids, position_ids(b, t, k, ids.device), cache)
        cache.append(kv)
        loss_sums.append(soft_cross_entropy_sum(logits, labels, train[k]))
        correct.append(correct_count(logits.detach(), labels, train[k]))
    return combine_steps(loss_sums, correct, train, accuracy, decay, denominators)


