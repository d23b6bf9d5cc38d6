"""P-EAGLE drafting (`method=parallel`): a chain of k drafts from ONE drafter forward.

What vLLM 0.32 drafts with `parallel_drafting: true` (`v1/spec_decode/llm_base_proposer.py`,
`utils.copy_and_expand_eagle_inputs_kernel`): after the accepted positions (target features, ids shifted by one,
the bonus token last) the drafter's query holds k - 1 more slots at the next positions, each with the
parallel-drafting token id and `fuse(mask_hidden)` as its feature, under causal attention. Draft 1 is read at the
last accepted position (the EAGLE-3 root logits), draft j + 1 at mask slot j. The decode loop's `extend` has
already run the accepted positions (same keys, same causal mask), so here one `draft_step` runs the k - 1 mask
slots at positions start .. start + k - 2 (a depth-d node is fed at start + d - 1, as in `engine.draft`).

Sampling: draft j is drawn from q_j, the drafter's distribution at its slot; the slots never see the drafts
drawn before them, so q_j is the proposal of draft j whatever came before, and the chain's p/q rule
(`verify.verify_sampled_chain`) keeps the target's distribution.
"""

from __future__ import annotations

import torch

from eaglekit.config.decode import DecodeOptions
from eaglekit.decode.methods import SpeculativeMethod
from eaglekit.decode.tree import DraftTree, chain_from_logits
from eaglekit.drafters.eagle3.decode import EagerDrafter, static_backend, static_supported


def parallel_logits(drafter_backend, drafter, root_logits: torch.Tensor, start: int | torch.Tensor,
                    num_drafts: int) -> torch.Tensor:
    """root_logits (Vd,) -> (k, Vd) the draft logits of the k chain positions: the root's, then those of the
    k - 1 mask slots (one drafter step of k - 1 rows)."""
    if num_drafts == 1:
        return root_logits[None]
    device, rows = root_logits.device, num_drafts - 1
    feature = drafter.mask_feature().to(root_logits.dtype).expand(rows, -1)  # (k-1, H)
    ids = torch.full((rows,), drafter.config.mask_token_id, dtype=torch.long, device=device)
    positions = torch.arange(rows, device=device) + start  # `start` may be a 0-d tensor (compiled graph)
    visible = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()  # causal among the mask slots
    _, logits = drafter_backend.draft_step(feature, ids, positions, visible)  # (k-1, Vd)
    return torch.cat([root_logits[None], logits])


def grow_parallel(drafter_backend, drafter, root_hidden: torch.Tensor, root_logits: torch.Tensor,
                  root_token: torch.Tensor, start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
                  generator) -> tuple[DraftTree, torch.Tensor]:
    """The chain of `chain_length` drafts after `root_token` -> (tree, its (k+1, k+1) ancestors-or-self mask).
    Same contract as EAGLE-3's `grow_tree`; `root_hidden` is not read (the mask slots carry `mask_hidden`)."""
    k = options.chain_length
    logits = parallel_logits(drafter_backend, drafter, root_logits, start, k)  # (k, Vd)
    return chain_from_logits(drafter, logits, root_token, options, vocab_size, generator)


def first_ahead(drafter_backend, drafter, root_logits: torch.Tensor, start: int | torch.Tensor,
                num_drafts: int) -> torch.Tensor:
    """(k - 1, Vd): the first chain's mask-slot drafts (later ones come with each step's extend)."""
    return parallel_logits(drafter_backend, drafter, root_logits, start, num_drafts)[1:]


METHOD = SpeculativeMethod("parallel", grow_parallel, EagerDrafter, static_backend, static_supported, at_once=True,
                           ahead=first_ahead)
