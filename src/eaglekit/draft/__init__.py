"""The drafter: the EAGLE-3 model (`model`), its draft vocabulary (`vocab`), training-time test (`ttt`, pure
functions) and training (`train`, with `build`, `data`, `setup`, `checkpoint`)."""

from eaglekit.draft.model import DrafterConfig, Eagle3Drafter

__all__ = ["DrafterConfig", "Eagle3Drafter"]
