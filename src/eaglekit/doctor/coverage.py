"""How much of a vLLM release the doctor's `--fix` covers: every architecture of its model registry, classified.

`eaglekit doctor --engine vllm --coverage FILE` runs the doctor's vLLM checks on each architecture name of the
registry read (no config: no model type, layer count or head size; no plugins) and sorts it into one category:

- `supported`: vLLM runs EAGLE-3 for it as shipped;
- `delegation plugin`: a multimodal wrapper whose language model implements the interface (`--fix` delegates to it);
- `subclass plugin`: a class without the interface whose decoder (`self.model`) collects the aux states already,
  mostly by inheritance (`--fix` adds the interface in a subclass);
- `embedding plugin`: the class implements the interface but vLLM's EAGLE proposer does not find its embedding
  (`--fix` exposes it under the name the proposer reads);
- `not fixable`: a model change is needed (a decoder that does not collect the aux states, a wrapper around such a
  model, a forward that does not return the decoder's output as is);
- `unknown`: the doctor cannot tell from the source (a class chosen at run time, a layout it does not read).

The registry also lists encoders, poolers, speech and draft models, which no target of EAGLE-3 is; they count as
what their class says (mostly `not fixable`).
"""

from __future__ import annotations

import logging
from typing import Any

from eaglekit.doctor.checks import check_vllm
from eaglekit.doctor.facts import NOT_SUPPORTED, SUPPORTED, Target, vllm_registry
from eaglekit.doctor.pysource import ModuleIndex
from eaglekit.doctor.source import open_source
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

CATEGORIES = ("supported", "delegation plugin", "subclass plugin", "embedding plugin", "not fixable", "unknown")


def category(report: dict[str, Any]) -> str:
    """The category (see the module docstring) of one doctor report."""
    if report["verdict"] == SUPPORTED:
        return "supported"
    if report["verdict"] != NOT_SUPPORTED:
        return "unknown"
    if not report["plugin_fix_possible"]:
        return "not fixable"
    if report.get("wrapper") and not report["interface"]["implements"]:
        return "delegation plugin"
    if (report.get("subclass") or {}).get("fits"):
        return "subclass plugin"
    return "embedding plugin"


def registry_coverage(engine_source: str = "") -> dict[str, Any]:
    """{engine_version, engine_source, architectures, counts: {category: n}, by_category: {category: [names]}}
    for every architecture of the vLLM registry read from `engine_source` (default: as `eaglekit doctor` finds it)."""
    from tqdm import tqdm

    source = open_source("vllm", engine_source)
    index = ModuleIndex([source])
    registry = vllm_registry(index)
    if registry is None:
        raise EaglekitError(f"{source.description} has no vLLM model registry the doctor reads "
                            "(vllm/model_executor/models/registry.py); pass engine_source= a vLLM package or wheel")
    by_category: dict[str, list[str]] = {name: [] for name in CATEGORIES}
    for architecture in tqdm(sorted(registry), desc="doctor coverage", unit="arch"):
        try:
            report = check_vllm(index, source, Target(architecture, source="architecture name"), [])
        except (EaglekitError, RecursionError, SyntaxError) as error:  # a module the doctor cannot read
            log.info("%s: %s", architecture, error)
            by_category["unknown"].append(architecture)
            continue
        by_category[category(report)].append(architecture)
    return {"engine_version": source.version(), "engine_source": source.description,
            "architectures": len(registry), "counts": {name: len(by_category[name]) for name in CATEGORIES},
            "by_category": by_category}


def format_coverage(coverage: dict[str, Any]) -> str:
    counts = coverage["counts"]
    fixable = counts["delegation plugin"] + counts["subclass plugin"] + counts["embedding plugin"]
    lines = [f"vLLM {coverage['engine_version']} ({coverage['engine_source']}): {coverage['architectures']} "
             f"registered architectures; EAGLE-3 supported as shipped: {counts['supported']}, fixable by --fix: "
             f"{fixable}"]
    lines += [f"  {name:<18} {counts[name]:>4}" for name in CATEGORIES]
    lines.append("  subclass plugin:   " + ", ".join(coverage["by_category"]["subclass plugin"]))
    return "\n".join(lines)
