"""`eaglekit generate` and `eaglekit bench` on a tiny chat model with a random drafter."""

from __future__ import annotations

import json

import pytest
import torch

from eaglekit.config import load_config
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.errors import EaglekitError
from eaglekit.stages import bench, generate


def check_acceptance(tau: float, rates: list[float], steps: int, new_tokens: int, prompts: int, max_drafts: int) -> None:
    """tau and acceptance per position agree with each other and with the tokens the verify steps produced:
    each step yields its accepted drafts plus one bonus token, each prompt's prefill one token, and a prompt's
    last step may overshoot the length limit (or stop at EOS) by at most `max_drafts` tokens."""
    assert len(rates) == max_drafts and all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:]))
    assert tau == pytest.approx(1 + sum(rates))  # mean accepted drafts per step == sum of P(draft i accepted)
    produced = prompts + round(tau * steps)
    assert new_tokens <= produced <= new_tokens + prompts * max_drafts



@pytest.fixture(scope="module")
def drafter_dir(chat_target, tmp_path_factory):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(chat_target)
    torch.manual_seed(4)
    drafter = Eagle3Drafter(DrafterConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=config.vocab_size,
        draft_vocab_size=config.vocab_size, target_hidden_size=32, aux_layer_ids=(2, 2, 1)))
    drafter.set_vocab_mapping(torch.arange(config.vocab_size))
    return str(drafter.save_pretrained(tmp_path_factory.mktemp("drafter"), include_embedding=False))


def test_generate_stage_methods_agree(chat_target, drafter_dir, tmp_path, capsys):
    outputs, configs = {}, {}
    for method in ("plain", "chain", "tree"):
        configs[method] = config = load_config(generate.Config, overrides=[f"target={chat_target}", f"drafter={drafter_dir}", "prompt=hello world",
                                                         f"method={method}", "max_new_tokens=12", "device=cpu",
                                                         f"output={tmp_path / method}.json"])
        outputs[method] = generate.run(config)
    assert outputs["plain"]["tokens"] == outputs["chain"]["tokens"] == outputs["tree"]["tokens"]
    saved = json.loads((tmp_path / "tree.json").read_text())
    assert saved["tokens"] == outputs["tree"]["tokens"] and saved["tau"] == outputs["tree"]["tau"]
    for method, max_drafts in (("chain", configs["chain"].chain_length), ("tree", configs["tree"].depth)):
        out = outputs[method]
        assert out["target_forwards"] == out["steps"] + 1  # the prefill, then one verify forward per step
        check_acceptance(out["tau"], out["acceptance_per_position"], out["steps"], len(out["tokens"]), 1, max_drafts)
    assert "tau" in capsys.readouterr().out


def test_generate_stage_needs_drafter_for_a_speculative_method(chat_target):
    with pytest.raises(EaglekitError, match="drafter=DIR"):
        generate.run(load_config(generate.Config, overrides=[f"target={chat_target}", "prompt=hi", "method=tree"]))
    plain = generate.run(load_config(generate.Config, overrides=[f"target={chat_target}", "prompt=hi",
                                                                 "max_new_tokens=4"]))  # method=auto, no drafter
    assert plain["tau"] == 1.0 and len(plain["tokens"]) <= 4


def test_bench_writes_json_table_and_plot(chat_target, drafter_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]},
            {"messages": [{"role": "user", "content": "hello"}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "bench"
    config = load_config(bench.Config, overrides=[f"prompts={prompts}", f"target={chat_target}", f"drafter={drafter_dir}",
                                                  f"output={out}", "methods=plain,hf,hf_assisted,hf_prompt_lookup,chain,tree",
                                                  f"assistant={chat_target}",
                                                  "temperatures=0.0,1.0", "max_new_tokens=5", "repeats=1", "warmup=1",
                                                  "device=cpu", "depth=3", "tree_top_k=3", "total_tokens=8"])
    result = bench.run(config)
    methods = [(r["method"], r["temperature"]) for r in result["rows"]]
    assert len(methods) == 12 and ("hf_assisted", 1.0) in methods
    saved = json.loads((out / "bench.json").read_text())
    tree = next(r for r in saved["rows"] if r["method"] == "tree" and r["temperature"] == 0.0)
    for row in saved["rows"]:
        if row["method"] in ("chain", "tree"):  # 2 prompts: one prefill forward each, then the verify steps
            max_drafts = config.depth if row["method"] == "tree" else config.chain_length
            check_acceptance(row["tau"], row["acceptance_per_position"], row["target_forwards"] - 2, row["new_tokens"], 2,
                             max_drafts)
    assert len(tree["acceptance_per_position"]) == 3
    assert all(r["tokens_per_second"] > 0 for r in saved["rows"])
    for row in saved["rows"]:  # eaglekit's rows split their time: prefills, and target forwards per new token
        if row["method"].startswith("hf"):
            assert "prefill_seconds" not in row
        else:
            assert 0 < row["prefill_seconds"] < row["seconds"] and row["target_forwards"] >= 2  # 2 prompts, each a prefill
            assert row["decode_tokens_per_second"] == pytest.approx(row["new_tokens"] / (row["seconds"] - row["prefill_seconds"]))
            if row["method"] == "tree":
                assert row["target_forwards"] <= row["new_tokens"] + 2
            if row["method"] in ("chain", "tree"):  # at most the two steps in flight of each prompt run for nothing
                assert 0 <= row["discarded_steps"] <= 2 * 2
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "bench.md").read_text()
    assert (out / "manifest.json").is_file() and "| tree | 0 |" in table and "| plain | 1 | " in table
    plain_line = next(line for line in table.splitlines() if line.startswith("| plain | 0 |"))
    assert plain_line.split("|")[5].strip() == "1.00x vs plain"  # speed-up against plain decoding at the same temperature
    assert saved["complete"] is True


def test_bench_checks_methods():
    config = load_config(bench.Config, overrides=["prompts=x.jsonl", "target=t", "methods=plain,beam"])
    with pytest.raises(EaglekitError, match="unknown bench methods"):
        bench.run(config)
    no_assistant = load_config(bench.Config, overrides=["prompts=x.jsonl", "target=t", "methods=plain,hf_assisted"])
    assert bench._check(no_assistant) == ["plain"]  # HF assisted generation needs assistant=: skipped
    with pytest.raises(EaglekitError, match="need drafter=DIR"):
        bench.run(load_config(bench.Config, overrides=["prompts=x.jsonl", "target=t", "methods=tree"]))


def one_prompt_bench(chat_target, tmp_path, monkeypatch, methods: str, failing: str, error: BaseException):
    """A one-prompt CPU bench of `methods` whose `failing` method raises `error` -> (config, output folder)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    real = bench._Runner.__call__

    def broken(self, method, ids, temperature):
        if method == failing:
            raise error
        return real(self, method, ids, temperature)

    monkeypatch.setattr(bench._Runner, "__call__", broken)
    out = tmp_path / "bench"
    config = load_config(bench.Config, overrides=[f"prompts={prompts}", f"target={chat_target}", f"output={out}",
                                                  f"methods={methods}", "temperatures=0.0", "max_new_tokens=4",
                                                  "repeats=1", "warmup=0", "device=cpu"])
    return config, out


def test_bench_keeps_other_methods_when_one_fails(chat_target, tmp_path, monkeypatch):
    config, out = one_prompt_bench(chat_target, tmp_path, monkeypatch, "plain,hf_prompt_lookup,hf", "hf_prompt_lookup",
                                   RuntimeError("lookup exploded"))
    with pytest.raises(EaglekitError, match=r"1 method\(s\) failed.*hf_prompt_lookup T=0 \(RuntimeError: lookup exploded\)"):
        bench.run(config)
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "hf_prompt_lookup", "hf"]
    assert rows[0]["tokens_per_second"] > 0 and rows[2]["tokens_per_second"] > 0 and "error" in rows[1]
    assert "failed: RuntimeError" in (out / "bench.md").read_text()
    assert not (out / "manifest.json").exists()  # not finished: `eaglekit run` measures it again


def test_interrupted_bench_keeps_the_rows_measured_so_far(chat_target, tmp_path, monkeypatch):
    """Ctrl-C during a method: bench.json already holds the methods measured before it (marked incomplete)."""
    config, out = one_prompt_bench(chat_target, tmp_path, monkeypatch, "plain,hf", "hf", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bench.run(config)
    saved = json.loads((out / "bench.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["plain"] and saved["complete"] is False
    assert saved["rows"][0]["tokens_per_second"] > 0
    assert not (out / "manifest.json").exists()


def test_warm_up_covers_every_prompt_for_eaglekits_methods():
    calls = []

    def runner(method, ids, temperature):
        calls.append(method)
        return 1, 0.5, None

    prompts = [[1], [2], [3]]
    for warmup, expected in ((1, {"plain": 6, "tree": 6, "hf": 4}), (0, {"plain": 3, "tree": 3, "hf": 3})):
        config = load_config(bench.Config, overrides=["prompts=x.jsonl", "target=t", f"warmup={warmup}", "repeats=1"])
        for method, count in expected.items():
            calls.clear()
            bench.measure_temperature(runner, [method], 0.0, prompts, config)
            assert len(calls) == count, (method, warmup)


def test_bench_logs_one_readable_line_per_row():
    row = {"method": "chain", "temperature": 0.0, "new_tokens": 128, "seconds": 25.675063670000327,
           "tokens_per_second": 4.985381989512253, "ms_per_token": 200.58643492187755, "tau": 1.4772727272727273,
           "acceptance_per_position": [0.32954545454545453, 0.0795454545454545, 0.0]}
    assert bench.row_summary(row) == ("bench: chain at T=0: tau 1.48, 5.0 tokens/s (200.6 ms/token), "
                                      "acceptance per position 0.33 0.08 0.00")
    assert bench.row_summary({"method": "plain", "temperature": 1.0, "tokens_per_second": None}) == (
        "bench: plain at T=1: no tokens generated")
    assert bench.row_summary({"method": "tree", "temperature": 0.0, "error": "RuntimeError: x"}) == (
        "bench: tree at T=0 failed: RuntimeError: x")


def test_a_lying_timer_never_gives_a_speedup_above_tau(chat_target, drafter_dir, tmp_path, monkeypatch):
    """plain's timed runs of the first round read 1000x slower (a load change that hits one method only): chain's
    T=0 speed-up reads far above its tau, is flagged and measured again, and bench.json and bench.md never give a
    speed-up above tau as a result."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    real, plain_calls = bench._Runner.__call__, []

    def slowed(self, method, ids, temperature):
        tokens, seconds, stats = real(self, method, ids, temperature)
        if method == "plain":
            plain_calls.append(seconds)
            seconds *= 1000 if len(plain_calls) <= 2 else 1  # the first round: 2 passes over the one prompt
        return tokens, seconds, stats

    monkeypatch.setattr(bench._Runner, "__call__", slowed)
    out = tmp_path / "bench"
    bench.run(load_config(bench.Config, overrides=[
        f"prompts={prompts}", f"target={chat_target}", f"drafter={drafter_dir}", f"output={out}", "methods=plain,chain",
        "temperatures=0.0", "max_new_tokens=6", "repeats=2", "warmup=0", "remeasure=1", "device=cpu"]))
    saved = json.loads((out / "bench.json").read_text())
    chain = next(r for r in saved["rows"] if r["method"] == "chain")
    first = chain["earlier_rounds"][0]
    assert first["speedup"] > 100 * chain["tau"] and first["flags"][0] == "speedup_above_tau"
    assert chain["rounds"] == 2 and len(plain_calls) == 4 and saved["schedule"]["max_rounds"] == 2
    assert chain["speedup"] <= chain["tau"] or "speedup_above_tau" in chain["flags"]
    cell = next(line for line in (out / "bench.md").read_text().splitlines() if line.startswith("| chain |"))
    cell = cell.split("|")[5].strip()
    assert cell.startswith("not measurable here") if chain["flags"] else float(cell.split("x")[0]) <= chain["tau"]


def test_hf_assisted_without_an_assistant_is_named_as_skipped(chat_target, tmp_path, caplog):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    out = tmp_path / "bench"
    config = load_config(bench.Config, overrides=[f"prompts={prompts}", f"target={chat_target}", f"output={out}",
                                                  "methods=plain,hf_assisted", "temperatures=0.0", "max_new_tokens=2",
                                                  "repeats=1", "warmup=0", "device=cpu"])
    with caplog.at_level("WARNING", logger="eaglekit.stages.bench"):
        result = bench.run(config)
    assert [r["method"] for r in result["rows"]] == ["plain"]
    assert result["skipped"] == [{"method": "hf_assisted", "reason": bench.NO_ASSISTANT}]
    assert json.loads((out / "bench.json").read_text())["skipped"] == result["skipped"]
    assert f"hf_assisted: skipped, {bench.NO_ASSISTANT}." in (out / "bench.md").read_text()
    assert "bench: hf_assisted skipped: no assistant= given" in caplog.text
