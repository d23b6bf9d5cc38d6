"""A drafter records a fingerprint of the weights of the target it was trained on (`target_weights_hash`): used with
another target of the same shape (same architecture, sizes and vocabulary; other weights, as a fine-tune has) it
warns, naming both; with its own target, under any name, it says nothing. Drafters saved without a fingerprint load
and are not compared; exports carry it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from eaglekit.targets.identity import target_weights_hash

OTHER_WEIGHTS = "other weights"


def other_weights(target: str, directory: Path) -> str:
    """`target`'s shape and tokenizer with every weight moved a little (a fine-tune's stand-in)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(target).save_pretrained(directory)
    return str(directory)


def train_for(target: str, output: Path, data: Path, **options) -> str:
    from eaglekit.config.train import TrainConfig
    from eaglekit.training.loop import train

    train(TrainConfig(target=target, data=(str(data),), output=str(output), draft_vocab_size=64, ttt_steps=2,
                      max_steps=2, batch_size=2, max_length=64, warmup_steps=0, val_fraction=0.0, log_every=1000,
                      save_every=100000, device="cpu", dtype="fp32", **options))
    return str(output)


@pytest.fixture(scope="module")
def trained(chat_target, tmp_path_factory) -> tuple[str, Path]:
    """(a drafter trained online on the chat target for two steps, its folder's parent)."""
    root = tmp_path_factory.mktemp("weights")
    chat = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four, the world"}]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": chat}) + "\n" for i in range(8)))
    return train_for(chat_target, root / "drafter", data), root


def load_with(drafter: str, target: str, caplog) -> str:
    """What `decode.setup.load_drafter` logs when `drafter` is used with `target`."""
    from eaglekit.decode.setup import load_drafter
    from eaglekit.targets.loading import load_target

    model = load_target(target, "cpu", torch.float32)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_drafter(drafter, model, torch.device("cpu"), torch.float32, target_name=target)
    return caplog.text


def test_training_records_the_fingerprint_read_the_same_from_the_checkpoint_and_in_any_dtype(trained, chat_target):
    from eaglekit.targets.loading import load_target
    from eaglekit.training.target_weights import load_target_embeddings

    drafter, _ = trained
    recorded = json.loads((Path(drafter) / "config.json").read_text())["target_weights_hash"]
    assert len(recorded) == 16 and recorded == json.loads((Path(drafter) / "manifest.json").read_text())[
        "target_weights_hash"]
    assert target_weights_hash(*load_target_embeddings(chat_target)) == recorded  # offline training reads these
    for dtype in (torch.float32, torch.bfloat16):
        model = load_target(chat_target, "cpu", dtype)
        assert target_weights_hash(model.get_input_embeddings().weight,
                                   model.get_output_embeddings().weight) == recorded
    embedding = model.get_input_embeddings().weight
    assert target_weights_hash(embedding, embedding) != recorded  # the lm_head counts
    assert target_weights_hash(torch.empty(300, 32, device="meta"), embedding) == ""


def test_a_same_shape_target_with_other_weights_warns_with_both_names(trained, chat_target, caplog):
    drafter, root = trained
    other = other_weights(chat_target, root / "finetuned-model")
    text = load_with(drafter, other, caplog)
    assert OTHER_WEIGHTS in text and chat_target in text and other in text, text
    renamed = shutil.copytree(chat_target, root / "same-model-elsewhere")
    assert load_with(drafter, str(renamed), caplog) == ""  # its own weights under another name: nothing said
    assert load_with(drafter, chat_target, caplog) == ""


def test_a_drafter_saved_without_a_fingerprint_loads_and_is_not_compared(trained, chat_target, caplog):
    drafter, root = trained
    old = Path(shutil.copytree(drafter, root / "old-drafter"))
    data = json.loads((old / "config.json").read_text())
    del data["target_weights_hash"]
    (old / "config.json").write_text(json.dumps(data))
    other = other_weights(chat_target, root / "other-for-old")
    assert OTHER_WEIGHTS not in load_with(str(old), other, caplog)


def test_train_init_from_a_drafter_of_other_weights_warns_and_records_the_new_target(trained, chat_target, caplog):
    from eaglekit.training.target_weights import load_target_embeddings

    drafter, root = trained
    other = other_weights(chat_target, root / "init-target")
    with caplog.at_level(logging.WARNING):
        output = train_for(other, root / "continued", root / "data.jsonl", init_from=drafter)
    assert OTHER_WEIGHTS in caplog.text and other in caplog.text
    recorded = json.loads((Path(output) / "config.json").read_text())["target_weights_hash"]
    assert recorded == target_weights_hash(*load_target_embeddings(other))


def test_exports_carry_the_fingerprint(trained):
    from eaglekit.drafters.dflash import formats as dflash_formats
    from eaglekit.drafters.dflash.model import DFlashConfig
    from eaglekit.drafters.eagle3 import convert, formats
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    config = Eagle3Drafter.from_pretrained(trained[0]).config
    for fmt in ("vllm", "sglang", "speculators"):
        data = formats.engine_config(config, fmt, "float32")
        layout = "speculators" if fmt == "speculators" else "vllm"
        assert convert.drafter_config_from(data, layout).target_weights_hash == config.target_weights_hash != ""
    dflash = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=1, vocab_size=300, draft_vocab_size=64, target_hidden_size=32,
                          target_layer_ids=(1, 2), mask_token_id=5, target_weights_hash="0123456789abcdef")
    for fmt in ("vllm", "speculators"):
        data = dflash_formats.engine_config(dflash, fmt, "float32")
        assert dflash_formats.config_from(data, Path("x")).target_weights_hash == "0123456789abcdef"
