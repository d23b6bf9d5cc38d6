"""DSpark checkpoints both ways: vLLM's/DeepSpec's layout (`Qwen3DSparkModel`) and speculators' (`dspark`), the keys
each reader needs, a round trip that keeps every head, the refusals (a gated/rnn head to vLLM, a layout without the
type), and the stages (`eaglekit export`, `eaglekit import`, `train init_from=` a DSpark checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglekit.config import load_config
from eaglekit.drafters.dflash.formats import export_dflash
from eaglekit.drafters.dspark.formats import export_dspark, import_dspark
from eaglekit.drafters.dspark.model import DSparkDrafter
from eaglekit.errors import EaglekitError
from eaglekit.formats.saved import load_drafter, load_saved_drafter
from eaglekit.stages import export as export_stage
from eaglekit.stages import import_ as import_stage
from test_dspark_train import tiny_dspark


def test_vllm_layout_holds_what_vllm_reads(tmp_path):
    drafter = tiny_dspark(confidence_temperatures=(1.2, 1.4, 1.6, 1.8), target_weights_hash="ab12")
    summary = export_dspark(drafter, tmp_path / "vllm", "vllm")
    data = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert data["architectures"] == ["Qwen3DSparkModel"] and data["model_type"] == "qwen3"
    assert data["target_layer_ids"] == [1, 3] and data["block_size"] == 4 and data["mask_token_id"] == 39
    assert (data["markov_rank"], data["markov_head_type"]) == (8, "vanilla")
    assert data["enable_confidence_head"] and data["confidence_head_with_markov"] and data["sample_from_anchor"]
    assert data["layer_types"] == ["full_attention"] * 2 and data["draft_vocab_size"] == 24
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "hidden_norm.weight", "lm_head.weight", "d2t"} <= set(tensors)
    assert tensors["markov_head.markov_w1.weight"].shape == (40, 8) and tensors["markov_head.markov_w2.weight"].shape \
        == (24, 8)
    assert "embed_tokens.weight" not in tensors and "t2d" not in tensors  # vLLM shares the target's; skips t2d
    assert summary["max_logit_difference"] == 0.0 and summary["max_drafts"] == 4
    again = import_dspark(tmp_path / "vllm")
    assert again.config.confidence_temperatures == drafter.config.confidence_temperatures  # eaglekit's calibration
    assert again.config.target_weights_hash == "ab12"  # the target it was trained on


@pytest.mark.parametrize("heads", [{"markov_head_type": "gated"}, {"markov_head_type": "rnn"},
                                   {"sample_from_anchor": False}, {"confidence_head": False,
                                                                   "confidence_head_with_markov": False}])
def test_speculators_layout_round_trips_every_head(heads, tmp_path):
    drafter = tiny_dspark(**heads)
    export_dspark(drafter, tmp_path / "spec", "speculators")
    data = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert data["speculators_model_type"] == "dspark" and data["architectures"] == ["DSparkDraftModel"]
    assert data["aux_hidden_state_layer_ids"] == [2, 4]  # input-of-layer: output-of-layer ids + 1
    assert data["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.config.max_drafts
    again = import_dspark(tmp_path / "spec")
    assert isinstance(again, DSparkDrafter) and again.config.markov_head_type == drafter.config.markov_head_type
    for key, tensor in drafter.state_dict().items():
        if key != "embed_tokens.weight":
            assert torch.equal(again.state_dict()[key], tensor), key


def test_vllm_refuses_gated_and_rnn_heads_so_export_does(tmp_path):
    with pytest.raises(EaglekitError, match="vLLM 0.32 loads only the vanilla Markov head.*--to speculators"):
        export_dspark(tiny_dspark(markov_head_type="rnn"), tmp_path / "x", "vllm")
    assert not (tmp_path / "x" / "config.json").exists()


def test_a_deepspec_dflash_checkpoint_reads_as_dspark_without_heads(tmp_path):
    """DeepSpec's DFlash drafters are the same class with markov_rank 0 (and vLLM's defaults: no confidence head)."""
    drafter = tiny_dspark(markov_rank=0, confidence_head=False, confidence_head_with_markov=False)
    export_dspark(drafter, tmp_path / "deepspec", "vllm")
    data = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    for key in ("enable_confidence_head", "confidence_head_with_markov", "markov_head_type", "sample_from_anchor"):
        data.pop(key)  # what a DeepSpec DFlash config.json leaves out
    (tmp_path / "deepspec" / "config.json").write_text(json.dumps(data))
    again = import_dspark(tmp_path / "deepspec")
    assert (again.config.markov_rank, again.config.confidence_head, again.config.sample_from_anchor) == (0, False, True)
    data.pop("markov_rank")
    (tmp_path / "deepspec" / "config.json").write_text(json.dumps(data))
    with pytest.raises(EaglekitError, match="no markov_rank, which vLLM requires"):
        import_dspark(tmp_path / "deepspec")


def chat_dspark(chat_target: str, output) -> DSparkDrafter:
    """A random DSpark drafter shaped for the chat target (its hidden size, vocabulary, embedding and lm_head), saved
    into `output`."""
    from eaglekit.targets.loading import load_target

    target = load_target(chat_target)
    c = target.config
    drafter = tiny_dspark(vocab=c.vocab_size, draft_vocab=c.vocab_size)
    drafter = DSparkDrafter(type(drafter.config).from_dict({
        **drafter.config.to_dict(), "hidden_size": c.hidden_size, "target_hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.hidden_size // c.num_attention_heads, "target_layer_ids": [1, 2], "target_num_layers": 4,
        "target_name_or_path": chat_target, "target_architecture": "LlamaForCausalLM"}))
    drafter.set_vocab_mapping(torch.arange(c.vocab_size))
    drafter.load_target_embedding(target.get_input_embeddings().weight.detach())
    drafter.load_target_lm_head(target.get_output_embeddings().weight.detach())
    drafter.save_pretrained(output)
    return drafter


def test_export_and_import_stages(tmp_path, chat_target):
    drafter = chat_dspark(chat_target, tmp_path / "drafter")
    with pytest.raises(EaglekitError, match="dspark drafter: it exports --to vllm or --to speculators"):
        export_stage.run(load_config(export_stage.Config, None, [f"drafter={tmp_path / 'drafter'}", "to=sglang"]))
    summary = export_stage.run(load_config(export_stage.Config, None, [
        f"drafter={tmp_path / 'drafter'}", "to=vllm", f"output={tmp_path / 'vllm'}"]))
    assert summary["format"] == "vllm" and summary["drafter_type"] == "dspark"
    # a published checkpoint drafts with the target's lm_head: without it, import needs the target
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "vllm" / "model.safetensors"))
    with pytest.raises(EaglekitError, match="has no lm_head: it drafts with the target's, so pass target=MODEL"):
        import_stage.run(load_config(import_stage.Config, None, [f"source={tmp_path / 'vllm'}",
                                                                 f"output={tmp_path / 'a'}"]))
    result = import_stage.run(load_config(import_stage.Config, None, [
        f"source={tmp_path / 'vllm'}", f"output={tmp_path / 'imported'}", f"target={chat_target}"]))
    assert result["drafter_type"] == "dspark" and result["lm_head_from_target"]
    imported = load_saved_drafter(tmp_path / "imported")
    assert torch.equal(imported.lm_head.weight, drafter.lm_head.weight)
    assert torch.equal(imported.markov_head.markov_w2.weight, drafter.markov_head.markov_w2.weight)
    # train init_from reads the engine layout directly (formats.saved.load_drafter)
    assert isinstance(load_drafter(tmp_path / "imported"), DSparkDrafter)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_the_serve_command_names_each_types_method_and_drafts(fmt, tmp_path):
    """The run report's (and `eaglekit export`'s) vLLM command serves each export with its own type's method and
    draft count: DSpark drafts from every slot of its block, DFlash block_size - 1."""
    from eaglekit.report import launch_commands
    from test_dflash_format import drafter as tiny_dflash

    export_dspark(tiny_dspark(), tmp_path / "dspark", fmt)
    export_dflash(tiny_dflash(), tmp_path / "dflash", fmt)
    block = json.loads((tmp_path / "dflash" / "config.json").read_text())["block_size"]
    for name, method, drafts in (("dspark", "dspark", 4), ("dflash", "dflash", block - 1)):
        command = launch_commands("MODEL", str(tmp_path / name), fmt)[-1]
        assert f'"method": "{method}"' in command and f'"num_speculative_tokens": {drafts}' in command, command


def test_generate_and_serve_cut_by_confidence(tmp_path, chat_target):
    """`eaglekit generate` and `eaglekit serve` take method=dspark with its chain_length, verify_threshold and
    draft_topk: the same greedy text as plain decoding, the drafts verified per step reported."""
    from eaglekit.stages import generate, serve

    chat_dspark(chat_target, tmp_path / "drafter")
    common = [f"target={chat_target}", "prompt=what is two plus two", "max_new_tokens=12", "device=cpu"]
    plain = generate.run(load_config(generate.Config, None, [*common, "method=plain"]))
    cut = generate.run(load_config(generate.Config, None, [*common, f"drafter={tmp_path / 'drafter'}",
                                                           "method=dspark", "chain_length=4",
                                                           "verify_threshold=0.5"]))
    assert cut["tokens"] == plain["tokens"] and 0 <= cut["verified_per_step"] <= 4
    engine = serve.build_engine(load_config(serve.Config, None, [
        f"target={chat_target}", f"drafter={tmp_path / 'drafter'}", "method=dspark", "chain_length=3",
        "verify_threshold=0.5", "device=cpu"]))
    assert engine.options == {"chain_length": 3, "verify_threshold": 0.5}  # a chain method's length, not a tree's
    served = engine.generate(plain["tokens"][:3], 6)
    assert served.stats["tau"] >= 1 and "verified_per_step" in engine.metrics()
    topk = generate.run(load_config(generate.Config, None, [*common, f"drafter={tmp_path / 'drafter'}",
                                                            "method=dspark", "chain_length=4", "draft_topk=3"]))
    assert topk["tokens"] == plain["tokens"]  # the Markov bias on 3 candidates: the same greedy text
    engine = serve.build_engine(load_config(serve.Config, None, [
        f"target={chat_target}", f"drafter={tmp_path / 'drafter'}", "method=dspark", "chain_length=3",
        "draft_topk=3", "device=cpu"]))
    assert engine.options == {"chain_length": 3, "draft_topk": 3}
