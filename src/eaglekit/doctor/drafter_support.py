"""Does a serving engine release serve a drafter type? Read from that release's source.

Each drafter type names, per engine that serves it, a source file and the text that is there only when the release
has the code path, with how it is served (`eaglekit.registry.EngineMarker`, in the type's folder). vLLM 0.32: eagle3
(`llama_eagle3.py`), p-eagle (the same class with its `mask_hidden` buffer, enabled by `"parallel_drafting": true`;
vLLM's MLA drafter class takes no parallel drafting), dflash (`DFlashDraftModel` in its model registry). SGLang:
eagle3; eaglekit knows no SGLang path for the others.
"""

from __future__ import annotations

from typing import Any

from eaglekit import registry


def drafter_type_support(source: Any, engine: str, drafter_type: str) -> dict[str, Any]:
    """source: an `doctor.source.EngineSource` of `engine` -> {"drafter_type", "served", "how", "evidence"}."""
    marker = registry.get(drafter_type).engines.get(engine)
    if marker is None:
        return {"drafter_type": drafter_type, "served": False, "how": "",
                "evidence": f"eaglekit knows no {engine} code path that serves a {drafter_type} drafter"}
    found = marker.text in (source.read(marker.path) or "")
    return {"drafter_type": drafter_type, "served": found, "how": marker.how if found else "",
            "evidence": f"{source.location(marker.path)} {'has' if found else 'lacks'} {marker.text}"}


def format_support(support: dict[str, Any], engine: str) -> str:
    if support["served"]:
        return f"drafter type {support['drafter_type']}: served by this {engine} ({support['how']})"
    return f"drafter type {support['drafter_type']}: NOT served by this {engine} ({support['evidence']})"
