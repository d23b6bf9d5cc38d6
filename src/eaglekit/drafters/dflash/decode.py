"""DFlash drafting (`method=dflash`): a chain of k drafts from ONE non-causal drafter forward over a block.

What vLLM 0.32 drafts with `{"method": "dflash"}` (`v1/spec_decode/dflash.py` and the kernel
`copy_and_expand_dflash_inputs_kernel` in `v1/spec_decode/utils.py`): the target states of every token the target
has processed are the drafter's context (keys/values written once per position, `DFlashDrafter.context`); the query
is [bonus token, mask x k] at positions m .. m + k (m = the bonus token's position, the number of context tokens),
attending to the whole context and to the whole block; draft j is read at block position j (1..k), the bonus
position's output is unused.

In the decode loop's contract (`eaglekit.decode.methods`): `extend` appends the context keys/values of the accepted
positions (it returns empty hidden states and logits: DFlash has no per-position draft), then `grow_dflash` runs the
block from the bonus token (the tree's root, at position `start` = m) and returns the chain.

Sampling: draft j is drawn from q_j, the drafter's distribution at block position j; the block never sees the
drafts drawn in it, so q_j is the proposal of draft j whatever came before, and the chain's p/q rule
(`verify.verify_sampled_chain`) keeps the target's distribution.
"""

from __future__ import annotations

import torch

from eaglekit.config.decode import DecodeOptions
from eaglekit.decode.methods import SpeculativeMethod
from eaglekit.decode.tree import DraftTree, chain_from_logits
from eaglekit.drafters.dflash.model import DFlashDrafter, check_block


class DFlashDrafterBackend:
    """Reference DFlash drafter backend: the context keys/values of every drafter layer, grown by `extend`."""

    def __init__(self, drafter: torch.nn.Module):
        self.drafter = drafter
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer 2 x (1, nkv, S, D)

    @property
    def context_length(self) -> int:
        return 0 if self.context is None else int(self.context[0][0].shape[2])

    def extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """aux (T, n_aux*H_t) of the positions (T,) the target just kept -> (hidden, logits), both (T, 0): DFlash
        drafts from the block alone. `next_ids` is not read (the bonus token enters the block)."""
        new = self.drafter.context(aux[None], positions[None])  # per layer 2 x (1, nkv, T, D)
        if self.context is None:
            self.context = new
        else:
            self.context = [(torch.cat([old_k, k], 2), torch.cat([old_v, v], 2))
                            for (old_k, old_v), (k, v) in zip(self.context, new)]
        empty = aux.new_zeros(aux.shape[0], 0)
        return empty, empty

    first_slot = 1  # the block slot of the first draft: the bonus token's own output is unused (DFlash's layout)

    def block_hidden(self, root_token: torch.Tensor, start: int | torch.Tensor, num_drafts: int) -> torch.Tensor:
        """root_token () at position `start` -> (k, H) the final hidden states of the block slots that draft (from
        `first_slot` on)."""
        device = root_token.device
        q = self.first_slot + num_drafts
        mask_id = self.drafter.config.mask_token_id
        ids = torch.cat([root_token.reshape(1), torch.full((q - 1,), mask_id, dtype=torch.long, device=device)])
        positions = torch.arange(q, device=device) + start  # (Q,)
        return self.drafter.hidden_states(ids[None], positions[None], self.context)[0, self.first_slot :]  # (k, H)

    def block_logits(self, root_token: torch.Tensor, start: int | torch.Tensor, num_drafts: int) -> torch.Tensor:
        """root_token () at position `start` -> (k, Vd) draft logits of block positions 1..k."""
        return self.drafter.lm_head(self.block_hidden(root_token, start, num_drafts))


def grow_dflash(drafter_backend: DFlashDrafterBackend, drafter, root_hidden: torch.Tensor, root_logits: torch.Tensor,
                root_token: torch.Tensor, start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
                generator) -> tuple[DraftTree, torch.Tensor]:
    """The chain of `chain_length` drafts after `root_token` -> (tree, its (k+1, k+1) ancestors-or-self mask).
    Same contract as EAGLE-3's `grow_tree`; `root_hidden` and `root_logits` are not read."""
    k = options.chain_length
    check_block(k, drafter.config.block_size)
    logits = drafter_backend.block_logits(root_token, start, k)  # (k, Vd)
    return chain_from_logits(drafter, logits, root_token, options, vocab_size, generator)


def static_backend(drafter: torch.nn.Module, capacity: int, num_drafts: int, compile: bool):
    from eaglekit.drafters.dflash.static import StaticDFlashDrafter

    return StaticDFlashDrafter(drafter, capacity, num_drafts, compile)


METHOD = SpeculativeMethod("dflash", grow_dflash, DFlashDrafterBackend, static_backend,
                           lambda drafter: isinstance(drafter, DFlashDrafter), at_once=True)
