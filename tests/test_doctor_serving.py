"""The doctor's verdict against vLLM serving an eaglekit drafter export: a tiny random target of each family,
one random drafter export for all of them (every target here has 4 layers of width 128 and the same vocabulary),
served by the real vLLM (CPU build) in one worker process. "supported" must mean vLLM serves it with the drafter;
"not supported" must name what vLLM then fails on, and where `--fix` offers a plugin, the plugin must make vLLM
serve it and the doctor say "supported".

GPT-NeoX is the case a class-level check misses: vLLM 0.32 runs it on its Transformers backend
(TransformersForCausalLM implements SupportsEagle3), whose `self.model` is Hugging Face's GPTNeoXModel, which
names its embedding `embed_in`; the EAGLE proposer looks the target's embedding up as `model.embed_tokens` or
`model.embedding` and refuses the drafter otherwise.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.vllm import engine as ve
from eaglekit.doctor.diagnose import vllm_serving_note
from eaglekit.stages import doctor

pytestmark = pytest.mark.engine

# family -> (transformers config class, extra fields): one per path the doctor's serving check takes in vLLM 0.32
# (an engine start costs ~15 s on 2 cores; Mistral and Qwen3 take Llama's and Qwen2's paths, OLMo, SmolLM3 and
# Starcoder2 Phi's, GPTBigCode's `wte` GPT-NeoX's)
FAMILIES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),  # native class, LlamaModel.embed_tokens
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),  # native class of its own module
    "phi": ("PhiConfig", {}),  # Transformers backend, PhiModel.embed_tokens
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 1.0}),  # Transformers backend, GPTNeoXModel.embed_in
}
WIDTH, LAYERS, VOCAB, DRAFTS = 128, 4, 4096, 2


def build_target(family: str, directory: Path) -> str:
    """A random 4-layer target of width 128 (head_dim 32: what vLLM's CPU attention takes), the tiny tokenizer's."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    name, extra = FAMILIES[family]
    config = getattr(tf, name)(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                               num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=512,
                               tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0, **extra)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    engines._with_tiny_tokenizer(directory)
    return str(directory)


def build_drafter_export(output: Path) -> str:
    """A random drafter for any of the targets above, in vLLM's layout (with its own embedding)."""
    import torch

    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
    from eaglekit.drafters.eagle3.convert import export_drafter

    torch.manual_seed(1)
    drafter = Eagle3Drafter(DrafterConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                                          num_key_value_heads=4, vocab_size=VOCAB, draft_vocab_size=VOCAB,
                                          target_hidden_size=WIDTH, aux_layer_ids=(1, 2, 3)))
    drafter.set_vocab_mapping(torch.arange(VOCAB))
    drafter.load_target_embedding(torch.randn(VOCAB, WIDTH))
    export_drafter(drafter, output, "vllm", dtype=torch.float32, speculative_tokens=DRAFTS)
    return str(output)


def job_run(name: str, target: str, drafter: str, engine: ve.Engine) -> dict:
    return {"name": name, "model": target, "speculative_config": ve.speculative_config(drafter, DRAFTS),
            "prompts": [[1, 17, 33, 250, 9]], "max_new_tokens": 6, "warmup": False,
            "engine_args": ve.engine_args(64, target, engine.device_type)}


def diagnose(target: str, source: str, *options: str) -> dict:
    return doctor.run(load_config(doctor.Config, None, [f"target={target}", "engine=vllm", f"engine_source={source}",
                                                        "installed_plugins=false", *options]))


@pytest.fixture(scope="module")
def engine() -> ve.Engine:
    return ve.find_engine(engines.vllm_python())


@pytest.fixture(scope="module")
def source(engine) -> str:
    done = subprocess.run([engine.python, "-c", "import importlib.util, os; "
                           "print(os.path.dirname(importlib.util.find_spec('vllm').origin))"],
                          capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("doctor_serving")
    return {"root": root, "drafter": build_drafter_export(root / "drafter-vllm"),
            "targets": {family: build_target(family, root / family) for family in FAMILIES}}


def test_doctor_verdict_matches_vllm_serving_each_family(engine, source, setup):
    verdicts = {family: diagnose(target, source) for family, target in setup["targets"].items()}
    runs = [job_run(family, target, setup["drafter"], engine) for family, target in setup["targets"].items()]
    served = {run["name"]: run for run in ve.run_worker(engine, {"kind": "generate", "runs": runs}, setup["root"],
                                                        "families")["runs"]}
    disagreements = []
    for family, report in verdicts.items():
        run = served[family]
        works = "error" not in run and run["counters"].get("spec_decode_num_drafts", 0) > 0
        if works != (report["verdict"] == "supported"):
            disagreements.append(f"{family}: doctor {report['verdict']}, vLLM {run.get('error') or 'served'}")
    assert not disagreements, disagreements
    assert [f for f, r in verdicts.items() if r["verdict"] != "supported"] == ["gpt_neox"]
    neox = verdicts["gpt_neox"]
    assert neox["serving"]["embedding"]["embedding_attribute"] == "embed_in" and neox["plugin_fix_possible"]
    assert "does not have 'embed_tokens' or 'embedding'" in served["gpt_neox"]["error"]
    assert "--fix" in vllm_serving_note(setup["targets"]["gpt_neox"])  # what `export --to vllm` warns with
    assert vllm_serving_note(setup["targets"]["phi"]) is None


def test_doctor_fix_plugin_makes_vllm_serve_gpt_neox(engine, source, setup, tmp_path):
    """--fix writes the embedding-alias plugin; installed (into a throwaway --target dir on the worker's path: the
    real vllm.general_plugins entry point, vLLM's venv untouched), vLLM serves the target and the doctor agrees."""
    target = setup["targets"]["gpt_neox"]
    fixed = diagnose(target, source, "fix=true", f"fix_output={tmp_path / 'plugins'}")
    assert fixed["verdict"] == "not supported" and fixed["plugin_written"]
    site = tmp_path / "site"
    subprocess.run([engine.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), fixed["plugin_written"]], check=True, timeout=300)
    assert diagnose(target, source, f"plugins={tmp_path / 'plugins'}")["verdict"] == "supported"
    job = {"kind": "generate", "runs": [job_run("gpt_neox", target, setup["drafter"], engine)]}
    result = ve.run_worker(engine, job, tmp_path, "plugin", env={"PYTHONPATH": str(site)})["runs"][0]
    assert "error" not in result, result["error"]
    assert result["counters"]["spec_decode_num_drafts"] > 0
