"""DFlash against DSpark on the built-in tiny target (CPU): the same data, backbone and training budget, both trained by
eaglekit, both decoded by eaglekit's decoder on prompts neither was trained on.

    python benchmarks/dspark_tiny.py --out benchmarks/results/latest      # dspark_tiny.json + .md (minutes, CPU)
    python benchmarks/dspark_tiny.py --steps 800 --block-size 7 --out X   # another budget or block
    python benchmarks/dspark_tiny.py --smoke                              # toy sizes, seconds, a temporary folder

1. Data and training: one `eaglekit run` into --work (`stages=regen,extract,vocab,train`,
   `drafter_types=dspark,dflash`): the target regenerates its own greedy answers to the shipped prompts
   (`data=tiny`), extract stores its states, the vocabulary is the target's whole vocabulary, and the train section
   (block_size, draft_layers, num_anchors, lr, steps, seed, batch, validation split) is the one both drafters train
   with: DSpark into train/, DFlash into train-dflash/, each from scratch (DSpark's backbone starts from the same
   seeded weights as DFlash's; its heads are added on top). Re-running with the same settings skips the finished
   stages (their wall times are kept).
2. Decoding (`eaglekit.decode.Decoder`, eager backend, batch 1) of the held-out prompts (`tiny-eval`, never trained
   on) at each temperature: DFlash over its whole block (block_size - 1 drafts); DSpark over its whole block
   (block_size drafts, every slot drafts) at each `verify_threshold`, and at block_size - 1 drafts (DFlash's count).
   Per row: tau (tokens per target forward), acceptance per drafted position (a draft left unverified by the cut
   counts as rejected), drafts verified per step and accepted / verified (`DecodeStats.verified`; every draft when
   the threshold is 0). At T=0 every row's tokens are compared with plain greedy decoding (lossless check).
3. Calibration: the DSpark train manifest's `after_training` (ECE and AUC per position on the validation split,
   raw and after sequential temperature scaling) and, at threshold 0, the same measures on the decode itself: the
   calibrated survival the drafter predicted for each draft against whether it was accepted.

Writes --out/dspark_tiny.json (settings, commands, environment and commit, every figure) and dspark_tiny.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

KINDS = ("dspark", "dflash")  # the run's own drafter (train/) first, so a DSpark run is what peer comparisons read
FOLDERS = {"dspark": "train", "dflash": "train-dflash"}
METHODS = {"dspark": "dspark", "dflash": "dflash"}
WORK = "runs/benchmarks/dspark_tiny"  # the eaglekit run both benchmarks share by default


@dataclasses.dataclass(frozen=True)
class Settings:
    records: int = 200  # shipped prompts regenerated and trained on (0 = all 200)
    new_tokens: int = 96  # the target's answer per prompt (regen)
    steps: int = 400  # optimizer steps, each drafter
    block_size: int = 6
    draft_layers: int = 2
    num_anchors: int = 32  # blocks per sequence and batch
    markov_rank: int = 64  # DSpark's Markov head (256 by default: larger than this 2-layer backbone)
    lr: float = 1e-3
    seed: int = 0
    batch_size: int = 4
    val_fraction: float = 0.1  # DSpark calibrates its confidence head on it
    prompts: int = 30  # held-out prompts decoded (tiny-eval holds 30)
    max_new_tokens: int = 64
    thresholds: tuple[float, ...] = (0.0, 0.3, 0.5, 0.7)
    temperatures: tuple[float, ...] = (0.0, 1.0)


SMOKE = Settings(records=12, new_tokens=16, steps=2, block_size=3, draft_layers=1, num_anchors=4, markov_rank=8,
                 val_fraction=0.25, prompts=2, max_new_tokens=8, thresholds=(0.0, 0.5), temperatures=(0.0,))


# ---- data and training ------------------------------------------------------------------------------

def run_overrides(settings: Settings, work: Path, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """`eaglekit run` options: regen, extract, vocab and the one train section every drafter of `kinds` uses."""
    s = settings
    return ["target=tiny", "data=tiny", f"out={work}", "device=cpu", "stages=[regen,extract,vocab,train]",
            f"drafter_types=[{','.join(kinds)}]", f"regen.max_new_tokens={s.new_tokens}", "regen.batch_size=40",
            f"regen.limit={s.records}", "regen.temperature=0", "extract.max_length=512", "extract.dtype=fp32",
            "vocab.size=4096", f"train.block_size={s.block_size}", f"train.draft_layers={s.draft_layers}",
            f"train.num_anchors={s.num_anchors}", f"train.markov_rank={s.markov_rank}", f"train.max_steps={s.steps}",
            f"train.lr={s.lr}", f"train.seed={s.seed}", f"train.batch_size={s.batch_size}", "train.max_length=512",
            f"train.val_fraction={s.val_fraction}", "train.dtype=fp32", "train.log_every=50", "train.save_every=0"]


def train_drafters(settings: Settings, work: Path, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """One `eaglekit run` (regen, extract, vocab, then each drafter of `kinds`) -> what each stage took and made."""
    from eaglekit.config import load_config
    from eaglekit.stages import run as run_stage

    overrides = run_overrides(settings, work, kinds)
    result = run_stage.run(load_config(run_stage.Config, None, overrides))
    steps = {s["stage"]: s for s in result["steps"]}
    extract = json.loads((work / "extract" / "manifest.json").read_text())
    regen = json.loads((work / "regen" / "stats.json").read_text())
    vocab = json.loads((work / "vocab" / "manifest.json").read_text())
    drafters = {}
    for kind in kinds:
        folder = work / FOLDERS[kind]
        manifest = json.loads((folder / "manifest.json").read_text())
        stage = steps[folder.name]  # the run names a train step by its folder
        drafters[kind] = {"drafter": str(folder), "train_wall_s": stage["seconds"],
                          "trained_now": stage["status"] == "ran",
                          "steps": manifest["steps"], "passes": manifest.get("passes"), "val": manifest.get("val"),
                          "after_training": manifest.get("after_training"),
                          "config": json.loads((folder / "config.json").read_text())}
    return {"command": ["eaglekit", "run", *overrides],
            "data": {"regen": {k: regen.get(k) for k in ("generated", "completion_tokens", "seconds")},
                     "records": extract.get("num_records"), "tokens": extract.get("num_tokens"),
                     "answer_tokens": vocab.get("tokens_counted"),
                     "distinct_answer_tokens": vocab.get("distinct_tokens"),
                     "stage_seconds": {name: s["seconds"] for name, s in steps.items()
                                       if not name.startswith("train")}},
            "drafters": drafters}


# ---- decoding ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Bench:
    """The target, the held-out prompts and plain greedy decoding of each (the lossless check at T=0)."""

    target: Any
    prompts: list[list[int]]
    eos: tuple[int, ...]
    max_new_tokens: int
    greedy: list[list[int]] = dataclasses.field(default_factory=list)

    @classmethod
    def load(cls, num_prompts: int, max_new_tokens: int) -> "Bench":
        from eaglekit.data import prompt_messages, read_conversations
        from eaglekit.data.readers import SHIPPED_DATA
        from eaglekit.decode import generate
        from eaglekit.decode.setup import eos_ids, prompt_ids
        from eaglekit.targets.loading import load_target, load_tokenizer

        target = load_target("tiny", torch.device("cpu"), torch.float32)
        tokenizer = load_tokenizer("tiny")
        conversations = read_conversations([str(SHIPPED_DATA["tiny-eval"])])[:num_prompts]
        bench = cls(target, [prompt_ids(tokenizer, prompt_messages(c)) for c in conversations],
                    eos_ids(tokenizer, target), max_new_tokens)
        bench.greedy = [generate(target, None, ids, max_new_tokens, method="plain", eos_token_ids=bench.eos).tokens
                        for ids in bench.prompts]
        return bench

    def decoder(self, drafter_dir: str) -> Any:
        from eaglekit.decode import Decoder
        from eaglekit.decode.setup import load_drafter

        drafter = load_drafter(drafter_dir, self.target, torch.device("cpu"), torch.float32, target_name="tiny")
        return Decoder(self.target, drafter, "eager", max_length=max(map(len, self.prompts)) + self.max_new_tokens + 16)

    def row(self, decoder: Any, method: str, chain_length: int, temperature: float,
            threshold: float = 0.0) -> dict[str, Any]:
        """Every prompt decoded once with these options -> the row's figures (module docstring)."""
        accepted, verified, survival, equal, started = [], [], [], 0, time.perf_counter()
        for ids, greedy in zip(self.prompts, self.greedy):
            result = decoder.generate(ids, self.max_new_tokens, method=method, chain_length=chain_length,
                                      temperature=temperature, verify_threshold=threshold, eos_token_ids=self.eos,
                                      seed=0)
            stats = result.stats
            accepted += stats.accepted
            verified += stats.verified or [chain_length] * len(stats.accepted)  # no cut: every draft is verified
            survival += stats.survival
            equal += result.tokens == greedy
        steps = max(len(accepted), 1)
        row: dict[str, Any] = {
            "method": method, "chain_length": chain_length, "temperature": temperature, "verify_threshold": threshold,
            "prompts": len(self.prompts), "steps": len(accepted),
            "tau": sum(a + 1 for a in accepted) / steps,
            "acceptance_per_position": [sum(a > i for a in accepted) / steps for i in range(chain_length)],
            "drafts_verified_per_step": sum(verified) / steps,
            "accepted_per_step": sum(accepted) / steps,
            "acceptance_rate": sum(accepted) / sum(verified) if sum(verified) else None,
            "seconds": time.perf_counter() - started}
        if temperature == 0:
            row["prompts_equal_to_plain_greedy"] = equal
        if survival and threshold == 0:
            row["decode_calibration"] = decode_calibration(survival, accepted)
        return row


def decode_calibration(survival: list[list[float]], accepted: list[int]) -> list[dict[str, Any]]:
    """Per drafted position k: the mean calibrated survival the drafter predicted for its draft k, the share of steps
    that accepted it, ECE and AUC of that prediction (the calibration module's measures)."""
    from eaglekit.drafters.dspark.calibration import auc, expected_calibration_error

    predicted = torch.tensor(survival, dtype=torch.float64)  # (steps, k)
    survived = torch.tensor([[float(a > k) for k in range(predicted.shape[1])] for a in accepted], dtype=torch.float64)
    return [{"position": k + 1, "predicted": float(predicted[:, k].mean()), "observed": float(survived[:, k].mean()),
             "ece": expected_calibration_error(predicted[:, k], survived[:, k]),
             "auc": auc(predicted[:, k], survived[:, k])}
            for k in range(predicted.shape[1])]


def bench_drafters(bench: Bench, drafters: dict[str, str], settings: Settings) -> list[dict[str, Any]]:
    """The rows of the module docstring's step 2 for the drafters {kind: folder} (a DSpark one, a DFlash one)."""
    rows = []
    for kind, folder in drafters.items():
        decoder = bench.decoder(folder)
        block = decoder.drafter.config.block_size
        for temperature in settings.temperatures:
            if kind == "dflash":
                rows.append({"drafter": kind, **bench.row(decoder, METHODS[kind], block - 1, temperature)})
                continue
            for threshold in settings.thresholds:
                rows.append({"drafter": kind, **bench.row(decoder, METHODS[kind], block, temperature, threshold)})
            rows.append({"drafter": kind, **bench.row(decoder, METHODS[kind], block - 1, temperature)})
        print(f"decoded with {kind} ({folder})", flush=True)
    return rows


# ---- report -----------------------------------------------------------------------------------------

def fmt(values: list[float] | None) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "-"


def rows_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| drafter | method | drafts | T | threshold | tau | verified / step | accepted / verified | "
             "acceptance per position | = greedy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        equal = f"{r['prompts_equal_to_plain_greedy']}/{r['prompts']}" if "prompts_equal_to_plain_greedy" in r else "-"
        lines.append(f"| {r['drafter']} | {r['method']} | {r['chain_length']} | {r['temperature']:g} | "
                     f"{r['verify_threshold']:g} | {r['tau']:.3f} | {r['drafts_verified_per_step']:.2f} | {rate} | "
                     f"{fmt(r['acceptance_per_position'])} | {equal} |")
    return lines


def calibration_table(after: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[str]:
    if not after or not after.get("positions"):
        return ["DSpark's confidence head was not calibrated (no validation split)."]
    lines = [f"Validation split ({after.get('blocks')} blocks), then the decode at T=1 and T=0 (threshold 0):", "",
             "| position | temperature | ECE raw | ECE | AUC | decode T=1: predicted / observed, ECE | "
             "decode T=0: predicted / observed, ECE |", "|---|---|---|---|---|---|---|"]
    whole = len(after["positions"])  # the rows over the whole block
    decoded = {r["temperature"]: r["decode_calibration"] for r in rows
               if r["drafter"] == "dspark" and "decode_calibration" in r and r["chain_length"] == whole}

    def at(temperature: float, k: int) -> str:
        found = decoded.get(temperature)
        if not found or k >= len(found):
            return "-"
        return f"{found[k]['predicted']:.3f} / {found[k]['observed']:.3f}, {found[k]['ece']:.3f}"

    for k, p in enumerate(after["positions"]):
        area = "-" if p.get("auc") is None else f"{p['auc']:.3f}"
        lines.append(f"| {p['position']} | {p['temperature']:.3f} | {p['ece_raw']:.3f} | {p['ece']:.3f} | {area} | "
                     f"{at(1.0, k)} | {at(0.0, k)} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    s, training = report["settings"], report["training"]
    lines = [f"# DFlash against DSpark on the tiny target ({report['environment'].get('commit', '?')[:12]}, CPU)", "",
             f"`{' '.join(report['commands']['this'])}`", "",
             f"Trained on the target's greedy answers to {training['data']['records']} shipped prompts "
             f"({training['data']['tokens']} tokens; the answers use {training['data']['distinct_answer_tokens']} "
             f"distinct token ids); {s['steps']} steps each, block {s['block_size']}, "
             f"{s['draft_layers']} layers, {s['num_anchors']} anchors, lr {s['lr']}, seed {s['seed']}; decoded on "
             f"{s['prompts']} held-out prompts, {s['max_new_tokens']} new tokens each, eager backend.", "",
             "| drafter | train wall s | steps | val accuracy per position | val est. tau |", "|---|---|---|---|---|"]
    for kind, d in training["drafters"].items():
        val = d.get("val") or {}
        lines.append(f"| {kind} | {d['train_wall_s']:.0f} | {d['steps']} | {fmt(val.get('acc_k'))} | "
                     f"{val.get('tau', float('nan')):.2f} |")
    lines += ["", *rows_table(report["rows"]), "", "## DSpark's confidence", "",
              *calibration_table(training["drafters"].get("dspark", {}).get("after_training"), report["rows"]), ""]
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------------

def add_settings(parser: argparse.ArgumentParser) -> None:
    """One option per `Settings` field (--steps, --block-size, ...; a tuple takes several values)."""
    for field in dataclasses.fields(Settings):
        value = getattr(Settings(), field.name)
        kind = type(value[0]) if isinstance(value, tuple) else type(value)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, nargs="+" if isinstance(value, tuple)
                            else None, default=None, help=f"default {value} (--smoke: {getattr(SMOKE, field.name)})")


def chosen_settings(args: Any, base: Settings) -> Settings:
    """`base` with the options given on the command line."""
    chosen = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in chosen.items()})


def show_progress() -> None:
    """eaglekit's stage logs on stderr, as the command line shows them."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("eaglekit").setLevel(logging.INFO)


def output_folder(out: str, smoke: bool, name: str) -> Path:
    """--out, else runs/benchmarks (a smoke run: a fresh temporary folder, never the results)."""
    if out:
        return Path(out)
    return Path(tempfile.mkdtemp(prefix=f"{name}_smoke_")) if smoke else Path("runs/benchmarks")


def parse(argv: list[str]) -> tuple[Any, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="folder for dspark_tiny.json and dspark_tiny.md (default "
                        "runs/benchmarks; --smoke: a temporary folder)")
    parser.add_argument("--work", default="", help=f"the eaglekit run's folder (default {WORK}; --smoke: OUT/work)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (seconds): checks the script, no figures")
    add_settings(parser)
    args = parser.parse_args(argv)
    return args, chosen_settings(args, SMOKE if args.smoke else Settings())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from eaglekit.manifest import atomic_write_json, atomic_write_text, environment

    argv = sys.argv[1:] if argv is None else argv
    args, settings = parse(argv)
    show_progress()
    out = output_folder(args.out, args.smoke, "dspark_tiny")
    work = Path(args.work) if args.work else (out / "work" if args.smoke else Path(WORK))
    started = time.perf_counter()
    training = train_drafters(settings, work)
    bench = Bench.load(settings.prompts, settings.max_new_tokens)
    rows = bench_drafters(bench, {kind: d["drafter"] for kind, d in training["drafters"].items()}, settings)
    report = {"benchmark": "dspark_tiny", "smoke": args.smoke, "settings": dataclasses.asdict(settings),
              "commands": {"this": ["python", "benchmarks/dspark_tiny.py", *argv], "run": training.pop("command")},
              "environment": {**environment(), "cpu_threads": torch.get_num_threads()},
              "training": training, "bench_prompts": "tiny-eval (src/eaglekit/assets/tiny_prompts_eval.jsonl)",
              "backend": "eager", "rows": rows, "wall_s": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "dspark_tiny.json", report)
    atomic_write_text(out / "dspark_tiny.md", markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
