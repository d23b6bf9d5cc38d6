"""eaglekit: an EAGLE-3 draft model for any large language model, and proof that it speeds the model up.

The pipeline stages live in `eaglekit.stages` (one module per stage, each with a frozen `Config`
dataclass and `run(config)`); the CLI `eaglekit <stage>` is a thin layer over them. Heavy imports
(torch, transformers) happen inside the stages so that `import eaglekit` stays fast.
"""

__version__ = "0.1.0"

from eaglekit.errors import EaglekitError  # noqa: E402

__all__ = ["EaglekitError", "__version__"]
