"""benchmarks/dspark_tiny.py and benchmarks/peer_speculators_dspark.py at toy sizes on the CPU: every row, the
calibration and the peer's settings present and consistent with each other (the figures come from the benchmarks'
real runs, never from here)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

import engines

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """dspark_tiny.py --smoke: its report, and the eaglekit run the peer comparison reuses."""
    out = tmp_path_factory.mktemp("dspark_tiny")
    load("dspark_tiny").main(["--smoke", "--out", str(out), "--work", str(out / "work")])
    return out


def check_rows(rows: list[dict], block: int) -> None:
    for row in rows:
        acceptance = row["acceptance_per_position"]
        assert len(acceptance) == row["chain_length"] and row["steps"] > 0
        assert all(a >= b for a, b in zip(acceptance, acceptance[1:]))  # a draft is accepted after its prefix only
        assert row["tau"] == pytest.approx(1 + sum(acceptance))
        assert row["accepted_per_step"] == pytest.approx(sum(acceptance))
        assert 0 <= row["drafts_verified_per_step"] <= row["chain_length"] <= block
        if row["verify_threshold"] == 0:  # no cut: every draft is verified
            assert row["drafts_verified_per_step"] == row["chain_length"]
        if row["drafts_verified_per_step"] > 0:
            assert row["acceptance_rate"] == pytest.approx(row["accepted_per_step"] / row["drafts_verified_per_step"])
        if row["temperature"] == 0:  # lossless: every prompt decodes to plain greedy decoding's tokens
            assert row["prompts_equal_to_plain_greedy"] == row["prompts"]


def test_dspark_tiny_smoke_benches_both_drafters_with_the_threshold_sweep_and_the_calibration(smoke):
    report = json.loads((smoke / "dspark_tiny.json").read_text())
    settings, drafters = report["settings"], report["training"]["drafters"]
    block = settings["block_size"]
    assert set(drafters) == {"dspark", "dflash"} and report["environment"]["commit"]
    for kind, drafter in drafters.items():  # the same backbone and budget for both
        assert drafter["steps"] == settings["steps"] and drafter["train_wall_s"] > 0
        config = drafter["config"]
        assert (config["block_size"], config["num_hidden_layers"]) == (block, settings["draft_layers"])
    rows = report["rows"]
    check_rows(rows, block)
    dspark = [(r["chain_length"], r["verify_threshold"]) for r in rows if r["drafter"] == "dspark"]
    assert dspark == [(block, t) for t in settings["thresholds"]] + [(block - 1, 0.0)]
    assert [r["chain_length"] for r in rows if r["drafter"] == "dflash"] == [block - 1]  # its whole block
    whole = next(r for r in rows if r["drafter"] == "dspark" and r["verify_threshold"] == 0)
    assert [p["position"] for p in whole["decode_calibration"]] == list(range(1, block + 1))
    calibration = drafters["dspark"]["after_training"]
    assert calibration["calibrated"] and len(calibration["positions"]) == block
    text = (smoke / "dspark_tiny.md").read_text()
    assert "| dflash | dflash |" in text and "## DSpark's confidence" in text


@pytest.fixture(scope="module")
def peer_python():
    return engines.speculators_python()  # skips (fails under CI) naming `make speculators-env` when not built


@pytest.mark.engine
def test_peer_speculators_dspark_smoke_trains_imports_and_benches_the_peer(peer_python, smoke, tmp_path):
    # peer_python first: without speculators the test skips before the smoke run it shares
    load("peer_speculators_dspark").main(["--smoke", "--out", str(tmp_path), "--work", str(smoke / "work"),
                                          "--peer-python", peer_python])
    report = json.loads((tmp_path / "peer_speculators_dspark.json").read_text())
    assert report["status"] == "ok" and report["versions"]["peer"]["speculators"] == "0.9.0"
    ours, peer, flags = report["eaglekit"], report["peer"], report["settings"]["peer"]
    settings, train = report["settings"]["benchmark"], report["settings"]["eaglekit_train"]
    assert peer["steps"] == ours["steps"] == settings["steps"] and peer["wall_s"] > 0
    assert flags["speculator-type"] == "dspark" and flags["max-steps"] == settings["steps"]
    assert flags["max-anchors"] == train["batch_size"] * train["num_anchors"]
    assert math.exp(-1 / flags["dflash-decay-gamma"]) == pytest.approx(train["step_decay"])
    assert flags["full-attention-indices"] == list(range(settings["draft_layers"]))
    imported = json.loads((Path(peer["drafter"]) / "config.json").read_text())  # `eaglekit import`'s DSpark drafter
    assert imported["drafter_type"] == "dspark"
    for key in ("block_size", "num_hidden_layers", "markov_rank", "target_layer_ids", "mask_token_id", "hidden_size"):
        assert imported[key] == report["settings"]["eaglekit"][key], key
    assert imported["confidence_temperatures"] == []  # speculators ships no calibration
    for side in (ours, peer):
        assert len(side["val"]["acc_k"]) == settings["block_size"]
        check_rows(side["rows"], settings["block_size"])
    assert {"loss", "anchors", "lm_head", "calibration"} <= {item["setting"] for item in report["not_matched"]}
    assert "| speculators | dspark |" in (tmp_path / "peer_speculators_dspark.md").read_text()


def test_drafters_summary_decides_each_goal_on_its_figures_or_names_what_is_missing(tmp_path):
    """benchmarks/drafters_summary.py on a drafters job's results: the goals from the rows' own tau and speed-ups,
    the step costs, and what did not run."""
    summary = load("drafters_summary")
    rows = [{"drafter": "eagle3", "method": "tree", "drafts": "tree", "temperature": 0.0, "tokens_per_second": 20.0,
             "speedup_vs_plain": 2.0, "tau": 4.0, "acceptance_per_position": [0.9, 0.8]},
            {"drafter": "dspark", "method": "dspark", "drafts": "2", "temperature": 0.0, "tokens_per_second": 15.0,
             "speedup_vs_plain": 1.5, "tau": 3.0, "acceptance_per_position": [0.8, 0.6]},
            {"drafter": "dflash", "method": "dflash", "drafts": "2", "temperature": 0.0, "tokens_per_second": 12.0,
             "speedup_vs_plain": 1.2, "tau": 2.5, "acceptance_per_position": [0.7, 0.4]}]
    results = tmp_path / "results"
    results.mkdir()
    (results / "summary.json").write_text(json.dumps({"methods": rows, "bench": {"rows": [
        {"method": "plain", "temperature": 0.0, "tokens_per_second": 10.0}]}}))
    found = summary.build(results, ["cmd"])
    assert not found["complete"] and "step_cost_8b" in found["missing"]
    goals = found["goals"]
    assert goals["dspark_tau>=1.15x_dflash"]["ratio"] == pytest.approx(1.2) and goals["dspark_tau>=1.15x_dflash"]["met"]
    assert goals["best>=2.5x_plain"]["method"] == "tree" and not goals["best>=2.5x_plain"]["met"]
    assert goals["dspark_step<=1.15x_plain"]["met"] is None
    (results / "step_cost_8b.json").write_text(json.dumps({"dspark": {"steps": {"dspark7": {"ratio_to_plain": 1.1}}}}))
    found = summary.build(results, ["cmd"])
    assert found["goals"]["dspark_step<=1.15x_plain"] == {"ratio_to_plain": {"dspark7": 1.1}, "met_by": ["dspark7"],
                                                          "met": True}
    (results / "step_cost_8b.json").write_text(json.dumps({"dspark": {"steps": {"dspark7": {"ratio_to_plain": 1.16}}}}))
    two = tmp_path / "two_layers.json"  # step_cost files given: each step named with its drafter's layers
    two.write_text(json.dumps({"environment": {"gpu": "H", "commit": "c"}, "dflash": {
        "drafter": {"layers": 2}, "steps": {"dflash7": {"ratio_to_plain": 1.12, "floor_ratio_to_plain": 1.05}}},
        "dspark": {"drafter": {"layers": 2}, "steps": {"dspark7": {"ratio_to_plain": 1.2, "floor_ratio_to_plain": 1.1}}}}))
    found = summary.build(results, ["cmd"], step_cost_files=[results / "step_cost_8b.json", two])
    assert found["goals"]["dspark_step<=1.15x_plain"] == {  # no DSpark step this cheap: not met
        "ratio_to_plain": {"dspark7": 1.16, "dspark7, 2 layers": 1.2},
        "floor_ratio_to_plain": {"dspark7, 2 layers": 1.1}, "met": False}
    assert found["step_cost"]["dflash7, 2 layers"] == {"kind": "dflash", "ratio_to_plain": 1.12,
                                                       "floor_ratio_to_plain": 1.05, "gpu": "H", "commit": "c"}
    assert "- dspark7, 2 layers: 1.200x plain, floor 1.100x (H, commit c)" in summary.markdown(found)
    assert ("- dspark_step<=1.15x_plain: not met (ratio_to_plain: dspark7 1.160, dspark7, 2 layers 1.200; "
            "floor_ratio_to_plain: dspark7, 2 layers 1.100)") in summary.markdown(found)
    top = tmp_path / "topk.json"  # one configuration cheap enough (the Markov bias on 64 candidates) meets it
    top.write_text(json.dumps({"environment": {"gpu": "H", "commit": "c"}, "dspark": {"drafter": {"layers": 2}, "steps": {
        "dspark7": {"ratio_to_plain": 1.17}, "dspark7_top64": {"ratio_to_plain": 1.14}}}}))
    goal = summary.build(results, ["cmd"], step_cost_files=[top])["goals"]["dspark_step<=1.15x_plain"]
    assert goal["met"] and goal["met_by"] == ["dspark7_top64, 2 layers"]
    assert summary.conditional([0.8, 0.6]) == [0.8, pytest.approx(0.75)]
    assert "| dspark | dspark | 2 | 0 | 15.0 | 1.50x | 3.00 | 0.80 0.60 | 0.80 0.75 |" in summary.markdown(found)


def test_drafters_summary_decides_dspark_on_its_whole_chain_not_a_confidence_cut(tmp_path):
    """The rows come from the variants' own benches: a cut row (verify_threshold) after the whole chain's is shown,
    never taken for the drafter's tau."""
    summary = load("drafters_summary")

    def bench(method, *rows):
        return [{"method": method, "temperature": 0.0, "tokens_per_second": t * 10, "tau": t, **more}
                for t, more in rows]

    results = tmp_path / "results"
    results.mkdir()
    (results / "summary.json").write_text(json.dumps({
        "bench": {"rows": [{"method": "plain", "temperature": 0.0, "tokens_per_second": 10.0}], "config": {}},
        "variant_dspark": {"variant": {"drafter_type": "dspark"}, "bench": bench(
            "dspark", (3.0, {}), (1.5, {"verify_threshold": 0.6}))},
        "variant_dflash": {"variant": {"drafter_type": "dflash"}, "bench": bench("dflash", (2.5, {}))}}))
    found = summary.build(results, ["cmd"])
    goal = found["goals"]["dspark_tau>=1.15x_dflash"]
    assert (goal["dspark_tau"], goal["dflash_tau"], goal["met"]) == (3.0, 2.5, True)
    assert [r["method"] for r in found["methods"]] == ["dflash", "dspark", "dspark (verify >= 0.6)"]
    assert "| dspark | dspark (verify >= 0.6) |" in summary.markdown(found)
