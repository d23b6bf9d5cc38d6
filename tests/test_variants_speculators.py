"""A norm_before_fc drafter written by the REAL `speculators` 0.9.0 (its own config classes and save code, in its
own venv), imported by eaglekit and decoded equal to vLLM 0.32.0 serving speculators' checkpoint itself.

The weights come from a drafter eaglekit trains on the tiny target (so acceptance is far from zero and the
comparison says something); speculators builds its `Eagle3DraftModel` with `norm_before_fc=True`, loads them and
`save_pretrained`s the checkpoint. eaglekit's import must keep every number and the flag; its chain decoding and
vLLM's (T=0, fp32, same prompt ids) must give the same acceptance per position within 0.01. Skipped unless both
engine venvs are built (`make vllm-env speculators-env`).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

import engines
from eaglekit.config import load_config
from eaglekit.stages import bench

pytestmark = pytest.mark.engine

NUM_PROMPTS, NEW_TOKENS, CHAIN = 4, 32, 3

BUILD = r'''
import json, os, sys
from safetensors.torch import load_file
from transformers import LlamaConfig
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

spec = json.loads(open(sys.argv[1]).read())
layer = LlamaConfig(**spec["layer"], num_hidden_layers=1, tie_word_embeddings=False)
config = Eagle3SpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=spec["draft_vocab_size"], norm_before_residual=False,
    eagle_aux_hidden_state_layer_ids=spec["aux_layer_ids"], norm_before_fc=True,
    speculators_config=SpeculatorsConfig(
        algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=spec["tokens"])],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=spec["verifier"], architectures=["LlamaForCausalLM"])))
model = Eagle3DraftModel(config)
missing, unexpected = model.load_state_dict(load_file(spec["weights"]), strict=False)
model.save_pretrained(spec["output"])
print(json.dumps({"missing": sorted(missing), "unexpected": sorted(unexpected),
                  "files": sorted(os.listdir(spec["output"]))}))
'''


def speculators_checkpoint(trained: str, workdir) -> tuple[str, dict]:
    """speculators' own checkpoint of the trained drafter's weights -> (directory, what the build printed)."""
    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.drafters.eagle3.convert import export_drafter
    from eaglekit.targets.loading import tiny_target_path

    drafter = Eagle3Drafter.from_pretrained(trained)
    weights = workdir / "weights"
    export_drafter(drafter, weights, "speculators", dtype=torch.float32)  # speculators' tensor names
    c = drafter.config
    spec = {"layer": {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                      "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                      "head_dim": c.resolved_head_dim, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
                      "max_position_embeddings": c.max_position_embeddings, "hidden_act": c.hidden_act,
                      "rope_theta": c.rope_parameters["rope_theta"]},
            "draft_vocab_size": c.draft_vocab_size, "aux_layer_ids": list(c.aux_layer_ids), "tokens": CHAIN,
            "verifier": str(tiny_target_path()), "weights": str(weights / "model.safetensors"),
            "output": str(workdir / "speculators")}
    (workdir / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run([engines.speculators_python(), "-c", BUILD, str(workdir / "spec.json")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return spec["output"], json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(tiny_drafter) -> str:
    engines.vllm_python(), engines.speculators_python()  # skip before any work when a venv is missing
    return tiny_drafter(norm_before_fc=True)  # the drafter tests/test_variants_vllm.py serves


def test_speculators_norm_before_fc_checkpoint_imports_and_decodes_as_vllm(trained, tmp_path):
    from eaglekit.data import prompt_messages, read_conversations
    from eaglekit.decode.setup import prompt_ids
    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.vllm import bench as vllm_bench
    from eaglekit.vllm import engine as ve
    from eaglekit.drafters.eagle3.convert import import_checkpoint
    from eaglekit.targets.loading import load_tokenizer, tiny_target_path

    checkpoint, built = speculators_checkpoint(trained, tmp_path)
    assert built["unexpected"] == [] and set(built["missing"]) <= {"verifier_norm.weight", "verifier_lm_head.weight"}
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3" and written["norm_before_fc"] is True
    imported = import_checkpoint(checkpoint)
    source = Eagle3Drafter.from_pretrained(trained)
    assert imported.config.norm_before_fc and not imported.config.fc_norm
    for key, tensor in source.state_dict().items():  # the same numbers, the vocabulary mapping included
        if key != "embed_tokens.weight" or key in imported.state_dict():
            assert torch.equal(imported.state_dict()[key], tensor), key
    imported.save_pretrained(tmp_path / "imported")
    output = tmp_path / "bench"
    bench.run(load_config(bench.Config, None, [
        f"prompts={engines.EVAL_PROMPTS}", "target=tiny", f"drafter={tmp_path / 'imported'}", "methods=chain",
        f"chain_length={CHAIN}", "temperatures=0", f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}",
        "repeats=1", "warmup=0", "device=cpu", f"output={output}"]))
    chain = next(r for r in json.loads((output / "bench.json").read_text())["rows"] if r["method"] == "chain")
    tokenizer = load_tokenizer("tiny")
    conversations = read_conversations(str(engines.EVAL_PROMPTS))[:NUM_PROMPTS]
    prompts = [prompt_ids(tokenizer, prompt_messages(c)) for c in conversations]  # bench's prompt ids
    engine = ve.find_engine(engines.vllm_python())
    target = str(tiny_target_path())
    runs = vllm_bench.offline(engine, target, checkpoint, prompts, NEW_TOKENS, CHAIN, tmp_path / "vllm")
    served = ve.acceptance(runs[vllm_bench.EAGLE3]["counters"])
    assert chain["acceptance_per_position"][0] > 0.05, "the drafter learned nothing: the comparison would be empty"
    assert served["acceptance_per_position"] == pytest.approx(chain["acceptance_per_position"], abs=0.01)
    assert runs[vllm_bench.EAGLE3]["output_ids"] == runs[vllm_bench.PLAIN]["output_ids"]
