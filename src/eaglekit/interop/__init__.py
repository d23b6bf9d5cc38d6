"""Interoperability with serving engines and other trainers.

- `formats`: export an eaglekit drafter to the vLLM, SGLang and speculators checkpoint layouts and
  import those (plus SafeAILab/EAGLE's published layout) back, with explicit key maps.
- `engine_source`, `pysource`: read an engine's Python source (installed package, source tree or
  wheel) without importing it, and resolve classes across its modules with `ast`.
- `engine_doctor`: does the engine's registry map this target to a class that implements EAGLE-3?
- `plugin`: the out-of-tree vLLM plugin written by `eaglekit doctor --fix`.
"""
