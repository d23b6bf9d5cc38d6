"""Export to vLLM / SGLang / speculators layouts and import them (plus EAGLE's published layout) back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglekit.config import load_config
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.layers import OUTPUT_OF_LAYER
from eaglekit.errors import EaglekitError
from eaglekit.drafters.eagle3 import convert, formats
from eaglekit.drafters.eagle3.convert import compare_drafters, export_drafter, import_checkpoint
from eaglekit.stages import export as export_stage
from eaglekit.stages import import_ as import_stage

LAYER = ["input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
         "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def make_drafter(**overrides) -> Eagle3Drafter:
    fields = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=120,
                  draft_vocab_size=40, target_hidden_size=32, aux_layer_ids=(2, 4, 5), target_num_layers=8,
                  target_architecture="LlamaForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    fields.update(overrides)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig(**fields))
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.2)
    drafter.set_vocab_mapping(torch.sort(torch.randperm(fields["vocab_size"])[: fields["draft_vocab_size"]]).values)
    return drafter


@pytest.fixture
def drafter_dir(tmp_path) -> Path:
    return make_drafter().save_pretrained(tmp_path / "drafter")


def test_required_key_lists_are_exact():
    config = make_drafter().config
    assert formats.required_keys("vllm", config) == [f"midlayer.{k}" for k in LAYER] + ["fc.weight", "norm.weight", "lm_head.weight", "d2t"]
    assert formats.required_keys("sglang", config) == formats.required_keys("vllm", config)
    assert formats.required_keys("speculators", config) == [f"layers.0.{k}" for k in LAYER] + [
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
    full_vocab = make_drafter(draft_vocab_size=120).config
    assert "d2t" not in formats.required_keys("vllm", full_vocab)


@pytest.mark.parametrize("fmt, written_ids, where", [
    ("vllm", [2, 4, 5], ("top", "eagle_config")),
    ("sglang", [1, 3, 4], ("eagle_config",)),
    ("speculators", [2, 4, 5], ("top",)),
])
def test_export_then_import_round_trip(tmp_path, drafter_dir, fmt, written_ids, where):
    out = tmp_path / fmt
    summary = export_stage.run(load_config(export_stage.Config, overrides={"drafter": str(drafter_dir), "to": fmt, "output": str(out)}))
    assert summary["max_logit_difference"] == 0.0 and (out / "manifest.json").is_file()
    data = json.loads((out / "config.json").read_text())
    assert ("eagle_aux_hidden_state_layer_ids" in data) == ("top" in where)
    if "top" in where:
        assert data["eagle_aux_hidden_state_layer_ids"] == written_ids
    if "eagle_config" in where:
        assert data["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": written_ids, "use_aux_hidden_state": True}
    tensors = load_file(str(out / "model.safetensors"))
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    assert set(tensors) == {prefix + k for k in LAYER} | {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"}
    if fmt == "speculators":
        assert data["speculators_model_type"] == "eagle3" and data["transformer_layer_config"]["num_hidden_layers"] == 1
        assert data["norm_before_residual"] is False  # vLLM assumes True when a speculators config omits it
    else:
        assert data["architectures"] == ["LlamaForCausalLMEagle3"] and data["draft_vocab_size"] == 40
        assert data["rope_theta"] == 500000.0 and data["rope_scaling"] is None

    back = tmp_path / f"{fmt}-back"
    import_stage.run(load_config(import_stage.Config, overrides={"source": str(out), "output": str(back)}))
    original, imported = Eagle3Drafter.from_pretrained(drafter_dir), Eagle3Drafter.from_pretrained(back)
    assert imported.config.aux_layer_ids == (2, 4, 5) and imported.config.aux_layer_convention == "input_of_layer"
    assert compare_drafters(original, imported, fmt) == 0.0


def test_output_of_layer_drafter_is_converted(tmp_path):
    drafter = make_drafter(aux_layer_ids=(1, 3, 4), aux_layer_convention=OUTPUT_OF_LAYER)
    vllm = export_drafter(drafter, tmp_path / "v", "vllm")
    sglang = export_drafter(drafter, tmp_path / "s", "sglang")
    assert vllm["config_aux_layer_ids"] == [2, 4, 5] and sglang["config_aux_layer_ids"] == [1, 3, 4]


def test_bf16_export_and_embedding_left_out(tmp_path):
    drafter = make_drafter()
    summary = export_drafter(drafter, tmp_path / "bf16", "vllm", dtype=torch.bfloat16, include_embedding=False)
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and "embed_tokens.weight" not in tensors
    assert summary["embedding_included"] is False and drafter.fc.weight.dtype == torch.float32  # source untouched


def test_refuses_checkpoints_an_engine_would_misload(tmp_path):
    with pytest.raises(EaglekitError, match="norm_before_residual"):
        export_drafter(make_drafter(norm_before_residual=True), tmp_path / "a", "sglang")
    with pytest.raises(EaglekitError, match="include 0"):
        export_drafter(make_drafter(aux_layer_ids=(0, 4, 5)), tmp_path / "b", "sglang")
    with pytest.raises(EaglekitError, match="speculators sizes fc"):
        export_drafter(make_drafter(target_hidden_size=48), tmp_path / "c", "speculators")
    config = make_drafter().config
    state = formats.to_checkpoint_state({k: v for k, v in make_drafter().state_dict().items() if k != "d2t"}, "vllm")
    with pytest.raises(EaglekitError, match=r"would lack \['d2t'\]"):
        formats.check_required("vllm", config, state)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_failed_verification_leaves_no_checkpoint(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise EaglekitError("logits differ")
    monkeypatch.setattr(convert, "compare_drafters", broken)
    with pytest.raises(EaglekitError, match="logits differ"):
        export_drafter(make_drafter(), tmp_path / "out", "vllm")
    assert list((tmp_path / "out").iterdir()) == []


def _eagle_published(tmp_path: Path, drafter: Eagle3Drafter, eagle_config: dict | None = None) -> Path:
    """A checkpoint the way SafeAILab/EAGLE publishes EAGLE-3 drafters: pytorch_model.bin, no embedding, no ids."""
    directory = tmp_path / "eagle"
    directory.mkdir()
    state = {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    torch.save(state, directory / "pytorch_model.bin")
    c = drafter.config
    data = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
            "draft_vocab_size": c.draft_vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": 500000.0,
            "rope_scaling": None, "max_position_embeddings": 2048, "hidden_act": "silu", "torch_dtype": "float16"}
    if eagle_config is not None:
        data["eagle_config"] = eagle_config
    (directory / "config.json").write_text(json.dumps(data))
    return directory


def test_import_eagle_published_layout(tmp_path):
    drafter = make_drafter()
    source = _eagle_published(tmp_path, drafter)
    with pytest.raises(EaglekitError, match="pass target="):
        import_checkpoint(source)
    imported = import_checkpoint(source, target_num_layers=8)
    assert imported.config.aux_layer_ids == (2, 4, 5)  # the engine default for 8 layers
    assert not imported.embed_tokens.weight.any()
    imported.load_target_embedding(drafter.embed_tokens.weight)
    assert compare_drafters(drafter, imported, "eagle import") == 0.0
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8}))
    summary = import_stage.run(load_config(import_stage.Config, overrides={"source": str(source), "target": str(target),
                                                                          "output": str(tmp_path / "out")}))
    assert summary["aux_layer_ids"] == [2, 4, 5] and summary["has_embedding"] is False
    assert Eagle3Drafter.from_pretrained(tmp_path / "out").config.target_architecture == "LlamaForCausalLM"


def test_import_ambiguous_ids_needs_the_engine(tmp_path):
    source = _eagle_published(tmp_path, make_drafter(), {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True})
    with pytest.raises(EaglekitError, match="from_format=vllm, from_format=sglang"):
        import_checkpoint(source)
    assert import_checkpoint(source, from_format="sglang").config.aux_layer_ids == (2, 4, 5)
    assert import_checkpoint(source, from_format="vllm").config.aux_layer_ids == (1, 3, 4)


def test_import_refuses_unsupported_variants(tmp_path):
    """A variant flag without its tensors, variant tensors without their flag (the engines would skip them), and
    variants eaglekit does not implement (a second layer) are refused."""
    drafter = make_drafter()
    export_drafter(drafter, tmp_path / "v", "vllm")
    config_path = tmp_path / "v" / "config.json"
    data = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**data, "norm_before_fc": True}))
    with pytest.raises(EaglekitError, match=r"missing tensors \['input_norm.weight'\]"):
        import_checkpoint(tmp_path / "v")
    config_path.write_text(json.dumps(data))
    weights = tmp_path / "v" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "fc_norm.0.weight": torch.ones(32)}, str(weights))
    with pytest.raises(EaglekitError, match="fc_norm.0.weight.*does not enable"):
        import_checkpoint(tmp_path / "v")
    save_file({**tensors, "layers.1.hidden_norm.weight": torch.ones(32)}, str(weights))
    with pytest.raises(EaglekitError, match="layers.1.hidden_norm.weight"):
        import_checkpoint(tmp_path / "v")
    with pytest.raises(EaglekitError, match="already an eaglekit drafter"):
        import_checkpoint(drafter.save_pretrained(tmp_path / "native"))


def test_cli_export_and_import(tmp_path, drafter_dir):
    from eaglekit.cli import main

    assert main(["export", str(drafter_dir), "--to", "sglang", f"output={tmp_path / 'sg'}"]) == 0
    assert main(["import", str(tmp_path / "sg"), f"output={tmp_path / 'back'}"]) == 0
    assert Eagle3Drafter.from_pretrained(tmp_path / "back").config.aux_layer_ids == (2, 4, 5)
    assert main(["export", str(drafter_dir), "--to", "tensorrt"]) == 1  # not a choice: one-line error


def test_export_warns_when_ids_are_not_the_engine_default(tmp_path):
    assert export_drafter(make_drafter(), tmp_path / "a", "vllm")["warnings"] == []
    summary = export_drafter(make_drafter(aux_layer_ids=(1, 4, 6)), tmp_path / "b", "vllm")
    assert len(summary["warnings"]) == 1 and "[2, 4, 5]" in summary["warnings"][0]


def test_the_aux_layers_warning_is_logged_once_for_every_format(tmp_path, caplog, monkeypatch):
    """`eaglekit run` exports one drafter in each format: the warning, the same each time, is logged once."""
    import logging

    from eaglekit.drafters.eagle3 import convert

    monkeypatch.setattr(convert, "LOGGED_WARNINGS", set())
    drafter = make_drafter(aux_layer_ids=(1, 4, 6))
    with caplog.at_level(logging.WARNING):
        summaries = [export_drafter(drafter, tmp_path / fmt, fmt) for fmt in ("vllm", "sglang", "speculators")]
    assert all(len(summary["warnings"]) == 1 for summary in summaries)  # each export's manifest still says it
    assert caplog.text.count("are not the engine default") == 1
