"""The names of the checkpoint layouts eaglekit exports and imports (see `eaglekit.drafters.eagle3.formats`).

Kept free of torch so that the stage configs (`eaglekit export --help`, `eaglekit run --help`)
can list them without importing the conversion code.
"""

EXPORT_FORMATS = ("vllm", "sglang", "speculators")
IMPORT_FORMATS = ("auto", "vllm", "sglang", "eagle", "speculators")
