"""The run report on synthetic stage outputs: every section present, numbers copied exactly, speed-up
computed against plain decoding, exact engine launch commands, and stages that were not run said so."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglekit.report import bench_table, launch_commands, read_metrics, write_report


def dump(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def manifest(directory: Path, stage: str, **data) -> None:
    dump(directory / "manifest.json", {"stage": stage, **data})


def synthetic_run(out: Path, target: str) -> None:
    steps = [{"stage": s, "status": "ran", "seconds": 1.5, "key": "k", "directory": str(out / s)} for s in ("regen", "extract", "train")]
    dump(out / "run.json", {"config": {"target": target, "data": ["p.jsonl"], "training": "offline", "trust_remote_code": False,
                                       "export_formats": ["vllm", "sglang"]}, "steps": steps})
    manifest(out / "regen", "regen")
    dump(out / "regen" / "stats.json", {"records": 12, "finished": 11, "completion_tokens": 345, "answers": 11, "seconds": 9.25})
    (out / "extract").mkdir(parents=True)
    save_file({"loss_mask": torch.tensor([1, 1, 0, 0, 1, 0, 0, 0], dtype=torch.uint8)}, str(out / "extract" / "shard-r0-00000.safetensors"))
    manifest(out / "extract", "extract", num_records=11, num_tokens=8, stats={"truncated": 2},
             shards=[{"file": "shard-r0-00000.safetensors", "records": ["a"], "num_tokens": 8}])
    manifest(out / "vocab", "vocab", draft_vocab_size=1024, vocab_size=4096, coverage=0.98765, tokens_counted=3, distinct_tokens=77,
             mapping="built from counts")
    val = {"loss": 1.2345, "loss_k": [0.5, 0.6], "acc_k": [0.812, 0.654], "tau": 2.47, "step": 40, "split": "val"}
    manifest(out / "train", "train", mode="offline", steps=40, epochs=2, train_records=10, val_records=1, val=val)
    lines = [{"split": "train", "step": 10, "loss": 3.0, "acc_k": [0.1, 0.05]},
             {"split": "train", "step": 10, "loss": 2.5, "acc_k": [0.2, 0.1]},  # the same step again after a resume
             {"split": "train", "step": 20, "loss": 2.0, "acc_k": [0.4, 0.3]}, val]
    (out / "train" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"split": "tra')
    rows = [{"method": "plain", "temperature": 0.0, "tokens_per_second": 10.0, "ms_per_token": 100.0},
            {"method": "chain", "temperature": 0.0, "tokens_per_second": 25.0, "ms_per_token": 40.0, "tau": 3.21,
             "acceptance_per_position": [0.9, 0.7, 0.5]},
            {"method": "tree", "temperature": 0.0, "tokens_per_second": 20.0, "ms_per_token": 50.0, "tau": 3.9,
             "acceptance_per_position": [0.95, 0.8, 0.6, 0.4]},
            {"method": "plain", "temperature": 1.0, "tokens_per_second": 8.0, "ms_per_token": 125.0},
            {"method": "chain", "temperature": 1.0, "tokens_per_second": 12.0, "ms_per_token": 83.3, "tau": 2.0,
             "acceptance_per_position": [0.6, 0.3, 0.1]}]
    manifest(out / "bench", "bench")
    dump(out / "bench" / "bench.json", {"rows": rows, "backend": "static", "num_prompts": 5,
                                        "config": {"prompts": "eval.jsonl", "max_new_tokens": 64, "repeats": 3, "device": "cpu"}})
    for fmt, ids in (("vllm", [2, 16, 29]), ("sglang", [1, 15, 28])):
        manifest(out / "export" / fmt, "export", summary={"config_aux_layer_ids": ids, "max_logit_difference": 1.5e-6})
    manifest(out / "export" / "vllm.old", "export", summary={})  # moved aside by a re-run with other options
    dump(out / "doctor" / "vllm" / "doctor.json", {"engine": "vllm", "engine_version": "0.11.0", "verdict": "supported",
                                                   "reasons": ["LlamaForCausalLM implements SupportsEagle3"], "fix": []})
    dump(out / "doctor" / "sglang" / "doctor.json", {"engine": "sglang", "engine_version": None, "verdict": "unknown",
                                                     "reasons": ["sglang is not installed in this environment"], "fix": []})


def test_report_sections_and_numbers(tmp_path):
    out = tmp_path / "run"
    target = str(tmp_path / "target")
    Path(target).mkdir()
    synthetic_run(out, target)
    report = write_report(out)
    text = report.path.read_text()
    for heading in ("# eaglekit run report", "## Data", "## Training", "## Decoding", "## Export", "## Serving engines (doctor)"):
        assert heading in text
    assert "- regen: 11 of 12 records answered by the target (345 new tokens in 11 answers, generated in 9.2 s)" in text
    assert "- records: 11; tokens: 8; loss-masked (assistant) tokens: 3 (37.5%); truncated records: 2" in text
    assert "draft vocabulary: 1024 of 4096 ids (built from counts); coverage 98.77% of 3 loss-masked tokens" in text
    assert "Validation at step 40: loss 1.2345, estimated tau 2.47." in text
    assert "| accuracy | 0.812 | 0.654 |" in text and "| loss | 0.500 | 0.600 |" in text
    assert "| chain | 0 | 25.0 | 40.00 | 2.50x vs plain | n/a | 3.21 | 0.90 0.70 0.50 |" in text
    assert "| tree | 0 | 20.0 | 50.00 | 2.00x vs plain | n/a | 3.90 | 0.95 0.80 0.60 0.40 |" in text
    assert "| chain | 1 | 12.0 | 83.30 | 1.50x vs plain | n/a | 2.00 |" in text
    vllm, sglang = (str((out / "export" / f).resolve()) for f in ("vllm", "sglang"))
    assert (f"vllm serve {target} --speculative-config "
            f"'{{\"method\": \"eagle3\", \"model\": \"{vllm}\", \"num_speculative_tokens\": 3}}'") in text
    assert (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 --speculative-draft-model-path "
            f"{sglang} --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in text
    assert text.index("**vllm**") < text.index("**sglang**")  # in the run's export order
    assert "vllm.old" not in text
    assert "| vllm | 0.11.0 | **supported** | LlamaForCausalLM implements SupportsEagle3 | - |" in text
    assert "| sglang | n/a | **unknown** | sglang is not installed in this environment | - |" in text
    # headline: the fastest EAGLE-3 method at the lowest temperature
    assert report.headline["method"] == "chain" and report.headline["tau"] == 3.21 and report.headline["speedup"] == 2.5
    assert report.headline["val_accuracy"] == 0.812
    assert "**Headline:** tau 3.21 (chain, T=0), speed-up 2.50x vs plain; val accuracy (first draft position) 0.812." in text
    assert [p.name for p in report.plots] == ["report-training.png", "report-acceptance.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report.plots)


def test_metrics_keep_the_last_line_per_step_and_skip_a_cut_line(tmp_path):
    synthetic_run(tmp_path / "run", "t")
    metrics = read_metrics(tmp_path / "run" / "train" / "metrics.jsonl")
    assert [m["loss"] for m in metrics["train"]] == [2.5, 2.0] and [m["step"] for m in metrics["val"]] == [40]


def test_report_of_a_run_with_nothing_finished(tmp_path):
    dump(tmp_path / "run.json", {"config": {"target": "tiny", "data": ["x"]}, "steps": []})
    report = write_report(tmp_path)
    text = report.path.read_text()
    assert "Not run (regen, extract and vocab left out or not finished)." in text
    assert "## Training\n\nNot run or not finished" in text and "## Decoding\n\nNot run or not finished" in text
    assert "## Export\n\nNot run" in text and "## Serving engines (doctor)\n\nNot run" in text
    assert "no headline numbers" in text and report.plots == [] and report.headline == {}


def test_speedup_falls_back_to_hf_generate_and_launch_commands():
    rows = bench_table([{"method": "hf", "temperature": 0.0, "tokens_per_second": 4.0},
                        {"method": "tree", "temperature": 0.0, "tokens_per_second": 10.0, "tau": 3.0}])
    assert rows[1]["speedup"] == 2.5 and rows[1]["baseline"] == "hf"
    assert launch_commands("org/model", "/d r", "speculators") == [
        "vllm serve '/d r'",
        "vllm serve org/model --speculative-config '{\"method\": \"eagle3\", \"model\": \"/d r\", \"num_speculative_tokens\": 3}'"]
    assert "--trust-remote-code" in launch_commands("org/model", "/d", "sglang", trust_remote_code=True)[0]


def test_online_training_data_is_counted_with_the_target_tokenizer(chat_target, tmp_path):
    from eaglekit.data import read_conversations, tokenize_conversation
    from eaglekit.targets.loading import load_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}) + "\n"
                            for u, a in (("hello world", "the lazy dog"), ("two plus two", "quick brown fox jumps"))))
    out = tmp_path / "run"
    dump(out / "run.json", {"config": {"target": chat_target, "data": [str(data)]}, "steps": []})
    manifest(out / "train", "train", mode="online", steps=1, config={"target": chat_target, "data": [str(data)], "max_length": 64})
    dump(out / "train" / ".run-done", {"key": "abc"})
    tokenizer = load_tokenizer(chat_target)
    records = [tokenize_conversation(tokenizer, c, 64) for c in read_conversations([str(data)])]
    tokens, learned = sum(r.num_tokens for r in records), sum(r.num_learned for r in records)
    text = write_report(out).path.read_text()
    assert f"- records: 2; tokens: {tokens}; loss-masked (assistant) tokens: {learned} ({learned / tokens:.1%})" in text
    assert json.loads((out / "report-data.json").read_text())["key"] == "abc"


def test_served_by_vllm_says_whether_the_drafter_kept_vllms_output(tmp_path):
    """The section's lines: T=0 the same greedy ids, T > 0 the same sampling distribution (with p and counts)."""
    out = tmp_path / "run"
    synthetic_run(out, "t")
    bench = json.loads((out / "bench" / "bench.json").read_text())
    vllm = {"engine": "vllm", "engine_version": "0.32.0", "new_tokens": 100, "ms_per_token": 1.0}
    check = {"samples": [400, 400], "positions": 5, "p_value": 3.2e-40, "alpha": 0.001, "matches_plain": False}
    bench["rows"] += [{"method": "vllm_plain", "temperature": 0.0, "tokens_per_second": 50.0, **vllm},
                      {"method": "vllm_eagle3", "temperature": 0.0, "tokens_per_second": 90.0, "tau": 2.8,
                       "acceptance_per_position": [0.7, 0.5, 0.3], "outputs_equal_plain": 1.0, **vllm},
                      {"method": "vllm_plain", "temperature": 1.0, "tokens_per_second": 45.0, **vllm},
                      {"method": "vllm_eagle3", "temperature": 1.0, "tokens_per_second": 20.0, "tau": 1.05,
                       "acceptance_per_position": [0.04, 0.01, 0.0], "distribution": check, **vllm}]
    bench["config"]["engine"] = "vllm"
    bench["vllm"] = {"version": "0.32.0", "python": "/venv/bin/python"}
    dump(out / "bench" / "bench.json", bench)
    text = write_report(out).path.read_text()
    section = text[text.index("## Served by vLLM"):]
    assert "(T=0, fp32): tau 2.800, acceptance per position 0.700 0.500 0.300" in section
    assert "- T=0: vLLM's output with the drafter equals its plain greedy output on 100% of the prompts" in section
    assert ("- T=1: vLLM's output with the drafter does NOT follow its plain output's distribution (p = 3.2e-40, 400 "
            "samples x 5 positions; a lossless engine passes unless p < 0.001): its speculative sampling is not "
            "lossless here") in section
    assert "| vllm_eagle3 | 1 | 20.0 | 1.00 | 0.44x vs vllm_plain |" in text


def _figures_saved(monkeypatch) -> list:
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: (saved.append(fig), real(fig, *args, **kwargs)))
    return saved


def test_plots_show_whole_positions_and_a_failed_bench_draws_no_blank_chart(tmp_path, monkeypatch):
    from eaglekit.report import plot_training
    from eaglekit.stages.bench import _plot

    saved = _figures_saved(monkeypatch)
    ok = {"method": "chain", "temperature": 0.0, "tau": 1.8, "tokens_per_second": 50.0,
          "acceptance_per_position": [0.7, 0.5, 0.3]}
    failed = {"method": "tree", "temperature": 0.0, "error": "out of memory"}
    png = tmp_path / "bench.png"
    _plot([ok, failed], png)
    assert png.is_file() and "failed, not shown: tree T=0" in saved[-1]._suptitle.get_text()
    ticks = [t for t in saved[-1].axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks == [1, 2, 3]  # not 1.0, 1.25, 1.5, ...
    _plot([failed], png)  # nothing measured: no chart, and the earlier one is not left as this bench's
    assert not png.exists() and len(saved) == 1
    metrics = {"train": [{"step": s, "loss": 3.0 - s / 4, "acc_k": [0.1 * s]} for s in (1, 2, 3)], "val": []}
    assert plot_training(metrics, tmp_path / "training.png")
    assert all(float(t).is_integer() for axis in saved[-1].axes for t in axis.get_xticks())


def test_a_launch_command_the_doctor_says_the_engine_refuses_is_marked(tmp_path):
    out = tmp_path / "run"
    synthetic_run(out, "t")
    text = write_report(out).path.read_text()
    assert "will not serve this target" not in text  # supported (vLLM) and unknown (SGLang): no note
    dump(out / "doctor" / "vllm" / "doctor.json", {"engine": "vllm", "engine_version": "0.32.0",
                                                   "verdict": "not supported", "reasons": ["no SupportsEagle3"],
                                                   "fix": ["add SupportsEagle3"]})
    text = write_report(out).path.read_text()
    vllm_part = text[text.index("**vllm**"):text.index("**sglang**")]
    assert "The doctor says vllm 0.32.0 will not serve this target with an EAGLE-3 drafter as installed" in vllm_part
    assert vllm_part.index("will not serve") < vllm_part.index("vllm serve t")
    assert "will not serve" not in text[text.index("**sglang**"):]


def test_the_report_and_the_training_log_say_the_same_steps_epochs_and_passes(chat_target, data, tmp_path, caplog):
    """12 records in batches of 4: 3 steps an epoch; max_steps=7 ends in the third epoch, 2.3 passes in."""
    import logging

    from eaglekit.config import load_config
    from eaglekit.report import _section_training
    from eaglekit.stages import train

    overrides = {"target": chat_target, "data": [str(data)], "output": str(tmp_path / "train"), "max_steps": 7,
                 "batch_size": 4, "ttt_steps": 1, "draft_vocab_size": 64, "max_length": 64, "val_fraction": 0.0,
                 "log_every": 1, "device": "cpu"}
    with caplog.at_level(logging.INFO):
        train.run(load_config(train.Config, overrides=overrides))
    assert ("max_steps=7 decides (epochs=1 is ignored): 2.3 passes over 12 training records at 3 steps each"
            in caplog.text)
    assert "step 7/7 (epoch 3, 2.3 passes):" in caplog.text
    written = json.loads((tmp_path / "train" / "manifest.json").read_text())
    text = "\n".join(_section_training({"train": written, "out": tmp_path}, plotted=False))
    assert "7 optimizer steps: 2.3 passes over the training records (the last step in epoch 3)" in text
    assert "2 epoch(s) finished" in "\n".join(_section_training({"train": {**written, "passes": None}, "out": tmp_path},
                                                                plotted=False))  # a manifest from before passes


def test_the_learned_nothing_warning_fires_at_its_thresholds_and_not_above():
    from eaglekit.report.notes import learned_nothing

    nothing, mismatch = "learned (next to) nothing", "right in validation but not when decoding"
    assert learned_nothing({"val_accuracy": 0.26, "tau": 1.20}) is None  # learned something, and decoding agrees
    assert nothing in learned_nothing({"val_accuracy": 0.05, "tau": 1.05})
    assert nothing in learned_nothing({"val_accuracy": 0.10}) and nothing in learned_nothing({"tau": 1.10})
    assert learned_nothing({"val_accuracy": 0.11}) is None and learned_nothing({"tau": 1.11}) is None
    assert learned_nothing({"val_accuracy": 0.5, "tau": 1.3}) is None
    assert mismatch in learned_nothing({"val_accuracy": 0.5, "tau": 1.2})  # half the first drafts promised, a fifth
    assert mismatch in learned_nothing({"val_accuracy": 0.26, "tau": 1.05})


def test_a_flagged_speedup_is_never_the_headline(tmp_path):
    """A T=0 speed-up above tau (bench's flag after its extra rounds) is shown as not measurable, with its figures,
    and the headline takes the fastest method whose speed-up is not flagged; with none, it says so."""
    out = tmp_path / "run"
    synthetic_run(out, "t")
    measured = {"repeats": 3, "rounds": 3, "baseline": "plain"}
    rows = [{"method": "plain", "temperature": 0.0, "tokens_per_second": 10.0, "ms_per_token": 100.0, "speedup": 1.0,
             "speedup_spread": [1.0, 1.0], "tokens_per_second_spread": [9.0, 11.0], "flags": [], **measured},
            {"method": "chain", "temperature": 0.0, "tokens_per_second": 12.0, "ms_per_token": 83.3, "tau": 2.1,
             "speedup": 1.2, "speedup_spread": [1.15, 1.25], "tokens_per_second_spread": [11.0, 13.0], "flags": [],
             "acceptance_per_position": [0.6, 0.4, 0.1], **measured},
            {"method": "tree", "temperature": 0.0, "tokens_per_second": 63.7, "ms_per_token": 15.7, "tau": 3.22,
             "speedup": 6.37, "speedup_spread": [0.95, 6.5], "tokens_per_second_spread": [13.5, 65.0],
             "flags": ["speedup_above_tau", "spread_wider_than_gap"], "acceptance_per_position": [0.9, 0.8, 0.5],
             **measured}]
    bench = json.loads((out / "bench" / "bench.json").read_text())
    bench.update(rows=rows, skipped=[{"method": "hf_assisted", "reason": "no assistant= given"}])
    dump(out / "bench" / "bench.json", bench)
    report = write_report(out)
    text = report.path.read_text()
    assert report.headline["method"] == "chain" and report.headline["speedup"] == 1.2
    assert report.headline["not_measurable"][0]["method"] == "tree"
    assert "**Headline:** tau 2.10 (chain, T=0), speed-up 1.20x vs plain (1.15-1.25 over 3 repeats);" in text
    assert "6.37" not in text.split("## Decoding")[0]  # nowhere above the decoding table
    assert "| chain | 0 | 12.0 (11.0-13.0) | 83.30 | 1.20x vs plain (1.15-1.25) |" in text
    assert "| tree | 0 | 63.7 (13.5-65.0) | 15.70 | not measurable here (above tau" in text
    assert ("**tree at T=0: speed-up not measurable on this machine under its load** after 3 round(s) of "
            "measurement: 6.37x vs plain (0.95-6.50), tau 3.22; above tau") in text
    assert "hf_assisted: skipped, no assistant= given." in text

    rows[1].update(flags=["spread_wider_than_gap"], speedup_spread=[0.98, 1.25])  # every drafting method flagged: no speed-up in the headline
    dump(out / "bench" / "bench.json", bench)
    report = write_report(out)
    assert report.headline["method"] == "tree" and report.headline["speedup"] is None
    headline = next(line for line in report.path.read_text().splitlines() if line.startswith("**Headline:**"))
    assert headline.startswith("**Headline:** tau 3.22 (tree, T=0), speed-up not measurable on this machine under "
                               "its load (chain 1.20x vs plain (0.98-1.25), tau 2.10: the repeats' spread reaches 1x")
    assert "tree 6.37x vs plain (0.95-6.50), tau 3.22: above tau" in headline
