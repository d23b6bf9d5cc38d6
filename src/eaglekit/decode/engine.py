"""The decode loop: plain, EAGLE-3 chain and EAGLE-3 dynamic-tree speculative decoding, batch 1.

One speculative step:
1. the drafter, fed the target's fused aux states of the tokens accepted last step (its stable KV
   cache grows by exactly those positions), drafts a chain or an EAGLE-2 tree from the last one;
2. ONE target forward verifies the root (the last produced token) and every draft node under a tree
   attention mask, capturing the aux states of all nodes;
3. `verify_greedy` / `verify_sampled_tree` / `verify_sampled_chain` pick the accepted path and the bonus token
   (each with one host sync);
4. the target cache keeps only the accepted nodes' KV entries; the drafter's draft slots are dropped
   and re-made next step from the target's states (what the drafter was trained on).

Positions: the root sits at position m (the number of tokens the target has cached); a node at depth
d at m + d. The drafter step for position t reads (feature of t, token t+1), so a depth-d node is fed
at drafter position m + d - 1 with its parent's output hidden state.
The loop below runs the eager reference backends (`backends.py`): a step has exactly one host
synchronisation (the accepted path, which the variable-length output and the EOS check need) and no
host-to-device copies. On the static fast path (`static.py`) every speculative step runs the same
pieces as one step function instead, a step ahead of the host (`fused.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.profiler import record_function

from eaglekit.decode.sampling import choose, draft_probs_to_target, logits_to_probs, sample
from eaglekit.decode.tree import (
    DraftTree, ancestor_matrix, build_tree, expand_candidates, extend_ancestry, next_frontier, sample_candidates,
)
from eaglekit.decode.verify import Verdict, verify_greedy, verify_sampled_chain, verify_sampled_tree
from eaglekit.config.decode import CHAIN_METHODS, METHODS, DecodeOptions  # noqa: F401 (re-exported: eaglekit.decode.engine's API)

SYNC_EVERY = 16  # plain decoding: steps between host checks for EOS


@dataclass
class DecodeStats:
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verify step
    max_drafts: int = 0  # longest path a step could accept
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    target_forwards: int = 0
    discarded_steps: int = 0  # fused loop: steps launched ahead whose tokens came after the end (their time counts)

    @property
    def tau(self) -> float:
        """Mean tokens produced per verify forward (accepted drafts + the bonus token)."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0

    def acceptance_per_position(self) -> list[float]:
        """[i] = fraction of steps whose draft at position i (0-based) was accepted."""
        steps = max(len(self.accepted), 1)
        return [sum(a > i for a in self.accepted) / steps for i in range(self.max_drafts)]

    def to_dict(self) -> dict:
        return {"tau": self.tau, "steps": len(self.accepted), "target_forwards": self.target_forwards,
                "acceptance_per_position": self.acceptance_per_position(),
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "discarded_steps": self.discarded_steps}


@dataclass
class GenerateResult:
    tokens: list[int]  # new tokens only
    finish_reason: str  # "eos" | "length"
    stats: DecodeStats


def draft_size(options: DecodeOptions) -> int:
    """Nodes one step verifies, root included: the chain, or the `total_tokens` best of the tree's pool (top-k
    children of the root, then top-k children of each of the top-k frontier nodes at every further level)."""
    if options.method in CHAIN_METHODS:
        return 1 + options.chain_length
    k = options.tree_top_k
    return 1 + min(options.total_tokens, k + (options.depth - 1) * k * k)


def draft(drafter_backend, drafter, root_hidden: torch.Tensor, root_logits: torch.Tensor, root_token: torch.Tensor,
          start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
          generator: torch.Generator | None) -> DraftTree:
    """Grow a chain or EAGLE-2 tree from the root. root_hidden (H,), root_logits (Vd,), root_token ().

    Every shape depends on `options` alone and nothing is read back to the host, so for deterministic
    drafts (trees, greedy chains) the whole function can run as one captured graph (`static.py`)."""
    chain = options.method == "chain"
    width, depth = (1, options.chain_length) if chain else (options.tree_top_k, options.depth)
    sampled = chain and options.temperature > 0
    sampled_tree = not chain and options.temperature > 0  # children drawn without replacement from q
    device = root_logits.device
    all_draft_ids = drafter.draft_to_target(torch.arange(root_logits.shape[-1], device=device))  # (Vd,)
    f_hidden, f_logits = root_hidden[None], root_logits[None]  # (k, H), (k, Vd) of the frontier nodes
    f_scores = torch.zeros(1, device=device)
    f_pool = torch.full((1,), -1, dtype=torch.long, device=device)  # pool index, -1 = root
    f_slot = torch.full((1,), -1, dtype=torch.long, device=device)  # drafter draft slot, -1 = root
    ancestry = torch.zeros(0, 0, dtype=torch.bool, device=device)
    pool: dict[str, list[torch.Tensor]] = {"tokens": [], "scores": [], "parents": [], "depths": [], "q": [],
                                           "owner": []}
    offset = 0
    for level in range(1, depth + 1):
        if sampled or sampled_tree:
            q = logits_to_probs(f_logits, options.temperature, options.top_k, options.top_p)  # (frontier, Vd)
            if sampled:
                ids, scores, slots = sample(q, generator), f_scores, torch.zeros(1, dtype=torch.long, device=device)
            else:
                ids, scores, slots = sample_candidates(f_scores, q, width, generator)
                pool["owner"].append(f_pool)
            pool["q"].append(draft_probs_to_target(q, all_draft_ids, vocab_size))
        else:
            ids, scores, slots = expand_candidates(f_scores, f_logits, width)
        tokens = all_draft_ids[ids]
        pool["tokens"].append(tokens)
        pool["scores"].append(scores)
        pool["parents"].append(f_pool[slots])
        pool["depths"].append(torch.full_like(tokens, level))
        if level == depth:
            break
        pick = next_frontier(scores, width)  # (k,) candidates to feed to the drafter
        parent = slots[pick]
        ancestry = extend_ancestry(ancestry, f_slot[parent])
        used = ancestry.shape[0] - pick.shape[0]
        positions = torch.zeros_like(pick) + (start + level - 1)  # `start` may be a 0-d tensor (compiled graph)
        f_hidden, f_logits = drafter_backend.draft_step(f_hidden[parent], tokens[pick], positions, ancestry[used:])
        f_scores, f_pool = scores[pick], offset + pick
        f_slot = used + torch.arange(pick.shape[0], device=device)
        offset += tokens.shape[0]
    cat = {k: torch.cat(v) for k, v in pool.items() if v}
    tree = build_tree(root_token, cat["tokens"], cat["scores"], cat["parents"], cat["depths"],
                      min(options.total_tokens if not chain else depth, cat["tokens"].shape[0]),
                      *((cat["q"], cat["owner"]) if sampled_tree else ()))
    if sampled:
        tree.draft_probs = torch.cat([torch.zeros_like(cat["q"][:1]), cat["q"]])  # chain keeps every node
    return tree


def grow_tree(drafter_backend, drafter, root_hidden: torch.Tensor, root_logits: torch.Tensor, root_token: torch.Tensor,
              start: int | torch.Tensor, options: DecodeOptions, vocab_size: int,
              generator: torch.Generator | None) -> tuple[DraftTree, torch.Tensor]:
    """`draft` plus the tree's (N, N) ancestors-or-self matrix, which is the verify attention mask."""
    tree = draft(drafter_backend, drafter, root_hidden, root_logits, root_token, start, options, vocab_size, generator)
    return tree, ancestor_matrix(tree.parents, options.draft_depth)


def verify(tree: DraftTree, ancestors: torch.Tensor, logits: torch.Tensor, options: DecodeOptions,
           generator) -> Verdict:
    """logits (N, V) of the target after each node, ancestors (N, N) -> accepted path and bonus token."""
    if options.temperature <= 0:
        return verify_greedy(tree.tokens, tree.parents, ancestors, logits.argmax(-1))
    probs = logits_to_probs(logits, options.temperature, options.top_k, options.top_p)
    if tree.draft_probs is not None:  # a chain of sampled drafts
        return verify_sampled_chain(tree.tokens, probs, tree.draft_probs, generator)
    return verify_sampled_tree(tree.tokens, tree.parents, ancestors, probs, generator, tree.child_probs,
                               options.tree_top_k)


class _Output:
    """Collects new tokens, stopping at the first EOS or at the length budget."""

    def __init__(self, max_new_tokens: int, eos: tuple[int, ...], on_tokens=None):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos = max_new_tokens, set(eos)
        self.finish_reason = ""
        self.on_tokens = on_tokens  # streaming callback, given the new tokens (EOS left out) after each step

    def add(self, tokens: list[int]) -> bool:
        """Append; True when generation is over."""
        start, done = len(self.tokens), False
        for token in tokens:
            self.tokens.append(token)
            if token in self.eos:
                self.finish_reason, done = "eos", True
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason, done = "length", True
                break
        fresh = [t for t in self.tokens[start:] if t not in self.eos]
        if self.on_tokens is not None and fresh:
            self.on_tokens(fresh)
        return done


def to_host(value: torch.Tensor) -> Callable[[], int]:
    """Start copying a device scalar to the host without waiting; the returned function waits for that copy
    alone (an event, not the whole stream) and gives the value."""
    if not value.is_cuda:
        return lambda: int(value)
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    event = torch.cuda.Event()
    event.record()

    def read() -> int:
        event.synchronize()
        return int(host)
    return read


def decode_loop(target_backend, drafter_backend, drafter, prompt_ids: list[int], max_new_tokens: int,
                options: DecodeOptions, vocab_size: int, on_tokens=None, fused=None, grow=None) -> GenerateResult:
    """Run plain or speculative decoding on prepared backends (see module docstring). `fused`: a
    `fused.FusedStep` over these backends, which then runs every speculative step after the prefill. `grow`:
    the method's draft function (`methods.speculative_method`; default `grow_tree`, EAGLE-3 chains and trees)."""
    grow = grow or grow_tree
    device = target_backend.device
    generator = torch.Generator(device=device).manual_seed(options.seed)
    stats = DecodeStats(max_drafts=0 if options.method == "plain" else options.draft_depth)
    out = _Output(max_new_tokens, options.eos_token_ids, on_tokens)
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    n = prompt.shape[0]
    start_time = time.perf_counter()
    logits, aux = target_backend.forward(prompt, torch.arange(n, device=device),
                                         torch.ones(n, n, dtype=torch.bool, device=device).tril(), last_only=True)
    token = choose(logits[-1], options.temperature, options.top_k, options.top_p, generator)  # ()
    stats.target_forwards += 1
    first = to_host(token)

    def read_first() -> bool:
        """The first token reaches the host (the prefill's time ends there); True when generation is over."""
        over = out.add([first()])
        stats.prefill_seconds = time.perf_counter() - start_time
        return over

    def prefill_drafter():
        """The drafter's first extend: the prompt's aux states with the next token of each position."""
        return drafter_backend.extend(aux, torch.cat([prompt[1:], token.reshape(1)]), torch.arange(n, device=device))

    m = n
    if fused is not None and max_new_tokens > 1:
        # static fast path: the drafter's prefill and the first steps are queued before the first token is read,
        # so the GPU does not wait for the host between the prefills and the steps (fused.py)
        hidden, draft_logits = prefill_drafter()
        fused.run(hidden[-1], draft_logits[-1], token, m, out, stats, generator, read_first)
        done = True
    else:
        done = read_first()
    if not done and options.method == "plain":
        one = torch.ones(1, 1, dtype=torch.bool, device=device)
        pending: list[torch.Tensor] = []  # tokens still on the device: the host checks EOS every SYNC_EVERY steps
        while not done:
            logits, _ = target_backend.forward(token.reshape(1), torch.full((1,), m, device=device), one)
            token = choose(logits[-1], options.temperature, options.top_k, options.top_p, generator)
            stats.target_forwards += 1
            m += 1
            pending.append(token)
            if len(pending) == SYNC_EVERY or len(out.tokens) + len(pending) >= max_new_tokens:
                done = out.add(torch.stack(pending).tolist())  # tokens after an EOS are dropped here
                pending = []
    elif not done:
        hidden, draft_logits = prefill_drafter()
        while not done:
            with record_function("eaglekit.drafters.eagle3"):
                tree, ancestors = grow(drafter_backend, drafter, hidden[-1], draft_logits[-1], token, m, options,
                                       vocab_size, generator)
            with record_function("eaglekit.verify_forward"):
                logits, aux = target_backend.forward(tree.tokens, m + tree.depths, ancestors)
            stats.target_forwards += 1
            with record_function("eaglekit.verify_and_sync"):
                verdict = verify(tree, ancestors, logits, options, generator)
            stats.accepted.append(verdict.num_accepted)
            path = verdict.path_tensor  # on the device: copying the host list back would be a second sync
            with record_function("eaglekit.keep"):
                target_backend.keep(path)
            done = out.add(verdict.tokens + [verdict.bonus])
            if done:
                break
            token = verdict.bonus_tensor[0]
            with record_function("eaglekit.extend"):
                next_ids = torch.cat([tree.tokens[path[1:]], verdict.bonus_tensor])
                hidden, draft_logits = drafter_backend.extend(aux[path], next_ids,
                                                              m + torch.arange(len(verdict.path), device=device))
            m += len(verdict.path)
    stats.decode_seconds = time.perf_counter() - start_time - stats.prefill_seconds
    return GenerateResult(tokens=out.tokens, finish_reason=out.finish_reason, stats=stats)
