"""P-EAGLE through the stages: `eaglekit train drafter_type=p-eagle` from an EAGLE-3 drafter (online and offline give
the same losses, a killed run resumes exactly, the type is kept or refused with the fix named), and export/import in
vLLM's and speculators' layouts (`mask_hidden`, the parallel-drafting token) with a published-style checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from builders import killed_and_resumed, random_drafter, tiny_target
from eaglekit.config import load_config
from eaglekit.formats.saved import load_saved_drafter
from eaglekit.drafters.p_eagle.train import to_parallel
from eaglekit.errors import EaglekitError
from eaglekit.drafters.eagle3.convert import export_drafter, import_checkpoint
from eaglekit.stages import train as stage
from test_train import data_file, metrics, options  # noqa: F401 (data_file: the fixture)


@pytest.fixture(scope="module")
def eagle3(chat_target, data_file, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eagle3") / "run"
    stage.run(options(chat_target, data_file, out, max_steps=2))
    return out


def test_p_eagle_from_an_eagle3_drafter_resumes_exactly(chat_target, data_file, eagle3, tmp_path):  # noqa: F811
    common = {"drafter_type": "p-eagle", "init_from": str(eagle3), "ttt_steps": 4, "save_every": 2, "batch_size": 2,
              "log_every": 1, "max_steps": 4}
    a, b = killed_and_resumed(lambda out, **more: options(chat_target, data_file, out, **common, **more), tmp_path)
    drafter = load_saved_drafter(tmp_path / "a")
    start = load_saved_drafter(eagle3)
    assert drafter.config.drafter_type == "p-eagle" and drafter.config.mask_token_id == drafter.config.vocab_size - 1
    assert drafter.mask_hidden.shape == (1, 3 * drafter.config.target_hidden_size)
    assert not torch.equal(drafter.fc.weight, start.fc.weight)  # trained on
    val = [m for m in metrics(tmp_path / "a") if m["split"] == "val"][-1]
    assert len(val["acc_k"]) == 4
    assert a.keys() == b.keys() and "mask_hidden" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # fine-tuning keeps the type: a p-eagle drafter trained as eagle3 would lose its mask_hidden
    with pytest.raises(EaglekitError, match="pass drafter_type=p-eagle"):
        stage.run(options(chat_target, data_file, tmp_path / "c", init_from=str(tmp_path / "a"), max_steps=1))


def test_p_eagle_offline_equals_online(chat_target, data_file, eagle3, tmp_path):  # noqa: F811
    from eaglekit.stages import extract

    store = tmp_path / "store"
    extract.run(load_config(extract.Config, overrides={"data": [str(data_file)], "output": str(store),
                                                         "target": chat_target, "dtype": "fp32", "max_length": 256}))
    common = {"drafter_type": "p-eagle", "init_from": str(eagle3), "max_steps": 2}
    stage.run(options(chat_target, data_file, tmp_path / "on", **common))
    stage.run(options(chat_target, data_file, tmp_path / "off", data=[], shards=str(store), **common))
    online, offline = metrics(tmp_path / "on"), metrics(tmp_path / "off")
    assert [m["split"] for m in offline] == [m["split"] for m in online]
    for a, b in zip(online, offline):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["acc_k"] == pytest.approx(b["acc_k"])


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_and_import_keep_the_parallel_drafting(fmt, tmp_path) -> None:
    target = tiny_target("llama")
    drafter = to_parallel(random_drafter(target), 7, 0)
    summary = export_drafter(drafter, tmp_path, fmt)
    assert "mask_hidden" in summary["tensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    if fmt == "vllm":
        assert config["ptd_token_id"] == 7 and config["parallel_drafting"] is True
        assert tuple(load_file(str(tmp_path / "model.safetensors"))["mask_hidden"].shape) == (1, 96)
    else:
        assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 7
        assert tuple(load_file(str(tmp_path / "model.safetensors"))["mask_hidden"].shape) == (1, 1, 96)
    back = import_checkpoint(tmp_path)
    assert back.config.drafter_type == "p-eagle" and back.config.mask_token_id == 7
    torch.testing.assert_close(back.mask_hidden, drafter.mask_hidden)
    with pytest.raises(EaglekitError, match="SGLang has no parallel drafting"):
        export_drafter(drafter, tmp_path / "sglang", "sglang")


def test_published_checkpoint_imports_and_a_missing_token_is_refused(tmp_path) -> None:
    """A P-EAGLE checkpoint as published for vLLM: an EAGLE-3 export plus mask_hidden and `pard_token`."""
    target = tiny_target("llama")
    export_drafter(random_drafter(target), tmp_path, "vllm")
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({**state, "mask_hidden": torch.randn(1, 96)}, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EaglekitError, match="names no parallel-drafting token"):
        import_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "pard_token": 5}))
    drafter = import_checkpoint(tmp_path)
    assert drafter.config.drafter_type == "p-eagle" and drafter.config.mask_token_id == 5


def test_run_benches_the_trained_types_methods(chat_target, run_prompts, tmp_path) -> None:
    from eaglekit.stages.run import plan
    from test_run import tiny_run

    def bench_methods(**extra) -> tuple[str, ...]:
        steps = {s.name: s for s in plan(tiny_run(chat_target, run_prompts, tmp_path, **extra))}
        return steps["bench"].make_config().methods

    assert bench_methods(train__drafter_type="p-eagle", bench__methods=["plain", "parallel"]) == ("plain", "parallel")
    config = tiny_run(chat_target, run_prompts, tmp_path, train__drafter_type="p-eagle")
    default = {s.name: s for s in plan(dataclasses.replace(config, bench=type(config.bench)()))}
    assert default["bench"].make_config().methods == ("plain", "parallel", "chain", "tree")


def test_doctor_reads_the_served_drafter_types_from_the_engine_source(tmp_path) -> None:
    from eaglekit.doctor.drafter_support import drafter_type_support
    from eaglekit.doctor.source import DirectorySource

    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "llama_eagle3.py").write_text("class Eagle3LlamaForCausalLM:\n    pass\n")  # a release before P-EAGLE
    source = DirectorySource("vllm", tmp_path)
    assert drafter_type_support(source, "vllm", "eagle3")["served"]
    before = drafter_type_support(source, "vllm", "p-eagle")
    assert not before["served"] and "lacks" in before["evidence"]
    (models / "llama_eagle3.py").write_text('class Eagle3LlamaForCausalLM:\n    buffer = "mask_hidden"\n')
    assert drafter_type_support(source, "vllm", "p-eagle")["served"]
    assert not drafter_type_support(source, "sglang", "p-eagle")["served"]


SPECULATORS_LOADER = """
import sys
from speculators.models.peagle import PEagleDraftModel
model = PEagleDraftModel.from_pretrained(sys.argv[1])
print(tuple(model.mask_hidden.shape), model.mask_token_id, model.mask_hidden.detach().flatten()[:3].tolist())
"""


@pytest.mark.engine
def test_speculators_loads_the_peagle_export(tmp_path) -> None:
    import subprocess

    import engines
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_interop_formats import make_drafter

    verifier = tmp_path / "verifier"  # speculators reads the verifier's config at from_pretrained
    LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(verifier)
    drafter = to_parallel(make_drafter(target_name_or_path=str(verifier)), 7, 0)
    export_drafter(drafter, tmp_path / "spec", "speculators")
    done = subprocess.run([engines.speculators_python(), "-c", SPECULATORS_LOADER, str(tmp_path / "spec")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = drafter.mask_hidden.detach().flatten()[:3].tolist()
    assert done.stdout.strip().splitlines()[-1] == f"(1, 1, 96) 7 {expected}"


def test_run_exports_the_layouts_that_serve_p_eagle_and_says_how(chat_target, run_prompts, tmp_path) -> None:
    from eaglekit.report import launch_commands
    from eaglekit.stages.run import plan
    from test_run import tiny_run

    config = tiny_run(chat_target, run_prompts, tmp_path, train__drafter_type="p-eagle")
    steps = [s.name for s in plan(config)]
    assert "export-vllm" in steps and "export-speculators" in steps and "export-sglang" not in steps
    with pytest.raises(EaglekitError, match="sglang, which serves no p-eagle drafter"):
        plan(tiny_run(chat_target, run_prompts, tmp_path, train__drafter_type="p-eagle",
                      export_formats=["vllm", "sglang"]))
    drafter = to_parallel(random_drafter(tiny_target("llama")), 7, 0)
    export_drafter(drafter, tmp_path / "vllm", "vllm")
    (command,) = launch_commands("MODEL", str(tmp_path / "vllm"), "vllm")
    assert '"parallel_drafting": true' in command
