"""benchmarks/step_cost.py on the CPU at tiny shapes: every figure present and consistent with the others."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
    step_cost = load("step_cost")
    out = tmp_path / "step_cost.json"
    result = step_cost.main(["--smoke", "--output", str(out), "--shapes", "chain4,parallel4", "--parts", "chain4,parallel4",
                             "--repeats", "1", "--calls", "2", "--reference-bench", str(bench), "--profile", "--mla",
                             "--dflash", "2", "--dflash-layers", "1"])
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
    row, dflash_row = result["projection"]
    assert dflash_row["shape"] == "dflash2" and dflash_row["reference_measured_speedup"] == 1.5
    assert dflash_row["projected_speedup"] == 2.0 * plain / result["dflash"]["steps"]["dflash2"]["step_ms"]
    assert "dflash_step<=1.15x_plain" in result["goals"]
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
    text = (tmp_path / "step_cost.md").read_text()
    assert "| chain4 |" in text and "MLA drafter" in text and "DFlash drafter" in text


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
