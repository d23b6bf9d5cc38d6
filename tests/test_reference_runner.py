"""The GPU reference benchmark's runner (benchmarks/run_all.py) at toy sizes on the CPU: every part that
`benchmarks/run_reference.sh` runs finishes, and the summary gathers their figures, so a clean checkout on a GPU
host runs the same flow through."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run_all's default parts (the speed ones: decode, train, regen and extract speed) and those run_reference.sh adds
# (store: the pipeline up to vocab, so the drafters job's variants train beside the run's own drafter)
PARTS = "target,store,pipeline,bench,speed,step_cost,variant,extract_speed_reference,profile,summary"


def test_the_reference_runner_runs_its_parts_and_summarises_them(tmp_path):
    work, out = tmp_path / "work", tmp_path / "results"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--parts", PARTS,
                           "--work", str(work), "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "FAILED parts" not in log, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for part in ("reference_target", "run", "variant", "step_cost_8b", "step_profile", "train_speed", "regen_speed",
                 "decode_speed_reference"):
        assert summary[part], part
    text = (out / "summary.md").read_text()
    for method in ("plain", "chain", "tree"):
        assert f"| {method} | 0 |" in text, method
    assert "## Speed and peers" in text and "- step_cost (" in text and "- variant " in text
    assert "- train_speed offline/eager/sdpa: " in text  # a CPU run: tokens/s, no MFU

    def run_all(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", *flags, "--work",
                               str(work), "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)

    # a bench option bench does not take: refused before the variant trains (nothing trained, nothing written)
    done = run_all("--parts", "variant", "--variant", "drafter_type=dflash,block_size=3",
                   "--variant-bench", "no_such_option=1")
    log = done.stdout + done.stderr
    assert done.returncode == 1 and "FAILED parts: variant" in log and "unknown config key 'no_such_option'" in log
    assert not (work / "variant-dflash").exists() and not (out / "variant_dflash.json").exists()
    # run_reference.sh's drafters job on the same run: a DSpark variant over its whole block (a list-valued bench
    # option keeps its commas), then step_cost with a DSpark drafter, its bench rows projected onto its step
    done = run_all("--parts", "variant,step_cost,summary",
                   "--variant", "drafter_type=dspark,block_size=3,draft_layers=1", "--variant-bench", "temperatures=0,1",
                   "--step-cost-args=--shapes= --parts= --no-separate --repeats 1 --dspark 3 --dspark-layers 1")
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "FAILED parts" not in log, log[-3000:]
    dspark = json.loads((out / "variant_dspark.json").read_text())
    assert dspark["bench_options"]["chain_length"] == 3 and dspark["bench_options"]["temperatures"] == [0.0, 1.0]
    assert {(r["method"], r["temperature"]) for r in dspark["bench"]} == {("dspark", 0.0), ("dspark", 1.0)}
    assert all(len(r["acceptance_per_position"]) == 3 for r in dspark["bench"])
    calibration = dspark["after_training"]  # the train manifest's calibration, per block position
    assert calibration["calibrated"] and [p["position"] for p in calibration["positions"]] == [1, 2, 3]
    assert {"ece_raw", "ece", "auc_raw", "auc"} <= set(calibration["positions"][0])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variant_dspark"]["variant"]["drafter_type"] == "dspark"
    assert summary["calibration"] == {"variant_dspark": calibration}
    assert [e["temperature"] for e in summary["block_acceptance"]] == [0.0, 1.0]
    assert all(set(e["drafters"]) == {"dspark"} for e in summary["block_acceptance"])  # no DFlash variant here
    # a DSpark drafter with a confidence head is benched uncut and at its type's cuts (0.3, 0.6), at each T
    assert sorted((r["temperature"], r.get("verify_threshold", 0)) for r in dspark["bench"]) == [
        (0.0, 0), (0.0, 0.3), (0.0, 0.6), (1.0, 0), (1.0, 0.3), (1.0, 0.6)]
    assert [r["shape"] for r in summary["step_cost_8b"]["projection"]] == ["dspark3"] * 6
    assert "dspark_step<=1.15x_plain" in summary["step_cost_8b"]["goals"]
    assert {r["drafter"] for r in summary["methods"]} == {"eagle3", "eagle3 variant", "dspark"}
    text = (out / "summary.md").read_text()
    assert "## DSpark against DFlash" in text and "`variant-dspark/train/`: confidence calibrated" in text
    assert "- step_cost dspark (draft_layers 1, Markov head rank 256): step / plain dspark3 " in text
    # --variant-only, as the drafters job trains two variants side by side: a bench before training is one error,
    # a training stops before its bench, and the bench then reads what that training left
    flags = ("--parts", "variant", "--variant", "drafter_type=dflash,block_size=3,draft_layers=1", "--variant-only")
    done = run_all(*flags, "bench")
    assert done.returncode == 1 and "run --variant-only train first" in done.stdout + done.stderr
    assert run_all(*flags, "train").returncode == 0 and not (out / "variant_dflash.json").exists()
    manifest = json.loads((work / "variant-dflash" / "train" / "manifest.json").read_text())
    assert run_all(*flags, "bench").returncode == 0
    dflash = json.loads((out / "variant_dflash.json").read_text())
    assert dflash["trained"]["steps"] == manifest["steps"] > 0 and dflash["trained"]["val"] == manifest["val"]
    assert {r["method"] for r in dflash["bench"]} == {"dflash"}


def test_the_summary_has_a_line_for_each_drafter_type_variant():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)

    def variant(options: dict, acc: list[float], rows: list[dict]) -> dict:
        return {"variant": options, "baseline": {"val": {"acc_k": [0.5]}}, "trained": {"val": {"acc_k": acc}},
                "bench": rows}

    summary = {"environment": {"commit": "abc"},
               "variant_p-eagle": variant({"drafter_type": "p-eagle"}, [0.25, 0.125],
                                          [{"method": "parallel", "temperature": 0.0, "tau": 1.5}]),
               "variant_dflash": variant({"drafter_type": "dflash"}, [],
                                         [{"method": "dflash", "temperature": 0.0, "tau": 2.25},
                                          {"method": "plain", "temperature": 0.0, "tau": None}])}
    lines = run_all.summary_markdown(summary, "").splitlines()
    assert "- variant {'drafter_type': 'p-eagle'}: val accuracy per position 0.250 0.125 (baseline 0.500); " \
           "parallel T=0 tau 1.50" in lines
    assert "- variant {'drafter_type': 'dflash'}: val accuracy per position - (baseline 0.500); dflash T=0 tau 2.25" \
           in lines
    assert run_all.VARIANT_KEYS == ("variant", "variant_p-eagle", "variant_dflash", "variant_dspark")
