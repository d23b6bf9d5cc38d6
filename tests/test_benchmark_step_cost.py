"""benchmarks/step_cost.py on the CPU at tiny shapes: every figure present and consistent with the others."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_cost_smoke_writes_ratios_parts_and_projection(tmp_path):
    bench = tmp_path / "bench.json"  # a reference target's bench rows, as `eaglekit bench` writes them
    bench.write_text(json.dumps({"rows": [
        {"method": "plain", "temperature": 0.0, "tokens_per_second": 100.0, "tau": None},
        {"method": "chain", "temperature": 0.0, "tokens_per_second": 180.0, "tau": 3.0},
        {"method": "dflash", "temperature": 0.0, "tokens_per_second": 150.0, "tau": 2.0,
         "acceptance_per_position": [0.6, 0.4]}]}))
    variant = tmp_path / "variant-dspark" / "bench" / "bench.json"  # a variant's bench, same prompts: drafting rows
    variant.parent.mkdir(parents=True)
    variant.write_text(json.dumps({"rows": [
        {"method": "dspark", "temperature": 0.0, "tokens_per_second": 160.0, "tau": 2.5,
         "acceptance_per_position": [0.8, 0.7]},
        {"method": "dspark", "temperature": 0.0, "tokens_per_second": 170.0, "tau": 2.25, "verify_threshold": 0.5,
         "acceptance_per_position": [0.8, 0.7]},
        {"method": "dspark", "temperature": 1.0, "tokens_per_second": 90.0, "tau": 1.5,  # a length not timed
         "acceptance_per_position": [0.4, 0.1, 0.0]}]}))
    step_cost = load("step_cost")
    out = tmp_path / "step_cost.json"
    result = step_cost.main(["--smoke", "--output", str(out), "--shapes", "chain4,parallel4", "--parts", "chain4,parallel4",
                             "--repeats", "1", "--calls", "2", "--reference-bench", str(bench), "--profile", "--mla",
                             "--dflash", "2", "--dflash-layers", "1", "--reference-bench", str(variant),
                             "--dspark", "2", "--dspark-layers", "1", "--dspark-rank", "8", "--dspark-topk", "0,3"])
    written = json.loads(out.read_text())
    assert written["complete"] and written["steps"] == result["steps"]
    plain = result["plain_step_ms"]["fused_projections"]
    step = result["steps"]["chain4"]
    assert step["ratio_to_plain"] == step["step_ms"] / plain
    for shape in ("chain4", "parallel4"):  # parallel4: the extend also drafts the next chain's mask slots
        parts = result["parts_ms"][shape]
        assert set(parts) == {"draft", "verify_forward", "verification", "kv_compaction", "drafter_extend",
                              "unattributed"}
        assert all(v > 0 for k, v in parts.items() if k != "unattributed")
    row, dflash_row, dspark_row, cut_row = result["projection"]  # the T=1 dspark chain of 3: no dspark3 step timed
    assert dflash_row["shape"] == "dflash2" and dflash_row["reference_measured_speedup"] == 1.5
    assert dflash_row["projected_speedup"] == 2.0 * plain / result["dflash"]["steps"]["dflash2"]["step_ms"]
    assert "dflash_step<=1.15x_plain" in result["goals"] and "dspark_step<=1.15x_plain" in result["goals"]
    assert "tree_step<=1.35x_plain" not in result["goals"]  # no tree timed: no tree goal
    assert dspark_row["shape"] == "dspark2" and dspark_row["reference_measured_speedup"] == 1.6  # the run's plain
    assert dspark_row["projected_speedup"] == 2.5 * plain / result["dspark"]["steps"]["dspark2"]["step_ms"]
    assert cut_row["verify_threshold"] == 0.5 and "verify_threshold" not in dspark_row
    assert dspark_row["bench"] == cut_row["bench"] == "variant-dspark"  # which drafter's bench the row came from
    assert row["reference_measured_speedup"] == 1.8 and row["projected_speedup"] == 3.0 * plain / step["step_ms"]
    assert set(result["plain_step_ms"]) == {"fused_projections", "separate_projections"}
    profile = result["profile"]["chain4"]  # no GPU kernels on the CPU: the walls and step counts only
    assert profile["steps"] >= 1 and profile["wall_ms_per_step"] > 0
    assert set(result["profile"]) == {"plain", "chain4", "parallel4", "plain_gemm_bandwidth_fraction"}
    assert result["steps"]["parallel4"]["options"] == {"method": "parallel", "chain_length": 4}  # P-EAGLE's step
    mla = result["mla"]
    assert set(mla["steps"]) == {"chain4", "tree48"} and mla["drafter"]["drafter_arch"] == "mla"
    assert all(v > 0 for v in mla["draft_level_ms_eager"].values())
    dflash = result["dflash"]  # a DFlash drafter's step: one block forward drafts the chain
    assert set(dflash["steps"]) == {"dflash2"} and dflash["steps"]["dflash2"]["step_ms"] > 0
    assert dflash["draft_ms"]["dflash2"] > 0 and dflash["drafter"]["layers"] == 1
    dspark = result["dspark"]  # DFlash's backbone, every slot drafting, the Markov and confidence heads in the step
    assert set(dspark["steps"]) == {"dspark2", "dspark2_top3"}  # every draft id, then the Markov bias on 3 of them
    assert dspark["steps"]["dspark2"]["options"] == {"method": "dspark", "chain_length": 2}
    assert dspark["steps"]["dspark2_top3"]["options"] == {"method": "dspark", "chain_length": 2, "draft_topk": 3}
    assert set(dspark["draft_ms"]) == {"dspark2", "dspark2_top3"} and all(v > 0 for v in dspark["draft_ms"].values())
    assert set(dspark["block_ms"]) == {"dspark2"} and dspark["block_ms"]["dspark2"] > 0
    assert dspark["drafter"]["markov_rank"] == 8 and dspark["drafter"]["block_size"] == 2
    assert dspark["drafter"]["confidence_head"] and dspark["drafter"]["sample_from_anchor"]
    assert dspark["drafter"]["draft_topks"] == [0, 3]
    step = dspark["steps"]["dspark2"]  # the floor: the rest of the step plus the drafter's weights at the bandwidth
    floor = dspark["weights_read_bytes"] / result["copy_bandwidth_bytes_per_s"] * 1e3
    assert dspark["draft_floor_ms"] == floor and 0 < floor < dspark["draft_ms"]["dspark2"]
    assert step["floor_ratio_to_plain"] == pytest.approx((step["step_ms"] - dspark["draft_ms"]["dspark2"] + floor) / plain)
    assert "a step no cheaper than dspark2" in (tmp_path / "step_cost.md").read_text()
    text = (tmp_path / "step_cost.md").read_text()
    assert "| chain4 |" in text and "MLA drafter" in text and "DFlash drafter" in text
    assert "rank 8 (vanilla; a _topK step biases K candidates alone: K = 3) and confidence head" in text
    assert "dspark2_top3" in text
    assert "| dspark (dspark2, variant-dspark, verify_threshold 0.5) | 0 | 2.25 |" in text


def test_step_cost_cut_off_keeps_the_figures_it_measured(tmp_path, monkeypatch):
    step_cost = load("step_cost")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # what a time limit does to the run after its plain figures

    monkeypatch.setattr(step_cost, "step_ms", stopped)
    out = tmp_path / "step_cost.json"
    try:
        step_cost.main(["--smoke", "--output", str(out), "--shapes", "chain4", "--parts", "", "--repeats", "1"])
    except KeyboardInterrupt:
        pass
    written = json.loads(out.read_text())
    assert written["complete"] is False and written["steps"] == {}
    assert set(written["plain_step_ms"]) == {"fused_projections"}  # the separate projections come last
    assert "INCOMPLETE" in (tmp_path / "step_cost.md").read_text()


def test_a_block_drafter_that_fails_keeps_the_other_figures(tmp_path, monkeypatch):
    step_cost = load("step_cost")
    figures = step_cost.block_figures

    def failing(kind, *args, **kwargs):
        if kind == "dspark":
            raise RuntimeError("no static step")  # what a drafter's step that does not compile does
        return figures(kind, *args, **kwargs)

    monkeypatch.setattr(step_cost, "block_figures", failing)
    out = tmp_path / "step_cost.json"
    result = step_cost.main(["--smoke", "--output", str(out), "--shapes=", "--parts=", "--no-separate", "--repeats",
                             "1", "--dflash", "2", "--dflash-layers", "1", "--dspark", "2"])
    assert result["complete"] and result["dspark"] == {"error": "RuntimeError: no static step"}
    assert set(result["dflash"]["steps"]) == {"dflash2"} and "dflash_step<=1.15x_plain" in result["goals"]
    assert "dspark_step<=1.15x_plain" not in result["goals"] and result["steps"] == {}
    assert "DSpark drafter: FAILED (RuntimeError: no static step)" in (tmp_path / "step_cost.md").read_text()


def test_chain_lengths_and_markov_candidates_that_are_not_counts_are_one_usage_error(tmp_path, capsys):
    step_cost = load("step_cost")
    for flags in (["--dspark", "2", "--dspark-topk", "0,x"], ["--dflash", "4,-1"], ["--dspark-topk", ""]):
        with pytest.raises(SystemExit) as stop:  # before any model is built or file written
            step_cost.main(["--smoke", "--output", str(tmp_path / "step_cost.json"), *flags])
        assert stop.value.code == 2 and "comma-separated whole numbers >= 0" in capsys.readouterr().err
    assert not (tmp_path / "step_cost.json").exists()
