"""Peer-trainer comparison for DSpark: eaglekit's DSpark drafter against one trained by speculators 0.9's own DSpark
trainer on the same tiny-target data, shape, anchors and steps, both decoded by eaglekit (CPU).

    python benchmarks/peer_speculators_dspark.py --out benchmarks/results/latest   # peer_speculators_dspark.json + .md
    python benchmarks/peer_speculators_dspark.py --peer-loss-fn kl_div --out X     # speculators' default loss instead
    python benchmarks/peer_speculators_dspark.py --smoke                           # toy sizes, a temporary folder

1. eaglekit's side is benchmarks/dspark_tiny.py's run (`train_drafters`, DSpark alone): the target's greedy answers
   to the shipped prompts, extracted, vocabulary, `eaglekit train drafter_type=dspark`. With the default --work it is
   the very run dspark_tiny.py made (finished stages are skipped; their wall times are kept).
2. The run's store in speculators' offline layout (`peer_speculators_convert.convert`: eaglekit's training records,
   then its validation records, `--train-data-ratio` cutting between them; the final state un-normed), the packing
   planned to give eaglekit's tokens per step (`plan_peer`), then `speculators train --speculator-type dspark` in its
   own Python (`--peer-python`; on a CPU through `CPU_LAUNCHER`) with eaglekit's shape (layers, block, target layers,
   mask token, Markov rank and head, confidence head and its inputs), anchors per step (batch_size x num_anchors
   blocks in one packed row), step decay (its gamma = -1 / ln step_decay), lr, warmup and cosine schedule, seed and
   number of optimizer steps. Its loss is its own (`--peer-loss-fn`, default `{"ce": 0.1, "tv": 1.8}`: DeepSpec's
   weights, which eaglekit trains with, in speculators' terms; `kl_div` is speculators' default), plus its confidence
   BCE (alpha 1.0, eaglekit's weight).
3. The final checkpoint imported by `eaglekit import` (the speculators layout read as a DSpark drafter), both drafters
   validated by eaglekit's `Trainer.validate` on the same split and decoded by `dspark_tiny.Bench` (held-out prompts,
   every draft of the block, T=0 and T=1: tau, acceptance per position, the confidence at decode), with each
   trainer's wall time (eaglekit: its train stage; speculators: its process, start-up and per-epoch validation
   included) and speculators' median step time from its log.
4. JSON: both sides, commands, settings of each, `not_matched` (what speculators' trainer cannot be driven to match,
   and why); a short .md beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also when loaded by file path
import dspark_tiny  # noqa: E402
from peer_speculators import eaglekit_context, eaglekit_tokens_per_step, evaluate  # noqa: E402
from peer_speculators_convert import convert, final_norm_weight  # noqa: E402
from peer_speculators_trainer import PEER_VERSION, peer_versions, plan_peer, shown, train_command, train_peer  # noqa: E402

DEEPSPEC_LOSS = '{"ce": 0.1, "tv": 1.8}'  # eaglekit's 0.1 CE + 0.9 L1 (= 1.8 TV) in speculators' loss terms


def default_peer_python() -> str:
    """$EAGLEKIT_SPECULATORS_PYTHON, else the checkout's .venv-speculators (what `make speculators-env` builds)."""
    checkout = Path(__file__).resolve().parents[1] / ".venv-speculators" / "bin" / "python"
    return os.environ.get("EAGLEKIT_SPECULATORS_PYTHON") or str(checkout)


def peer_settings(args: Any, trainer: Any, data: Path, save: Path, plan: dict[str, Any], conv: dict[str, Any],
                  store_aux_ids: list[int]) -> dict[str, Any]:
    """speculators train's flags for eaglekit's DSpark drafter and training options."""
    from eaglekit.targets.loading import resolve_target

    c, d = trainer.config, trainer.drafter.config
    assert [i + 1 for i in d.target_layer_ids] == store_aux_ids, (d.target_layer_ids, store_aux_ids)
    warmup = c.warmup_steps if c.warmup_steps >= 0 else round(0.03 * args.steps)
    return {
        "speculator-type": "dspark", "verifier-name-or-path": resolve_target(c.target), "data-path": str(data),
        "save-path": str(save), "log-dir": str(save.parent / "logs"), "seed": c.seed,
        "target-layer-ids": store_aux_ids,  # speculators' ids are input-of-layer (vLLM's aux ids), as the store's
        "num-layers": d.num_hidden_layers, "draft-arch": "qwen3", "draft-hidden-act": d.hidden_act,
        "full-attention-indices": list(range(d.num_hidden_layers)),  # DeepSpec's and eaglekit's full attention
        "draft-attn-impl": "eager",  # its flex attention compiles its mask; eager runs on a CPU
        "block-size": d.block_size, "sample-from-anchor": d.sample_from_anchor, "mask-token-id": d.mask_token_id,
        "markov-rank": d.markov_rank, "markov-head-type": d.markov_head_type,
        "enable-confidence-head": d.confidence_head, "confidence-head-with-markov": d.confidence_head_with_markov,
        "confidence-head-alpha": 1.0,  # eaglekit's confidence BCE weight (DeepSpec's)
        "dflash-decay-gamma": -1.0 / math.log(c.step_decay),  # exp(-k / gamma) = step_decay ** k
        "per-position-loss-weight": "fixed-exp-decay", "loss-fn": args.peer_loss_fn, "loss-implementation": "eager",
        "max-anchors": c.batch_size * c.grad_accum * c.num_anchors,  # eaglekit's blocks per step, in one packed row
        "optimizer": "adamw", "lr": c.lr, "weight-decay": c.weight_decay,
        "scheduler-type": "cosine", "scheduler-warmup-steps": warmup, "scheduler-total-steps": args.steps,
        "epochs": plan["epochs"], "max-steps": args.steps, "total-seq-len": plan["packed"],
        "train-data-ratio": conv["train_data_ratio"], "hidden-states-dtype": "float32", "num-workers": 0,
        "on-missing": "raise", "no-resume-from-checkpoint": True, "log-freq": 1,
    }


def not_matched(trainer: Any, settings: dict[str, Any], eaglekit_tps: float, plan: dict[str, Any],
                peer_loss: str) -> list[dict[str, str]]:
    """What speculators 0.9's DSpark trainer cannot be driven to match (each with why), for this comparison."""
    c = trainer.config
    loss = ("speculators' `ce` labels are the target's argmax, not the data token (here the data are the target's own "
            "greedy answers, so the two agree where regen and extract agree); it weighs slot k by exp(-k / gamma) "
            "inside one sum over every slot divided by the slots' undecayed count (eaglekit: each position's mean over "
            "its own blocks, weighted step_decay**k, summed), masks slot k by the input position p+k, and counts every "
            "masked slot of a block, where eaglekit counts a block's contiguous prefix only")
    if peer_loss != DEEPSPEC_LOSS:
        loss = f"speculators trained with --loss-fn {peer_loss}, eaglekit with DeepSpec's 0.1 CE + 0.9 L1; " + loss
    out = [
        {"setting": "loss", "why": loss},
        {"setting": "anchors", "why": f"speculators draws --max-anchors {settings['max-anchors']} blocks per packed "
         "row (positions with loss_mask[a], none in the row's last block_size positions; a block near a record's end "
         f"may read the next packed record's labels); eaglekit draws num_anchors={c.num_anchors} per record (positions "
         f"with m[a+1]) for {c.batch_size * c.grad_accum} records a step: the same blocks per step, drawn differently"},
        {"setting": "batching", "why": f"eaglekit steps on {c.batch_size * c.grad_accum} padded records "
         f"({eaglekit_tps:.0f} tokens/step on average); speculators packs records into one row of --total-seq-len "
         f"{plan['packed']} ({plan['tokens_per_step']:.0f} tokens/step on average; no record batch size or "
         "accumulation option); shuffling and packing orders differ"},
        {"setting": "lm_head", "why": "speculators keeps the target's lm_head frozen (speculators/model.py, no "
         f"option); eaglekit starts from it and {'keeps it frozen' if c.freeze_lm_head else 'trains it'} "
         f"(lm_head_init={c.lm_head_init}, freeze_lm_head={str(c.freeze_lm_head).lower()})"},
        {"setting": "initialisation", "why": "speculators draws the backbone's linear layers from N(0, 0.02) and W2 "
         "with torch's default (uniform, bound 1/sqrt(r)); eaglekit keeps torch's default for the backbone "
         f"(init_std={c.init_std}) and starts W2 at 0 (its first drafts are the backbone's); W1 ~ N(0, 0.01) in both; "
         "the random streams differ (the same seed does not give the same weights)"},
        {"setting": "schedule", "why": f"both warm up linearly ({settings['scheduler-warmup-steps']} steps) then decay "
         "by a cosine, but transformers' warmup starts at lr 0 where eaglekit starts at lr/(warmup+1)"
         + (f"; eaglekit decays to lr x {c.min_lr_ratio}, speculators to 0" if c.min_lr_ratio else "")},
        {"setting": "calibration", "why": "speculators ships no calibration: its drafter decodes with the raw "
         "confidence head (no confidence_temperatures after import); eaglekit calibrates per position on its "
         "validation split"},
        {"setting": "precision", "why": "speculators saves its checkpoints in bf16 (train/checkpointer.py), so its "
         "drafter is measured with bf16-rounded weights; eaglekit's is stored in fp32"},
        {"setting": "wall time", "why": "speculators' wall is its whole process (imports, data loading, a validation "
         "pass and a checkpoint after each epoch, eager attention under CPU_LAUNCHER); eaglekit's is its train stage "
         "(the target's embedding and lm_head read, validation each epoch, the calibration)"},
    ]
    if tuple(c.betas) != (0.9, 0.999):
        out.append({"setting": "optimizer", "why": f"AdamW betas (0.9, 0.999) in speculators (no option); eaglekit "
                    f"{tuple(c.betas)}"})
    if c.grad_clip != 1.0:
        out.append({"setting": "gradient clipping", "why": f"1.0 in speculators (no option); eaglekit {c.grad_clip}"})
    return out


def step_ms(log: Path) -> float | None:
    """speculators' median `profile/step_ms` over its logged steps (its own timer)."""
    found = [float(v) for v in re.findall(r"profile/step_ms=([0-9.]+)", log.read_text())] if log.is_file() else []
    return statistics.median(found) if found else None


def import_peer(checkpoint: str, output: Path) -> dict[str, Any]:
    """`eaglekit import CHECKPOINT target=tiny output=OUTPUT`, the stage as the command line runs it."""
    from eaglekit.config import load_config
    from eaglekit.stages import import_ as import_stage

    config = load_config(import_stage.Config, None, [f"source={checkpoint}", "target=tiny", f"output={output}",
                                                     "overwrite=true"])
    import_stage.run(config)
    return {"command": ["eaglekit", "import", checkpoint, "target=tiny", f"output={output}"], "drafter": str(output)}


def validated(trainer: Any, folder: str, embedding: torch.Tensor) -> dict[str, Any]:
    """eaglekit's validation (`Trainer.validate`) of the drafter saved in `folder`; a drafter saved without its
    embedding (what `eaglekit import` writes: the engines share the target's) gets the target's `embedding`, as
    decoding gives it (a zero embedding would validate a drafter that reads nothing of its block's tokens)."""
    from eaglekit.formats.saved import load_saved_drafter

    drafter = load_saved_drafter(folder, torch.device("cpu"))
    if not bool(drafter.embed_tokens.weight.any()):
        drafter.load_target_embedding(embedding)
    assert bool(drafter.embed_tokens.weight.any()), folder
    return evaluate(trainer, drafter)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# eaglekit's DSpark trainer against speculators {report['versions']['peer'].get('speculators', '?')} "
             f"({report['environment'].get('commit', '?')[:12]}, CPU)", "", f"`{' '.join(report['commands']['this'])}`",
             "", f"Status: {report['status']}. speculators' loss: `{report['settings']['peer'].get('loss-fn')}`.", "",
             "| trainer | wall s | steps | step ms (median) | val accuracy per position | val est. tau |",
             "|---|---|---|---|---|---|"]
    for name in ("eaglekit", "peer"):
        side = report.get(name) or {}
        val = side.get("val") or {}
        ms = "-" if side.get("step_ms") is None else f"{side['step_ms']:.0f}"
        tau = "-" if "tau" not in val else f"{val['tau']:.2f}"
        lines.append(f"| {name} | {side.get('wall_s') or 0:.0f} | {side.get('steps')} | {ms} | "
                     f"{dspark_tiny.fmt(val.get('acc_k'))} | {tau} |")
    rows = [r for name in ("eaglekit", "peer") for r in (report.get(name) or {}).get("rows", [])]
    lines += ["", *dspark_tiny.rows_table(rows), "", "Not matched:", ""]
    lines += [f"- {item['setting']}: {item['why']}" for item in report.get("not_matched", [])]
    return "\n".join(lines) + "\n"


# ---- main -------------------------------------------------------------------------------------------

def parse(argv: list[str]) -> tuple[Any, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="folder for peer_speculators_dspark.json and .md (default "
                        "runs/benchmarks; --smoke: a temporary folder)")
    parser.add_argument("--work", default="", help=f"the eaglekit run (default {dspark_tiny.WORK}, dspark_tiny.py's; "
                        "--smoke: OUT/work); the peer's files go to WORK/peer_speculators_dspark")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: checks the script, no figures")
    parser.add_argument("--peer-python", default=default_peer_python(),
                        help=f"a Python with speculators=={PEER_VERSION} (default $EAGLEKIT_SPECULATORS_PYTHON, else "
                             "the venv `make speculators-env` builds)")
    parser.add_argument("--peer-loss-fn", default=DEEPSPEC_LOSS,
                        help="speculators --loss-fn (default DeepSpec's weights in its terms; kl_div: its default)")
    dspark_tiny.add_settings(parser)
    args = parser.parse_args(argv)
    base = dspark_tiny.SMOKE if args.smoke else dspark_tiny.Settings(thresholds=(0.0,))  # the raw peer head: no cut
    return args, dspark_tiny.chosen_settings(args, base)


def decode_rows(bench: Any, name: str, folder: str, settings: Any) -> list[dict[str, Any]]:
    """Every draft of the block at each temperature and threshold (`dspark_tiny.Bench.row`)."""
    decoder = bench.decoder(folder)
    block = decoder.drafter.config.max_drafts
    return [{"drafter": name, **bench.row(decoder, "dspark", block, temperature, threshold)}
            for temperature in settings.temperatures for threshold in settings.thresholds]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from eaglekit.config import to_dict
    from eaglekit.manifest import atomic_write_json, atomic_write_text, environment

    argv = sys.argv[1:] if argv is None else argv
    args, settings = parse(argv)
    dspark_tiny.show_progress()
    versions = peer_versions(args.peer_python)
    out = dspark_tiny.output_folder(args.out, args.smoke, "peer_speculators_dspark")
    work = Path(args.work) if args.work else (out / "work" if args.smoke else Path(dspark_tiny.WORK))
    peer_work = work / "peer_speculators_dspark"
    started = time.perf_counter()
    training = dspark_tiny.train_drafters(settings, work, kinds=("dspark",))
    ours = training["drafters"]["dspark"]
    args.steps = ours["steps"]
    report: dict[str, Any] = {
        "benchmark": "peer_speculators_dspark", "smoke": args.smoke,
        "settings": {"benchmark": dataclasses.asdict(settings)},
        "commands": {"this": ["python", "benchmarks/peer_speculators_dspark.py", *argv], "run": training["command"]},
        "environment": {**environment(), "cpu_threads": torch.get_num_threads()},
        "versions": {"peer": versions, "eaglekit_torch": torch.__version__}, "data": training["data"]}
    with contextlib.ExitStack() as stack:
        trainer = eaglekit_context(work, "cpu", peer_work, stack)
        embedding = trainer.drafter.embed_tokens.weight.detach().clone()  # the target's (frozen in training)
        tokens_per_step = eaglekit_tokens_per_step(trainer, args.steps)
        conv = convert(trainer, final_norm_weight(trainer.config.target), peer_work / "data", torch.float32)
        lengths, seed = conv.pop("train_lengths"), trainer.config.seed
        plan = plan_peer(args.peer_python, lengths, args.steps, tokens_per_step, seed, 1)  # 1: eager attention
        store_ids = json.loads((work / "extract" / "manifest.json").read_text())["aux_layer_ids"]
        save = peer_work / "peer" / "checkpoints"
        flags = peer_settings(args, trainer, peer_work / "data", save, plan, conv, store_ids)
        command = train_command(args.peer_python, flags, cuda=False)
        report["settings"].update(peer=flags, eaglekit=ours["config"], eaglekit_train=to_dict(trainer.config))
        report["commands"]["peer_train"] = shown(command)
        report["conversion"] = {k: v for k, v in conv.items() if k != "val_ids"}
        report["not_matched"] = not_matched(trainer, flags, tokens_per_step, plan, args.peer_loss_fn)
        peer = train_peer(command, save, "cpu", lambda: None)
        peer.update(planned_steps=args.steps, planned_epochs=plan["epochs"], tokens_per_step=plan["tokens_per_step"],
                    step_ms=step_ms(Path(peer["log"])))
        report["eaglekit"] = {"drafter": ours["drafter"], "wall_s": ours["train_wall_s"], "steps": ours["steps"],
                              "tokens_per_step": tokens_per_step, "manifest_val": ours["val"],
                              "val": validated(trainer, ours["drafter"], embedding)}
        report["peer"] = peer
        if "error" not in peer:
            peer.update(import_peer(peer["checkpoint"], peer_work / "peer_eaglekit"))
            peer["val"] = validated(trainer, peer["drafter"], embedding)
            if peer.get("steps") != args.steps:
                report["not_matched"].append({"setting": "steps", "why": f"speculators performed {peer.get('steps')} "
                                              f"optimizer steps, {args.steps} were asked"})
    bench = dspark_tiny.Bench.load(settings.prompts, settings.max_new_tokens)
    report["eaglekit"]["rows"] = decode_rows(bench, "eaglekit", ours["drafter"], settings)
    if "error" not in peer:
        peer["rows"] = decode_rows(bench, "speculators", peer["drafter"], settings)
    report["status"] = "peer_failed" if "error" in peer else "ok"
    report["wall_s"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "peer_speculators_dspark.json", report)
    atomic_write_text(out / "peer_speculators_dspark.md", markdown(report))
    print(markdown(report))
    if "error" in peer:
        e = peer["error"]
        raise SystemExit(f"speculators' trainer failed ({e.get('where', '?')}: {e['exception']}); eaglekit's figures "
                         f"are in {out / 'peer_speculators_dspark.json'}; full log: {peer['log']}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
