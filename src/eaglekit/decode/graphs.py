"""How the static fast path compiles its steps: torch.compile settings, CUDA-graph helpers, and the drafter
view a captured speculative step drafts through. Shared by `static.py` (the backends) and `fused.py` (the
one-function step), which import it and not each other.

Fixed-shape steps compile with `COMPILE_OPTIONS` ("reduce-overhead": CUDA graphs on GPU); the prefills
compile once with a symbolic token dimension (`PREFILL_OPTIONS`). Tests swap in another backend (e.g.
"aot_eager") by setting these module attributes, which every helper reads at call time.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

# how fixed-shape steps are compiled (tests swap in backend="aot_eager" to trace the same graphs on a CPU)
COMPILE_OPTIONS: dict[str, Any] = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
# how the prefills are compiled: one inductor graph for every prompt length (the token dimension is
# symbolic), replayed as a CUDA graph recorded once per padded length (`static.PREFILL_BUCKET`)
PREFILL_OPTIONS: dict[str, Any] = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": None}


def compiled(fn: Callable, enabled: bool) -> Callable:
    """`fn` under torch.compile with `COMPILE_OPTIONS`, or `fn` itself when not `enabled`."""
    return torch.compile(fn, **COMPILE_OPTIONS) if enabled else fn


def prefill_compiled(fn: Callable, enabled: bool) -> Callable:
    """`fn(*tensors)` compiled once for any length of the tensors' token dimension (dim 0; a (1, 1, T, S)
    mask: dim 2), outputs cloned as `call_step` does; a length seen for the first time runs twice (CUDA graph
    trees warm up, then record: the recording is not left to a timed call). One-token calls and
    `enabled=False` run `fn` as it is."""
    if not enabled:
        return fn
    step = torch.compile(fn, **PREFILL_OPTIONS)
    seen: set[int] = set()

    def call(*tensors: torch.Tensor):
        length = tensors[0].shape[0]
        if length < 2:  # a length of 1 would be specialised: a second graph for a rare case
            return fn(*tensors)
        for x in tensors:  # the token dimension of each input that has one (a (1, 1, T, S) mask: dim 2)
            if x.dim() == 4 or x.shape[0] == length:
                torch._dynamo.maybe_mark_dynamic(x, 2 if x.dim() == 4 else 0)
        for _ in range(1 if length in seen else 2):  # idempotent: the same K/V written to the same slots
            out = call_step(step, True, *tensors)
        seen.add(length)
        return out

    return call


def static_buffers(module: nn.Module) -> None:
    """Mark a module's cache buffers as fixed addresses, so CUDA graphs write them in place (no copies)."""
    for buffer in module.buffers():
        torch._dynamo.mark_static_address(buffer)


def call_step(fn: Callable, is_compiled: bool, *args):
    """Run a (possibly CUDA-graphed) step; outputs are cloned so the next replay cannot overwrite them."""
    if not is_compiled:
        return fn(*args)
    torch.compiler.cudagraph_mark_step_begin()
    return tuple(None if o is None else o.clone() for o in fn(*args))


class GraphSteps:
    """The drafter backend a method's grow function sees inside the fused step: plain calls of a static drafter
    backend's step module (the graph is captured once around the whole step), the stable length as a tensor."""

    def __init__(self, owner: Any, stable: torch.Tensor):  # owner: a drafter type's static backend
        self.owner, self.stable = owner, stable

    def draft_step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor):
        slots, mask = self.owner.step_inputs(ids, visible, self.stable)
        return self.owner.net(hidden, ids, positions, slots, mask)

    def block_logits(self, root_token: torch.Tensor, start: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """A block drafter's draft logits (DFlash's static backend): the owner's own, already a fixed-shape function."""
        return self.owner.block_logits(root_token, start, num_drafts)

    def block_hidden(self, root_token: torch.Tensor, start: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """A block drafter's drafting slots' hidden states (DSpark's Markov loop reads them): the owner's own."""
        return self.owner.block_hidden(root_token, start, num_drafts)
