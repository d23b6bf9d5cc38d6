"""eaglekit's DSpark exports in the real readers that run on this CPU (vLLM's CPU build cannot serve DSpark: its V1
runner refuses it and the V2 runner needs a CPU Triton).

- speculators 0.9 (its venv): `DSparkDraftModel.from_pretrained` loads the speculators export with every tensor used
  as written, and its own forward gives the same Markov-corrected logits and confidence logits as eaglekit on the same
  target states, anchors and tokens (every Markov head, both layouts).
- vLLM 0.32 (its venv): `Qwen3DSparkForCausalLM` built by vLLM's config machinery from the vLLM export, its weights
  loaded by vLLM's loader, gives eaglekit's block hidden states, greedy Markov drafts and confidences
  (`tests/fixtures/dspark/vllm_read.py` says what stands in for the model runner); a gated head in vLLM's layout is
  refused by vLLM's loader itself, which is why eaglekit's export refuses it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engines
from eaglekit.drafters.dflash.train import block_attention_mask, block_input_ids, block_positions
from eaglekit.drafters.dflash.formats import checkpoint_state
from eaglekit.drafters.dspark.formats import engine_config, export_dspark
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.dspark.train import block_tokens
from eaglekit.targets.loading import load_target, tiny_target_path

pytestmark = pytest.mark.engine
SCRIPTS = Path(__file__).resolve().parent / "fixtures" / "dspark"


def random_dspark(block_size: int = 4, seed: int = 0, **heads) -> DSparkDrafter:
    """A DSpark drafter shaped for the built-in tiny target (random weights, a draft vocabulary of 512 of 4096)."""
    target = load_target("tiny", "cpu", torch.float32)
    c = target.config
    torch.manual_seed(seed)
    drafter = DSparkDrafter(DSparkConfig(
        hidden_size=c.hidden_size, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=2, vocab_size=c.vocab_size, draft_vocab_size=512, target_hidden_size=c.hidden_size,
        target_layer_ids=(1, 4), mask_token_id=c.vocab_size - 1, block_size=block_size,
        target_num_layers=c.num_hidden_layers, target_name_or_path="tiny", target_architecture="LlamaForCausalLM",
        rope_parameters=dict(c.rope_parameters), **{"markov_rank": 8, **heads}))
    for name, parameter in drafter.named_parameters():
        if name != "embed_tokens.weight":
            torch.nn.init.normal_(parameter, std=0.1)
    drafter.set_vocab_mapping(torch.arange(512) * 8)
    drafter.load_target_embedding(target.get_input_embeddings().weight.detach())
    return drafter.eval()


def eaglekit_blocks(drafter: DSparkDrafter, aux: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor):
    """The teacher-forced logits (N, K, Vd) and raw confidence logits (N, K) of the blocks at `anchors`."""
    t, size, k = ids.shape[1], drafter.config.block_size, drafter.config.max_drafts
    with torch.no_grad():
        context = drafter.context(aux, torch.arange(t)[None])
        hidden = drafter.hidden_states(block_input_ids(ids, anchors, size, drafter.config.mask_token_id),
                                       block_positions(anchors, size), context, block_attention_mask(anchors, t, size))
        hidden = hidden.view(1, anchors.shape[1], size, -1)[:, :, drafter.config.first_slot :]
        logits, e = drafter.markov_logits(hidden, block_tokens(ids, anchors, size, k, 0))
        return logits[0], drafter.confidence_logits(hidden, e)[0]


@pytest.mark.parametrize("heads", [{"markov_head_type": "vanilla"}, {"markov_head_type": "gated"},
                                   {"markov_head_type": "rnn"}, {"sample_from_anchor": False}])
def test_speculators_reads_the_export_as_eaglekit_computes_it(heads, tmp_path):
    python = engines.speculators_python()
    drafter = random_dspark(**heads)
    export_dspark(drafter, tmp_path / "spec", "speculators", dtype=torch.float32)
    torch.manual_seed(5)
    inputs = {"hidden_states": torch.randn(1, 20, 2 * drafter.config.target_hidden_size),
              "input_ids": torch.randint(0, 4000, (1, 20)), "anchors": torch.tensor([6, 11])}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    done = subprocess.run([python, str(SCRIPTS / "speculators_read.py"), str(tmp_path / "spec"),
                           str(tmp_path / "inputs.safetensors"), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["unused"] == [] and report["differ"] == []  # every tensor taken as written
    assert report["markov_head_type"] == drafter.config.markov_head_type
    assert report["sample_from_anchor"] == drafter.config.sample_from_anchor
    theirs = load_file(str(tmp_path / "out.safetensors"))
    logits, confidence = eaglekit_blocks(drafter, inputs["hidden_states"], inputs["input_ids"], inputs["anchors"][None])
    blocks, size, first = 2, drafter.config.block_size, drafter.config.first_slot  # theirs: every slot of a block
    torch.testing.assert_close(theirs["logits"].reshape(blocks, size, -1)[:, first:], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(theirs["confidence"].reshape(blocks, size)[:, first:], confidence, atol=1e-5, rtol=1e-5)


def test_vllm_loads_the_export_and_drafts_as_eaglekit(tmp_path):
    from eaglekit.config.decode import DecodeOptions
    from eaglekit.drafters.dspark.decode import DSparkDrafterBackend, markov_chain

    python = engines.vllm_python()
    anchor_first, fill_in = random_dspark(), random_dspark(seed=1, sample_from_anchor=False)
    export_dspark(anchor_first, tmp_path / "first", "vllm", dtype=torch.float32)
    export_dspark(fill_in, tmp_path / "fill", "vllm", dtype=torch.float32)
    gated = random_dspark(seed=2, markov_head_type="gated")
    (tmp_path / "gated").mkdir()  # what export refuses, written as vLLM's layout would hold it
    save_file(checkpoint_state(gated, "vllm", torch.float32), str(tmp_path / "gated" / "model.safetensors"))
    (tmp_path / "gated" / "config.json").write_text(json.dumps(engine_config(gated.config, "vllm", "float32")))
    torch.manual_seed(3)
    aux = torch.randn(9, 2 * anchor_first.config.target_hidden_size)
    save_file({"aux": aux, "anchor": torch.tensor(17), "drafts": torch.tensor(3)}, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "out").mkdir()
    done = subprocess.run([python, str(SCRIPTS / "vllm_read.py"), str(tiny_target_path()),
                           str(tmp_path / "inputs.safetensors"), str(tmp_path / "out"), str(tmp_path / "first"),
                           str(tmp_path / "fill"), str(tmp_path / "gated")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"draft"')]  # vLLM logs to stdout too
    found = {Path(r["draft"]).name: r for r in map(json.loads, lines)}
    assert "markov_head.gate_proj" in found["gated"]["error"] or "gate_up_proj" in found["gated"]["error"]
    for name, drafter in (("first", anchor_first), ("fill", fill_in)):
        report = found[name]
        assert "error" not in report, report
        assert report["sample_from_anchor"] == drafter.config.sample_from_anchor
        assert (report["block_size"], report["markov_rank"]) == (drafter.config.block_size, 8)
        backend = DSparkDrafterBackend(drafter)
        with torch.no_grad():
            backend.extend(aux, torch.zeros(9, dtype=torch.long), torch.arange(9))
            hidden = backend.block_hidden(torch.tensor(17), 9, 3)
            drafts, _, confidence = markov_chain(drafter, hidden, torch.tensor(17), DecodeOptions(method="dspark"),
                                                 drafter.config.vocab_size, None)
        theirs = load_file(str(tmp_path / "out" / f"{name}.safetensors"))
        torch.testing.assert_close(theirs["hidden"], hidden, atol=1e-5, rtol=1e-5)
        assert report["drafts"] == drafts.tolist()
        torch.testing.assert_close(theirs["confidence"], torch.sigmoid(confidence), atol=1e-5, rtol=1e-5)
