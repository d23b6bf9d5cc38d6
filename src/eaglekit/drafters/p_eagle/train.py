"""P-EAGLE training: an EAGLE-3 drafter that drafts K tokens in one forward, as pure tensor functions.

At decode time (`eaglekit.drafters.p_eagle.decode`, vLLM's `parallel_drafting`) the drafter's query after the last
accepted position t holds K - 1 mask slots at positions t+1 .. t+K-1: each reads the feature `fuse(mask_hidden)`
and the parallel-drafting token `mask_token_id`, under causal attention. Position t itself predicts x_{t+2} (the
EAGLE-3 step), mask slot j predicts x_{t+2+j}.

Training over a sequence x_0..x_{T-1} lays the slots out as the TTT steps of `eaglekit.drafters.eagle3.ttt`: step 0 is
the
EAGLE-3 step (features f_t, ids x_{t+1}, position t); step k >= 1 at anchor t is mask slot k of anchor t (feature
fuse(mask_hidden), id mask_token_id, position t + k). Its query sees the step-0 keys at positions <= t and the keys
of steps 1..k at anchor t: exactly `ttt.ttt_attention_mask`, and the labels and loss masks of step k are TTT's
(`ttt.step_masks`: the predicted token x_{t+2+k} is an assistant token, the target's argmax of L_{t+1+k} is in the
draft vocabulary). Unlike TTT no step reads an earlier step's output, so what differs is only the inputs
(`step_inputs`). `naive_parallel_forward` is the reference: for every anchor t, the decode-time sequence (positions
0..t, then K - 1 mask slots) run through the drafter under a plain causal mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from eaglekit.drafters.eagle3.ttt import DEFAULT_DECAY, DEFAULT_STEPS, TTTModule, shift_left, unrolled_forward
from eaglekit.training.objective import TTTResult, combine_steps
from eaglekit.errors import EaglekitError

MASK_HIDDEN_STD = 0.02  # a fresh mask_hidden: normal, like speculators' and Hugging Face's linear init


# --- inputs and loss ------------------------------------------------------------------------
def step_inputs(
    feature: torch.Tensor,  # (B, T, H) fused target features f_t
    mask_feature: torch.Tensor,  # (1, H) fuse(mask_hidden)
    input_ids: torch.Tensor,  # (B, T) raw token ids x_t
    mask_token_id: int,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (B, T, H), ids (B, T)) of step `step`: step 0 the EAGLE-3 inputs (f_t, x_{t+1}); every later step
    the mask slot's (fuse(mask_hidden), mask_token_id) at every anchor."""
    if step == 0:
        return feature, shift_left(input_ids, 1, 0)
    return mask_feature.to(feature.dtype).expand_as(feature), torch.full_like(input_ids, mask_token_id)


def parallel_forward(
    drafter: Any,  # Eagle3Drafter with drafter_type p-eagle
    aux: torch.Tensor,  # (B, T, n_aux*H_target) target aux states
    input_ids: torch.Tensor,  # (B, T) raw token ids x_t
    loss_mask: torch.Tensor,  # (B, T) bool, assistant tokens (False on padding)
    probs: torch.Tensor,  # (B, T, Vd) soft labels (softmax of L_t over draft columns)
    in_vocab: torch.Tensor,  # (B, T) bool, argmax L_t in the draft vocabulary
    num_steps: int = DEFAULT_STEPS,  # K drafted positions per anchor
    decay: float = DEFAULT_DECAY,
    attention: str = "sdpa",  # "sdpa" (boolean mask) or "flex" (block mask)
    denominators: torch.Tensor | None = None,  # (K,) loss normalisers; default: local train counts
) -> TTTResult:
    """The K positions of every anchor: one attention call per step over the keys of steps 0..k (TTT's mask)."""
    feature, mask_feature = drafter.fuse(aux), drafter.mask_feature()  # (B, T, H), (1, H)
    token = drafter.config.mask_token_id
    return unrolled_forward(drafter, feature, lambda k, _: step_inputs(feature, mask_feature, input_ids, token, k),
                            input_ids, loss_mask, probs, in_vocab, num_steps, decay, attention, denominators)


# --- naive reference ------------------------------------------------------------------------
def anchor_logits(drafter: Any, feature: torch.Tensor, input_ids: torch.Tensor, anchor: int,
                  num_steps: int) -> torch.Tensor:
    """Decode-time drafting at one anchor, written out: feature (T, H) and ids (T,) of one sequence ->
    (K, Vd) logits of positions anchor, then the K - 1 mask slots after it, from one causal forward."""
    length = input_ids.shape[0]
    next_ids = torch.cat([input_ids[1 : anchor + 2], input_ids.new_zeros(max(0, anchor + 2 - length))])
    slots = num_steps - 1
    hidden = torch.cat([feature[: anchor + 1], drafter.mask_feature().to(feature.dtype).expand(slots, -1)])
    ids = torch.cat([next_ids, torch.full((slots,), drafter.config.mask_token_id, dtype=torch.long,
                                          device=input_ids.device)])  # (anchor + K,)
    total = anchor + 1 + slots
    causal = torch.ones(total, total, dtype=torch.bool, device=ids.device).tril()[None, None]
    positions = torch.arange(total, device=ids.device)[None]
    _, logits, _ = drafter(hidden[None], ids[None], positions, None, causal)
    return logits[0, anchor:]  # (K, Vd)


def naive_parallel_forward(
    drafter: Any, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, probs: torch.Tensor,
    in_vocab: torch.Tensor, num_steps: int = DEFAULT_STEPS, decay: float = DEFAULT_DECAY,
    denominators: torch.Tensor | None = None,
) -> TTTResult:
    """Reference: `anchor_logits` at every anchor of every sequence; labels and masks indexed by hand (step k at
    anchor t: label probs[t+1+k], counted where loss_mask[t+2+k] and in_vocab[t+1+k])."""
    b, t = input_ids.shape
    feature = drafter.fuse(aux)  # (B, T, H)
    loss_sums = [torch.zeros((), device=aux.device) for _ in range(num_steps)]
    correct = [torch.zeros((), device=aux.device) for _ in range(num_steps)]
    train = torch.zeros(num_steps, b, t, dtype=torch.bool, device=aux.device)
    accuracy = torch.zeros_like(train)
    for row in range(b):
        for anchor in range(t):
            logits = anchor_logits(drafter, feature[row], input_ids[row], anchor, num_steps)  # (K, Vd)
            for k in range(num_steps):
                if anchor + 2 + k >= t:
                    continue
                accuracy[k, row, anchor] = loss_mask[row, anchor + 2 + k]
                train[k, row, anchor] = accuracy[k, row, anchor] & in_vocab[row, anchor + 1 + k]
                if not train[k, row, anchor]:
                    continue
                label = probs[row, anchor + 1 + k]  # (Vd,)
                loss_sums[k] = loss_sums[k] - (label * torch.log_softmax(logits[k].float(), -1)).sum()
                correct[k] = correct[k] + (logits[k].argmax() == label.argmax()).float()
    return combine_steps(loss_sums, correct, train, accuracy, decay, denominators)


# --- the training module and the drafter --------------------------------------------------------
class ParallelModule(TTTModule):
    """P-EAGLE's training objective (the contract of `eaglekit.drafters.eagle3.ttt.TTTModule`): parallel_forward's K
    steps."""

    steps_forward = staticmethod(parallel_forward)


def to_parallel(drafter: Any, mask_token_id: int, seed: int) -> Any:
    """An EAGLE-3 drafter as a P-EAGLE one: the same weights, `mask_token_id` and a fresh `mask_hidden`
    (normal, std MASK_HIDDEN_STD). A P-EAGLE drafter comes back as it is (a differing token id is refused)."""
    config = drafter.config
    if config.drafter_type == "p-eagle":
        if mask_token_id >= 0 and mask_token_id != config.mask_token_id:
            raise EaglekitError(f"mask_token_id={mask_token_id}: this p-eagle drafter was trained with "
                                f"{config.mask_token_id}; drop mask_token_id= to keep it")
        return drafter
    if config.drafter_arch != "llama":
        raise EaglekitError(f"drafter_type=p-eagle: vLLM serves parallel drafting for Llama-style EAGLE-3 drafters, "
                            f"not drafter_arch={config.drafter_arch}; train drafter_type=eagle3 for it")
    token = mask_token_id if mask_token_id >= 0 else config.vocab_size - 1
    new = type(drafter)(dataclasses.replace(config, drafter_type="p-eagle", mask_token_id=token))
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    assert missing == ["mask_hidden"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        new.mask_hidden.normal_(0.0, MASK_HIDDEN_STD, generator=torch.Generator().manual_seed(seed))
    new.embed_tokens.weight.requires_grad_(False)
    return new
