"""DSpark training end to end on the tiny chat target (online): the drafter saved and loaded with its heads, its
confidence head calibrated on the validation split (temperatures stored, ECE and AUC per position in the manifest),
exact resume, init_from a DFlash drafter (its backbone kept) or a DSpark one (its heads kept), and the refusals; the
calibration's pure functions on synthetic data."""

from __future__ import annotations

import json

import pytest
import torch

from builders import killed_and_resumed, write_random_chats
from eaglekit.config import load_config
from eaglekit.drafters.dspark.calibration import (
    auc,
    expected_calibration_error,
    fit_temperatures,
    predicted_survival,
    survival_labels,
)
from eaglekit.drafters.dspark.model import DSparkDrafter
from eaglekit.errors import EaglekitError
from eaglekit.formats.saved import load_saved_drafter
from eaglekit.stages import train as stage


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_random_chats(tmp_path_factory.mktemp("dspark_data") / "chat.jsonl", 16, (6, 12))


def options(chat_target, data_file, out, **extra):
    base = {"drafter_type": "dspark", "target": chat_target, "data": [str(data_file)], "output": str(out),
            "batch_size": 4, "epochs": 1, "block_size": 4, "draft_layers": 2, "num_anchors": 8, "markov_rank": 16,
            "draft_vocab_size": 64, "val_fraction": 0.25, "lr": 1e-3, "warmup_steps": 1, "step_decay": 0.78}
    return load_config(stage.Config, overrides={**base, **extra})


def test_online_training_writes_a_calibrated_dspark_drafter(chat_target, data_file, tmp_path):
    out = tmp_path / "run"
    result = stage.run(options(chat_target, data_file, out))
    drafter = load_saved_drafter(out)
    assert isinstance(drafter, DSparkDrafter) and result["steps"] == 3
    config = drafter.config
    assert (config.block_size, config.markov_rank, config.max_drafts) == (4, 16, 4)
    assert drafter.markov_head.markov_w2.weight.abs().sum() > 0  # the Markov head trained (it starts at zero)
    manifest = json.loads((out / "manifest.json").read_text())
    calibration = manifest["after_training"]
    assert calibration["calibrated"] and len(config.confidence_temperatures) == 4
    assert list(config.confidence_temperatures) == pytest.approx(calibration["temperatures"])
    positions = calibration["positions"]
    assert [p["position"] for p in positions] == [1, 2, 3, 4] and positions[0]["blocks"] > 0
    assert 0 <= positions[0]["ece"] <= positions[0]["ece_raw"] + 1e-9  # T = 1 is on the grid: never worse at 1
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert val["split"] == "val" and len(val["acc_k"]) == 4


def test_without_a_validation_split_the_drafter_is_saved_uncalibrated(chat_target, data_file, tmp_path, caplog):
    out = tmp_path / "run"
    stage.run(options(chat_target, data_file, out, val_fraction=0.0))
    assert load_saved_drafter(out).config.confidence_temperatures == ()  # the raw head, as vLLM uses it
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["after_training"] == {"calibrated": False, "reason": "no validation blocks"}
    assert "raise val_fraction" in caplog.text


def test_killed_and_resumed_dspark_run_matches_an_uninterrupted_one(chat_target, data_file, tmp_path):
    common = {"epochs": 2, "save_every": 2, "batch_size": 2, "log_every": 1, "markov_head_type": "rnn"}
    a, b = killed_and_resumed(lambda out, **more: options(chat_target, data_file, out, **common, **more), tmp_path)
    assert a.keys() == b.keys() and "markov_head.joint_proj.weight" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_init_from_a_dflash_drafter_keeps_its_backbone(chat_target, data_file, tmp_path):
    stage.run(options(chat_target, data_file, tmp_path / "dflash", drafter_type="dflash", max_steps=1))
    dflash = load_saved_drafter(tmp_path / "dflash")
    stage.run(options(chat_target, data_file, tmp_path / "dspark", init_from=str(tmp_path / "dflash"), max_steps=1,
                      lr=1e-9, warmup_steps=0))
    dspark = load_saved_drafter(tmp_path / "dspark")
    assert isinstance(dspark, DSparkDrafter) and dspark.config.target_layer_ids == dflash.config.target_layer_ids
    torch.testing.assert_close(dspark.fc.weight, dflash.fc.weight, atol=1e-6, rtol=0)  # lr ~ 0: kept
    assert torch.equal(dspark.d2t, dflash.d2t)
    # fine-tuning a DSpark drafter keeps its heads: asking for others is refused, naming what it has
    with pytest.raises(EaglekitError, match="markov_rank=8: init_from=.* is a DSpark drafter with markov_rank=16"):
        stage.run(options(chat_target, data_file, tmp_path / "x", init_from=str(tmp_path / "dspark"), markov_rank=8))


def test_bad_dspark_options_are_refused(chat_target, data_file, tmp_path):
    with pytest.raises(EaglekitError, match="markov_rank=-1"):
        stage.run(options(chat_target, data_file, tmp_path / "a", markov_rank=-1))
    with pytest.raises(EaglekitError, match="markov_head_type"):
        stage.run(options(chat_target, data_file, tmp_path / "b", markov_head_type="lstm"))


def test_calibration_measures_golden() -> None:
    prediction = torch.tensor([0.05, 0.15, 0.95, 0.95])
    label = torch.tensor([0, 1, 1, 1])
    # bins: [0, .1): 0.05 vs 0; [.1, .2): 0.15 vs 1; [.9, 1]: 0.95 vs 1 (two)
    assert expected_calibration_error(prediction, label) == pytest.approx((0.05 + 0.85 + 2 * 0.05) / 4)
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)  # a tie counts half
    assert auc(torch.tensor([0.5, 0.6]), torch.tensor([1, 1])) is None
    counted = torch.tensor([[True, True, False]])
    assert survival_labels(torch.tensor([[1.0, 0.0, 1.0]]), counted).tolist() == [[True, False, False]]


def test_sequential_temperature_scaling_repairs_overconfidence() -> None:
    """Confidences twice as sure as the truth: the fitted temperatures bring the ECE of every position's survival
    down, and keep the order of the blocks (a temperature rescales a logit)."""
    torch.manual_seed(1)  # not the acceptance draws' seed (0): the logits and the draws must be independent
    n, k = 4000, 3
    true_logit = torch.randn(n, k)
    accept = torch.sigmoid(true_logit)
    counted = torch.ones(n, k, dtype=torch.bool)
    labels = survival_labels(accept, counted)
    head = 2.0 * true_logit  # overconfident
    temperatures = fit_temperatures(head, labels, counted)
    raw, calibrated = predicted_survival(head, []), predicted_survival(head, temperatures)
    for j in range(k):
        assert expected_calibration_error(calibrated[:, j], labels[:, j]) < \
            0.5 * expected_calibration_error(raw[:, j], labels[:, j])
    assert temperatures[0] == pytest.approx(2.0, rel=0.25)
    assert torch.equal(torch.argsort(calibrated[:, 0]), torch.argsort(raw[:, 0]))
