"""Options out of range and data a stage cannot read: refused before any work, in ONE error line that lists every bad
option (by `section.key` in `eaglekit run`) or names the stage that reads the bad line, with a fix that works; nothing
left on disk that a later run would trust (docs/errors.md lists each case)."""

from __future__ import annotations

import pytest

import eaglekit
from eaglekit.cli import main
from eaglekit.errors import EaglekitError

from user_errors import CHAT, assert_unchanged, in_process, snapshot, write_jsonl

RUN_BUDGET = ("stages=regen,extract,vocab,train,bench", "device=cpu", "regen.max_new_tokens=4", "extract.max_length=64",
              "extract.dtype=fp32", "extract.shard_mb=1", "vocab.size=64", "train.max_steps=1", "train.batch_size=2",
              "train.ttt_steps=1", "train.max_length=64", "train.val_fraction=0", "bench.methods=plain",
              "bench.temperatures=0", "bench.num_prompts=1", "bench.max_new_tokens=2", "bench.repeats=1",
              "bench.warmup=0")


@pytest.fixture
def malformed(tmp_path):
    """The shipped tiny prompts with a line that is not JSON at line 7."""
    from eaglekit.data.readers import SHIPPED_DATA

    lines = SHIPPED_DATA["tiny"].read_text().splitlines(keepends=True)[:12]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(lines[:6]) + '{"messages": [broken\n' + "".join(lines[6:]))
    return path


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


# ---- data --------------------------------------------------------------------------------------------

def test_run_names_the_stage_that_reads_a_malformed_line_and_a_fix_that_works(malformed, tmp_path, capsys):
    """The line is met before anything runs, for the first stage that reads it; `skip_errors=true` on the run skips it
    in every stage (a section's own skips it in that stage alone: bench, reading the data as its prompts, still
    stops)."""
    run = ("run", "--target", "tiny", "--data", str(malformed), "--out", str(tmp_path / "run"), *RUN_BUDGET)
    before = snapshot(tmp_path)
    line = in_process(capsys, *run)
    assert "regen would stop at its data, so nothing ran: " in line and "prompts.jsonl:7: not valid JSON" in line
    assert "set skip_errors=true" in line
    line = in_process(capsys, *run, "regen.skip_errors=true")
    assert "bench would stop at its data, so nothing ran: " in line and "prompts.jsonl:7" in line
    assert_unchanged(before, tmp_path)
    assert not (tmp_path / "run").exists()
    assert main([*run, "skip_errors=true"]) == 0, capsys.readouterr().err
    regenerated = (tmp_path / "run" / "regen" / "conversations.jsonl").read_text().splitlines()
    assert len(regenerated) == 12  # the good records, the malformed one skipped


def test_a_regen_that_fails_on_its_input_leaves_nothing_behind(malformed, chat_target, tmp_path, capsys):
    line = in_process(capsys, "regen", str(malformed), f"target={chat_target}", f"output={tmp_path / 'r'}")
    assert "prompts.jsonl:7: not valid JSON" in line and "set skip_errors=true" in line
    assert not (tmp_path / "r").exists()
    good = write_jsonl(tmp_path / "good.jsonl", [{"id": "a", "messages": CHAT}])
    in_process(capsys, "regen", str(good), f"target={tmp_path / 'no-model'}", f"output={tmp_path / 'r'}")
    left = sorted(p.name for p in (tmp_path / "r").iterdir()) if (tmp_path / "r").exists() else []
    assert not {"config.yaml", "settings.json", "conversations.jsonl", "manifest.json"} & set(left), left


def test_prompt_only_data_is_pointed_at_regen(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "messages": CHAT[:1]} for i in range(4)])
    line = in_process(capsys, "extract", str(prompts), "target=tiny", f"output={tmp_path / 'x'}", "dtype=fp32",
                      "device=cpu")
    assert "none of the 4 records has assistant tokens to learn from: the data holds prompts only" in line
    assert f"`eaglekit regen {prompts} output=DIR target=T`" in line
    line = in_process(capsys, "vocab", str(prompts), "target=tiny", f"output={tmp_path / 'v'}")
    assert "`eaglekit regen PROMPTS output=DIR target=T`" in line
    line = in_process(capsys, "train", "target=tiny", f"data={prompts}", f"output={tmp_path / 't'}", "device=cpu")
    assert f"`eaglekit regen {prompts} output=DIR target=tiny`" in line
    assert not (tmp_path / "x" / "manifest.json").exists()
