"""DSpark drafting (`method=dspark`): one block forward of the DFlash backbone, then the Markov head left to right.

What vLLM 0.32 drafts with `{"method": "dspark"}` (`v1/worker/gpu/spec_decode/dspark/speculator.py`): the context is
DFlash's (`eaglekit.drafters.dflash.decode`); the block [bonus token, mask ...] at positions m .. (k queries with
`sample_from_anchor`, k + 1 in the fill-in layout) gives each drafted position's hidden state h_i and base logits
lm_head(h_i) (all k in one pass over the lm_head, the largest weight the drafter reads); then for i = 0 .. k-1:
logits_i = base_i + W2 · z(W1[x_prev]), x_prev the bonus token for i = 0 and the token drafted at i - 1 after;
draft i is the argmax (T = 0) or a draw from softmax(logits_i / T) (the bias before the temperature), and feeds the
next position.

`draft_topk` = K (vLLM's `dspark_draft_topk`): the Markov bias is added to each position's K best base logits alone
(K rows of W2 read instead of Vd), the other draft ids get -inf: a draft is one of those K, and q_i is that truncated
distribution, so sampling stays lossless. With the vanilla head, whose bias depends on the previous token alone, the
loop needs no pass over the model: the previous token of position i is one of position i-1's K candidates, so the
corrected logits after every (previous candidate, candidate) pair of the block are one batched product
(`candidate_chain`); what stays in order is k lookups in that table (greedy: the best candidate after the one drafted
before, from one argmax over the table; sampled: a draw from its row, over K ids, not Vd).

Sampling: draft i is drawn from q_i(· | drafts 0..i-1), the drafter's corrected distribution given the drafts before
it; the chain's p/q rule (`verify.sampled_chain_path`) with these q_i keeps the target's distribution.

Confidence-based verification (`verify_threshold` > 0, a drafter with a confidence head): the survival of draft i is
the product of the calibrated confidences c_0..c_i (`DSparkDrafter.calibrated`); only the leading drafts whose survival
is at least the threshold are verified (`DraftTree.limit`: the later ones count as rejected, the bonus comes from the
target's distribution at the cut). Which drafts are verified depends on the drafts alone, never on the target, so the
output keeps the target's distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglekit.config.decode import DecodeOptions
from eaglekit.decode.methods import SpeculativeMethod
from eaglekit.decode.sampling import draft_probs_to_target, logits_to_probs, sample
from eaglekit.decode.tree import DraftTree, ancestor_matrix, chain_parents
from eaglekit.drafters.dflash.decode import DFlashDrafterBackend
from eaglekit.drafters.dspark.model import DSparkDrafter
from eaglekit.errors import EaglekitError


class DSparkDrafterBackend(DFlashDrafterBackend):
    """DFlash's reference backend (the context keys/values grown by `extend`), the drafting slots by the layout."""

    def __init__(self, drafter: torch.nn.Module):
        super().__init__(drafter)
        self.first_slot = drafter.config.first_slot


def markov_chain(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # (k, H) post-norm hidden states of the k drafted positions
    root_token: torch.Tensor,  # () the bonus token (target id)
    options: DecodeOptions,
    vocab_size: int,
    generator,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The Markov loop (module docstring) -> (drafts (k,) target ids, the distributions they were drawn from (k, V)
    or None at T = 0, raw confidence logits (k,) or None)."""
    k = hidden.shape[0]
    all_draft_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=hidden.device))
    prev, state = root_token.reshape(1), None  # one-element tensors throughout: no value is read back (graphs)
    base = drafter.lm_head(hidden)  # (k, Vd): one pass over the lm_head for the whole block, not one per position
    drafts, probs = [root_token.reshape(1)], []
    config = drafter.config
    by_table = options.draft_topk and config.markov_rank and config.markov_head_type == "vanilla"  # no loop
    if options.draft_topk:  # each position's K best base logits, once for the block
        values, candidates = base.topk(options.draft_topk, dim=-1)  # (k, K) each
    if by_table:
        chosen, q = candidate_chain(drafter, values, candidates, root_token, options, generator)
        drafts.append(drafter.draft_to_target(chosen))
        if q is not None:  # over every draft id: zero off the candidates
            probs.append(torch.zeros(base.shape, dtype=q.dtype, device=q.device).scatter(-1, candidates, q))  # (k, Vd)
    else:  # the loop over the model, one draft after the other
        for i in range(k):
            if options.draft_topk:  # the Markov bias on the K candidates alone
                top, state = drafter.candidate_logits(hidden[i : i + 1], prev, state, values[i : i + 1],
                                                      candidates[i : i + 1])  # (1, K)
                if options.temperature > 0:  # the proposal over every draft id: -inf off the candidates
                    logits = torch.full_like(base[i : i + 1], float("-inf")).scatter(-1, candidates[i : i + 1], top)
            else:
                logits, _, state = drafter.position_logits(hidden[i : i + 1], prev, state, base[i : i + 1])  # (1, Vd)
            if options.temperature > 0:
                q = logits_to_probs(logits, options.temperature, options.top_k, options.top_p)  # (1, Vd)
                draft = sample(q, generator)  # (1,) one (1, 1) uniform, as a sampled EAGLE-3 chain draws each level
                probs.append(q)
            elif options.draft_topk:
                draft = candidates[i].index_select(0, top.argmax(-1))  # (1,)
            else:
                draft = logits.argmax(-1)  # (1,)
            prev = all_draft_ids.index_select(0, draft)  # (1,) target id
            drafts.append(prev)
    previous = torch.cat(drafts)  # (k+1,) the bonus token, then the drafts
    # the confidences read only the drafts before them: all k in one pass after the loop, none inside it
    e = (drafter.markov_head.markov_w1(previous[:-1]) if config.confidence_head and config.confidence_head_with_markov
         else None)  # (k, r)
    probs = draft_probs_to_target(torch.cat(probs), all_draft_ids, vocab_size) if probs else None  # (k, V) at once
    return previous[1:], probs, drafter.confidence_logits(hidden, e)


def candidate_chain(
    drafter: DSparkDrafter,
    values: torch.Tensor,  # (k, K) base logits of each position's K candidates
    candidates: torch.Tensor,  # (k, K) their draft ids
    root_token: torch.Tensor,  # () the bonus token (target id)
    options: DecodeOptions,
    generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Markov loop over K candidates for the vanilla head, from one table (module docstring) -> (drafts (k,)
    draft ids, the distributions over its K candidates each was drawn from (k, K), None at T = 0)."""
    head = drafter.markov_head
    k, width = candidates.shape
    prev = torch.cat([root_token.reshape(1, 1).expand(1, width),  # position 0 follows the bonus token alone
                      drafter.draft_to_target(candidates[:-1])])  # (k, K) target ids of the possible previous tokens
    w1 = head.markov_w1(prev)  # (k, K, r)
    w2 = F.embedding(candidates, head.markov_w2.weight)  # (k, K, r)
    bias = w1.to(w2.dtype) @ w2.transpose(1, 2)  # (k, K previous, K next): W2[next] . W1[previous]
    table = values[:, None, :] + bias.to(values.dtype)  # (k, K, K) the corrected logits after each previous one
    if options.temperature <= 0:
        best = table.argmax(-1)  # (k, K) the best next candidate after each previous one
    else:
        q = logits_to_probs(table, options.temperature, options.top_k, options.top_p)  # (k, K, K)
    chosen, rows = [torch.zeros(1, dtype=torch.long, device=values.device)], []  # position 0: any row (all alike)
    for i in range(k):
        if options.temperature <= 0:
            chosen.append(best[i].index_select(0, chosen[-1]))  # (1,)
        else:
            rows.append(q[i].index_select(0, chosen[-1]))  # (1, K)
            chosen.append(sample(rows[-1], generator))  # (1,) one (1, 1) uniform a draft, as the loop draws
    drafted = candidates.gather(1, torch.cat(chosen[1:])[:, None])[:, 0]
    return drafted, torch.cat(rows) if rows else None


def grow_dspark(drafter_backend, drafter: DSparkDrafter, root_hidden: torch.Tensor, root_logits: torch.Tensor,
                root_token: torch.Tensor, start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
                generator) -> tuple[DraftTree, torch.Tensor]:
    """The chain of `chain_length` drafts after `root_token` -> (tree, its (k+1, k+1) ancestors-or-self mask).
    Same contract as EAGLE-3's `grow_tree`; `root_hidden` and `root_logits` are not read."""
    k = options.chain_length
    hidden = drafter_backend.block_hidden(root_token, start, k)  # (k, H)
    drafts, probs, confidences = markov_chain(drafter, hidden, root_token, options, vocab_size, generator)
    tokens = torch.cat([root_token.reshape(1), drafts])  # (k+1,)
    parents = chain_parents(k, tokens.device)
    draft_probs = None if probs is None else torch.cat([torch.zeros_like(probs[:1]), probs])  # the root has none
    tree = DraftTree(tokens, parents, torch.arange(k + 1, device=tokens.device), draft_probs=draft_probs)
    if confidences is not None:
        tree.survival = torch.cumprod(drafter.calibrated(confidences), 0)  # (k,)
        if options.verify_threshold > 0:
            tree.limit = (tree.survival >= options.verify_threshold).long().sum()  # survival only falls along a chain
    return tree, ancestor_matrix(parents, k)


def check(config, options: DecodeOptions) -> None:
    """What `method=dspark` refuses before drafting, from the drafter's config, beyond what every method is checked
    for (its type, more drafts than a block makes): a confidence threshold without a confidence head, more Markov
    candidates than draft ids."""
    ids = config.draft_vocab_size
    if options.draft_topk > ids:
        raise EaglekitError(f"draft_topk={options.draft_topk}: this DSpark drafter has {ids} draft ids; pass "
                            f"draft_topk=1..{ids} (0 = all of them)")
    if options.verify_threshold > 0 and not config.confidence_head:
        raise EaglekitError(f"verify_threshold={options.verify_threshold} needs the drafter's confidence head, and "
                            "this DSpark drafter has none: leave verify_threshold at 0, or train one with "
                            "confidence_head=true")


def static_backend(drafter: torch.nn.Module, capacity: int, num_drafts: int, compile: bool):
    from eaglekit.drafters.dspark.static import StaticDSparkDrafter

    return StaticDSparkDrafter(drafter, capacity, num_drafts, compile)


METHOD = SpeculativeMethod("dspark", grow_dspark, DSparkDrafterBackend, static_backend,
                           lambda drafter: isinstance(drafter, DSparkDrafter), check=check, confidence=True,
                           markov=True)
