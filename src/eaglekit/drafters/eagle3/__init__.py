"""EAGLE-3 drafters: the model (`model`; the MLA midlayer in `mla`), training-time test (`ttt`, pure functions),
building one for a target (`build`) and the engines' checkpoint layouts (`formats`, `mla_format`, `convert`)."""

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3 import mla  # noqa: F401, E402  registers drafter_arch="mla" in model.MIDLAYERS

__all__ = ["DrafterConfig", "Eagle3Drafter"]
