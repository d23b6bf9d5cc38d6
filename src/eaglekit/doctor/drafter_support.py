"""Does a serving engine release serve a drafter type (eagle3, p-eagle, dflash)? Read from that release's source.

Each known (engine, drafter type) pair names a source file and the text that is there only when the release has
the code path, with how it is served. vLLM 0.32: eagle3 (`llama_eagle3.py`), p-eagle (the same class with its
`mask_hidden` buffer, enabled by `"parallel_drafting": true`; vLLM's MLA drafter class takes no parallel drafting),
dflash (`DFlashDraftModel` in its model registry). SGLang: eagle3; eaglekit knows no SGLang path for the others.
"""

from __future__ import annotations

from typing import Any

MARKERS = {  # (engine, drafter type) -> (source file, text present when served, how it is served)
    ("vllm", "eagle3"): ("vllm/model_executor/models/llama_eagle3.py", "class Eagle3LlamaForCausalLM",
                         'speculative_config {"method": "eagle3"}'),
    ("vllm", "p-eagle"): ("vllm/model_executor/models/llama_eagle3.py", '"mask_hidden"',
                          'speculative_config {"method": "eagle3", "parallel_drafting": true} (Llama-style drafters '
                          "only: vLLM's MLA drafter takes no parallel drafting)"),
    ("vllm", "dflash"): ("vllm/model_executor/models/registry.py", '"DFlashDraftModel"',
                         'speculative_config {"method": "dflash"}'),
    ("sglang", "eagle3"): ("sglang/srt/models/llama_eagle3.py", "class LlamaForCausalLMEagle3",
                           "--speculative-algorithm EAGLE3"),
}


def drafter_type_support(source: Any, engine: str, drafter_type: str) -> dict[str, Any]:
    """source: an `engine_source.EngineSource` of `engine` -> {"drafter_type", "served", "how", "evidence"}."""
    marker = MARKERS.get((engine, drafter_type))
    if marker is None:
        return {"drafter_type": drafter_type, "served": False, "how": "",
                "evidence": f"eaglekit knows no {engine} code path that serves a {drafter_type} drafter"}
    path, text, how = marker
    found = text in (source.read(path) or "")
    return {"drafter_type": drafter_type, "served": found, "how": how if found else "",
            "evidence": f"{source.location(path)} {'has' if found else 'lacks'} {text}"}


def format_support(support: dict[str, Any], engine: str) -> str:
    if support["served"]:
        return f"drafter type {support['drafter_type']}: served by this {engine} ({support['how']})"
    return f"drafter type {support['drafter_type']}: NOT served by this {engine} ({support['evidence']})"
