"""Gather benchmark result files into one JSON (e.g. to compare two machines' runs side by side).

    python benchmarks/collect.py --out runs/benchmarks/collected.json benchmarks/results/latest/*.json \
        benchmarks/results/latest/reference_drafter_metrics.jsonl

Each input lands under its file name (without the date-machine prefix); a training-metrics JSONL contributes
its last validation record. Nothing is computed here: every figure is the one its benchmark wrote.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def load(path: Path) -> object:
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        validation = [r for r in records if r.get("split") == "val"]
        return {"last_validation": validation[-1] if validation else None, "source": str(path)}
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    merged = {}
    for path in args.inputs:
        if path.resolve() == args.out.resolve():
            continue
        key = re.sub(r"^\d{4}-\d{2}-\d{2}-[a-z0-9]+-", "", path.stem)
        merged[key] = load(path)
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"{len(merged)} result files -> {args.out}")


if __name__ == "__main__":
    main()
