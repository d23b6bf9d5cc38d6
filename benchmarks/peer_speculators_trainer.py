"""speculators' side of benchmarks/peer_speculators.py: its trainer planned, launched (also on a CPU), its failures
read, its checkpoint imported, and the settings it does not let the comparison match.

Every function here runs speculators in its own Python (`--peer-python`) as a subprocess: nothing imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

PEER_VERSION = "0.9.0"
INSTALL_HINT = f"make speculators-env (a venv .venv-speculators with speculators=={PEER_VERSION}; see the Makefile)"
# speculators' flex-attention TTT mask grows by whole 128-token blocks (models/eagle3/attention.py,
# extend_mask_for_draft_tokens), so a packed length off that grid fails at the second TTT step (on an H200:
# "block_mask was created for ... (1, 1, 768, 1536) but got q_len=648 and kv_len=1296")
FLEX_BLOCK = 128
# Runs in the peer's Python: speculators' own packing sampler, to pick the packed length (tokens per step) and the
# number of epochs after which --max-steps stops (speculators starts every later epoch with one more step).
PLAN_SNIPPET = r"""
import json, sys
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Sampler
a = json.load(sys.stdin)
lengths, steps = a["lengths"], a["steps"]
def plan(packed):
    epochs, done, tokens = 0, 0, 0
    while done < steps:
        sampler = Sampler(batch_max_length=packed, lengths=lengths, num_replicas=1, rank=0, seed=a["seed"])
        sampler.set_epoch(epochs)
        batches = list(sampler)
        if not batches:
            raise SystemExit(f"packed length {packed} gives no batch")
        for batch in batches[: steps - done]:
            tokens += sum(min(lengths[i], packed) for i in batch)
        done, epochs = done + min(len(batches), steps - done), epochs + 1
    return {"packed": packed, "epochs": epochs, "tokens_per_step": tokens / steps}
def up(n):  # flex attention's block mask needs a whole number of blocks
    return -(-n // a["multiple"]) * a["multiple"]
packed = up(max(a["longest"], round(a["tokens_per_step"])))
tried = [plan(packed)]
for _ in range(3):  # packing leaves slack: scale the length until a step holds eaglekit's tokens per step
    packed = up(max(a["longest"], round(tried[-1]["packed"] * a["tokens_per_step"] / tried[-1]["tokens_per_step"])))
    if any(t["packed"] == packed for t in tried):
        break
    tried.append(plan(packed))
print(json.dumps(min(tried, key=lambda t: abs(t["tokens_per_step"] - a["tokens_per_step"]))))
"""

# Runs `python -m speculators ARGS` on a machine without an accelerator. speculators 0.9.0 trains on `local_rank`,
# an accelerator index (train/trainer.py:348 `self.model.to(self.local_rank)`, batches at :533), and its step timer
# calls torch.accelerator.synchronize() (:80); here an integer device means the CPU and synchronising is a no-op.
# Nothing else of speculators changes: its model, loss (eager), data, packing, optimizer and schedule run as they are.
CPU_LAUNCHER = r"""
import runpy, sys, torch
def on_cpu(to):
    def moved(self, *args, **kwargs):
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = ("cpu", *args[1:])
        return to(self, *args, **kwargs)
    return moved
torch.accelerator.synchronize = lambda *args, **kwargs: None
torch.nn.Module.to = on_cpu(torch.nn.Module.to)
torch.Tensor.to = on_cpu(torch.Tensor.to)
sys.argv = ["speculators", *sys.argv[1:]]
runpy.run_module("speculators", run_name="__main__", alter_sys=True)
"""

VERSIONS_SNIPPET = ("import json, torch, transformers, speculators.version as v; "
                    "print(json.dumps({'speculators': v.version, 'torch': torch.__version__, 'transformers': transformers.__version__, "
                    "'python': '.'.join(map(str, __import__('sys').version_info[:3]))}))")


def peer_versions(python: str) -> dict[str, str]:
    try:
        out = subprocess.run([python, "-c", VERSIONS_SNIPPET], capture_output=True, text=True, timeout=300)
    except OSError as error:
        raise SystemExit(f"--peer-python {python} cannot run ({error}); install speculators: {INSTALL_HINT}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"--peer-python {python} cannot import speculators ({last}); install it: {INSTALL_HINT}")
    versions = json.loads(out.stdout.strip().splitlines()[-1])
    if versions["speculators"] != PEER_VERSION:
        print(f"warning: speculators {versions['speculators']} found, this comparison was written for {PEER_VERSION}", file=sys.stderr)
    return versions


def plan_peer(python: str, lengths: list[int], steps: int, tokens_per_step: float, seed: int, multiple: int) -> dict[str, Any]:
    """speculators' packed length (a multiple of `multiple`) and epochs for `steps` steps of about `tokens_per_step`."""
    payload = json.dumps({"lengths": lengths, "steps": steps, "tokens_per_step": tokens_per_step, "seed": seed,
                          "longest": max(lengths), "multiple": multiple})
    out = subprocess.run([python, "-c", PLAN_SNIPPET], input=payload, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"planning the peer's packing failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_command(args: Any, trainer: Any, data: Path, save: Path, plan: dict[str, Any], conv: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """`speculators train` with eaglekit's settings; also the settings as a dict for the report."""
    from eaglekit.training.loop import _amp_dtype
    from eaglekit.targets.loading import resolve_target

    c, drafter = trainer.config, trainer.drafter.config
    cuda = args.device.startswith("cuda")
    amp = _amp_dtype(c.dtype, torch.device(args.device))
    warmup = c.warmup_steps if c.warmup_steps >= 0 else round(0.03 * args.steps)
    settings = {
        "speculator-type": "eagle3", "verifier-name-or-path": resolve_target(c.target), "data-path": str(data),
        "save-path": str(save), "log-dir": str(save.parent / "logs"), "seed": c.seed,
        "d2t-path": str(data / "d2t.npy"), "t2d-path": str(data / "t2d.npy"), "draft-vocab-size": drafter.draft_vocab_size,
        "target-layer-ids": list(drafter.aux_layer_ids), "num-layers": 1, "draft-arch": "llama", "draft-hidden-act": drafter.hidden_act,
        "norm-before-residual": drafter.norm_before_residual, "norm-before-fc": False, "norm-output": False,  # eaglekit's drafter
        "full-attention-indices": [0], "draft-attn-impl": "simple_flex_attention" if cuda else "sdpa",
        "ttt-steps": c.ttt_steps, "ttt-step-loss-decay": c.step_decay, "loss-fn": "kl_div",
        "loss-implementation": args.peer_loss,
        "optimizer": "adamw", "lr": c.lr, "weight-decay": c.weight_decay,
        "scheduler-type": "cosine", "scheduler-warmup-steps": warmup, "scheduler-total-steps": args.steps,
        "epochs": plan["epochs"], "max-steps": args.steps, "total-seq-len": plan["packed"],
        "train-data-ratio": conv["train_data_ratio"], "hidden-states-dtype": "float32" if amp is None else "bfloat16",
        "num-workers": args.peer_workers, "on-missing": "raise", "no-resume-from-checkpoint": True, "log-freq": 1,
    }
    return train_command(args.peer_python, settings, cuda), settings


def train_command(python: str, settings: dict[str, Any], cuda: bool) -> list[str]:
    """`speculators train` in `python` with `settings` as its flags (True: `--key`, False: `--no-key`, a list: its
    items); on a machine without CUDA through `CPU_LAUNCHER`."""
    launch = ["-m", "speculators"] if cuda else ["-c", CPU_LAUNCHER]
    cmd = [python, *launch, "train"]
    for key, value in settings.items():
        if value is True:
            cmd.append(f"--{key}")
        elif value is False:
            cmd.append(f"--no-{key}")
        elif isinstance(value, list):
            cmd += [f"--{key}", *map(str, value)]
        else:
            cmd += [f"--{key}", str(value)]
    return cmd


def shown(cmd: list[str]) -> list[str]:
    """The command as printed and reported: the CPU launcher by name."""
    return ["<peer_speculators.CPU_LAUNCHER>" if part == CPU_LAUNCHER else part for part in cmd]


def speculators_error(log: str) -> dict[str, str]:
    """The failing line of speculators' own source (innermost frame) and the exception, from a traceback."""
    frames = re.findall(r'File "[^"]*(speculators/[^"]+)", line (\d+), in (\S+)\n\s*(.*)', log)
    errors = [line.strip() for line in log.splitlines() if re.match(r"^\s*[\w.]*(Error|Exception)\b.*:", line)]
    out = {"exception": errors[-1] if errors else (log.strip().splitlines() or ["no output"])[-1]}
    if frames:
        path, line, function, code = frames[-1]
        out["where"] = f"{path}:{line} in {function}: {code.strip()}"
    return out


def train_peer(cmd: list[str], save: Path, device: str, meanwhile: Callable[[], None]) -> dict[str, Any]:
    """Runs speculators' trainer; `meanwhile()` runs in this process while it trains (the peer is killed if it raises)."""
    shutil.rmtree(save.parent, ignore_errors=True)
    save.parent.mkdir(parents=True)
    env = dict(os.environ, COLUMNS="200", PYTHONUNBUFFERED="1", _TYPER_STANDARD_TRACEBACK="1")  # plain tracebacks
    if not device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ""  # speculators has no device option: it trains on any accelerator it sees
    log_path = save.parent / "speculators_train.log"
    print("peer:", " ".join(shown(cmd)), flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            meanwhile()
        except BaseException:
            process.kill()
            process.wait()
            raise
        code = process.wait()
    result: dict[str, Any] = {"wall_s": time.perf_counter() - started, "returncode": code, "log": str(log_path)}
    if code != 0:
        result["error"] = speculators_error(log_path.read_text())
        return result
    written = save.iterdir() if save.is_dir() else []
    epochs = sorted((p for p in written if p.name.isdigit() and (p / "config.json").is_file()), key=lambda p: int(p.name))
    if not epochs:
        result["error"] = {"exception": f"speculators wrote no checkpoint into {save}"}
        return result
    final = epochs[-1]
    state = json.loads((final / "training_state.json").read_text()) if (final / "training_state.json").is_file() else {}
    own_val = json.loads((final / "val_metrics.json").read_text()) if (final / "val_metrics.json").is_file() else None
    result.update(checkpoint=str(final), steps=state.get("global_step"), epochs=len(epochs), speculators_val=own_val)
    return result


def import_peer(checkpoint: str, output: Path, trainer: Any) -> Any:
    """speculators checkpoint -> eaglekit drafter (eaglekit's import), saved to `output` with the target's embedding."""
    from eaglekit.drafters.eagle3.convert import import_checkpoint

    drafter = import_checkpoint(checkpoint, "speculators").float()
    if not torch.equal(drafter.t2d.cpu(), trainer.drafter.t2d.cpu()):
        raise SystemExit(f"{checkpoint} has another draft vocabulary than eaglekit's: the d2t/t2d files were not used")
    if not bool(drafter.embed_tokens.weight.any()):
        drafter.load_target_embedding(trainer.drafter.embed_tokens.weight.detach().cpu())
    drafter.config = dataclasses.replace(drafter.config, target_name_or_path=trainer.config.target)
    drafter.save_pretrained(output)
    return drafter


def differences(args: Any, trainer: Any, settings: dict[str, Any], eaglekit_tps: float, plan: dict[str, Any], label: dict[str, Any]) -> list[str]:
    c, out = trainer.config, []
    if args.steps != args.eaglekit_steps:
        out.append(f"steps: the peer ran --steps {args.steps}, eaglekit's drafter was trained for {args.eaglekit_steps}")
    head = ("starts from the target's rows" if c.lm_head_init == "target" else "starts random") + (
        " and stays frozen" if c.freeze_lm_head else " and is trained")
    out += [
        "lm_head: speculators initialises it from the target's lm_head rows of the draft vocabulary and keeps it FROZEN "
        f"(speculators/model.py _init_vocab / _load_verifier_weights; no option); eaglekit's {head} "
        f"(lm_head_init={c.lm_head_init}, freeze_lm_head={str(c.freeze_lm_head).lower()})",
        f"optimizer: AdamW betas are torch's default (0.9, 0.999) in speculators (train/optimizers.py, no option); eaglekit {tuple(c.betas)}",
        f"gradient clipping: speculators clips at 1.0 (train/trainer.py, no option); eaglekit at {c.grad_clip}",
        f"schedule: both linear warmup ({settings['scheduler-warmup-steps']} steps) then cosine to 0, but transformers' warmup starts "
        "at lr 0 (step/warmup) where eaglekit starts at lr/(warmup+1)"
        + (f"; eaglekit decays to lr x {c.min_lr_ratio}, speculators to 0" if c.min_lr_ratio else ""),
        f"batching: eaglekit steps on {c.batch_size * c.grad_accum} padded records ({eaglekit_tps:.0f} tokens/step on average), "
        + ("each step's loss the mean over its own tokens (step_weighting=equal: a step of short records weighs as much as one "
           "of long records)" if c.step_weighting == "equal" else "every token weighing the same (step_weighting=tokens)")
        + f"; speculators packs records into one sequence of --total-seq-len {plan['packed']} per step and has no record batch "
        f"size or gradient accumulation ({plan['tokens_per_step']:.0f} tokens/step on average); shuffling and packing orders differ",
        "loss mask: speculators weights position t by the mask of its INPUT token and keeps targets whose argmax lies outside "
        "the draft vocabulary; eaglekit uses the mask of the predicted token and drops out-of-vocabulary targets (docs/train.md)",
        "loss: KL(target || draft) in speculators, soft cross-entropy in eaglekit: the same gradients, losses differ by the "
        "target entropy (both weight TTT step k by step_decay**k, normalised per step over its mask)",
        "final hidden state: speculators applies the target's final RMSNorm itself; the converted files hold eaglekit's "
        f"post-norm state divided by the norm weight (label check on {label['tokens']} validation tokens: argmax agreement "
        f"{label['argmax_agreement']:.4f}, mean KL {label['kl_mean']:.2e})",
        "architecture flags set to eaglekit's drafter: --no-norm-before-fc --no-norm-output (speculators' eagle3 defaults are "
        "on, and eaglekit's import refuses them) and full attention (speculators defaults to a 2048-token sliding window)",
        "precision: speculators saves checkpoints in bf16 (train/checkpointer.py save_checkpoint), so the peer is measured with "
        "bf16-rounded weights; eaglekit's drafter is stored in fp32",
        "initialisation: speculators draws every linear layer from N(0, 0.02) (transformers' PreTrainedModel._init_weights); "
        + (f"eaglekit from N(0, {c.init_std}) (init_std)" if c.init_std > 0 else "eaglekit keeps torch's default (uniform, std "
           "1/sqrt(3 fan_in); init_std=0.02 is speculators' scheme)")
        + "; the random streams differ (the same seed value does not give the same weights)",
    ]
    if args.device != c.device and c.device != "auto":
        out.append(f"device: eaglekit's drafter was trained on {c.device}, the peer on {args.device}")
    if c.dtype == "fp16":
        out.append("precision: eaglekit trained under fp16 autocast; speculators refuses float16, the peer used bfloat16")
    return out
