"""The decode loop: plain and speculative decoding (any drafter type's method), batch 1.

One speculative step:
1. the drafter, fed the target's fused aux states of the tokens accepted last step (its stable KV
   cache grows by exactly those positions), drafts a chain or an EAGLE-2 tree from the last one (the method's
   `grow`, from the drafter type's folder: `eaglekit.decode.methods`);
2. ONE target forward verifies the root (the last produced token) and every draft node under a tree
   attention mask, capturing the aux states of all nodes;
3. `verify_greedy` / `verify_sampled_tree` / `verify_sampled_chain` pick the accepted path and the bonus token
   (each with one host sync);
4. the target cache keeps only the accepted nodes' KV entries; the drafter's draft slots are dropped
   and re-made next step from the target's states (what the drafter was trained on).

Positions: the root sits at position m (the number of tokens the target has cached); a node at depth
d at m + d.
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

from eaglekit.decode.sampling import choose, logits_to_probs
from eaglekit.decode.tree import (
    DraftTree,
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
    # a confidence cut (`verify_threshold`): each step's drafts verified; the eager loop also keeps the calibrated
    # survival of each draft's prefix (a drafter with a confidence head)
    verified: list[int] = field(default_factory=list)
    survival: list[list[float]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens produced per verify forward (accepted drafts + the bonus token)."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0

    def acceptance_per_position(self) -> list[float]:
        """[i] = fraction of steps whose draft at position i (0-based) was accepted."""
        steps = max(len(self.accepted), 1)
        return [sum(a > i for a in self.accepted) / steps for i in range(self.max_drafts)]

    def to_dict(self) -> dict:
        found = {"tau": self.tau, "steps": len(self.accepted), "target_forwards": self.target_forwards,
                 "acceptance_per_position": self.acceptance_per_position(),
                 "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                 "discarded_steps": self.discarded_steps}
        if self.verified:
            found["verified_per_step"] = sum(self.verified) / len(self.verified)
        return found


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


def verify(tree: DraftTree, ancestors: torch.Tensor, logits: torch.Tensor, options: DecodeOptions,
           generator) -> Verdict:
    """logits (N, V) of the target after each node, ancestors (N, N) -> accepted path and bonus token."""
    if options.temperature <= 0:
        return verify_greedy(tree.tokens, tree.parents, ancestors, logits.argmax(-1), tree.limit)
    probs = logits_to_probs(logits, options.temperature, options.top_k, options.top_p)
    if tree.draft_probs is not None:  # a chain of sampled drafts
        return verify_sampled_chain(tree.tokens, probs, tree.draft_probs, generator, tree.limit)
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
    the method's draft function (`methods.SpeculativeMethod.grow`; None for plain decoding)."""
    assert grow is not None or options.method == "plain", "a speculative method needs its grow function"
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
            if tree.limit is not None:
                stats.verified.append(int(tree.limit))
            if tree.survival is not None:
                stats.survival.append(tree.survival.tolist())
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
