"""Each drafter variant served by the REAL vLLM 0.32.0 (CPU build, its own venv) gives eaglekit's acceptance.

Per variant (norm_before_fc; EAGLE 3.1 = fc_norm + norm_output), a drafter is trained on the built-in tiny target's
own answers, decoded by eaglekit's `bench methods=chain`, exported for vLLM as `bench engine=vllm` exports it, and
served there on the same prompt ids: vLLM's acceptance per position must equal eaglekit's within 0.01 (T=0, fp32).
A semantic slip (a norm applied to the wrong tensor, the pre-norm state fed back where vLLM feeds the post-norm one)
shows as a different acceptance. The vLLM runs (plain and every variant) share one worker process. Skipped when
vLLM's venv is not built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.vllm import engine as ve
from eaglekit.vllm.bench import PLAIN, export_for_vllm, model_length
from eaglekit.stages import bench
from eaglekit.targets.loading import tiny_target_path
from test_vllm_targets import prompt_ids

pytestmark = pytest.mark.engine

VARIANTS = {  # fc_norm and norm_output run together (EAGLE 3.1): a slip in either changes the acceptance
    "norm_before_fc": {"norm_before_fc": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
NUM_PROMPTS, NEW_TOKENS, CHAIN = 4, 32, 3


def eaglekit_chain(drafter: str, output: Path) -> dict:
    config = load_config(bench.Config, None, [
        f"prompts={engines.EVAL_PROMPTS}", "target=tiny", f"drafter={drafter}", "methods=chain",
        f"chain_length={CHAIN}", "temperatures=0", f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}",
        "repeats=1", "warmup=0", "device=cpu", "backend=static", f"output={output}"])
    return bench.run(config)["rows"][0]


@pytest.fixture(scope="module")
def served(tiny_drafter, tmp_path_factory) -> dict[str, dict]:
    """Per variant: its drafter, eaglekit's chain row, the exported config and vLLM's run; and vLLM's plain run."""
    engine = ve.find_engine(engines.vllm_python())  # skip before any work when vLLM's venv is missing
    root = tmp_path_factory.mktemp("variants_vllm")
    target, prompts = str(tiny_target_path()), prompt_ids()
    args = ve.engine_args(model_length(prompts, NEW_TOKENS, CHAIN), target, engine.device_type)
    found, runs = {}, [{"name": PLAIN, "model": target, "speculative_config": None}]
    for name, flags in VARIANTS.items():
        drafter = tiny_drafter(**flags)
        export = export_for_vllm(drafter, root / name / "export", CHAIN)
        found[name] = {"drafter": drafter, "chain": eaglekit_chain(drafter, root / name / "bench"),
                       "exported": json.loads((export / "config.json").read_text())}
        runs.append({"name": name, "model": target,
                     "speculative_config": ve.speculative_config(export, CHAIN, engine.device_type)})
    job = {"kind": "generate", "runs": [{**run, "prompts": prompts, "max_new_tokens": NEW_TOKENS, "engine_args": args}
                                        for run in runs]}
    for run in ve.run_worker(engine, job, root, "variants")["runs"]:
        found.setdefault(run["name"], {})["run"] = run
    return found


@pytest.mark.parametrize("name", list(VARIANTS))
def test_vllm_acceptance_equals_eaglekit_per_variant(name, served):
    flags, variant = VARIANTS[name], served[name]
    loaded = Eagle3Drafter.from_pretrained(variant["drafter"])
    assert all(getattr(loaded.config, flag) for flag in flags)
    assert all(variant["exported"][flag] is True for flag in flags)  # what vLLM read
    chain, run, plain = variant["chain"], variant["run"], served[PLAIN]["run"]
    assert "error" not in run, run.get("error")
    assert chain["acceptance_per_position"][0] > 0.05, "the drafter learned nothing: the comparison would be empty"
    figures = ve.acceptance(run["counters"])
    assert figures["acceptance_per_position"] == pytest.approx(chain["acceptance_per_position"], abs=0.01)
    assert figures["tau"] == pytest.approx(chain["tau"], abs=0.03)
    assert run["output_ids"] == plain["output_ids"]  # greedy speculative decoding kept vLLM's own greedy output
