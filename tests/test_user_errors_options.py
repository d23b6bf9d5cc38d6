"""Options out of range: refused before any work, in ONE error line that lists every bad option (by `section.key` in
`eaglekit run`), with nothing left on disk (docs/errors.md lists each case)."""

from __future__ import annotations

import pytest

import eaglekit
from eaglekit.errors import EaglekitError

from user_errors import assert_unchanged, in_process, snapshot


# ---- option values -----------------------------------------------------------------------------------

def test_train_lists_every_option_out_of_range_before_any_work(data, tmp_path, capsys):
    before = snapshot(tmp_path)
    line = in_process(capsys, "train", "target=tiny", f"data={data}", f"output={tmp_path / 't'}", "max_steps=-3",
                      "epochs=0", "lr=-1", "batch_size=0", "betas=0.9", "val_fraction=1")
    for fragment in ("epochs must be >= 1 (epochs=0)", "max_steps must be >= 0 (max_steps=-3)",
                     "batch_size must be >= 1 (batch_size=0)", "lr must be > 0 (lr=-1.0)", "betas must be two numbers, each in [0, 1) (betas=0.9)",
                     "val_fraction must be in [0, 1) (val_fraction=1.0)", "set each within its range"):
        assert fragment in line, line
    assert_unchanged(before, tmp_path)
    assert not (tmp_path / "t").exists()
    with pytest.raises(EaglekitError, match=r"lr must be > 0 \(lr=-1.0\): set it within its range"):
        eaglekit.run_stage("train", target="tiny", data=[str(data)], output=str(tmp_path / "t"), lr=-1)
    # 0 where the help says it means off or auto is accepted
    from eaglekit.config import load_config
    from eaglekit.stages import train

    load_config(train.Config, overrides=["max_steps=0", "grad_clip=0", "val_every=0", "save_every=0",
                                         "pad_to_multiple=0", "warmup_steps=-1", "mask_token_id=-1", "init_std=0"])


def test_every_stage_refuses_an_option_out_of_range(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args, fragment in ((("regen", "x.jsonl", "output=o", "top_p=0", "temperature=-1"),
                            "temperature must be >= 0 (temperature=-1.0); top_p must be in (0, 1] (top_p=0.0)"),
                           (("extract", "x.jsonl", "output=o", "batch_tokens=0"),
                            "batch_tokens must be >= 1 (batch_tokens=0)"),
                           (("vocab", "x.jsonl", "output=o", "size=0"), "size must be >= 1 (size=0)"),
                           (("bench", "x.jsonl", "temperatures=0,-1", "concurrency=0"),
                            "temperatures must each be >= 0 (temperatures=0.0,-1.0); concurrency must each be >= 1 "
                            "(concurrency=0)"),
                           (("generate", "hi", "top_k=-1"), "top_k must be >= 0 (top_k=-1)"),
                           (("serve", "tiny", "port=70000"), "port must be in [0, 65535] (port=70000)"),
                           (("export", "d", "speculative_tokens=0"),
                            "speculative_tokens must be >= 1 (speculative_tokens=0)"),
                           (("inspect", "x.jsonl", "limit=-1"), "limit must be >= 0 (limit=-1)")):
        line = in_process(capsys, *args)
        assert fragment in line, line
    assert list(tmp_path.iterdir()) == []


def test_run_lists_every_bad_option_of_every_section_before_the_first_stage(tmp_path, capsys):
    before = snapshot(tmp_path)
    line = in_process(capsys, "run", "--target", "tiny", "--data", "tiny", "--out", str(tmp_path / "run"),
                      "train.lr=-1", "train.max_steps=-3", "bench.repeats=0", "regen.top_p=2", "extract_processes=0")
    assert line.startswith("eaglekit run: error: run, regen, train and bench would refuse these options, so nothing "
                           "ran: "), line
    for fragment in ("extract_processes must be >= 1 (extract_processes=0)",
                     "regen.top_p must be in (0, 1] (regen.top_p=2.0)",
                     "train.max_steps must be >= 0 (train.max_steps=-3)", "train.lr must be > 0 (train.lr=-1.0)",
                     "bench.repeats must be >= 1 (bench.repeats=0)"):
        assert fragment in line, line
    assert_unchanged(before, tmp_path)
    assert not (tmp_path / "run").exists()
