"""DFlash drafters in vLLM's and speculators' layouts: export key lists and configs, round trips, a published
(z-lab style) checkpoint without lm_head, the export and import stages, and the layouts refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglekit.config import load_config
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.errors import EaglekitError
from eaglekit.drafters.dflash.formats import export_dflash, import_dflash, probe_logits
from eaglekit.stages import export, import_

VOCAB = 40
LAYER_KEYS = ["input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight"]


def drafter(draft_vocab: int = 24, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(DFlashConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=16, target_layer_ids=(1, 3),
        mask_token_id=VOCAB - 1, block_size=4, target_num_layers=6, target_name_or_path="some/target"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.set_vocab_mapping(torch.sort(torch.randperm(VOCAB)[:draft_vocab]).values)
    return model


def test_vllm_export_has_the_keys_and_config_vllm_loads(tmp_path):
    model = drafter()
    summary = export_dflash(model, tmp_path, "vllm")
    expected = sorted(["d2t", "fc.weight", "hidden_norm.weight", "lm_head.weight", "norm.weight"]
                      + [f"layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS])
    assert sorted(load_file(str(tmp_path / "model.safetensors"))) == expected == summary["tensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3]}
    assert config["draft_vocab_size"] == 24 and config["num_hidden_layers"] == 2 and config["block_size"] == 4
    again = import_dflash(tmp_path)
    again.load_target_embedding(model.embed_tokens.weight.detach())
    assert torch.equal(probe_logits(again), probe_logits(model))
    assert torch.equal(again.t2d, model.t2d)  # rebuilt from d2t


def test_speculators_export_uses_input_of_layer_ids(tmp_path):
    model = drafter(draft_vocab=VOCAB)  # the full vocabulary: no mapping written
    export_dflash(model, tmp_path, "speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [2, 4]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert not {"d2t", "t2d", "embed_tokens.weight"} & set(load_file(str(tmp_path / "model.safetensors")))
    assert import_dflash(tmp_path).config.target_layer_ids == (1, 3)


def test_published_checkpoint_without_lm_head_takes_the_targets(tmp_path):
    """A z-lab style checkpoint: full vocabulary, no lm_head, no mapping, keys under `model.`, no rope_theta."""
    model = drafter(draft_vocab=VOCAB)
    export_dflash(model, tmp_path / "x", "vllm")
    state = load_file(str(tmp_path / "x/model.safetensors"))
    head = state.pop("lm_head.weight")
    save_file({f"model.{k}": v for k, v in state.items()}, str(tmp_path / "x/model.safetensors"))
    config = json.loads((tmp_path / "x/config.json").read_text())
    for key in ("rope_parameters", "rope_theta", "draft_vocab_size", "eaglekit"):
        config.pop(key)
    (tmp_path / "x/config.json").write_text(json.dumps(config))
    imported = import_dflash(tmp_path / "x", lm_head=head)
    assert imported.config.rope_parameters["rope_theta"] == 1_000_000.0  # vLLM's default for such a config
    assert torch.equal(imported.lm_head.weight, head)
    assert not bool(import_dflash(tmp_path / "x").lm_head.weight.any())  # left for load_target_lm_head
    with pytest.raises(EaglekitError, match="pass target=MODEL"):
        import_.run(load_config(import_.Config, overrides={"source": str(tmp_path / "x"),
                                                           "output": str(tmp_path / "y")}))


def test_export_and_import_stages_round_trip_a_dflash_drafter(tmp_path):
    model = drafter()
    model.save_pretrained(tmp_path / "drafter")
    summary = export.run(load_config(export.Config, overrides={"drafter": str(tmp_path / "drafter"), "to": "vllm",
                                                               "output": str(tmp_path / "vllm")}))
    assert summary["max_logit_difference"] == 0.0 and not summary["embedding_included"]
    import_.run(load_config(import_.Config, overrides={"source": str(tmp_path / "vllm"),
                                                       "output": str(tmp_path / "back")}))
    back = DFlashDrafter.from_pretrained(tmp_path / "back")
    back.load_target_embedding(model.embed_tokens.weight.detach())
    assert torch.equal(probe_logits(back), probe_logits(model))
    with pytest.raises(EaglekitError, match="exports --to vllm or --to speculators"):
        export.run(load_config(export.Config, overrides={"drafter": str(tmp_path / "drafter"), "to": "sglang",
                                                         "output": str(tmp_path / "sglang")}))


def test_vllm_bench_refuses_more_drafts_than_the_block(tmp_path):
    from eaglekit.vllm.bench import export_for_vllm, served_method

    drafter().save_pretrained(tmp_path / "drafter")
    assert served_method(str(tmp_path / "drafter")) == "dflash"
    with pytest.raises(EaglekitError, match="block_size 4: at most 3"):
        export_for_vllm(str(tmp_path / "drafter"), tmp_path / "out", speculative_tokens=4)
    export_for_vllm(str(tmp_path / "drafter"), tmp_path / "out", speculative_tokens=3)
    assert json.loads((tmp_path / "out/config.json").read_text())["architectures"] == ["DFlashDraftModel"]


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window or causal"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3], "causal": True}}, "sliding-window or causal"),
    ({"dflash_config": {"target_layer_ids": [1, 3]}}, "mask_token_id"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_layouts_eaglekit_does_not_implement_are_refused(tmp_path, change, message):
    export_dflash(drafter(), tmp_path, "vllm")
    config = {**json.loads((tmp_path / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EaglekitError, match=message):
        import_dflash(tmp_path)
