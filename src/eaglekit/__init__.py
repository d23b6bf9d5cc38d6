"""eaglekit: an EAGLE-3 draft model for any large language model, and proof that it speeds the model up.

The pipeline stages live in `eaglekit.stages` (one module per stage, each with a frozen `Config`
dataclass and `run(config)`); the CLI `eaglekit <stage>` and `run_stage` below are thin layers over
them. Heavy imports (torch, transformers) happen inside the stages so that `import eaglekit` is fast.

    import eaglekit
    eaglekit.run_stage("extract", target="tiny", data=["chats.jsonl"], output="runs/x/extract")
    eaglekit.run_stage("train", target="tiny", shards="runs/x/extract", output="runs/x/drafter", max_steps=5)

(`chats.jsonl`: one conversation a line, e.g. `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit import moved
from eaglekit.errors import EaglekitError
from eaglekit.version import __version__

moved.install()  # the earlier layout's module paths, for one more release


def run_stage(name: str, config_file: str | Path | None = None, **options: Any) -> Any:
    """Run one stage from Python: options as keyword arguments (nested sections as dicts), like the CLI's key=value."""
    from eaglekit.config import load_config
    from eaglekit.stages import STAGES, load_stage

    if name not in STAGES:
        raise EaglekitError(f"unknown stage '{name}'; stages: {', '.join(STAGES)}")
    stage = load_stage(name)
    return stage.run(load_config(stage.Config, config_file, options))


__all__ = ["EaglekitError", "__version__", "run_stage"]
