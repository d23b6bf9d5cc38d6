"""The drafter: the EAGLE-3 model (`model`; the MLA midlayer in `mla`), its draft vocabulary (`vocab`),
training-time test (`ttt`, pure functions) and training (`train`, with `build`, `data`, `setup`, `checkpoint`)."""

from eaglekit.draft.model import DrafterConfig, Eagle3Drafter
from eaglekit.draft import mla  # noqa: F401, E402  registers drafter_arch="mla" in draft.model.MIDLAYERS

__all__ = ["DrafterConfig", "Eagle3Drafter"]
