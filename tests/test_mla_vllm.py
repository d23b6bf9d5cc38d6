"""The MLA drafter (drafter_arch=mla) served by the real vLLM 0.32.0 (CPU) as `Eagle3DeepseekV2ForCausalLM` beside a
tiny random DeepSeek-V3 target (MLA + MoE), against eaglekit's own decoder.

Pipeline as a user runs it: regen of the target's own greedy answers, `train drafter_arch=mla` (its MLA dims from
the target's config) for a few dozen steps, then one `bench engine=vllm methods=chain chain_length=3` (offline
vLLM runs with and without the drafter in one worker process). vLLM's acceptance per position (its spec-decode
counters) must equal eaglekit's chain figures within 0.01 at T=0, fp32, and vLLM's greedy output must be the
target's (eaglekit's plain decoding), so that both compare the same drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.stages import bench

pytestmark = pytest.mark.engine

NUM_PROMPTS, NEW_TOKENS, DRAFTS = 4, 32, 3


def train_mla_drafter(target: str, output: Path, data: str) -> str:
    from eaglekit.training.loop import train
    from eaglekit.config.train import TrainConfig

    train(TrainConfig(target=target, data=(data,), output=str(output), drafter_arch="mla", draft_vocab_size=512,
                      ttt_steps=3, max_steps=20, batch_size=4, max_length=96, lr=3e-3, warmup_steps=2,
                      val_fraction=0.0, log_every=1000, save_every=100000, device="cpu", dtype="fp32"))
    return str(output)


@pytest.fixture(scope="module")
def benched(tmp_path_factory) -> tuple[Path, dict, str]:
    python = engines.vllm_python()
    root = tmp_path_factory.mktemp("mla_vllm")
    target = engines.random_target("deepseek_v3", root / "target")
    answers = engines.own_answers(target, root / "regen", records=16, new_tokens=32)
    drafter = train_mla_drafter(target, root / "drafter", answers)
    output = root / "bench"
    config = load_config(bench.Config, None, [
        f"prompts={engines.EVAL_PROMPTS}", f"target={target}", f"drafter={drafter}", "methods=chain",
        f"chain_length={DRAFTS}", "temperatures=0", f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}",
        "repeats=1", "warmup=0", "device=cpu", f"output={output}", "engine=vllm", f"vllm_python={python}",
        "concurrency="])
    bench.run(config)
    return output, json.loads((output / "bench.json").read_text()), drafter


def test_vllm_serves_the_mla_drafter_with_eaglekits_acceptance(benched):
    output, result, drafter = benched
    exported = json.loads((output / "vllm" / "drafter" / "config.json").read_text())
    assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["kv_lora_rank"] == 512
    rows = {r["method"]: r for r in result["rows"]}
    chain, eagle = rows["chain"], rows["vllm_eagle3"]
    assert chain["acceptance_per_position"][0] > 0.05, "the drafter learned nothing: the comparison would be empty"
    assert eagle["acceptance_per_position"] == pytest.approx(chain["acceptance_per_position"], abs=0.01)
    assert eagle["tau"] == pytest.approx(chain["tau"], abs=0.03)
    assert eagle["outputs_equal_plain"] == 1.0  # speculative greedy kept vLLM's own greedy output


# far from plain RoPE (most frequencies interpolated 8x); original * factor = 256 covers every position vLLM sees here
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.3}


def rope_variant(drafter_dir: str, output: Path, rope: dict | None) -> str:
    """The trained drafter with `rope` (None: its own), its queries' rope rows x4 so that the attention scores, and
    with them the drafts, depend on positions (on this mostly-bigram target the trained drafter's barely do)."""
    import dataclasses

    import torch

    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    trained = Eagle3Drafter.from_pretrained(drafter_dir)
    rope = dict(rope or trained.config.rope_parameters)
    drafter = Eagle3Drafter(dataclasses.replace(trained.config, rope_parameters=rope))
    drafter.load_state_dict(trained.state_dict())
    attention = drafter.midlayer.self_attn
    with torch.no_grad():
        rows = attention.q_b_proj.weight.view(attention.num_heads, attention.nope_dim + attention.rope_dim, -1)
        rows[:, attention.nope_dim:] *= 4.0  # (nh, R, q_lora_rank): the rope slice of each head's query
    drafter.save_pretrained(output)
    return str(output)


def eaglekit_chain(target: str, drafter: str, output: Path) -> dict:
    config = load_config(bench.Config, None, [
        f"prompts={engines.EVAL_PROMPTS}", f"target={target}", f"drafter={drafter}", "methods=chain",
        f"chain_length={DRAFTS}", "temperatures=0", f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}",
        "repeats=1", "warmup=0", "device=cpu", f"output={output}"])
    return bench.run(config)["rows"][0]


def vllm_acceptance(target: str, drafter: str, workdir: Path) -> dict:
    """One vLLM run of `drafter` (exported here) on the bench's prompt ids -> tau and acceptance per position."""
    from eaglekit.data import prompt_messages, read_conversations
    from eaglekit.decode.setup import prompt_ids
    from eaglekit.vllm import engine as ve
    from eaglekit.vllm.bench import export_for_vllm, model_length
    from eaglekit.targets.loading import load_tokenizer

    tokenizer = load_tokenizer(target)
    prompts = [prompt_ids(tokenizer, prompt_messages(c))
               for c in read_conversations(str(engines.EVAL_PROMPTS))[:NUM_PROMPTS]]
    engine = ve.find_engine(engines.vllm_python())
    export = export_for_vllm(drafter, workdir / "export", DRAFTS)
    assert json.loads((export / "config.json").read_text())["rope_scaling"]["mscale_all_dim"] == YARN["mscale_all_dim"]
    run = {"name": "yarn", "model": target, "prompts": prompts, "max_new_tokens": NEW_TOKENS, "warmup": False,
           "engine_args": ve.engine_args(model_length(prompts, NEW_TOKENS, DRAFTS), target, engine.device_type),
           "speculative_config": ve.speculative_config(export, DRAFTS, engine.device_type)}
    served = ve.run_worker(engine, {"kind": "generate", "runs": [run]}, workdir, "yarn")["runs"][0]
    assert "error" not in served, served.get("error")
    return ve.acceptance(served["counters"])


def test_vllm_applies_yarn_to_the_mla_drafter_as_eaglekit_does(benched, tmp_path):
    """YaRN RoPE on the drafter (frequencies, cos/sin magnitude mscale(f, 1)/mscale(f, 0.3), softmax factor
    mscale(f, 0.3)^2): eaglekit's drafts change with it, and vLLM's acceptance per position is still eaglekit's."""
    _, _, drafter_dir = benched
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    target = Eagle3Drafter.from_pretrained(drafter_dir).config.target_name_or_path
    plain = eaglekit_chain(target, rope_variant(drafter_dir, tmp_path / "rope", None), tmp_path / "bench-rope")
    yarn_drafter = rope_variant(drafter_dir, tmp_path / "yarn", YARN)
    yarn = eaglekit_chain(target, yarn_drafter, tmp_path / "bench-yarn")
    assert yarn["acceptance_per_position"] != plain["acceptance_per_position"]  # the check below can tell RoPEs apart
    assert yarn["acceptance_per_position"][0] > 0.05
    figures = vllm_acceptance(target, yarn_drafter, tmp_path / "vllm")
    assert figures["acceptance_per_position"] == pytest.approx(yarn["acceptance_per_position"], abs=0.01)
    assert figures["tau"] == pytest.approx(yarn["tau"], abs=0.03)


def test_the_trained_drafter_is_mla_with_the_targets_dims(benched):
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    _, _, drafter = benched
    config = Eagle3Drafter.from_pretrained(drafter).config
    assert config.drafter_arch == "mla"
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (64, 512, 32, 64, 32)  # engines.random_target's DeepSeek-V3


# --- the engines' own loaders read every field the export writes ------------------------------
ENGINE_SET = {"target_layer_count"}  # vLLM sets it on the config itself
DEFAULTED = {"logit_scale", "num_aux_hidden_states", "use_aux_norm", "bias"}  # absent = 1.0 / from eagle_config / off
ROPE = {"rope_parameters", "rope_scaling", "rope_theta"}  # transformers turns rope_theta + rope_scaling into parameters


def config_reads(source: str) -> set[str]:
    """Names a model file reads from a config object: `config.X`, `self.config.X`, getattr/hasattr(config, "X")."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "config":
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
              and getattr(node.args[0], "id", getattr(node.args[0], "attr", None)) == "config"
              and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def exported_config(tmp_path: Path, fmt: str) -> dict:
    import torch

    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
    from eaglekit.drafters.eagle3.convert import export_drafter

    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                           vocab_size=64, draft_vocab_size=32, target_hidden_size=32, aux_layer_ids=(1, 2, 3),
                           drafter_arch="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                           v_head_dim=8)
    drafter = Eagle3Drafter(config)
    drafter.set_vocab_mapping(torch.arange(32) * 2)
    export_drafter(drafter, tmp_path / fmt, fmt)
    return json.loads((tmp_path / fmt / "config.json").read_text())


def test_vllm_loader_reads_only_fields_the_export_writes(tmp_path):
    """Every config field vLLM's deepseek_eagle3.py reads is written explicitly (none left to DeepseekV3Config's
    defaults, which are DeepSeek-V3's full-size values)."""
    site = sorted(Path(engines.vllm_python()).parent.parent.glob("lib/python3*/site-packages"))
    loader = site[0] / "vllm" / "model_executor" / "models" / "deepseek_eagle3.py" if site else None
    if loader is None or not loader.is_file():
        pytest.skip("vLLM's deepseek_eagle3.py is not in the vLLM venv's site-packages")
    missing = config_reads(loader.read_text()) - ENGINE_SET - DEFAULTED - ROPE - set(exported_config(tmp_path, "vllm"))
    assert not missing, f"vLLM reads {sorted(missing)}, which the export leaves to defaults"


def test_sglang_loader_reads_only_fields_the_export_writes(tmp_path):
    """The same for SGLang 0.5.23's kimi_k25_eagle3.py (from the cached wheel), whose checkpoint alias kimi_k2 it
    registers itself."""
    import os
    import zipfile

    cache = Path(os.environ.get("EAGLEKIT_TEST_WHEELS", "~/.cache/eaglekit-test-wheels")).expanduser()
    wheels = sorted(cache.glob("sglang-0.5.23-*.whl"))
    if not wheels:
        pytest.skip(f"sglang 0.5.23's wheel is not in {cache} (tests/test_doctor_real_engines.py downloads it)")
    with zipfile.ZipFile(wheels[0]) as wheel:
        loader = wheel.read("sglang/srt/models/kimi_k25_eagle3.py").decode()
        aliases = wheel.read("sglang/srt/utils/hf_transformers/common.py").decode()
    assert "EntryClass = [Eagle3DeepseekV2ForCausalLM]" in loader and '_CONFIG_REGISTRY["kimi_k2"]' in aliases
    data = exported_config(tmp_path, "sglang")
    missing = config_reads(loader) - DEFAULTED - ROPE - {"eagle_aux_hidden_state_layer_ids"} - set(data)
    assert not missing, f"SGLang reads {sorted(missing)}, which the export leaves to defaults"
    assert data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang's output-of-layer ids
