"""`eaglekit train drafter_type=dflash` on a tiny random chat target: a loadable DFlash drafter online, the same
loss offline from an extract store of its layers (and the extract command named when the store holds others),
exact resume, init_from, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from builders import killed_and_resumed, write_random_chats

from eaglekit.config import load_config
from eaglekit.formats.saved import load_saved_drafter
from eaglekit.drafters.dflash.model import DFlashDrafter
from eaglekit.errors import EaglekitError
from eaglekit.stages import train as stage

@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_random_chats(tmp_path_factory.mktemp("dflash_data") / "chat.jsonl", 12, (6, 12))


def options(chat_target, data_file, out, **extra):
    base = {"drafter_type": "dflash", "target": chat_target, "data": [str(data_file)], "output": str(out),
            "batch_size": 4, "epochs": 1, "block_size": 4, "draft_layers": 2, "num_anchors": 8,
            "draft_vocab_size": 64, "val_fraction": 0.2, "lr": 1e-3, "warmup_steps": 1, "step_decay": 0.9}
    return load_config(stage.Config, overrides={**base, **extra})


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_online_training_writes_a_loadable_dflash_drafter(chat_target, data_file, tmp_path):
    out = tmp_path / "run"
    result = stage.run(options(chat_target, data_file, out))
    assert result["steps"] == 2
    drafter = load_saved_drafter(out)
    assert isinstance(drafter, DFlashDrafter)
    config = drafter.config
    assert config.block_size == 4 and config.num_hidden_layers == 2 and len(drafter.layers) == 2
    assert config.target_layer_ids == (1,)  # a 4-layer target: layers 1 .. L-3 = 1 (output-of-layer)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [2]  # what the store must hold: input-of-layer id = output id + 1
    val = [m for m in metrics(out) if m["split"] == "val"][-1]
    assert len(val["acc_k"]) == 3  # block_size - 1 drafted positions
    from eaglekit.targets.loading import load_target

    target = load_target(chat_target)
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    assert 0 <= config.mask_token_id < config.vocab_size


def test_killed_and_resumed_dflash_run_matches_an_uninterrupted_one(chat_target, data_file, tmp_path):
    common = {"epochs": 2, "save_every": 2, "batch_size": 2, "log_every": 1}
    a, b = killed_and_resumed(lambda out, **more: options(chat_target, data_file, out, **common, **more), tmp_path)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_offline_from_a_store_of_its_layers_equals_online(chat_target, data_file, tmp_path):
    from eaglekit.stages import extract

    def store(name: str, ids: str):
        path = tmp_path / name
        extract.run(load_config(extract.Config, overrides={"data": [str(data_file)], "output": str(path),
                                                             "target": chat_target, "dtype": "fp32",
                                                             "aux_layer_ids": ids, "max_length": 256}))
        return str(path)

    good = store("store", "2,3")  # input-of-layer: the outputs of layers 1 and 2
    stage.run(options(chat_target, data_file, tmp_path / "on", max_steps=2, target_layer_ids="1,2"))
    stage.run(options(chat_target, data_file, tmp_path / "off", max_steps=2, data=[], shards=good))
    online, offline = metrics(tmp_path / "on"), metrics(tmp_path / "off")
    assert [m["split"] for m in offline] == [m["split"] for m in online]
    for a, b in zip(online, offline):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["acc_k"] == pytest.approx(b["acc_k"])
    assert load_saved_drafter(tmp_path / "off").config.target_layer_ids == (1, 2)  # the store's layers
    with pytest.raises(EaglekitError, match=r"aux_layer_ids=2,4"):  # other layers: the extract that fixes it
        stage.run(options(chat_target, data_file, tmp_path / "bad", data=[], shards=good, target_layer_ids="1,3"))
    # fine-tuning: init_from the offline drafter, its layers and vocabulary kept
    stage.run(options(chat_target, data_file, tmp_path / "tuned", max_steps=1, init_from=str(tmp_path / "off"),
                      data=[], shards=good))
    assert load_saved_drafter(tmp_path / "tuned").config.target_layer_ids == (1, 2)
    # ... or from vLLM's layout without lm_head (a published checkpoint): the target's lm_head fills it
    from eaglekit.drafters.dflash.formats import export_dflash

    export_dflash(load_saved_drafter(tmp_path / "off"), tmp_path / "vllm", "vllm")
    state = load_file(str(tmp_path / "vllm/model.safetensors"))
    state.pop("lm_head.weight")
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "vllm/model.safetensors"))
    stage.run(options(chat_target, data_file, tmp_path / "tuned2", max_steps=1, init_from=str(tmp_path / "vllm"),
                      data=[], shards=good))
    assert bool(load_saved_drafter(tmp_path / "tuned2").lm_head.weight.any())


def test_bad_dflash_options_are_refused(chat_target, data_file, tmp_path):
    with pytest.raises(EaglekitError, match="block_size=1"):
        stage.run(options(chat_target, data_file, tmp_path / "a", block_size=1))
    with pytest.raises(EaglekitError, match="target_layer_ids=\\[7\\]"):
        stage.run(options(chat_target, data_file, tmp_path / "b", target_layer_ids="7"))
    with pytest.raises(EaglekitError, match="mask_token_id=99999"):
        stage.run(options(chat_target, data_file, tmp_path / "c", mask_token_id=99999))
    # a drafter of the other type as init_from: refused both ways, naming the type to pass
    stage.run(options(chat_target, data_file, tmp_path / "eagle3", drafter_type="eagle3", max_steps=1, ttt_steps=2))
    stage.run(options(chat_target, data_file, tmp_path / "dflash", max_steps=1))
    with pytest.raises(EaglekitError, match="is a eagle3 drafter"):
        stage.run(options(chat_target, data_file, tmp_path / "d", init_from=str(tmp_path / "eagle3")))
    with pytest.raises(EaglekitError, match="is a dflash drafter: pass drafter_type=dflash"):
        stage.run(options(chat_target, data_file, tmp_path / "e", drafter_type="p-eagle",
                          init_from=str(tmp_path / "dflash")))
