"""The GPU reference benchmark: the whole eaglekit pipeline on a self-trained target, beside its peers.

    # on a GPU host; each part skips what is already on disk (--work), figures go to --out:
    python -m pytest -q tests/test_decode_gpu.py   # first: the compiled CUDA fast path equals the eager one (~1 min)
    python benchmarks/run_all.py --parts target --work runs/reference --out runs/reference-results     # ~5 min
    python benchmarks/run_all.py --parts pipeline,bench,summary --work runs/reference --out runs/reference-results
    # the peer trainer: speculators and its pinned needs in a folder that only the peer's process sees
    # (benchmarks/peer_speculators.py lists the wheels for a host without internet):
    python -m pip install -q --no-index --no-deps --target runs/peer-site .whl/*.whl
    EAGLEKIT_PEER_SITE=runs/peer-site python benchmarks/run_all.py --parts peer,summary --work runs/reference \
        --out runs/reference-results
    # speed figures that need no trained target (8B-shaped, random weights):
    python benchmarks/run_all.py --parts decode_speed,decode_speed_8b,train_speed,summary --out runs/reference-results
    # or all of it as one background job: benchmarks/run_reference.sh start|wait|collect
    # the drafter types side by side, DSpark beside DFlash, about 20 minutes (run_reference.sh lists the parts):
    bash benchmarks/run_reference.sh start drafters
    # the same flow at toy sizes on a CPU, a few minutes:
    python benchmarks/run_all.py --smoke --work /tmp/reference --out /tmp/reference-results

Wall time of the parts on one H200: target about 5 minutes (tokenising included; the draft LM 1.5 more),
pipeline about 3 (regen 66 s, extract 8 s, vocab 2 s, train 77 s for 1,100 steps), bench with plain, chain
and tree at T=0 and T=1 on 8 prompts about 5 (the HF peers add a few), the peer part about 10 (speculators
trains for 8 minutes), extract_speed_reference plus profile about 4; train_speed's four cases 103 s,
decode_speed 163 s, extract_speed on the 8B shape 31 s, regen_speed on a 1B shape 73 s.

Parts
- target:   trains the reference target (Llama, own BPE tokenizer, ChatML template) from scratch on the
            Python sources installed on this machine (stdlib + site-packages, files split by path hash so
            held-out prompts come from files never trained on) for a fixed number of steps, about 3
            minutes (scripts/build_tiny_target.py), and a small draft LM with the same tokenizer for HF
            assisted generation, trained for the same wall budget the EAGLE-3 drafter gets.
- store:    `eaglekit run` on that target up to the drafter's training data: regen (the target answers the
            training prompts) -> extract -> vocab (so drafters can train beside the run's own).
- pipeline: the same run on to train (a fixed number of steps sized to the drafter budget).
- bench:    the same `eaglekit run`, now with bench (eaglekit plain fast path, HF generate, HF assisted
            generation, HF prompt lookup, EAGLE-3 chain and tree; temperature 0 and 1, held-out prompts)
            and export.
- speed:    benchmarks/decode_speed.py on the reference target's shape (plain vs chain vs tree step
            cost, with a profiler table) and on the 8B shape (plain decoding vs HF generate and the
            memory-bandwidth bound, verify cost vs tokens), benchmarks/train_speed.py (8B-shaped drafter:
            tokens/s, MFU, peak memory), benchmarks/regen_speed.py (regen vs bare generate on the
            reference target) and benchmarks/extract_speed.py (extract vs the bare forward on the 8B
            shape and the reference target, shards in RAM and on disk).
- profile:  benchmarks/step_profile.py on the trained pair and a held-out prompt: per plain and tree step
            (chain: `step_profile.py --methods chain`), kernels launched, GPU time, host launch/wait
            time and the costliest kernels.
- peer:     benchmarks/peer_speculators.py on the pipeline's run: a drafter trained by vLLM's speculators
            on the same shards, vocabulary, split, shape and steps, both evaluated and benched the same way.
- variant:  a second drafter trained by the run's own train stage with `--variant` options changed (default
            `fc_norm=true,norm_output=true`: EAGLE 3.1) and benched on the same prompts. Another drafter type
            (`--variant drafter_type=dflash,block_size=8,draft_layers=2`: a DFlash drafter on the store's layers)
            trains into <work>/variant-dflash, is benched with its own methods (dflash: chain_length =
            block_size - 1) and writes <out>/variant_dflash.json. `--variant drafter_type=p-eagle,ttt_steps=8`:
            a P-EAGLE drafter fine-tuned from the run's own drafter (init_from=<work>/run/train unless given),
            benched with methods parallel, chain and tree; <out>/variant_p-eagle.json.
            `--variant drafter_type=dspark,block_size=8,draft_layers=2`: a DSpark drafter with DFlash's backbone
            of the same size (its Markov and confidence heads on top) in <work>/variant-dspark, benched with method
            dspark over its whole block (chain_length = block_size: every slot drafts); <out>/variant_dspark.json
            also keeps its confidence calibration (`after_training`: per block position, ECE and AUC raw and
            calibrated). `--variant-bench` passes bench options through (a list keeps its commas:
            verify_thresholds=0,0.3,0.5,0.7 where bench takes it); one bench does not take fails before training.
            `--variant-only train` trains the drafter and stops; `--variant-only bench` benches the drafter such a
            call trained (two variants can train side by side on one GPU, then bench one after the other).
- step_cost: benchmarks/step_cost.py: 8B-shaped step costs (random weights) with the tau of the bench and of the
            other drafter types' variants projected; `--step-cost-args` adds its flags (e.g. `--dflash 4,7
            --dspark 4,7`: block drafters' steps).
- summary:  gathers every figure into `<out>/summary.json` and a markdown table `<out>/summary.md` (a line per
            variant: variant.json, variant_p-eagle.json, variant_dflash.json, variant_dspark.json), DSpark against
            DFlash position by position (`block_acceptance`: acceptance per position, given the position before,
            DSpark's minus DFlash's) and the DSpark variant's calibration (`calibration`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also when loaded by file path
from reference_summary import VARIANT_KEYS, block_acceptance, calibrations, side_by_side, summary_markdown  # noqa: E402

# Sizes: (reference target, draft LM, pipeline) for the GPU run and for the CPU smoke run.
GPU = {
    "target": dict(hidden_size=512, num_layers=24, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                   vocab_size=8192, seq_len=512, batch_size=96, lr=1.5e-3, warmup_steps=100, steps=1200,
                   corpus="stdlib+site-packages", corpus_mb=120.0, num_prompts=2500, num_eval=40,
                   device="cuda", compile=True, threads=16, max_positions=2048),
    # 1,200 steps: about 3 minutes on an H200. A fixed step count, not a wall budget: in 180 s the same recipe
    # makes 1,046 to 1,301 steps with the host's load, and the target, and every figure after it, moves with
    # them (held-out loss 1.99 to 2.21). The draft LM keeps a wall budget, so that HF assisted generation's drafter gets the GPU
    # time the EAGLE-3 drafter gets: 1.25 minutes, about the wall time of its 1,100 training steps on the H200
    "draft_lm": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, minutes=1.25),
    "run": {
        "regen": {"max_new_tokens": 160, "batch_size": 256},
        "extract": {"max_length": 512},
        "vocab": {"size": 4096},
        "train": {"epochs": 30, "max_steps": 1100, "batch_size": 32, "max_length": 512, "lr": 6e-4,
                  "ttt_steps": 7, "val_fraction": 0.05, "log_every": 50, "save_every": 500, "compile": False},
        "bench": {"num_prompts": 8, "max_new_tokens": 128, "repeats": 1, "warmup": 1,
                  "methods": ["plain", "chain", "tree", "hf_assisted", "hf_prompt_lookup", "hf"],  # eaglekit's first
                  "temperatures": [0.0, 1.0], "depth": 6, "tree_top_k": 8, "total_tokens": 48, "chain_length": 4},
    },
}
# The same flow cut for a short GPU budget (a side-by-side of drafter types): half the target's steps on a third of
# the corpus, half the prompts, 500 drafter steps; bench as in GPU. Target, pipeline and bench: 8.5 minutes on one H100.
QUICK = {
    "target": {**GPU["target"], "steps": 600, "corpus_mb": 40.0, "num_prompts": 1200},
    "draft_lm": GPU["draft_lm"],
    "run": {**GPU["run"], "train": {**GPU["run"]["train"], "max_steps": 500, "save_every": 250}},
}
SMOKE = {
    "target": dict(hidden_size=64, num_layers=8, num_heads=2, num_kv_heads=1, intermediate_size=128,
                   vocab_size=1024, seq_len=128, batch_size=4, steps=4, corpus="stdlib", corpus_mb=2.0,
                   num_prompts=24, num_eval=4, device="cpu", threads=2),
    "draft_lm": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, steps=2),
    "run": {
        "regen": {"max_new_tokens": 16, "batch_size": 8},
        "extract": {"max_length": 128},
        "vocab": {"size": 512},
        "train": {"epochs": 1, "batch_size": 4, "max_length": 128, "ttt_steps": 2, "log_every": 1},
        "bench": {"num_prompts": 2, "max_new_tokens": 8, "repeats": 1, "warmup": 0, "temperatures": [0.0, 1.0],
                  "depth": 2, "tree_top_k": 2, "total_tokens": 4, "chain_length": 2},
    },
}


def log(message: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_models(work: Path, sizes: dict, draft_lm: bool = True) -> dict:
    """The reference target and the same-tokenizer draft LM (skipped when already built, or not wanted)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_tiny_target import BuildConfig, build

    reports = {}
    target_dir = work / "models" / "reference_target"
    if not (target_dir / "training_report.json").is_file():
        log("training the reference target")
        build(BuildConfig(output=str(work / "models"), name="reference_target", **sizes["target"]))
    reports["target"] = json.loads((target_dir / "training_report.json").read_text())
    draft_dir = work / "models" / "draft_lm"
    if not draft_lm:
        return reports
    if not (draft_dir / "training_report.json").is_file():
        log("training the draft LM for HF assisted generation (same tokenizer)")
        shared = {k: v for k, v in sizes["target"].items() if k not in sizes["draft_lm"] and k not in ("compile", "steps", "minutes")}
        build(BuildConfig(output=str(work / "models"), name="draft_lm", tokenizer=str(target_dir),
                          **shared, **sizes["draft_lm"]))
    reports["draft_lm"] = json.loads((draft_dir / "training_report.json").read_text())
    return reports


def run_pipeline(work: Path, sizes: dict, stages: tuple[str, ...], bench_methods: str = "", bench_repeats: int = 0) -> None:
    """`eaglekit run` on the reference target with the given stages (finished ones are skipped)."""
    from eaglekit.config import load_config
    from eaglekit.stages import run as run_stage

    models = work / "models"
    overrides = {
        "target": str(models / "reference_target"),
        "data": [str(models / "tiny_prompts.jsonl")],
        "out": str(work / "run"),
        "stages": list(stages),
        "doctor_engines": [],
        **json.loads(json.dumps(sizes["run"])),
    }
    overrides["bench"] = {**overrides["bench"], "prompts": str(models / "tiny_prompts_eval.jsonl"),
                          "assistant": str(models / "draft_lm")}
    if bench_methods:
        overrides["bench"]["methods"] = bench_methods.split(",")
    if bench_repeats:
        overrides["bench"]["repeats"] = bench_repeats
    run_stage.run(load_config(run_stage.Config, None, overrides))


def split_options(text: str) -> list[str]:
    """`a=1,b=0,0.5` -> ["a=1", "b=0,0.5"]: comma-separated key=value pairs, a list value's commas kept (a piece
    without "=" continues the value before it)."""
    pairs: list[str] = []
    for piece in (p for p in text.split(",") if p):
        if "=" in piece or not pairs:
            pairs.append(piece)
        else:
            pairs[-1] += "," + piece
    return pairs


def run_variant(work: Path, out: Path, variant: str, bench_methods: str, bench_repeats: int, bench_options: str = "",
                only: str = "") -> None:
    """A second drafter trained by the run's own train stage with some options changed (`--variant`: same
    shards, vocabulary, split, seed and steps) and benched by the run's bench stage on the same prompts
    (speculative methods only: plain decoding does not depend on the drafter), with `--variant-bench` bench
    options changed (e.g. chain_length=7 for a P-EAGLE chain that costs about what a chain of 4 does; a list
    value keeps its commas: verify_thresholds=0,0.5). The bench options are checked before the drafter trains.
    What the drafter type does after training (DSpark: its confidence calibration, `after_training` in the
    train manifest) is kept in the JSON beside the bench rows. `only`: "train" stops after training, "bench"
    benches what such a call trained, reading its train manifest."""
    from eaglekit.config import load_config, parse_overrides, to_dict
    from eaglekit.manifest import atomic_write_json, environment
    from eaglekit.stages import bench as bench_stage
    from eaglekit.stages import train as train_stage
    from eaglekit.stages.run import Config, plan

    from eaglekit import registry

    run = work / "run"
    steps = {s.name: s for s in plan(load_config(Config, run / "run.yaml", {"out": str(run),
                                                                               "stages": ["regen", "extract", "vocab", "train", "bench"]}))}
    options = parse_overrides(split_options(variant))
    train_config = steps["train"].make_config()  # validated like a command line: an unknown option is one error
    own = train_config.drafter_type  # the run's drafter type
    kind = registry.get(str(options.get("drafter_type", own)))  # another type: its own folder and JSON, its methods
    if kind.starts_from == own:  # its usual recipe (P-EAGLE): from the run's own drafter (weights and vocabulary)
        options.setdefault("init_from", str(run / "train"))
    variant_dir, name = ((work / "variant", "variant.json") if kind.name == own
                         else (work / f"variant-{kind.name}", f"variant_{kind.name}.json"))
    train_config = load_config(type(train_config), None, {**to_dict(train_config), **options, "output": str(variant_dir / "train")})
    bench_config = steps["bench"].make_config()
    allowed = kind.methods
    methods = tuple(m for m in (bench_methods.split(",") if bench_methods else bench_config.methods) if m in allowed) or allowed
    if not bench_methods:  # the type's own method first, beside the others it also drafts (P-EAGLE: chain, tree)
        methods = (allowed[0], *(m for m in methods if m != allowed[0]))
    chain = kind.bench_options(train_config)  # DFlash and DSpark: the whole block
    changed = parse_overrides(split_options(bench_options)) if bench_options else {}
    bench_config = load_config(type(bench_config), None, {  # an option bench does not take fails here, before training
        **to_dict(bench_config), "drafter": str(variant_dir / "train"), "output": str(variant_dir / "bench"),
        "methods": list(methods), **chain, **({"repeats": bench_repeats} if bench_repeats else {}), **changed})
    manifest = variant_dir / "train" / "manifest.json"
    if only == "bench":
        if not manifest.is_file():
            raise FileNotFoundError(f"no trained variant drafter in {manifest.parent}: run --variant-only train first")
        trained = json.loads(manifest.read_text())
    else:
        log(f"training the variant drafter ({variant})")
        trained = train_stage.run(train_config)
        if only == "train":
            return
    rows = bench_stage.run(bench_config)["rows"]
    base = json.loads((run / "train" / "manifest.json").read_text())
    after = json.loads(manifest.read_text()).get("after_training")
    atomic_write_json(out / name, {
        "benchmark": "drafter_variant", "variant": options, "environment": environment(),
        "baseline": {"val": base.get("val"), "steps": base.get("steps"), "drafter": str(run / "train")},
        "trained": {"val": trained.get("val"), "steps": trained.get("steps"), "drafter": str(variant_dir / "train")},
        "bench_options": {key: getattr(bench_config, key)
                          for key in ("chain_length", "depth", "total_tokens", *changed)}
        | {"methods": list(bench_config.methods)},
        **({"after_training": after} if after else {}),
        "bench": rows,
    })


def run_step_cost(work: Path, out: Path, smoke: bool, extra: str = "") -> None:
    """8B-shaped step costs (random weights), with the reference target's measured tau projected onto them: the
    run's bench rows and those of the other drafter types' variants (<work>/variant-<type>/bench, same prompts).
    `extra`: more step_cost.py flags (`--step-cost-args`, split on spaces), after run_all's own (so they win)."""
    benches = [work / "run" / "bench" / "bench.json", *sorted(work.glob("variant-*/bench/bench.json"))]
    flags = ["--smoke", "--shapes", "chain4,tree48", "--repeats", "1"] if smoke else []
    # ~10 minutes on an H200 with the defaults, most of it compiling the 8B-shaped graphs (one per step shape, and
    # the parts)
    _script("step_cost.py", *flags, "--output", str(out / "step_cost_8b.json"),
            *(flag for bench in benches if bench.is_file() for flag in ("--reference-bench", str(bench))),
            *extra.split(), timeout=1800)


def run_train_speed(out: Path, smoke: bool, budget_s: float) -> None:
    """8B-shaped drafter: tokens/s, MFU, peak memory (cases past the budget are skipped, not cut off)."""
    cases = "offline:compile:flex,online:compile:flex,offline:compile:sdpa,offline:eager:sdpa"  # best first
    flags = ["--smoke"] if smoke else ["--cases", cases, "--budget-s", str(budget_s)]
    _script("train_speed.py", *flags, "--out", str(out / "train_speed.json"))


def run_regen_speed(work: Path, out: Path, smoke: bool) -> None:
    """`regen --backend hf` against bare `model.generate` on the same batches of the reference target."""
    target = ["--smoke"] if smoke else ["--target", str(work / "models" / "reference_target")]
    _script("regen_speed.py", *target, "--records", "128", "--batch-size", "64", "--max-new-tokens", "128", "--repeats", "2",
            "--out", str(out / "regen_speed.json"))


RAM_SHARDS = ["--shard-dir", "/dev/shm/eaglekit-extract"]


def run_extract_speed(work: Path, out: Path, smoke: bool) -> None:
    """extract vs the bare forward: the 8B-shaped random Llama (bf16 and float8, shards in RAM) and the
    reference target (bf16, shards in RAM: what the pipeline sustains; on disk: what the disk allows)."""
    if smoke:
        _script("extract_speed.py", "--smoke", "--no-tiny", "--no-quant", "--out", str(out / "extract_speed_reference_ram.json"))
        return
    _script("extract_speed.py", "--steps", "24", "--repeats", "1", "--no-tiny", "--no-quant", *RAM_SHARDS,
            "--out", str(out / "extract_speed_8b_ram.json"))
    run_extract_speed_reference(work, out, disk=True)


def run_extract_speed_reference(work: Path, out: Path, disk: bool = False) -> None:
    """extract vs the bare forward on the reference target, bf16 shards in RAM (and on disk)."""
    # 96 batches (~3.5 s a repeat): the last shard's flush after the last forward (~0.13 s, once per run) weighs
    # 13% in a 24-batch measurement (0.86 s), far more than in any real extraction
    shape = ["--target", str(work / "models" / "reference_target"), "--batch-size", "64", "--seq-len", "512", "--steps", "96",
             "--repeats", "2", "--dtypes", "bf16", "--no-tiny", "--no-quant"]
    _script("extract_speed.py", *shape, *RAM_SHARDS, "--out", str(out / "extract_speed_reference_ram.json"))
    if disk:
        _script("extract_speed.py", *shape, "--out", str(out / "extract_speed_reference_disk.json"))


def run_peer(work: Path, out: Path, smoke: bool, variants: list[str]) -> None:
    """The peer trainer on the pipeline's run, both drafters benched. speculators and its needs are found on
    this Python's path, or in the folder EAGLEKIT_PEER_SITE names (put on the path of the peer's process only,
    so its pinned libraries never shadow the pipeline's)."""
    device = "cpu" if smoke else "cuda"
    env = dict(os.environ)
    if env.get("EAGLEKIT_PEER_SITE"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env["EAGLEKIT_PEER_SITE"], env.get("PYTHONPATH", "")) if p)
    _script("peer_speculators.py", "--run", str(work / "run"), "--device", device, "--bench", "--peer-python", sys.executable,
            *(["--variants", *variants] if variants else []), "--out", str(out / "peer_speculators.json"), env=env, timeout=1500)


def run_profile(work: Path, out: Path, smoke: bool) -> None:
    """Where a decode step's time goes for the trained pair on a held-out prompt (kernels, GPU and host time)."""
    if smoke:
        _script("step_profile.py", "--smoke", "--out", str(out / "step_profile.json"))
        return
    models = work / "models"
    _script("step_profile.py", "--target", str(models / "reference_target"), "--drafter", str(work / "run" / "train"),
            "--prompt-file", str(models / "tiny_prompts_eval.jsonl"), "--methods", "plain,tree", "--out", str(out / "step_profile.json"))


def run_decode_speed(out: Path, smoke: bool, shape: str = "reference") -> None:
    """Random weights. reference: step costs on the reference target's shape (plain vs chain vs tree, profiled);
    8b: plain decoding vs HF generate and the memory-bandwidth bound, verify cost vs tokens, the tree step."""
    if smoke:
        _script("decode_speed.py", "--smoke", "--output", str(out / f"decode_speed_{shape}.json"))
    elif shape == "reference":
        _script("decode_speed.py", "--shape", "reference", "--output", str(out / "decode_speed_reference.json"),
                "--profile", str(out / "decode_profile.txt"))
    else:
        _script("decode_speed.py", "--shape", "8b", "--methods", "tree", "--output", str(out / "decode_speed_8b.json"))


def _script(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 560) -> None:
    log(f"running {name} {' '.join(args)}")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], check=False, timeout=timeout, env=env)


def summarise(work: Path, out: Path) -> dict:
    """Every figure of this run in one JSON (and a markdown table)."""
    import torch  # noqa: F401 - environment() reports the versions and the GPU of modules already imported
    import transformers  # noqa: F401

    from eaglekit.manifest import environment

    def load(path: Path) -> dict | None:
        return json.loads(path.read_text()) if path.is_file() else None

    run_dir = work / "run"
    summary = {
        "environment": environment(),
        "reference_target": load(work / "models" / "reference_target" / "training_report.json"),
        "draft_lm": load(work / "models" / "draft_lm" / "training_report.json"),
        "run": load(run_dir / "run.json"),
        "bench": load(run_dir / "bench" / "bench.json"),
        "train_speed": load(out / "train_speed.json"),
        "regen_speed": load(out / "regen_speed.json"),
        "decode_speed_reference": load(out / "decode_speed_reference.json"),
        "decode_speed_8b": load(out / "decode_speed_8b.json"),
        "extract_speed": {name: load(out / f"extract_speed_{name}.json") for name in ("8b_ram", "reference_ram", "reference_disk")},
        "peer_speculators": load(out / "peer_speculators.json"),
        "step_profile": load(out / "step_profile.json"),
        **{key: load(out / f"{key}.json") for key in VARIANT_KEYS},
        "step_cost_8b": load(out / "step_cost_8b.json"),
    }
    summary["methods"] = side_by_side(summary)
    summary["calibration"] = calibrations(summary)  # the DSpark variants' confidence, per block position
    summary["block_acceptance"] = block_acceptance(summary)  # DSpark against DFlash, position by position
    for key in ("reference_target", "draft_lm"):
        if summary[key]:
            summary[key] = {k: v for k, v in summary[key].items() if k != "eval_records"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    bench_md = run_dir / "bench" / "bench.md"
    if bench_md.is_file():
        (out / "bench.md").write_text(bench_md.read_text())
    (out / "summary.md").write_text(summary_markdown(summary, bench_md.read_text() if bench_md.is_file() else ""))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="target,pipeline,bench,speed,summary",
                        help="comma list of: target, store, pipeline, bench, variant, step_cost, profile, peer, decode_speed, decode_speed_8b, train_speed, regen_speed, extract_speed (speed = all five), extract_speed_reference (its reference target in RAM only), summary")
    parser.add_argument("--work", default="runs/reference", help="where models and the run live (reused across parts)")
    parser.add_argument("--out", default="runs/reference-results",
                        help="where the JSON figures go (publish them by moving them into benchmarks/results/latest/)")
    parser.add_argument("--train-speed-budget", type=float, default=200, help="seconds of train_speed cases (later ones are skipped)")
    parser.add_argument("--bench-methods", default="", help="bench only these methods (comma list; default: all, HF peers included)")
    parser.add_argument("--bench-repeats", type=int, default=0,
                        help="runs per prompt and method, the median kept (default: the sizes' 1; eaglekit's methods take "
                             "about a second a run on the H200, the HF peers half a minute)")
    parser.add_argument("--no-draft-lm", action="store_true", help="target part: skip the draft LM (only HF assisted generation uses it)")
    parser.add_argument("--peer-variants", nargs="*", default=[], metavar="KEY=VALUE,...",
                        help="peer part: also train eaglekit drafters with these train options changed (peer_speculators.py --variants)")
    parser.add_argument("--variant", default="fc_norm=true,norm_output=true", metavar="KEY=VALUE,...",
                        help="variant part: train options changed for the second drafter (default: EAGLE 3.1's fc_norm + norm_output)")
    parser.add_argument("--variant-bench", default="", metavar="KEY=VALUE,...",
                        help="variant part: bench options changed for it (e.g. chain_length=7; a list keeps its "
                             "commas: temperatures=0,0.7)")
    parser.add_argument("--variant-only", choices=("train", "bench"), default="",
                        help="variant part: only train the drafter, or only bench the one an earlier call trained")
    parser.add_argument("--step-cost-args", default="", metavar="'--FLAG VALUE ...'",
                        help="step_cost part: more benchmarks/step_cost.py flags, split on spaces (e.g. "
                             "--step-cost-args='--shapes= --parts= --dflash 4,7 --dspark 4,7')")
    parser.add_argument("--quick", action="store_true", help="GPU sizes cut for a short GPU budget (QUICK: 600 target "
                        "steps, 500 drafter steps; target, pipeline and bench 8.5 minutes on one H100)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: proves the flow runs")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else QUICK if args.quick else GPU
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    speed = ("decode_speed", "decode_speed_8b", "train_speed", "regen_speed", "extract_speed")
    parts = [q for p in args.parts.split(",") for q in (speed if p == "speed" else (p,))]
    steps = {
        "target": lambda: build_models(work, sizes, not args.no_draft_lm),
        "store": lambda: run_pipeline(work, sizes, ("regen", "extract", "vocab")),
        "pipeline": lambda: run_pipeline(work, sizes, ("regen", "extract", "vocab", "train")),
        "bench": lambda: run_pipeline(work, sizes, ("regen", "extract", "vocab", "train", "bench", "export"), args.bench_methods,
                                     args.bench_repeats),
        "profile": lambda: run_profile(work, out, args.smoke),
        "peer": lambda: run_peer(work, out, args.smoke, args.peer_variants),
        "decode_speed": lambda: run_decode_speed(out, args.smoke),
        "decode_speed_8b": lambda: run_decode_speed(out, args.smoke, "8b"),
        "train_speed": lambda: run_train_speed(out, args.smoke, args.train_speed_budget),
        "regen_speed": lambda: run_regen_speed(work, out, args.smoke),
        "extract_speed": lambda: run_extract_speed(work, out, args.smoke),
        "extract_speed_reference": lambda: (run_extract_speed(work, out, True) if args.smoke
                                            else run_extract_speed_reference(work, out)),
        "variant": lambda: run_variant(work, out, args.variant, args.bench_methods, args.bench_repeats,
                                       args.variant_bench, args.variant_only),
        "step_cost": lambda: run_step_cost(work, out, args.smoke, args.step_cost_args),
        "summary": lambda: summarise(work, out),
    }
    unknown = [p for p in parts if p not in steps]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(steps)}")
    start, failed = time.perf_counter(), []
    for name in steps:  # in pipeline order, whatever order --parts names them in
        if name not in parts:
            continue
        try:
            steps[name]()
        except Exception:  # noqa: BLE001 - a failed part must not cost the figures of the parts after it
            log(f"part {name} failed:\n{traceback.format_exc()}")
            failed.append(name)
        log(f"part {name} done at {time.perf_counter() - start:.0f}s")
    log(f"done in {time.perf_counter() - start:.0f}s" + (f"; FAILED parts: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
