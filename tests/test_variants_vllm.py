"""Each drafter variant served by the REAL vLLM 0.32.0 (CPU build, its own venv) gives eaglekit's acceptance.

Per variant (norm_before_fc; EAGLE 3.1 = fc_norm + norm_output), a drafter is trained on the
built-in tiny target's own answers, then `eaglekit bench ... engine=vllm` (offline only) exports it for vLLM,
serves it there, and decodes the same prompt ids with eaglekit's chain: vLLM's acceptance per position must equal
eaglekit's within 0.01 (T=0, fp32). A semantic slip (a norm applied to the wrong tensor, the pre-norm state fed back
where vLLM feeds the post-norm one) shows as a different acceptance. Skipped when vLLM's venv is not built.
"""

from __future__ import annotations

import json

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.draft.model import Eagle3Drafter
from eaglekit.stages import bench

pytestmark = pytest.mark.engine

VARIANTS = {  # fc_norm and norm_output run together (EAGLE 3.1): a slip in either changes the acceptance
    "norm_before_fc": {"norm_before_fc": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
NUM_PROMPTS, NEW_TOKENS, CHAIN = 4, 32, 3


def shared_answers(tmp_path_factory) -> str:
    """The tiny target's own answers, generated once per test session (test_variants_speculators.py reads them too)."""
    from eaglekit.stages import regen

    directory = tmp_path_factory.getbasetemp() / "variants_regen"
    if (directory / "manifest.json").is_file():
        return str(directory / regen.OUTPUT_FILE)
    return engines.own_answers("tiny", directory, records=32, new_tokens=40)


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> str:
    engines.vllm_python()  # skip before any work when vLLM's venv is missing
    return shared_answers(tmp_path_factory)


def train_variant(answers: str, output, flags: dict) -> str:
    from eaglekit.draft.train import train
    from eaglekit.train_config import TrainConfig

    config = TrainConfig(target="tiny", data=(answers,), output=str(output), draft_vocab_size=1024, ttt_steps=3,
                         max_steps=30, batch_size=4, max_length=192, lr=2e-3, warmup_steps=2, val_fraction=0.0,
                         log_every=1000, save_every=100000, device="cpu", dtype="fp32", **flags)
    train(config)
    return str(output)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_vllm_acceptance_equals_eaglekit_per_variant(name, answers, tmp_path):
    flags = VARIANTS[name]
    drafter = train_variant(answers, tmp_path / "drafter", flags)
    loaded = Eagle3Drafter.from_pretrained(drafter)
    assert all(getattr(loaded.config, flag) for flag in flags)
    output = tmp_path / "bench"
    config = load_config(bench.Config, None, [
        f"prompts={engines.EVAL_PROMPTS}", "target=tiny", f"drafter={drafter}", "methods=chain",
        f"chain_length={CHAIN}", "temperatures=0", f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}",
        "repeats=1", "warmup=0", "device=cpu", "backend=static", f"output={output}", "engine=vllm",
        f"vllm_python={engines.vllm_python()}", "concurrency="])
    bench.run(config)
    rows = {r["method"]: r for r in json.loads((output / "bench.json").read_text())["rows"]}
    exported = json.loads((output / "vllm" / "drafter" / "config.json").read_text())
    assert all(exported[flag] is True for flag in flags)  # what vLLM read
    chain, served = rows["chain"], rows["vllm_eagle3"]
    assert "error" not in served, served.get("error")
    assert chain["acceptance_per_position"][0] > 0.05, "the drafter learned nothing: the comparison would be empty"
    assert served["acceptance_per_position"] == pytest.approx(chain["acceptance_per_position"], abs=0.01)
    assert served["tau"] == pytest.approx(chain["tau"], abs=0.03)
    assert served["outputs_equal_plain"] == 1.0  # greedy speculative decoding kept vLLM's own greedy output
