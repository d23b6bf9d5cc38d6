"""Peer-trainer comparison: eaglekit's drafter against one trained by vLLM's `speculators` on the same data.

    make speculators-env                                   # .venv-speculators: speculators 0.9.0 in a venv of its own
    python benchmarks/peer_speculators.py --run runs/demo --out runs/benchmarks/peer_speculators_tiny_cpu.json
    python benchmarks/peer_speculators.py --run runs/demo --device cuda --bench --peer-python python3 --out X.json
    python benchmarks/peer_speculators.py --run runs/demo --steps 200 --out X.json    # another step count
    python benchmarks/peer_speculators.py --run runs/demo --no-peer --variants lm_head_init=random freeze_lm_head=true --out X.json

RUN_DIR is an `eaglekit run` output that holds extract/, vocab/ and train/ (eaglekit's drafter). The script

1. rebuilds eaglekit's training context from RUN_DIR/train/config.yaml (`eaglekit.training.setup.setup` and
   `eaglekit.training.loop.Trainer`): the same records, the same validation split (`split_indices`), the same
   soft labels and the same `Trainer.validate` for both drafters;
2. converts the extract shards into the layout `speculators train` reads offline (a `datasets` directory with
   input_ids / loss_mask / seq_len, and hidden_states/hs_<i>.safetensors holding token_ids and hidden_states
   (T, 3 + 1, H): the three aux states, then the final state), the training records first and eaglekit's
   validation records last, with `--train-data-ratio` cutting exactly between them; eaglekit's draft vocabulary
   goes in as d2t/t2d .npy files. speculators applies the target's final RMSNorm to the last state, eaglekit
   stores it after that norm: the script stores final / norm_weight, whose RMSNorm gives the stored state back
   (its rms is 1 up to eps); `data.label_check` measures how close the rebuilt soft labels are;
3. runs `python -m speculators train` in the peer's own Python (`--peer-python`) with eaglekit's drafter shape,
   TTT steps, step weights, learning rate, warmup/cosine schedule and number of optimizer steps; speculators
   packs records into one sequence per step, so its packed length is chosen to give the same tokens per step;
4. imports the final checkpoint with eaglekit's own import code (`eaglekit.drafters.eagle3.convert.import_checkpoint`),
   evaluates both drafters with `Trainer.validate` (accuracy per TTT position, estimated tau) and, with --bench,
   decodes the run's bench prompts with both (`eaglekit.stages.bench`, chain and tree, temperature 0);
   With --variants, eaglekit's drafter is trained again with some train options changed (one drafter per
   variant, e.g. speculators' settings on eaglekit's trainer) and evaluated the same way; the variants train
   in this process while the peer trains in its own (their wall times overlap: `variants_trained_beside_peer`);
5. writes JSON: both drafters side by side, commands, steps actually performed, wall times, versions, and the
   settings speculators does not let us match (`differences`); also after each variant, evaluation and bench,
   with `status: partial`, so a run cut off keeps what it finished.

Work files (converted data, peer checkpoints and log, imported drafter) go to --work (default RUN_DIR/peer_speculators).

speculators 0.9.0 trains only on an accelerator: its Trainer moves the model to `local_rank`, an accelerator index
(speculators/train/trainer.py:348, `self.model.to(self.local_rank)`; batches likewise at :533). With --device cpu the
peer runs under `CPU_LAUNCHER`, which maps that index to the CPU and nothing else; on the CPU the peer uses SDPA
attention, on CUDA speculators' default flex attention (packed length a multiple of 128: `FLEX_BLOCK`). Its
loss is the eager KL (`--peer-loss`). If the peer fails, the JSON holds eaglekit's figures, the conversion and
the error (`status: peer_failed`), and the script exits with a one-line message naming the failing line.

Installing speculators on a GPU host without internet (the host's torch is used; 6.9 MB of wheels): on a machine with it,
`pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
--platform manylinux2014_x86_64 -d .whl` speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1
multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
typing-inspection==0.4.5 annotated-types==0.8.0 loguru==0.7.3 openai==3.57.0 jiter==0.19.0 httpx2==2.16.2
httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 typing_extensions; there, `pip install --no-index --no-deps
--target /tmp/site .whl/*.whl`, `export PYTHONPATH=/tmp/site:$PWD/src`, and run with `--device cuda --peer-python
python3` (datasets 5.1 needs pyarrow >= 24: check the machine's). torchvision/torchaudio are not needed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also when loaded by file path
from peer_speculators_convert import convert, final_norm_weight, label_check  # noqa: E402
from peer_speculators_trainer import (  # noqa: E402,F401  (CPU_LAUNCHER, shown: the script's own names, for its tests)
    CPU_LAUNCHER, FLEX_BLOCK, PEER_VERSION, differences, import_peer, peer_command, peer_versions, plan_peer, shown,
    train_peer)

EAGLEKIT_SETTINGS = ("ttt_steps", "step_decay", "lr", "betas", "weight_decay", "warmup_steps", "min_lr_ratio", "grad_clip", "step_weighting", "init_std",
                     "lm_head_init", "freeze_lm_head", "batch_size", "grad_accum", "max_length", "epochs", "max_steps", "seed", "split_seed", "device",
                     "dtype", "attention")  # eaglekit's train options the report lists beside the peer's


# ---- checks --------------------------------------------------------------------------------------

def check_run(run: Path) -> None:
    needed = {"extract/manifest.json": "eaglekit extract", "vocab/vocab.safetensors": "eaglekit vocab",
              "train/manifest.json": "eaglekit train", "train/config.yaml": "eaglekit train"}
    for path, stage in needed.items():
        if not (run / path).is_file():
            raise SystemExit(f"{run} lacks {path}: finish the run first (`eaglekit run --config RECIPE out={run}` runs {stage})")


# ---- eaglekit's side -----------------------------------------------------------------------------

def run_train_overrides(run: Path, output: Path, device: str) -> dict[str, Any]:
    """RUN_DIR's train config, offline on its shards and vocabulary, written to `output` on `device`, from scratch."""
    return {"shards": str(run / "extract"), "vocab": str(run / "vocab" / "vocab.safetensors"), "output": str(output),
            "resume": False, "device": device, "init_from": ""}


def eaglekit_context(run: Path, device: str, work: Path, stack: contextlib.ExitStack) -> Any:
    """eaglekit's trainer for RUN_DIR's train config (records, split, soft labels, validate), on `device`."""
    from eaglekit.config import load_config
    from eaglekit.training.setup import setup
    from eaglekit.training.loop import Trainer, setup_distributed
    from eaglekit.stages.train import Config

    config = load_config(Config, run / "train" / "config.yaml", run_train_overrides(run, work / "eval", device))
    if not config.shards or config.val_fraction <= 0:
        raise SystemExit(f"{run}/train was not trained offline with a validation split (val_fraction > 0): nothing to compare on")
    shutil.rmtree(work / "eval", ignore_errors=True)
    (work / "eval").mkdir(parents=True)
    d = setup_distributed(device)
    drafter, source, identity = setup(config, d, stack)
    return Trainer(config, d, drafter, source, identity)


def eaglekit_tokens_per_step(trainer: Any, steps: int) -> float:
    """Mean record tokens per optimizer step of eaglekit's run (its own batches, replayed)."""
    from eaglekit.training.data import epoch_batches

    c, tokens, done, epoch = trainer.config, 0, 0, 0
    while done < steps:
        batches = epoch_batches(trainer.train_idx, trainer.source.lengths, c.batch_size, 1, c.seed, epoch)
        groups = [batches[i : i + c.grad_accum] for i in range(0, len(batches), c.grad_accum)]
        for group in groups[: steps - done]:
            tokens += sum(trainer.source.lengths[i] for batch in group for i in batch)
        done, epoch = done + min(len(groups), steps - done), epoch + 1
    return tokens / steps


# ---- measuring -----------------------------------------------------------------------------------

def peer_side(args: Any, trainer: Any, work: Path, eaglekit_tps: float, report: dict[str, Any],
              meanwhile: Callable[[], None]) -> dict[str, Any]:
    """Convert the run's data for speculators, train the peer with eaglekit's settings (running `meanwhile()` as
    it trains), and record the data, the commands, both settings and their `differences` in `report` -> the
    peer's side (its `error` if it failed)."""
    from eaglekit.training.loop import _amp_dtype
    from eaglekit.targets.capture import text_config
    from eaglekit.targets.loading import load_target_config

    c = trainer.config
    amp = _amp_dtype(c.dtype, torch.device(args.device))
    hs_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.hs_dtype, torch.float32 if amp is None else torch.bfloat16)
    norm_weight = final_norm_weight(c.target)
    started = time.perf_counter()
    conv = convert(trainer, norm_weight, work / "data", hs_dtype)
    conv["seconds"] = time.perf_counter() - started
    eps = float(getattr(text_config(load_target_config(c.target)), "rms_norm_eps", 1e-6))
    label = label_check(trainer, work / "data", conv["train_records"], norm_weight, eps)
    multiple = FLEX_BLOCK if args.device.startswith("cuda") else 1  # cuda: simple_flex_attention (peer_command)
    plan = plan_peer(args.peer_python, conv.pop("train_lengths"), args.steps, eaglekit_tps, c.seed, multiple)
    cmd, settings = peer_command(args, trainer, work / "data", work / "peer" / "checkpoints", plan, conv)
    report.update(data={**conv, "label_check": label}, commands={"this": [sys.executable, *sys.argv], "peer_train": shown(cmd)},
                  settings={"eaglekit": {k: getattr(c, k) for k in EAGLEKIT_SETTINGS}, "peer": settings},
                  differences=differences(args, trainer, settings, eaglekit_tps, plan, label))
    peer = train_peer(cmd, work / "peer" / "checkpoints", args.device, meanwhile)
    peer.update(planned_steps=args.steps, planned_epochs=plan["epochs"], tokens_per_step=plan["tokens_per_step"])
    return peer


def variant_options(spec: str) -> list[str]:
    """'a=1,b=[0.9,0.999]' -> ['a=1', 'b=[0.9,0.999]'] (commas inside [...] belong to a value)."""
    return [kv for kv in re.split(r",(?![^\[]*\])", spec) if kv]


def train_variant(run: Path, spec: str, output: Path, trainer: Any, device: str) -> dict[str, Any]:
    """eaglekit's drafter trained again from RUN_DIR's train config with `spec` ('key=value,...') changed, on `device`,
    then evaluated like the others."""
    from eaglekit.config import load_config, parse_overrides
    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.stages import train as train_stage

    config = load_config(train_stage.Config, run / "train" / "config.yaml",
                         {**run_train_overrides(run, output, device), **parse_overrides(variant_options(spec))})
    shutil.rmtree(output, ignore_errors=True)
    started = time.perf_counter()
    result = train_stage.run(config)
    return {"options": spec, "drafter": str(output), "steps": result.get("steps"), "wall_s": time.perf_counter() - started,
            "manifest_val": result.get("val"), "val": evaluate(trainer, Eagle3Drafter.from_pretrained(output))}


def evaluate(trainer: Any, drafter: Any) -> dict[str, Any]:
    """eaglekit's own validation (`Trainer.validate`) with `drafter`'s weights."""
    state = {k: v for k, v in drafter.state_dict().items() if k in trainer.drafter.state_dict()}
    trainer.drafter.load_state_dict(state)
    metrics = trainer.validate()
    return {k: metrics[k] for k in ("loss", "loss_k", "acc_k", "tau", "tokens")}


def bench(run: Path, drafter: Path, output: Path, device: str) -> dict[str, Any]:
    """`eaglekit bench` on the run's bench prompts (its bench section), chain and tree at temperature 0."""
    from eaglekit.config import load_config
    from eaglekit.stages import bench as bench_stage
    from eaglekit.stages.run import Config, plan

    if not (run / "run.yaml").is_file():
        raise SystemExit(f"--bench reads the bench prompts from {run}/run.yaml (an `eaglekit run` output); it has none")
    # the run's bench section, wired as `eaglekit run` wires it, also when the run has not benched yet
    stages = ["regen", "extract", "vocab", "train", "bench"]
    step = next((s for s in plan(load_config(Config, run / "run.yaml", {"out": str(run), "stages": stages})) if s.name == "bench"), None)
    if step is None:
        raise SystemExit(f"{run}/run.yaml gives no bench stage")
    config = dataclasses.replace(step.make_config(), drafter=str(drafter), output=str(output), methods=("chain", "tree"),
                                 temperatures=(0.0,), repeats=1, warmup=0, compile=False, device=device)
    rows = bench_stage.run(config)["rows"]
    keep = ("method", "temperature", "tau", "acceptance_per_position", "tokens_per_second", "error")
    return {"prompts": config.prompts, "num_prompts": config.num_prompts, "max_new_tokens": config.max_new_tokens,
            "chain_length": config.chain_length, "depth": config.depth, "tree_top_k": config.tree_top_k,
            "total_tokens": config.total_tokens, "rows": [{k: r[k] for k in keep if k in r} for r in rows]}


# ---- main ----------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="an `eaglekit run` output directory with extract/, vocab/ and train/")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps for the peer (0 = as many as eaglekit's drafter had)")
    parser.add_argument("--out", default="runs/benchmarks/peer_speculators.json")
    parser.add_argument("--peer-python", default=".venv-speculators/bin/python",
                        help=f"a Python with speculators=={PEER_VERSION} (`make speculators-env` builds the default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: the peer's training, both evaluations and the bench")
    parser.add_argument("--bench", action="store_true", help="also decode the run's bench prompts with both drafters (chain, tree, T=0)")
    parser.add_argument("--work", default="", help="work directory (default RUN_DIR/peer_speculators)")
    parser.add_argument("--hs-dtype", default="auto", choices=("auto", "bf16", "fp32"),
                        help="dtype of the converted hidden states (auto: fp32 when the peer trains in fp32, else bf16)")
    parser.add_argument("--peer-loss", default="eager", choices=("eager", "fused"),
                        help="speculators --loss-implementation. fused (Triton) broke under torch 2.11's dynamo on the H200 "
                             "('ListVariable(length=21) is already tracked for mutation' at speculators/losses/fused.py:343); "
                             "eager computes the same KL loss in plain torch")
    parser.add_argument("--peer-workers", type=int, default=-1, help="speculators --num-workers (-1: 0 on cpu, 4 on cuda)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="KEY=VALUE,...",
                        help="also train eaglekit drafters with these train options changed (e.g. 'lm_head_init=random' or "
                             "'freeze_lm_head=true,betas=[0.9,0.999],grad_clip=1.0'), evaluated and benched like the other two")
    parser.add_argument("--no-peer", action="store_true", help="only eaglekit's drafter and --variants (no speculators needed)")
    args = parser.parse_args(argv)
    if args.peer_workers < 0:
        args.peer_workers = 4 if args.device.startswith("cuda") else 0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.manifest import atomic_write_json, environment

    args = parse(argv)
    run = Path(args.run)
    check_run(run)
    versions = None if args.no_peer else peer_versions(args.peer_python)
    work = Path(args.work) if args.work else run / "peer_speculators"
    manifest = json.loads((run / "train" / "manifest.json").read_text())
    args.eaglekit_steps = int(manifest["steps"])
    args.steps = args.steps or args.eaglekit_steps
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "peer_speculators", "run": str(run), "device": args.device, "environment": environment(),
                              "versions": {"peer": versions, "eaglekit_torch": torch.__version__}}
    with contextlib.ExitStack() as stack:
        trainer = eaglekit_context(run, args.device, work, stack)
        eaglekit_tps = eaglekit_tokens_per_step(trainer, args.steps)
        variants: list[dict[str, Any]] = []
        report["variants"] = variants

        def train_variants() -> None:  # while the peer trains: the GPU has room for both (a 1-layer drafter each)
            for i, spec in enumerate(args.variants):
                variants.append(train_variant(run, spec, work / f"variant-{i}", trainer, args.device))
                save_partial(out_path, report)

        if args.no_peer:
            peer = {"error": {"exception": "not run (--no-peer)"}}
            train_variants()
        else:
            peer = peer_side(args, trainer, work, eaglekit_tps, report, train_variants)
        report["variants_trained_beside_peer"] = bool(variants) and not args.no_peer  # their and the peer's wall times overlap
        ours = Eagle3Drafter.from_pretrained(run / "train")
        report["eaglekit"] = {"drafter": str(run / "train"), "steps": args.eaglekit_steps, "epochs": manifest.get("epochs"),
                              "wall_s": json.loads((run / "train" / ".run-done").read_text())["seconds"]
                              if (run / "train" / ".run-done").is_file() else None,
                              "tokens_per_step": eaglekit_tps, "manifest_val": manifest.get("val"), "val": evaluate(trainer, ours)}
        report["peer"] = peer
        if "error" not in peer:
            imported = import_peer(peer["checkpoint"], work / "peer_eaglekit", trainer)
            peer.update(drafter=str(work / "peer_eaglekit"), val=evaluate(trainer, imported))
            if peer.get("steps") != args.steps:
                report["differences"].append(f"steps: speculators performed {peer.get('steps')} optimizer steps, {args.steps} were asked")
        save_partial(out_path, report)
        if args.bench:
            report["eaglekit"]["bench"] = bench(run, run / "train", work / "bench_eaglekit", args.device)
            if "error" not in peer:
                peer["bench"] = bench(run, work / "peer_eaglekit", work / "bench_peer", args.device)
            save_partial(out_path, report)
            for i, variant in enumerate(report["variants"]):
                variant["bench"] = bench(run, Path(variant["drafter"]), work / f"bench_variant-{i}", args.device)
                save_partial(out_path, report)
    report["status"] = "not_run" if args.no_peer else "peer_failed" if "error" in report["peer"] else "ok"
    atomic_write_json(out_path, report)
    print_summary(report, out_path)
    if "error" in report["peer"] and not args.no_peer:
        e = report["peer"]["error"]
        raise SystemExit(f"speculators' trainer failed ({e.get('where', '?')}: {e['exception']}); eaglekit's figures and the "
                         f"converted data are in {out_path} and {work}; full log: {report['peer']['log']}")
    return report


def save_partial(out_path: Path, report: dict[str, Any]) -> None:
    """The report so far, `status: partial`: a run cut off (a time limit, a lost machine) keeps what it finished."""
    from eaglekit.manifest import atomic_write_json

    atomic_write_json(out_path, {**report, "status": "partial"})


def print_summary(report: dict[str, Any], out_path: Path) -> None:
    def line(name: str, side: dict[str, Any]) -> str:
        val = side.get("val")
        if not val:
            return f"{name:>9}: no figures ({side.get('error', {}).get('exception', 'not run')})"
        taus = " ".join(f"{r['method']} {r['tau']:.2f}" for r in side.get("bench", {}).get("rows", []) if "tau" in r)
        return (f"{name:>9}: acc_k {' '.join(f'{a:.3f}' for a in val['acc_k'])}  est. tau {val['tau']:.2f}  steps {side.get('steps')}  "
                f"wall {side.get('wall_s') or 0:.0f}s" + (f"  bench tau {taus}" if taus else ""))
    print(line("eaglekit", report["eaglekit"]))
    print(line("peer", report["peer"]))
    for variant in report.get("variants", []):
        print(line("variant", variant) + f"  ({variant['options']})")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(sys.argv[1:])
