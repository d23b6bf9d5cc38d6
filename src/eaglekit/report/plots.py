"""The run report's plots: training loss and accuracy per TTT position, acceptance per draft position (PNG, written
atomically). Without matplotlib (the `plots` extra) nothing is drawn and the report says so once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.manifest import atomic_path


def _pyplot() -> Any:
    """pyplot, or None when matplotlib is not installed (the report is written without its plots)."""
    from eaglekit.extras import pyplot

    return pyplot("the run report's plots")


def _save(fig: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    _pyplot().close(fig)


def plot_training(metrics: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    train, val = metrics["train"], metrics["val"]
    if not train and not val:
        return False
    plt = _pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if train:
        left.plot([m["step"] for m in train], [m["loss"] for m in train], label="train")
    if val:
        left.plot([m["step"] for m in val], [m["loss"] for m in val], "o-", label="validation")
    left.set(xlabel="optimizer step", ylabel="TTT loss (weighted)", title="loss")
    left.legend()
    positions = len((val or train)[-1]["acc_k"])
    colors = plt.get_cmap("viridis")([k / max(positions - 1, 1) for k in range(positions)])
    for k in range(positions):
        if train:
            right.plot([m["step"] for m in train], [m["acc_k"][k] for m in train], color=colors[k], alpha=0.4)
        if val:
            right.plot([m["step"] for m in val], [m["acc_k"][k] for m in val], "o-", color=colors[k],
                       label=f"position {k + 1}")
    right.set(xlabel="optimizer step", ylabel="top-1 accuracy (train: thin lines)",
              title="accuracy per TTT position (dots: validation)", ylim=(0, 1.02))
    if val:  # the labelled lines
        right.legend(fontsize=7, ncol=2)
    for axis in (left, right):
        axis.xaxis.get_major_locator().set_params(integer=True)  # optimizer steps are whole numbers
    fig.tight_layout()
    _save(fig, path)
    return True


def plot_acceptance(rows: list[dict[str, Any]], val: dict[str, Any], path: Path) -> bool:
    measured = [r for r in rows if r.get("acceptance_per_position")]
    if not measured and not val.get("acc_k"):
        return False
    plt = _pyplot()
    if plt is None:
        return False
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for row in measured:
        rates = row["acceptance_per_position"]
        axis.plot(range(1, len(rates) + 1), rates, "o-",
                  label=f"{row['method']} T={row['temperature']:g}: accepted (tau {row['tau']:.2f})")
    if val.get("acc_k"):
        acc = val["acc_k"]
        axis.plot(range(1, len(acc) + 1), acc, "s--", color="gray", label="training validation accuracy")
    axis.set(xlabel="draft position", ylabel="share", ylim=(0, 1.05), title="acceptance per draft position")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    return True
