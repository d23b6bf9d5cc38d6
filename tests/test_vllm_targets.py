"""Real vLLM serves an eaglekit drafter for a Qwen3 target, and refuses Moonshot's KimiVL wrapper around a
DeepSeek-V3 (MLA + MoE) language model until `eaglekit doctor --fix`'s plugin is installed; then it serves the
wrapper with an eaglekit MLA drafter.

(KimiK25ForConditionalGeneration is left out: a tiny checkpoint gets through its config and image processor, then
vLLM 0.32.0's CPU worker fails in register_triton_kernel_overrides: "'_lib_fn_wrapper' object has no attribute
'get'". The DeepSeek-V3 target is the Kimi-K2.5-shaped one here.)

Each target is small and random (mostly bigram: large embeddings, a sharp lm_head), with a drafter trained for 20
steps on its hidden states over its own greedy answers (regen, then train, as the pipeline does); vLLM's
acceptance per position (its spec-decode counters) must equal eaglekit's `bench methods=chain` on the same
prompt ids within 0.01 (T=0, fp32). The vLLM runs of a test share one worker process.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import engines
from eaglekit.config import load_config
from eaglekit.vllm import engine as ve
from eaglekit.vllm.bench import export_for_vllm, model_length
from eaglekit.stages import bench, doctor

pytestmark = pytest.mark.engine

NUM_PROMPTS, NEW_TOKENS, DRAFTS = 4, 32, 3


@dataclass
class Served:
    target: str
    drafter: str  # eaglekit layout
    export: str  # vLLM layout
    bench_row: dict  # eaglekit's bench, chain of DRAFTS


def prompt_ids() -> list[list[int]]:
    """The prompt ids eaglekit's bench uses (the target's chat template): every target here has the tiny tokenizer."""
    from eaglekit.data import prompt_messages, read_conversations
    from eaglekit.decode.setup import prompt_ids as encode
    from eaglekit.targets.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    return [encode(tokenizer, prompt_messages(c)) for c in read_conversations(str(engines.EVAL_PROMPTS))[:NUM_PROMPTS]]


def eaglekit_chain(target: str, drafter: str, output: Path) -> dict:
    config = load_config(bench.Config, None, [f"prompts={engines.EVAL_PROMPTS}", f"target={target}",
                                              f"drafter={drafter}",
                                              "methods=chain", f"chain_length={DRAFTS}", "temperatures=0",
                                              f"num_prompts={NUM_PROMPTS}", f"max_new_tokens={NEW_TOKENS}", "repeats=1",
                                              "warmup=0", "device=cpu", f"output={output}"])
    return bench.run(config)["rows"][0]


def prepare(kind: str, root: Path) -> Served:
    target = engines.random_target(kind, root / kind)
    answers = engines.own_answers(target, root / f"{kind}-regen")
    arch = "mla" if kind == "deepseek_v3" else "llama"  # the CPU build pairs an MLA target with an MLA drafter only
    drafter = engines.train_drafter(target, root / f"{kind}-drafter", steps=20, lr=2e-3, data=answers,
                                    draft_vocab_size=4096, drafter_arch=arch)
    export = export_for_vllm(drafter, root / f"{kind}-drafter-vllm", DRAFTS)
    return Served(target, drafter, str(export), eaglekit_chain(target, drafter, root / f"{kind}-bench"))


@pytest.fixture(scope="module")
def engine() -> ve.Engine:
    return ve.find_engine(engines.vllm_python())


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory) -> dict[str, Served]:
    root = tmp_path_factory.mktemp("vllm_targets")
    found = {kind: prepare(kind, root) for kind in ("qwen3", "deepseek_v3")}
    deepseek = found["deepseek_v3"]  # the wrapper holds its weights: eaglekit's bench on it is the wrapper's
    for name, indexed in (("kimi_vl", False), ("kimi_vl_indexed", True)):
        wrapper = engines.kimi_vl_wrapper(Path(deepseek.target), root / name, image_token_index=indexed)
        found[name] = Served(wrapper, deepseek.drafter, deepseek.export, deepseek.bench_row)
    return found


def job_run(name: str, item: Served, engine: ve.Engine, prompts: list[list[int]]) -> dict:
    args = ve.engine_args(model_length(prompts, NEW_TOKENS, DRAFTS), item.target, engine.device_type)
    return {"name": name, "model": item.target, "speculative_config": ve.speculative_config(item.export, DRAFTS),
            "prompts": prompts, "max_new_tokens": NEW_TOKENS, "engine_args": args, "warmup": False}


def assert_equal_acceptance(run: dict, row: dict) -> None:
    assert "error" not in run, run.get("error")
    figures = ve.acceptance(run["counters"])
    assert figures["acceptance_per_position"][0] > 0, "the drafter learned nothing: the comparison would be empty"
    assert figures["acceptance_per_position"] == pytest.approx(row["acceptance_per_position"], abs=0.01)
    assert figures["tau"] == pytest.approx(row["tau"], abs=0.03)


def test_vllm_acceptance_equals_eaglekit_and_the_wrapper_is_refused(engine, served, tmp_path):
    prompts = prompt_ids()
    # (the DeepSeek-V3 target itself with its MLA drafter: tests/test_mla_vllm.py)
    runs = [job_run(name, served[name], engine, prompts) for name in ("qwen3", "kimi_vl_indexed", "kimi_vl")]
    result = ve.run_worker(engine, {"kind": "generate", "runs": runs}, tmp_path, "targets")
    by_name = {r["name"]: r for r in result["runs"]}
    assert_equal_acceptance(by_name["qwen3"], served["qwen3"].bench_row)
    refused = by_name["kimi_vl_indexed"].get("error", "")
    assert "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested" in refused, refused
    # Kimi-VL's own config (no image_token_index): vLLM 0.32 fails even earlier, in its EAGLE proposer
    assert "no attribute 'image_token_index'" in by_name["kimi_vl"].get("error", ""), by_name["kimi_vl"]


def vllm_package_dir(engine: ve.Engine) -> str:
    done = subprocess.run([engine.python, "-c", "import importlib.util, os; "
                           "print(os.path.dirname(importlib.util.find_spec('vllm').origin))"],
                          capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


def test_doctor_fix_plugin_makes_vllm_serve_the_wrapper(engine, served, tmp_path):
    """Refused -> `doctor --fix` -> pip-installed (into a throwaway --target dir on the worker's path: the real
    vllm.general_plugins entry point, vLLM's venv untouched) -> served, acceptance equal to eaglekit's bench."""
    source = vllm_package_dir(engine)
    wrapper = served["kimi_vl"]
    fix = doctor.run(load_config(doctor.Config, None, [f"target={wrapper.target}", "engine=vllm",
                                                       f"engine_source={source}",
                                                       "fix=true", f"fix_output={tmp_path / 'plugins'}",
                                                       "installed_plugins=false"]))
    assert fix["verdict"] == "not supported" and fix["plugin_fix_possible"]
    site = tmp_path / "site"
    subprocess.run([engine.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), fix["plugin_written"]], check=True, timeout=300)
    entry_points = next(site.glob("*.dist-info/entry_points.txt")).read_text()
    assert "[vllm.general_plugins]" in entry_points
    env = {"PYTHONPATH": str(site)}
    checked = ve.run_worker(engine, {"kind": "supports_eagle3", "architectures": ["KimiVLForConditionalGeneration"]},
                            tmp_path, "supports", env=env)
    verdict = checked["architectures"]["KimiVLForConditionalGeneration"]
    assert verdict["supports_eagle3"] and verdict["class"].startswith("eaglekit_eagle3_"), verdict
    rechecked = doctor.run(load_config(doctor.Config, None, [f"target={wrapper.target}", "engine=vllm",
                                                             f"engine_source={source}",
                                                             f"plugins={tmp_path / 'plugins'}",
                                                             "installed_plugins=false"]))
    assert rechecked["verdict"] == "supported"
    result = ve.run_worker(engine, {"kind": "generate", "runs": [job_run("kimi_vl", wrapper, engine, prompt_ids())]},
                           tmp_path, "wrapper", env=env)
    assert_equal_acceptance(result["runs"][0], wrapper.bench_row)
    architectures = json.loads((Path(wrapper.target) / "config.json").read_text())["architectures"]
    assert architectures == ["KimiVLForConditionalGeneration"]
