"""DSpark on the static fast path: DFlash's static backbone (`eaglekit.drafters.dflash.static`: the context in
preallocated buffers, the block forward of a fixed shape) with the block laid out by the drafter's layout; the
Markov loop of `decode.markov_chain` runs inside the same step function, so a whole speculative step stays one graph
(`eaglekit.decode.fused.FusedStep`)."""

from __future__ import annotations

from torch import nn

from eaglekit.drafters.dflash.static import StaticDFlashDrafter


class StaticDSparkDrafter(StaticDFlashDrafter):
    """`StaticDFlashDrafter` whose first drafting slot follows the drafter's layout (0 when every slot drafts)."""

    def __init__(self, drafter: nn.Module, capacity: int, num_drafts: int, compile: bool = False):
        self.first_slot = drafter.config.first_slot
        super().__init__(drafter, capacity, num_drafts, compile)
