"""The target model: loading it, verified hidden-state capture (hooks on whatever class is loaded), extraction into
the hidden-state store, and the identities that keep stored states paired with their target.

Names are imported lazily so `import eaglekit.targets.loading` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HiddenStateCapture": "eaglekit.targets.capture",
    "find_decoder": "eaglekit.targets.capture",
    "default_aux_layers": "eaglekit.targets.capture",
    "verify_capture": "eaglekit.targets.verify",
    "HiddenStateDataset": "eaglekit.targets.store",
    "tokenizer_hash": "eaglekit.targets.identity",
    "target_config_hash": "eaglekit.targets.identity",
    "target_report": "eaglekit.targets.inspection",
    "format_target_report": "eaglekit.targets.inspection",
    "load_target": "eaglekit.targets.loading",
    "load_tokenizer": "eaglekit.targets.loading",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'eaglekit.targets' has no attribute {name!r}")
