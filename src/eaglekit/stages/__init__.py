"""The pipeline stages, one module each. Every stage module defines:

- `Config`: a frozen dataclass whose fields use `eaglekit.config.option(default, help)`;
- `run(config: Config) -> result`: does the work, writes outputs with the resolved config beside them;
- optionally `POSITIONAL`: config keys that bare CLI arguments fill in order (`eaglekit inspect FILE`).

The module docstring's first line is the stage's one-line summary in `eaglekit --help`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# stage name -> module. The order is the pipeline's order, which `eaglekit --help` shows.
STAGES: dict[str, str] = {
    "inspect": "eaglekit.stages.inspect",
    "regen": "eaglekit.stages.regen",
    "extract": "eaglekit.stages.extract",
    "vocab": "eaglekit.stages.vocab",
    "train": "eaglekit.stages.train",
    "generate": "eaglekit.stages.generate",
    "bench": "eaglekit.stages.bench",
    "export": "eaglekit.stages.export",
    "import": "eaglekit.stages.import_",
    "doctor": "eaglekit.stages.doctor",
    "serve": "eaglekit.stages.serve",
    "run": "eaglekit.stages.run",
}


def load_stage(name: str) -> ModuleType:
    """Import a stage module by its CLI name."""
    return importlib.import_module(STAGES[name])


def available() -> dict[str, str]:
    """Stages whose module exists in this install (a stage under construction is left out)."""
    found = {}
    for name, module in STAGES.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = module
    return found
