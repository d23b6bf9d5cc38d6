"""The engine doctor: will a serving engine run EAGLE-3 for this target? Answered from the engine's own source.

- `source`, `pysource`: read an engine's Python source (installed package, source tree or wheel) without importing
  it, and resolve classes across its modules with `ast`.
- `facts` (what the source says) <- `checks` (per-engine checks and verdicts) <- `diagnose` (the entry point and
  its report); `serving`: what vLLM's proposer needs of the target when it loads a drafter.
- `plugin`: the out-of-tree vLLM plugin written by `eaglekit doctor --fix`.
- `drafter_support`: does an engine release serve a drafter type.
"""
