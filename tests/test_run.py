"""`eaglekit run`: the whole pipeline end to end on a tiny random chat target, Ctrl-C in a stage and re-run,
a re-run that skips everything, a changed option that re-runs only the stage that depends on it; wiring rules."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from eaglekit.config import load_config
from eaglekit.errors import EaglekitError
from eaglekit.stages import run as run_stage
from eaglekit.stages.run import Config, plan, resolve_data_path



def tiny_run(target: str, data: str, out: Path, **extra) -> Config:
    """Tiny budgets: the whole pipeline in seconds on the CPU."""
    values = {
        "target": target, "data": [data], "out": str(out), "device": "cpu", "doctor_engines": ["vllm"],
        "regen": {"max_new_tokens": 10, "batch_size": 4},
        "extract": {"max_length": 64, "dtype": "fp32", "shard_mb": 1},
        "vocab": {"size": 128},
        "train": {"epochs": 2, "batch_size": 2, "ttt_steps": 2, "max_length": 64, "val_fraction": 0.25, "lr": 1e-3, "log_every": 1},
        "bench": {"methods": ["plain", "chain"], "temperatures": [0.0], "num_prompts": 2, "max_new_tokens": 8,
                  "repeats": 1, "warmup": 0, "chain_length": 2},
        "doctor": {"engine_source": str(out.parent / "no-vllm-here")},
    }
    for key, value in extra.items():
        section, _, name = key.partition("__")
        if name:
            values[section] = {**values.get(section, {}), name: value}
        else:
            values[key] = value
    return load_config(Config, overrides=values)


def statuses(result: dict) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in result["steps"]}


def test_pipeline_end_to_end_interrupt_resume_skip_and_change(chat_target, run_prompts, tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = tiny_run(chat_target, run_prompts, out)
    from eaglekit.doctor import source
    from eaglekit.stages import train

    monkeypatch.setattr(source, "vllm_venvs", lambda: [])  # no vLLM anywhere: the doctor stage says unknown

    real_train = train.run

    def interrupted(stage_config):  # Ctrl-C in the middle of training
        (Path(stage_config.output) / "partial").write_text("x")
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_stage.run(config)
    assert (out / "regen" / "manifest.json").is_file() and (out / "vocab" / "manifest.json").is_file()
    assert not (out / "train" / ".run-done").exists()
    monkeypatch.setattr(train, "run", real_train)

    result = run_stage.run(config)  # continues: finished stages skipped, train resumed in its own folder
    assert statuses(result) == {"regen": "skipped", "extract": "skipped", "vocab": "skipped", "train": "ran", "bench": "ran",
                                "export-vllm": "ran", "export-sglang": "ran", "export-speculators": "ran", "doctor-vllm": "ran"}
    assert (out / "train" / "partial").exists() and not (out / "train.old").exists()
    for path in ("regen/conversations.jsonl", "extract/manifest.json", "vocab/vocab.safetensors", "train/model.safetensors",
                 "train/metrics.jsonl", "bench/bench.json", "export/vllm/config.json", "export/sglang/model.safetensors",
                 "export/speculators/config.json", "doctor/vllm/doctor.json", "report-training.png", "report-acceptance.png"):
        assert (out / path).is_file(), path
    for stage in ("regen", "extract", "vocab", "train", "bench"):
        assert (out / stage / "config.yaml").is_file() and (out / stage / "manifest.json").is_file(), stage

    report = (out / "report.md").read_text()
    bench = json.loads((out / "bench" / "bench.json").read_text())
    chain = next(r for r in bench["rows"] if r["method"] == "chain")
    vocab = json.loads((out / "vocab" / "manifest.json").read_text())
    assert f"| chain | 0 | {chain['tokens_per_second']:.1f} |" in report and f"{chain['tau']:.2f}" in report
    assert f"coverage {vocab['coverage']:.2%}" in report
    assert str((out / "export" / "sglang").resolve()) in report and "--speculative-algorithm EAGLE3" in report
    assert f"vllm serve {chat_target} --speculative-config" in report
    assert "| vllm | n/a | **unknown** |" in report  # no vLLM source: the doctor says unknown, the run goes on
    assert result["headline"]["tau"] == pytest.approx(chain["tau"])

    again = run_stage.run(config)  # nothing changed: everything skipped
    assert set(statuses(again).values()) == {"skipped"}

    changed_config = dataclasses.replace(config, bench=dataclasses.replace(config.bench, max_new_tokens=6))
    changed = run_stage.run(changed_config)
    ran = {name for name, status in statuses(changed).items() if status == "ran"}
    assert ran == {"bench"}  # export reads train, not bench: it is kept
    assert (out / "bench.old" / "bench.json").is_file()

    # another export into the run's vLLM export folder: refused, then (overwrite=true) noticed by the next run
    from eaglekit.manifest import read_manifest
    from eaglekit.stages import export

    vllm_dir = out / "export" / "vllm"
    again_vllm = export.Config(drafter=str(out / "train"), to="vllm", output=str(vllm_dir))
    export.run(again_vllm)  # the same drafter, format and options: allowed
    sglang_into_vllm = dataclasses.replace(again_vllm, to="sglang")
    with pytest.raises(EaglekitError, match=rf"output {vllm_dir} holds another export \(the vllm export of "
                                            rf"{out / 'train'}, other format\): choose a new output directory, or "
                                            r"pass overwrite=true to replace it"):
        export.run(sglang_into_vllm)
    assert read_manifest(vllm_dir)["summary"]["format"] == "vllm"
    export.run(dataclasses.replace(sglang_into_vllm, overwrite=True))
    with pytest.raises(EaglekitError, match=rf"export-vllm: {vllm_dir} was written again by `eaglekit export` at "
                                            r".* after this run finished it \(its manifest.json changed\): move that "
                                            r"folder elsewhere \(or delete it\) and re-run"):
        run_stage.run(changed_config)
    vllm_dir.rename(tmp_path / "my-sglang-export")
    assert {n for n, s in statuses(run_stage.run(changed_config)).items() if s == "ran"} == {"export-vllm"}
    assert read_manifest(vllm_dir)["summary"]["format"] == "vllm"


def test_drafter_types_train_on_one_store_and_are_benched_side_by_side(chat_target, run_prompts, tmp_path):
    """drafter_types: each further type trains into train-<type>/ from the run's store (P-EAGLE from the run's
    EAGLE-3 drafter), benches every method it drafts into bench-<type>/ on the same prompts, and the report sets
    them beside the run's drafter with speed-ups over the one plain row; a re-run skips them all."""
    from eaglekit.report import collect

    out = tmp_path / "run"
    config = tiny_run(chat_target, run_prompts, out, stages=["regen", "extract", "vocab", "train", "bench"],
                      drafter_types=["eagle3", "p-eagle", "dflash", "dspark"], train__block_size=4,
                      train__draft_layers=1)
    steps = {s.name: s for s in plan(config)}
    assert list(steps) == ["regen", "extract", "vocab", "train", "train-p-eagle", "train-dflash", "train-dspark",
                           "bench", "bench-p-eagle", "bench-dflash", "bench-dspark"]
    peagle, dflash = steps["train-p-eagle"].make_config(), steps["train-dflash"].make_config()
    assert (peagle.drafter_type, peagle.init_from, steps["train-p-eagle"].after) == (
        "p-eagle", str(out / "train"), ("extract", "vocab", "train"))
    assert (dflash.drafter_type, dflash.init_from, dflash.shards) == ("dflash", "", str(out / "extract"))
    assert steps["bench"].make_config().methods == ("plain", "chain")
    assert steps["bench-p-eagle"].make_config().methods == ("parallel", "chain", "tree")
    assert (steps["bench-dflash"].make_config().methods, steps["bench-dflash"].make_config().chain_length) == (
        ("dflash",), 2)  # bench.chain_length is set here; left at its default, DFlash drafts the whole block:
    unset = dataclasses.replace(config, bench=dataclasses.replace(config.bench, chain_length=Config().bench.chain_length))
    assert {s.name: s for s in plan(unset)}["bench-dflash"].make_config().chain_length == 3  # block_size - 1
    assert {s.name: s for s in plan(unset)}["bench-dspark"].make_config().chain_length == 4  # every slot drafts

    assert set(statuses(run_stage.run(config)).values()) == {"ran"}
    kinds = [kind for kind, _ in collect(out)["drafter_types"]]
    assert kinds == ["eagle3", "p-eagle", "dflash", "dspark"]
    report = (out / "report.md").read_text()
    assert "### Drafter types side by side" in report
    for row in ("| eagle3 | chain | 2 | 0 |", "| p-eagle | parallel | 2 | 0 |", "| p-eagle | tree | tree ",
                "| dflash | dflash | 2 | 0 |", "| dspark | dspark | 2 | 0 |"):
        assert row in report, row
    assert "| dspark | dspark (verify >= 0.3) | 2 | 0 |" in report  # DSpark's confidence cuts beside its chain
    assert "### Confidence (DSpark)" in report and "`train-dspark/`: confidence calibrated on" in report
    assert "| position | blocks | survived | temperature | ECE raw | ECE | AUC raw | AUC |" in report
    assert set(statuses(run_stage.run(config)).values()) == {"skipped"}
    with pytest.raises(EaglekitError, match="name each of eagle3, p-eagle, dflash, dspark at most once"):
        plan(tiny_run(chat_target, run_prompts, tmp_path / "x", drafter_types=["eagle3", "eagle3"]))
    with pytest.raises(EaglekitError, match="drop train.drafter_type"):
        plan(tiny_run(chat_target, run_prompts, tmp_path / "x", drafter_types=["eagle3", "dflash"],
                      train__drafter_type="dflash"))


def test_online_plan_skips_extract_and_trains_on_regenerated_data(chat_target, run_prompts, tmp_path):
    config = tiny_run(chat_target, run_prompts, tmp_path / "run", training="online")
    steps = {s.name: s for s in plan(config)}
    assert "extract" not in steps
    train = steps["train"].make_config()
    assert train.shards == "" and train.data == (str(tmp_path / "run" / "regen" / "conversations.jsonl"),)
    assert train.vocab == str(tmp_path / "run" / "vocab" / "vocab.safetensors") and train.resume
    assert steps["train"].after == ("regen", "vocab")
    assert steps["vocab"].make_config().max_length == 64  # follows train.max_length in online mode


def test_without_regen_stages_read_the_data_as_is(chat_target, run_prompts, tmp_path):
    config = tiny_run(chat_target, run_prompts, tmp_path / "run", stages=["extract", "vocab", "train"])
    steps = {s.name: s for s in plan(config)}
    assert list(steps) == ["extract", "vocab", "train"]
    assert steps["extract"].make_config().data == (run_prompts,) and run_prompts in steps["extract"].inputs


def test_wired_options_and_bad_combinations_are_refused(chat_target, run_prompts, tmp_path):
    with pytest.raises(EaglekitError, match="train.output is set by eaglekit run"):
        plan(tiny_run(chat_target, run_prompts, tmp_path, train__output="elsewhere"))
    with pytest.raises(EaglekitError, match="did you mean 'train.lr'"):
        tiny_run(chat_target, run_prompts, tmp_path, train__lrr=1.0)
    with pytest.raises(EaglekitError, match="keep train in stages"):
        plan(tiny_run(chat_target, run_prompts, tmp_path, stages=["bench"]))
    with pytest.raises(EaglekitError, match="add extract to stages"):
        plan(tiny_run(chat_target, run_prompts, tmp_path, stages=["vocab", "train"]))
    with pytest.raises(EaglekitError, match="unknown stages"):
        plan(tiny_run(chat_target, run_prompts, tmp_path, stages=["regen", "trian"]))
    with pytest.raises(EaglekitError, match="export_formats"):
        plan(tiny_run(chat_target, run_prompts, tmp_path, export_formats=["onnx"]))
    with pytest.raises(EaglekitError, match="no data"):
        plan(dataclasses.replace(tiny_run(chat_target, run_prompts, tmp_path), data=()))


def test_data_shorthands_and_package_paths():
    shipped = Path(resolve_data_path("tiny"))
    assert shipped.name == "tiny_prompts.jsonl" and shipped.is_file()
    assert Path(resolve_data_path("assets/tiny_prompts_eval.jsonl")) == shipped.parent / "tiny_prompts_eval.jsonl"
    with pytest.raises(EaglekitError, match="data=tiny"):
        resolve_data_path("no/such/file.jsonl")


def test_a_stage_launched_under_torchrun_reads_its_resolved_config(chat_target, run_prompts, tmp_path):
    """The torchrun path writes the stage's resolved config and runs `-m eaglekit <stage> --config` on it."""
    config = tiny_run(chat_target, run_prompts, tmp_path / "run", stages=["vocab"])
    step = plan(config)[0]
    stage_config = step.make_config()
    step.directory.mkdir(parents=True)
    manifest = run_stage.torchrun("vocab", stage_config, 1, step.directory)
    assert manifest["stage"] == "vocab" and manifest["config"] == dataclasses.asdict(stage_config) | {"data": [run_prompts]}
    assert (step.directory / "launch.yaml").is_file() and (step.directory / "vocab.safetensors").is_file()
