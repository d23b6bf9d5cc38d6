"""Peer-trainer comparison: eaglekit's drafter against one trained by vLLM's `speculators` on the same data.

    make speculators-env                                   # .venv-speculators: speculators 0.9.0 in a venv of its own
    python benchmarks/peer_speculators.py --run runs/demo --out runs/benchmarks/peer_speculators_tiny_cpu.json
    python benchmarks/peer_speculators.py --run runs/demo --device cuda --bench --peer-python python3 --out X.json
    python benchmarks/peer_speculators.py --run runs/demo --steps 200 --out X.json    # another step count
    python benchmarks/peer_speculators.py --run runs/demo --no-peer --variants lm_head_init=random freeze_lm_head=true --out X.json

RUN_DIR is an `eaglekit run` output that holds extract/, vocab/ and train/ (eaglekit's drafter). The script

1. rebuilds eaglekit's training context from RUN_DIR/train/config.yaml (`eaglekit.draft.setup.setup` and
   `eaglekit.draft.train.Trainer`): the same records, the same validation split (`split_indices`), the same
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
4. imports the final checkpoint with eaglekit's own import code (`eaglekit.interop.convert.import_checkpoint`),
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
# extend_mask_for_draft_tokens), so a packed length off that grid fails at the second TTT step (H200, 2026-12-03:
# "block_mask was created for ... (1, 1, 768, 1536) but got q_len=648 and kv_len=1296")
FLEX_BLOCK = 128
EAGLEKIT_SETTINGS = ("ttt_steps", "step_decay", "lr", "betas", "weight_decay", "warmup_steps", "min_lr_ratio", "grad_clip", "step_weighting", "init_std",
                     "lm_head_init", "freeze_lm_head", "batch_size", "grad_accum", "max_length", "epochs", "max_steps", "seed", "split_seed", "device",
                     "dtype", "attention")  # eaglekit's train options the report lists beside the peer's
LABEL_CHECK_TOKENS = 2048  # validation tokens on which eaglekit's and the peer's soft labels are compared

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


# ---- checks --------------------------------------------------------------------------------------

def check_run(run: Path) -> None:
    needed = {"extract/manifest.json": "eaglekit extract", "vocab/vocab.safetensors": "eaglekit vocab",
              "train/manifest.json": "eaglekit train", "train/config.yaml": "eaglekit train"}
    for path, stage in needed.items():
        if not (run / path).is_file():
            raise SystemExit(f"{run} lacks {path}: finish the run first (`eaglekit run --config RECIPE out={run}` runs {stage})")


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


# ---- eaglekit's side -----------------------------------------------------------------------------

def run_train_overrides(run: Path, output: Path, device: str) -> dict[str, Any]:
    """RUN_DIR's train config, offline on its shards and vocabulary, written to `output` on `device`, from scratch."""
    return {"shards": str(run / "extract"), "vocab": str(run / "vocab" / "vocab.safetensors"), "output": str(output),
            "resume": False, "device": device, "init_from": ""}


def eaglekit_context(run: Path, device: str, work: Path, stack: contextlib.ExitStack) -> Any:
    """eaglekit's trainer for RUN_DIR's train config (records, split, soft labels, validate), on `device`."""
    from eaglekit.config import load_config
    from eaglekit.draft.setup import setup
    from eaglekit.draft.train import Trainer, setup_distributed
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
    from eaglekit.draft.data import epoch_batches

    c, tokens, done, epoch = trainer.config, 0, 0, 0
    while done < steps:
        batches = epoch_batches(trainer.train_idx, trainer.source.lengths, c.batch_size, 1, c.seed, epoch)
        groups = [batches[i : i + c.grad_accum] for i in range(0, len(batches), c.grad_accum)]
        for group in groups[: steps - done]:
            tokens += sum(trainer.source.lengths[i] for batch in group for i in batch)
        done, epoch = done + min(len(groups), steps - done), epoch + 1
    return tokens / steps


def final_norm_weight(target: str) -> torch.Tensor:
    """The target's final RMSNorm weight, read from its checkpoint (what speculators loads as verifier_norm)."""
    from eaglekit.draft.build import _checkpoint_tensors
    from eaglekit.target.loading import resolve_target

    found = _checkpoint_tensors(Path(resolve_target(target)), ["model.norm.weight"])
    if not found:
        raise SystemExit(f"cannot read model.norm.weight from {resolve_target(target)}: speculators needs the target's final norm "
                         "in a local safetensors checkpoint")
    return found["model.norm.weight"].float()


# ---- conversion ----------------------------------------------------------------------------------

def convert(trainer: Any, norm_weight: torch.Tensor, data: Path, hs_dtype: torch.dtype) -> dict[str, Any]:
    """eaglekit's train records, then its validation records, in speculators' offline layout."""
    import numpy as np
    from datasets import Dataset
    from safetensors.torch import save_file

    from eaglekit.draft.data import split_indices

    source, config = trainer.source, trainer.config
    train_idx, val_idx = split_indices(len(source), config.val_fraction, config.split_seed)  # eaglekit's split, as its trainer makes it
    assert (train_idx, val_idx) == (trainer.train_idx, trainer.val_idx)
    if any(w.abs() < 1e-6 for w in norm_weight):
        raise SystemExit("the target's final norm has zero weights: the post-norm states eaglekit stores cannot be turned back")
    shutil.rmtree(data, ignore_errors=True)
    (data / "hidden_states").mkdir(parents=True)
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for file_idx, i in enumerate(train_idx + val_idx):
        record = source.dataset[source.order[i]]
        cut = {k: record[k][: config.max_length] for k in ("input_ids", "loss_mask", "aux", "final")}
        t, h = cut["final"].shape
        # speculators computes lm_head(RMSNorm_w(last)); eaglekit stored y = RMSNorm_w(x). last = y / w gives x / rms(x),
        # whose rms is 1 (up to eps), so RMSNorm_w(last) = y again.
        last = cut["final"].float() / norm_weight
        states = torch.cat([cut["aux"].float().view(t, -1, h), last[:, None]], dim=1).to(hs_dtype)  # (T, 3 + 1, H)
        save_file({"hidden_states": states.contiguous(), "token_ids": cut["input_ids"].long()}, str(data / "hidden_states" / f"hs_{file_idx}.safetensors"))
        rows["input_ids"].append(cut["input_ids"].long().tolist())
        rows["loss_mask"].append(cut["loss_mask"].long().tolist())
        rows["seq_len"].append(t)
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data))
    np.save(data / "d2t.npy", trainer.drafter.d2t.cpu().numpy())
    np.save(data / "t2d.npy", trainer.drafter.t2d.cpu().numpy())
    n_train, n_val = len(train_idx), len(val_idx)
    return {"train_records": n_train, "val_records": n_val, "train_tokens": sum(rows["seq_len"][:n_train]),
            "val_tokens": sum(rows["seq_len"][n_train:]), "train_lengths": rows["seq_len"][:n_train],
            "train_data_ratio": (n_train + 0.5) / (n_train + n_val),  # int(N * ratio) == n_train: the split falls between them
            "val_ids": [source.dataset.ids[source.order[i]] for i in val_idx], "hidden_states_dtype": str(hs_dtype).replace("torch.", "")}


def label_check(trainer: Any, data: Path, n_train: int, norm_weight: torch.Tensor, eps: float) -> dict[str, Any]:
    """Soft labels eaglekit trains on vs the ones speculators rebuilds from the converted files (validation tokens)."""
    from safetensors.torch import load_file

    from eaglekit.draft.ttt import soft_labels_from_hidden

    source, theirs, ours, scales, file_idx = trainer.source, [], [], [], n_train
    while sum(len(x) for x in ours) < LABEL_CHECK_TOKENS and (data / "hidden_states" / f"hs_{file_idx}.safetensors").is_file():
        last = load_file(str(data / "hidden_states" / f"hs_{file_idx}.safetensors"))["hidden_states"][:, -1].float()
        rms = last.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
        theirs.append(last / rms * norm_weight)  # LlamaRMSNorm, as speculators' verifier_norm computes it
        scales.append(rms.flatten())
        ours.append(source.dataset[source.order[trainer.val_idx[file_idx - n_train]]]["final"][: len(last)].float())
        file_idx += 1
    weight, t2d = source.lm_head_weight.float().cpu(), source.t2d.cpu()
    p, _ = soft_labels_from_hidden(torch.cat(ours)[None], weight, t2d)
    q, _ = soft_labels_from_hidden(torch.cat(theirs)[None], weight, t2d)
    kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)
    scale = torch.cat(scales)
    return {"tokens": int(p.shape[1]), "argmax_agreement": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "rms_of_stored_last_min": float(scale.min()),
            "rms_of_stored_last_max": float(scale.max())}


# ---- the peer's run ------------------------------------------------------------------------------

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
    from eaglekit.draft.train import _amp_dtype
    from eaglekit.target.loading import resolve_target

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
    launch = ["-m", "speculators"] if cuda else ["-c", CPU_LAUNCHER]
    cmd = [args.peer_python, *launch, "train"]
    for key, value in settings.items():
        if value is True:
            cmd.append(f"--{key}")
        elif value is False:
            cmd.append(f"--no-{key}")
        elif isinstance(value, list):
            cmd += [f"--{key}", *map(str, value)]
        else:
            cmd += [f"--{key}", str(value)]
    return cmd, settings


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


# ---- measuring -----------------------------------------------------------------------------------

def import_peer(checkpoint: str, output: Path, trainer: Any) -> Any:
    """speculators checkpoint -> eaglekit drafter (eaglekit's import), saved to `output` with the target's embedding."""
    from eaglekit.interop.convert import import_checkpoint

    drafter = import_checkpoint(checkpoint, "speculators").float()
    if not torch.equal(drafter.t2d.cpu(), trainer.drafter.t2d.cpu()):
        raise SystemExit(f"{checkpoint} has another draft vocabulary than eaglekit's: the d2t/t2d files were not used")
    if not bool(drafter.embed_tokens.weight.any()):
        drafter.load_target_embedding(trainer.drafter.embed_tokens.weight.detach().cpu())
    drafter.config = dataclasses.replace(drafter.config, target_name_or_path=trainer.config.target)
    drafter.save_pretrained(output)
    return drafter


def peer_side(args: Any, trainer: Any, work: Path, eaglekit_tps: float, report: dict[str, Any],
              meanwhile: Callable[[], None]) -> dict[str, Any]:
    """Convert the run's data for speculators, train the peer with eaglekit's settings (running `meanwhile()` as
    it trains), and record the data, the commands, both settings and their `differences` in `report` -> the
    peer's side (its `error` if it failed)."""
    from eaglekit.draft.train import _amp_dtype
    from eaglekit.target.capture import text_config
    from eaglekit.target.loading import load_target_config

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
    from eaglekit.draft.model import Eagle3Drafter
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
                             "(2026-12-03: 'ListVariable(length=21) is already tracked for mutation' at speculators/losses/fused.py:343); "
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
    from eaglekit.draft.model import Eagle3Drafter
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
