"""The run report's section on drafters with a confidence head (DSpark): how well their calibrated confidences
predict which drafts survive, per block position, from what training recorded (`after_training` in a train
folder's manifest.json), and what bench measured at each `verify_thresholds` value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.manifest import read_manifest


def calibrations(out: Path) -> dict[str, dict[str, Any]]:
    """Train folder name (train, train-<type>) -> the calibration its training recorded, for each calibrated one."""
    found = {}
    for folder in sorted(d for d in out.glob("train*") if d.is_dir() and not d.name.endswith(".old")):
        after = (read_manifest(folder) or {}).get("after_training") or {}
        if after.get("calibrated"):
            found[folder.name] = after
    return found


def _number(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def calibration_markdown(folder: str, after: dict[str, Any]) -> list[str]:
    """One drafter's calibration: per block position, the survivals counted and the confidence's ECE and AUC before
    and after its temperature."""
    lines = [f"`{folder}/`: confidence calibrated on {after.get('blocks')} validation blocks (one temperature per "
             "block position, fitted in order). ECE: the gap between predicted and observed survival (0 = "
             "calibrated); AUC: how well the confidence ranks surviving drafts above the others (0.5 = chance).", "",
             "| position | blocks | survived | temperature | ECE raw | ECE | AUC raw | AUC |",
             "|---|---|---|---|---|---|---|---|"]
    for row in after.get("positions") or []:
        lines.append(f"| {row['position']} | {row['blocks']} | {row['survived']} | {row['temperature']:.2f} | "
                     f"{_number(row.get('ece_raw'))} | {_number(row.get('ece'))} | {_number(row.get('auc_raw'))} | "
                     f"{_number(row.get('auc'))} |")
    return lines


def section(info: dict[str, Any]) -> list[str]:
    """The report's 'Confidence' section (nothing when no drafter of the run has a calibrated confidence head)."""
    found = info.get("calibration") or {}
    if not found:
        return []
    lines = ["", "### Confidence (DSpark)", "",
             "A draft's confidence is the probability that it survives verification given its prefix did; the "
             "product over a block is its survival, and `verify_threshold=` verifies only the drafts whose survival "
             "reaches it (fewer tokens per target forward, the same output).", ""]
    for folder, after in found.items():
        lines += [*calibration_markdown(folder, after), ""]
    return lines[:-1]
