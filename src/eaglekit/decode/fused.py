"""Speculative decoding on the static fast path as ONE step function, run a step ahead of the host.

A speculative step of `engine.decode_loop` is five pieces (draft, verify forward, verification, KV
compaction, drafter extend) with the host in between: it reads the accepted path, then launches the next
pieces. On a small target the host work (Python, dispatch, one CUDA-graph launch per piece) cost more
than the GPU work (profiled on an H200: 3.4 ms per tree step, of which 1.9 ms on the GPU). Here a whole
step (greedy or sampled, chain or tree) is one function of device state, so with `compile=True` it is
one CUDA graph:

    draft from (root hidden, root logits, root token)  ->  verify the tree at cache length m
    ->  accepted path, count and bonus (`greedy_path`, `sampled_chain_path`)  ->  keep the path's KV entries
    ->  extend the drafter by the path (padded to the longest path)  ->  the next root, m + count

Everything a step needs (the root, the target length m, the drafter's stable length) lives in buffers the
step updates in place, so step k+1 can be launched before step k's tokens reach the host: the loop keeps one
step queued while it reads the previous one (one pinned copy and one event wait per step), and the GPU never
idles on the host. The host only learns the tokens, checks EOS and the length budget, and drops the step
queued after the last one; once the steps in flight would reach the length budget (at the tokens per step
seen so far) it queues none, so a generation ended by its length mostly runs no step for nothing; and the
drafter's prefill and the first steps are queued before the prefill's first token is read. Sampling: a
captured graph cannot take a generator, so a step's uniforms are drawn from the seeded generator just before
its launch, in the order and shapes the reference loop draws them (`_draw_shapes`), and handed to the step
as `sampling.PreDrawn`: the tokens equal the reference loop's for every seed. Tests: equal tokens and
acceptance to the eager reference, one graph per step, no host transfers that grow with the steps, no
overrun of the tightest cache.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import replace

import torch
from torch import nn

from eaglekit.decode import graphs
from eaglekit.config.decode import CHAIN_METHODS
from eaglekit.decode.engine import DecodeOptions, DecodeStats, draft_size
from eaglekit.decode.methods import SpeculativeMethod
from eaglekit.decode.sampling import PreDrawn, logits_to_probs, rand
from eaglekit.decode.tree import chain_from_logits
from eaglekit.decode.verify import greedy_path, rejection_tree_tokens, sampled_chain_path
from eaglekit.errors import EaglekitError


class _State(nn.Module):
    """The loop-carried state of the steps (buffers at fixed addresses, updated in place)."""

    def __init__(self, hidden: int, draft_vocab: int, ahead: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        # root's drafter state
        self.register_buffer("hidden", torch.zeros(hidden, dtype=dtype, device=device), persistent=False)
        self.register_buffer("logits", torch.zeros(draft_vocab, dtype=dtype, device=device), persistent=False)
        # a method that drafts ahead (P-EAGLE): the logits of the next chain's drafts 2 .. k, from the extend's forward
        self.register_buffer("ahead_logits", torch.zeros(ahead, draft_vocab, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("token", torch.zeros((), dtype=torch.long, device=device), persistent=False)  # root token
        # m, = stable
        self.register_buffer("length", torch.zeros((), dtype=torch.long, device=device), persistent=False)


def tree_mask(columns: torch.Tensor, length: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """(N, S) verify mask: every cached column (< length), and among columns length .. length + N - 1 the
    node's ancestors-or-self. `length` is a 0-d device tensor, so the mask has one shape for all steps."""
    n = ancestors.shape[0]
    relative = columns - length  # (S,)
    inside = (relative >= 0) & (relative < n)
    return (columns < length)[None, :] | (ancestors[:, relative.clamp(0, n - 1)] & inside[None, :])


def fused_shape(options: DecodeOptions) -> DecodeOptions:
    """The options that fix a fused step's graph (sampling settings only where it samples)."""
    if options.temperature <= 0:
        options = replace(options, temperature=0.0, top_k=0, top_p=1.0)
    return replace(options, eos_token_ids=(), seed=0)


class FusedStep:
    """Chains and trees, greedy or sampled, over a `static.StaticTarget` and a drafter type's static backend (module
    docstring). `Decoder` builds one per target backend and options shape (`fused_shape`)."""

    def __init__(self, target, drafter, options: DecodeOptions, vocab_size: int, method: SpeculativeMethod):
        self.target, self.drafter, self.method = target, drafter, method
        net = drafter.net.drafter
        param = net.fc.weight
        self.nodes = draft_size(options)  # verify width
        # a method that drafts ahead (P-EAGLE: the k - 1 mask slots) runs them in the same drafter forward as the
        # extend (`extend_and_draft`), so its step runs one drafter forward, as vLLM's does
        self.ahead = self.nodes - 2 if method.ahead is not None else 0
        self.state = _State(*drafter.state_sizes, self.ahead, param.dtype, param.device)  # root hidden (H,), logits
        self.path = min(options.draft_depth, self.nodes - 1) + 1  # longest accepted path, bonus included
        self.capacity = min(target.capacity, drafter.capacity)
        self.options = fused_shape(options)
        self.step = graphs.compiled(functools.partial(self._step, options=self.options, vocab_size=vocab_size),
                                    target.compile)
        if target.compile:
            graphs.static_buffers(self.state)
        self._host = [torch.zeros(self.path + 2, dtype=torch.long, pin_memory=param.is_cuda) for _ in range(2)]
        self._draw_shapes = self.draw_shapes(self.options, self.nodes, net.config.draft_vocab_size, method.at_once)

    @staticmethod
    def draw_shapes(options: DecodeOptions, nodes: int, draft_vocab: int, at_once: bool) -> list[tuple[int, ...]]:
        """The uniforms one step of the reference loop draws, in order: a sampled chain draws each draft
        (`sample` of (1, Vd); all k at once for a method that drafts the chain at once: `tree.chain_from_logits`),
        then the k acceptance tests and the bonus (`verify.sampled_chain_path`); a
        sampled tree draws every expanded node's children (`tree.sample_candidates`: the root, then top_k
        nodes a level), then per node a test for each child and the bonus (`verify.rejection_tree_tokens`);
        greedy draws nothing."""
        if options.temperature <= 0:
            return []
        if options.method in CHAIN_METHODS:
            k = nodes - 1
            return ([(k, 1)] if at_once else [(1, 1)] * k) + [(k,), (1, 1)]
        k = options.tree_top_k
        return [(1, draft_vocab)] + [(k, draft_vocab)] * (options.depth - 1) + [(nodes, k), (nodes, 1)]

    def _step(self, *draws: torch.Tensor, options: DecodeOptions, vocab_size: int) -> torch.Tensor:
        """One step on the state -> (2 + path,): the path length c, the drafts verified (-1: every one), then the
        step's new tokens (the c - 1 accepted drafts and the bonus) padded to the longest path. `draws`: the step's
        uniforms (sampling)."""
        state, target, drafter = self.state, self.target, self.drafter
        m = state.length
        source = PreDrawn(draws)
        if self.ahead:  # the chain's logits came with the last extend
            chain = torch.cat([state.logits[None], state.ahead_logits])  # (k, Vd)
            tree, ancestors = chain_from_logits(drafter.net.drafter, chain, state.token, options, vocab_size, source)
        else:
            tree, ancestors = self.method.grow(graphs.GraphSteps(drafter, m), drafter.net.drafter, state.hidden,
                                               state.logits, state.token, m, options, vocab_size, source)
        n = tree.tokens.shape[0]
        offsets = torch.arange(n, device=m.device)
        mask = tree_mask(target._columns, m, ancestors)[None, None]
        logits, aux = target.net(tree.tokens, m + tree.depths, m + offsets, mask)
        if options.temperature > 0 and tree.draft_probs is not None:  # sampled chain: the p/q rule
            probs = logits_to_probs(logits, options.temperature, options.top_k, options.top_p)
            accepted, bonus = sampled_chain_path(tree.tokens, probs, tree.draft_probs, source, tree.limit)
            order, count = offsets, accepted + 1
        else:  # greedy, or a sampled tree: each node's emitted token, walked like greedy (verify_sampled_tree)
            target_ids = (rejection_tree_tokens(tree.tokens, tree.parents,
                                                logits_to_probs(logits, options.temperature, options.top_k,
                                                                options.top_p),
                                                tree.child_probs, options.tree_top_k, source)
                          if options.temperature > 0 else logits.argmax(-1))
            on_path, order, bonus = greedy_path(tree.tokens, tree.parents, ancestors, target_ids, tree.limit)
            count = on_path.sum()  # () nodes on the accepted path, root included
        path = order[: self.path]  # (P,) the path, then nodes that fill the padding rows
        target.net.compact(m, path)  # padding rows land past m + count, where the next verify writes
        after = torch.cat([path[1:], path[:1]])  # (P,) the node after each path node (last row: a dummy)
        rows = torch.arange(self.path, device=m.device)
        new_tokens = torch.where(rows + 1 < count, tree.tokens[after], bonus)  # accepted drafts, then the bonus
        # rows >= count are overwritten later
        if self.ahead:
            hidden, draft_logits = drafter.extend_and_draft(aux[path], new_tokens, m + rows, m, m + count, self.ahead)
            state.ahead_logits.copy_(draft_logits[self.path :])
        else:
            hidden, draft_logits = drafter._extend(aux[path], new_tokens, m + rows, m)
        last = (count - 1).reshape(1)
        state.hidden.copy_(hidden.index_select(0, last)[0])
        state.logits.copy_(draft_logits.index_select(0, last)[0])
        state.token.copy_(bonus[0])
        state.length.copy_(m + count)
        verified = tree.limit.reshape(1) if tree.limit is not None else torch.full_like(count.reshape(1), -1)
        return torch.cat([count.reshape(1), verified.to(new_tokens.dtype), new_tokens])

    def run(self, root_hidden: torch.Tensor, root_logits: torch.Tensor, root_token: torch.Tensor, length: int,
            out, stats: DecodeStats, generator: torch.Generator | None = None, read_first=None) -> None:
        """Decode after the prefill (state: the drafter's output at the last prompt position, the first
        token, `length` cached tokens) until `out` says stop. `read_first()`: hands the first token to `out`
        (True: generation is over), called once the first steps are queued, so they run while it waits."""
        state = self.state
        state.hidden.copy_(root_hidden)
        state.logits.copy_(root_logits)
        state.token.copy_(root_token)
        state.length.fill_(length)
        if self.ahead:  # the first chain's mask slots (later ones come with each step's extend)
            state.ahead_logits.copy_(self.method.ahead(graphs.GraphSteps(self.drafter, state.length),
                                                       self.drafter.net.drafter, root_logits, state.length,
                                                       self.ahead + 1))
        queued: deque = deque()  # (host buffer, event) of launched steps not yet read
        done, confirmed, launched = False, length, 0
        while not done:
            # queue steps (at most two: one running, one waiting) while the cache surely has room for them, and
            # none once the steps in flight, at this generation's tokens per step so far, would reach the length
            # budget: it would likely run for nothing (and a wrong guess costs one host round trip, not a step)
            produced = len(out.tokens) + (read_first is not None)  # a first token not read yet is on its way
            read = len(stats.accepted)  # steps read so far
            per_step = (confirmed - length) / read if read else 1.0
            while (len(queued) < 2 and confirmed + self.path * len(queued) + self.nodes <= self.capacity
                   and not (queued and produced + per_step * len(queued) >= out.max_new_tokens)):
                queued.append(self._launch(launched % 2, generator))
                launched += 1
            if read_first is not None:
                done, read_first = read_first(), None
                continue
            if not queued:
                raise EaglekitError(f"static KV cache full ({self.capacity} slots); raise max_length")
            host, event = queued.popleft()
            if event is not None:
                event.synchronize()
            values = host.tolist()
            count, verified = values[0], values[1]
            stats.accepted.append(count - 1)
            if verified >= 0:
                stats.verified.append(verified)
            stats.target_forwards += 1
            confirmed += count
            done = out.add(values[2 : 2 + count])
        for _, event in queued:  # the step queued after the last one: its time counts, its tokens do not
            if event is not None:
                event.synchronize()
        stats.discarded_steps = len(queued)
        self.target.length = self.drafter.stable_length = confirmed

    def _launch(self, slot: int, generator: torch.Generator | None):
        device = self.state.token.device
        draws = [rand(shape, generator, device) for shape in self._draw_shapes]  # as the reference loop draws them
        if self.target.compile:
            torch.compiler.cudagraph_mark_step_begin()
        emitted = self.step(*draws)
        host = self._host[slot]
        host.copy_(emitted, non_blocking=True)
        if not emitted.is_cuda:
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event
