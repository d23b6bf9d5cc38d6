"""The target side: loading a target, verified hidden-state capture, the hidden-state store.

Names are imported lazily so `import eaglekit.target.loading` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HiddenStateCapture": "eaglekit.target.capture",
    "find_decoder": "eaglekit.target.capture",
    "default_aux_layers": "eaglekit.target.capture",
    "verify_capture": "eaglekit.target.verify",
    "HiddenStateDataset": "eaglekit.target.store",
    "tokenizer_hash": "eaglekit.target.identity",
    "target_config_hash": "eaglekit.target.identity",
    "target_report": "eaglekit.target.inspection",
    "format_target_report": "eaglekit.target.inspection",
    "load_target": "eaglekit.target.loading",
    "load_tokenizer": "eaglekit.target.loading",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'eaglekit.target' has no attribute {name!r}")
