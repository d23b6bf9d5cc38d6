"""The reference benchmark's summary of block drafters (benchmarks/reference_summary.py): DSpark against DFlash
position by position, its confidence calibration and confidence-cut rows, and run_all's option lists."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(method: str, temperature: float, tau: float, acceptance: list[float], **fields) -> dict:
    return {"method": method, "temperature": temperature, "tau": tau, "tokens_per_second": 100.0 * tau,
            "acceptance_per_position": acceptance, **fields}


CALIBRATION = {"calibrated": True, "blocks": 40, "temperatures": [0.5, 2.0], "positions": [
    {"position": 1, "blocks": 40, "survived": 30, "temperature": 0.5, "ece_raw": 0.2, "auc_raw": 0.7, "ece": 0.05,
     "auc": 0.7},
    {"position": 2, "blocks": 30, "survived": 12, "temperature": 2.0, "ece_raw": 0.3, "auc_raw": None, "ece": 0.1,
     "auc": None}]}


def summary_of_block_drafters() -> dict:
    def variant(kind: str, rows: list[dict], **fields) -> dict:
        return {"variant": {"drafter_type": kind}, "baseline": {"val": None}, "trained": {
            "val": None, "drafter": f"/w/variant-{kind}/train"}, "bench_options": {"chain_length": 2}, "bench": rows,
            **fields}

    return {"environment": {"commit": "abc"},
            "bench": {"rows": [{"method": "plain", "temperature": 0.0, "tokens_per_second": 100.0, "tau": None}],
                      "config": {"chain_length": 4}},
            "variant_dflash": variant("dflash", [row("dflash", 0.0, 1.9, [0.8, 0.4]),
                                                 row("dflash", 1.0, 1.2, [0.2, 0.0])]),
            "variant_dspark": variant("dspark", [row("dspark", 0.0, 2.5, [0.9, 0.6, 0.3]),
                                                 row("dspark", 0.0, 2.0, [0.9, 0.6, 0.3], verify_threshold=0.5,
                                                     verified_per_step=1.5)], after_training=CALIBRATION)}


def test_dspark_is_compared_with_dflash_position_by_position():
    summary_module = load("reference_summary")
    summary = summary_of_block_drafters()
    t0, t1 = summary_module.block_acceptance(summary)
    assert t0["temperature"] == 0.0 and list(t0["drafters"]) == ["dflash", "dspark"]
    dspark = t0["drafters"]["dspark"]  # the whole chain's row: the confidence-cut row is not compared
    assert dspark["tau"] == 2.5 and dspark["drafts"] == 3 and dspark["method"] == "dspark"
    assert dspark["conditional_acceptance"] == pytest.approx([0.9, 0.6 / 0.9, 0.5])
    assert t0["difference"]["of"] == "dspark - dflash"
    assert t0["difference"]["per_position"] == pytest.approx([0.1, 0.2])  # the positions both draft
    assert set(t1["drafters"]) == {"dflash"} and "difference" not in t1  # no DSpark row at T=1
    assert t1["drafters"]["dflash"]["conditional_acceptance"] == [0.2, 0.0]
    assert summary_module.conditional([0.5, 0.0, 0.0]) == [0.5, 0.0, None]  # no step reached position 3
    assert summary_module.calibrations(summary) == {"variant_dspark": CALIBRATION}
    assert summary_module.calibrations({"variant_dspark": {"after_training": {"calibrated": False}}}) == {}


def test_the_summary_markdown_has_the_block_drafters_section():
    summary_module = load("reference_summary")
    summary = summary_of_block_drafters()
    summary["methods"] = summary_module.side_by_side(summary)
    cut = [r for r in summary["methods"] if r["method"] == "dspark (verify >= 0.5)"]
    assert len(cut) == 1 and cut[0]["speedup_vs_plain"] == 2.0 and cut[0]["drafter"] == "dspark"
    assert cut[0]["verify_threshold"] == 0.5  # a cut row says so as a field too, not only in its name
    assert all("verify_threshold" not in r for r in summary["methods"] if r is not cut[0])
    unpaired = [r for r in summary["methods"] if r["temperature"] == 1.0]  # no plain at T=1: kept, no speed-up
    assert [r["drafter"] for r in unpaired] == ["dflash"] and unpaired[0]["speedup_vs_plain"] is None
    lines = summary_module.summary_markdown(summary, "").splitlines()
    assert "## DSpark against DFlash (the same block backbone, the same prompts)" in lines
    assert "| dspark | dspark | 0 | 3 | 2.50 | 250.0 | 0.90 0.60 0.30 | 0.90 0.67 0.50 |" in lines
    assert "| dflash | dflash | 1 | 2 | 1.20 | 120.0 | 0.20 0.00 | 0.20 0.00 |" in lines
    assert "- T=0, dspark - dflash per position: +0.10 +0.20" in lines
    assert "| dspark | dspark | 0 | 0.5 | 2.00 | 1.50 | 200.0 |" in lines  # drafts verified per step
    assert any(line.startswith("`variant-dspark/train/`: confidence calibrated on 40 validation blocks")
               for line in lines)
    assert "| 2 | 30 | 12 | 2.00 | 0.300 | 0.100 | - | - |" in lines
    assert summary_module.block_markdown({"environment": {}}) == []  # neither variant ran: no section


def test_the_summary_names_the_block_drafters_step_costs_and_their_goal():
    summary_module = load("reference_summary")
    steps = {"dflash7": {"ratio_to_plain": 1.25}}
    cost = {"weights": "random", "plain_tokens_per_s": {"fused_projections": 150.0},
            "plain_fraction_of_bound": {"fused_projections": 0.85}, "steps": {},
            "dflash": {"drafter": {"layers": 5}, "steps": steps},
            "dspark": {"drafter": {"layers": 5, "markov_rank": 256}, "steps": {"dspark7": {"ratio_to_plain": 1.125}}},
            "goals": {"dflash_step<=1.15x_plain": False, "dspark_step<=1.15x_plain": True},
            "projection": [{"method": "dspark", "temperature": 0.0, "tau": 3.0, "shape": "dspark8",
                            "projected_speedup": 2.6, "reference_measured_speedup": None, "verify_threshold": 0.5}]}
    lines = summary_module.summary_markdown({"environment": {}, "step_cost_8b": cost}, "").splitlines()
    assert "- step_cost (random): plain 150.0 tok/s (85.0% of the bound)" in lines
    assert "- step_cost dflash (draft_layers 5): step / plain dflash7 1.250 (dflash_step<=1.15x_plain: not met)" in lines
    assert ("- step_cost dspark (draft_layers 5, Markov head rank 256): step / plain dspark7 1.125 "
            "(dspark_step<=1.15x_plain: met)") in lines
    assert ("- projection at the 8B shape, dspark (dspark8, verify_threshold 0.5) T=0: tau 3.00 x plain / step = "
            "2.60x (reference target measured -)") in lines
    cost["dspark"] = {"error": "RuntimeError: no static step"}  # step_cost kept the others' figures
    lines = summary_module.summary_markdown({"environment": {}, "step_cost_8b": cost}, "").splitlines()
    assert "- step_cost dspark: FAILED (RuntimeError: no static step)" in lines


def test_run_all_keeps_a_list_value_of_its_options_whole():
    run_all = load("run_all")
    assert run_all.split_options("drafter_type=dspark,block_size=8") == ["drafter_type=dspark", "block_size=8"]
    assert run_all.split_options("verify_thresholds=0,0.3,0.5,methods=dspark") == [
        "verify_thresholds=0,0.3,0.5", "methods=dspark"]
    assert run_all.split_options("target_layer_ids=1,3,5,block_size=8,") == ["target_layer_ids=1,3,5", "block_size=8"]
    assert run_all.split_options("") == []
