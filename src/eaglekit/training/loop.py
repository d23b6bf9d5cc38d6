"""The drafter training loop, whatever the drafter type: its objective (`registry` -> the type's TTT, mask-slot or
block loss), AdamW + warmup/cosine, grad clipping and accumulation, bf16 autocast, length-bucketed batches,
validation (loss/accuracy per drafted position, tau estimate), exact resume, NaN stop, and torchrun DDP / FSDP2.

`train(config)` takes an `eaglekit.config.train.TrainConfig`. Setup (target, data, drafter) is in `setup`;
`Trainer` owns the optimisation state and the loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from eaglekit import registry
from eaglekit.config import config_hash, save_resolved, to_dict
from eaglekit.config.train import TrainConfig
from eaglekit.errors import EaglekitError
from eaglekit.training import checkpoint as ckpt
from eaglekit.training.data import epoch_batches, split_indices
from eaglekit.training.objective import expected_acceptance, step_weights

log = logging.getLogger(__name__)
MIN_VALIDATION_RECORDS = 20  # fewer: a warning that the validation figures are noise
# options that change neither the data order nor the math: a run may resume with other values
RESUME_IGNORED = ("resume", "overwrite", "log_every", "val_every", "save_every", "keep_checkpoints", "compile",
                  "device", "device_map",
                  "pad_to_multiple", "skip_errors")
AUTO_PAD_CUDA = 128  # pad_to_multiple=0 on CUDA: at most max_length/128 distinct lengths reach the kernels


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_name: str) -> Dist:
    """torchrun environment -> process group (NCCL on CUDA, gloo on CPU) and this rank's device."""
    from eaglekit.runtime import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name)
    if world == 1:
        return Dist(0, 1, device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def all_reduce(tensor: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(tensor)
    return tensor


def summarize(sums: torch.Tensor, decay: float) -> dict[str, Any]:
    """sums (4, K) = loss_sums, correct, train_counts, accuracy_counts -> metrics."""
    loss_sums, correct, train_counts, acc_counts = sums.double().cpu()
    loss_k = (loss_sums / train_counts.clamp(min=1)).tolist()
    acc_k = (correct / acc_counts.clamp(min=1)).tolist()
    loss = float((step_weights(len(loss_k), decay).double() * torch.tensor(loss_k)).sum())
    return {"loss": loss, "loss_k": loss_k, "acc_k": acc_k, "tau": expected_acceptance(acc_k),
            "tokens": int(acc_counts[0])}


def pad_multiple(option: int, device: torch.device) -> int:
    """The `pad_to_multiple` option resolved: 0 = AUTO_PAD_CUDA on CUDA (bounded shapes for compiled kernels),
    1 (no extra padding) elsewhere."""
    if option < 0:
        raise EaglekitError(f"pad_to_multiple={option}: use 0 (auto), 1 (no extra padding) or a positive "
                            "multiple such as 128")
    return option or (AUTO_PAD_CUDA if device.type == "cuda" else 1)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to `min_ratio` at `total` steps."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Position:
    epoch: int = 0
    batch: int = 0  # micro-batches of this epoch already consumed
    step: int = 0  # optimizer steps done


class Trainer:
    def __init__(self, config: TrainConfig, d: Dist, drafter: nn.Module, source: Any, identity: dict[str, Any],
                 step_callback: Callable[[int, Any], None] | None = None):
        self.config, self.d, self.drafter, self.source, self.identity = config, d, drafter, source, identity
        self.step_callback = step_callback
        self.output = Path(config.output)
        self.checkpoints = self.output / "checkpoints"
        self.amp = _amp_dtype(config.dtype, d.device)
        self.pad_to = pad_multiple(config.pad_to_multiple, d.device)
        self.train_idx, self.val_idx = split_indices(len(source), config.val_fraction, config.split_seed)
        if d.main and config.val_fraction > 0 and len(self.val_idx) < MIN_VALIDATION_RECORDS:
            log.warning("the validation split holds %d record(s) (val_fraction=%g of %d): its loss, accuracy and tau "
                        "swing with which records it drew; add data or raise val_fraction (%d records or more)",
                        len(self.val_idx), config.val_fraction, len(source), MIN_VALIDATION_RECORDS)
        self.micro_batches = len(epoch_batches(self.train_idx, source.lengths, config.batch_size, d.world, config.seed,
                                               0))
        if self.micro_batches == 0:
            raise EaglekitError(f"{len(self.train_idx)} training records are fewer than one batch of "
                                f"{config.batch_size * d.world} (batch_size x processes); lower batch_size or add data")
        self.steps_per_epoch = math.ceil(self.micro_batches / config.grad_accum)
        attention = config.attention if config.attention != "auto" else "sdpa"
        # the drafter type's objective (`eaglekit.training.objective`), unwrapped: its num_positions, masks, counts
        self.objective = registry.get(config.drafter_type).objective(config, drafter, attention)
        # step_weighting=tokens: loss sums are divided by the mean count of a global micro-batch, not by its own
        # (objectives whose positions are sampled blocks have no per-record count: their own counts then)
        counts = (self.objective.mean_counts(source.tokens, self.train_idx, config.max_length)
                  if config.step_weighting == "tokens" else None)
        self.record_counts = None if counts is None else counts.to(d.device)
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        if d.main:
            log.info("training %d optimizer steps: %s", self.total_steps, self._schedule_note())
        self.warmup = config.warmup_steps if config.warmup_steps >= 0 else round(0.03 * self.total_steps)
        self.position = Position()
        resume_from = self._resume_point()
        if resume_from is not None:  # weights before wrapping: every rank reads the same file
            state = type(drafter).from_pretrained(resume_from).state_dict()
            drafter.load_state_dict(state)
        self.module = self._wrap(drafter)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=tuple(config.betas),
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, warmup=self.warmup, total=self.total_steps,
                                              min_ratio=config.min_lr_ratio))
        if resume_from is not None:
            self._restore(resume_from)

    def passes(self, steps: int) -> float:
        """Passes over the training records after `steps` optimizer steps (epoch k + 1 runs from k to k + 1): what
        the schedule note, the log lines and the manifest (hence the report) say."""
        return steps / self.steps_per_epoch

    def _schedule_note(self) -> str:
        c, per_epoch = self.config, self.steps_per_epoch
        if c.max_steps:
            return (f"max_steps={c.max_steps} decides (epochs={c.epochs} is ignored): "
                    f"{self.passes(c.max_steps):.1f} passes over {len(self.train_idx)} training records at "
                    f"{per_epoch} steps each")
        return f"{c.epochs} epoch(s) x {per_epoch} steps over {len(self.train_idx)} training records"

    # --- setup --------------------------------------------------------------------------------
    def _wrap(self, drafter: nn.Module) -> nn.Module:
        module: nn.Module = self.objective.to(self.d.device)
        if self.d.world > 1 and self.config.distributed == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for unit in drafter.shard_units():  # its decoder layers, then the rest with the objective
                fully_shard(unit)
            fully_shard(module)
        elif self.d.world > 1:
            module = nn.parallel.DistributedDataParallel(module, device_ids=[self.d.device]
                                                         if self.d.device.type == "cuda" else None)
        return torch.compile(module) if self.config.compile else module

    def _resume_point(self) -> Path | None:
        if not self.config.resume:
            return None
        path = ckpt.latest_checkpoint(self.checkpoints)
        if path is None and self.checkpoints.is_dir() and any(self.checkpoints.iterdir()):  # not a fresh run's
            log.warning("resume=true but %s holds no complete checkpoint: starting from the beginning",
                        self.checkpoints)
        return path

    def _restore(self, path: Path) -> None:
        state = ckpt.load_trainer_state(path)
        wanted = config_hash(self.config, exclude=RESUME_IGNORED)
        if state["config_hash"] != wanted or state["world"] != self.d.world:
            raise EaglekitError(f"{path} was written by a run with other settings (config or number of "
                                "processes); resume with the same config, or train into a new output directory")
        if self.config.distributed == "fsdp" and self.d.world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.position = Position(**state["position"])
        log.info("resumed from %s (epoch %d, batch %d, step %d)", path, self.position.epoch, self.position.batch,
                 self.position.step)

    # --- one optimizer step -------------------------------------------------------------------
    def _micro(self, indices: list[int], scale: float, sync: bool) -> torch.Tensor:
        """Forward + backward of this rank's share of a global micro-batch -> (4, K) sums."""
        mine = indices[self.d.rank :: self.d.world]
        batch = self.source.batch(mine, self.d.device, self.amp or torch.float32, self.pad_to)
        if self.record_counts is None:
            train_masks, _ = self.objective.masks(batch.loss_mask, batch.in_vocab)
            denominators = all_reduce(train_masks.sum(dim=(1, 2)).float(), self.d).clamp(min=1.0)
        else:
            denominators = (self.record_counts * len(indices)).clamp(min=1.0)
        no_sync = getattr(self.module, "no_sync", None)
        context = no_sync() if (no_sync is not None and not sync) else contextlib.nullcontext()
        with context, _autocast(self.d.device, self.amp):
            loss, loss_sums, correct, train_counts, acc_counts = self.module(
                batch.aux, batch.input_ids, batch.loss_mask, batch.probs, batch.in_vocab, denominators)
            # DDP averages gradients over ranks; the denominators are global, so undo the average
            (loss * scale * self.d.world).backward()
        return torch.stack([loss_sums.float(), correct, train_counts, acc_counts]).detach()

    def _step(self, group: list[list[int]]) -> dict[str, Any]:
        sums = sum(self._micro(b, 1.0 / len(group), i == len(group) - 1) for i, b in enumerate(group))
        metrics = summarize(all_reduce(sums, self.d), self.config.step_decay)
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        metrics["grad_norm"] = float(nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))
        for name in ("loss", "grad_norm"):  # checked before the update: weights and checkpoints stay good
            if not math.isfinite(metrics[name]):
                good = ckpt.latest_checkpoint(self.checkpoints)
                raise EaglekitError(f"the {name.replace('_', ' ')} became {metrics[name]} at step "
                                    f"{self.position.step + 1}; stopped without applying it. Last good checkpoint: "
                                    f"{good or 'none yet'}. Lower lr or check the data, then resume=true")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    # --- loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        c, pos = self.config, self.position
        last_val: dict[str, Any] = {}
        bar = tqdm(total=self.total_steps, initial=pos.step, desc="train", unit="step", disable=not self.d.main or None)
        self._clock = (time.perf_counter(), pos.step)  # for the ETA of the log lines shown instead of the bar
        while (c.max_steps or pos.epoch < c.epochs) and pos.step < self.total_steps:  # max_steps wins over epochs
            batches = epoch_batches(self.train_idx, self.source.lengths, c.batch_size, self.d.world, c.seed, pos.epoch)
            while pos.batch < len(batches) and pos.step < self.total_steps:
                group = batches[pos.batch : pos.batch + c.grad_accum]
                started = time.perf_counter()
                metrics = self._step(group)
                metrics["batch_tokens"] = sum(self.source.lengths[i] for b in group for i in b)
                pos.batch, pos.step = pos.batch + len(group), pos.step + 1
                self._log_train(metrics, started, bar)
                if c.val_every and pos.step % c.val_every == 0:
                    last_val = self.validate(bar)
                if c.save_every and pos.step % c.save_every == 0:
                    self.save()
                if self.step_callback is not None:
                    self.step_callback(pos.step, self)  # tests: kill or corrupt a run after a finished step
            if pos.batch >= len(batches):
                pos.epoch, pos.batch = pos.epoch + 1, 0
                last_val = self.validate(bar) or last_val
                self.save()
        if last_val.get("step") != pos.step:
            last_val = self.validate(bar) or last_val
        bar.close()
        return last_val

    def _log_train(self, metrics: dict[str, Any], started: float, bar: Any) -> None:
        pos = self.position
        metrics.update(step=pos.step, epoch=pos.epoch, split="train", lr=self.scheduler.get_last_lr()[0],
                       tokens_per_s=metrics["batch_tokens"] / max(time.perf_counter() - started, 1e-9))
        if metrics["loss"] == 0.0 and metrics["tokens"] and not getattr(self, "_warned_no_loss", False):
            self._warned_no_loss = True  # soft cross-entropy is never exactly 0 over counted positions
            log.warning("step %d has no loss to learn from: at none of its %d assistant positions is the target's "
                        "prediction in the %d-id draft vocabulary; raise draft_vocab_size (or vocab size=)", pos.step,
                        metrics["tokens"], self.drafter.config.draft_vocab_size)
        bar.update(1)
        bar.set_postfix({"loss": f"{metrics['loss']:.3f}", "acc@1": f"{metrics['acc_k'][0]:.3f}",
                         "tok/s": f"{metrics['tokens_per_s']:.0f}", "lr": f"{metrics['lr']:.2e}"})
        if pos.step % max(1, self.config.log_every) == 0 or pos.step == self.total_steps:
            self._write_metrics(metrics)
            if bar.disable and self.d.main:  # no terminal (a log file, CI): a line every log_every steps instead
                log.info("step %d/%d (epoch %d, %.1f passes): loss %.3f, acc@1 %.3f, %.0f tokens/s, ETA %s",
                         pos.step, self.total_steps, pos.epoch + 1, self.passes(pos.step), metrics["loss"],
                         metrics["acc_k"][0], metrics["tokens_per_s"], self._eta())

    def _eta(self) -> str:
        start, first = getattr(self, "_clock", (time.perf_counter(), self.position.step))
        done = self.position.step - first
        if done <= 0:
            return "unknown"
        seconds = round((time.perf_counter() - start) / done * (self.total_steps - self.position.step))
        return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

    @torch.no_grad()
    def validate(self, bar: Any = None) -> dict[str, Any]:
        if not self.val_idx:
            return {}
        self.module.eval()
        size = self.config.batch_size * self.d.world
        order = sorted(self.val_idx, key=lambda i: -self.source.lengths[i])
        sums = torch.zeros(4, self.objective.num_positions, device=self.d.device)
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            mine, weight = chunk[self.d.rank :: self.d.world], 1.0
            if not mine:  # every rank runs the same forwards (FSDP gathers weights collectively): a dummy, weighted 0
                mine, weight = chunk[:1], 0.0
            batch = self.source.batch(mine, self.d.device, self.amp or torch.float32, self.pad_to)
            ones = torch.ones(self.objective.num_positions, device=self.d.device)
            with _autocast(self.d.device, self.amp):
                _, loss_sums, correct, train_counts, acc_counts = self.module(
                    batch.aux, batch.input_ids, batch.loss_mask, batch.probs, batch.in_vocab, ones)
            sums += weight * torch.stack([loss_sums.float(), correct, train_counts, acc_counts])
        self.module.train()
        metrics = summarize(all_reduce(sums, self.d), self.config.step_decay)
        metrics.update(step=self.position.step, epoch=self.position.epoch, split="val")
        if bar is not None:
            bar.set_postfix({"val_loss": f"{metrics['loss']:.3f}", "val_acc@1": f"{metrics['acc_k'][0]:.3f}",
                             "tau": f"{metrics['tau']:.2f}"})
        if self.d.main and (bar is None or bar.disable):  # a visible bar shows them in its postfix
            log.info("validation at step %d: loss %.3f, acc@1 %.3f, estimated tau %.2f", self.position.step,
                     metrics["loss"], metrics["acc_k"][0], metrics["tau"])
        self._write_metrics(metrics)
        return metrics

    def validation_batches(self) -> Any:
        """The validation split's batches on this process's device (all of them: the main process's use)."""
        size = self.config.batch_size
        for start in range(0, len(self.val_idx), size):
            yield self.source.batch(self.val_idx[start : start + size], self.d.device, self.amp or torch.float32,
                                    self.pad_to)

    def after_training(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The drafter type's work on the finished drafter (`DrafterType.after_training`: DSpark calibrates its
        confidence head), on an unwrapped copy of `state`; what it changes of the config is what gets saved."""
        drafter = type(self.drafter)(self.drafter.config)
        drafter.load_state_dict(state)
        drafter.to(self.d.device).eval()
        found = registry.get(self.config.drafter_type).after_training(self.config, drafter, self.validation_batches)
        self.drafter.config = drafter.config
        return found

    def _write_metrics(self, metrics: dict[str, Any]) -> None:
        if self.d.main:
            with open(self.output / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(metrics) + "\n")

    # --- persistence --------------------------------------------------------------------------
    def full_drafter_state(self) -> dict[str, torch.Tensor]:
        if self.d.world > 1 and self.config.distributed == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {k: v for k, v in state.items()}
        return {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()}

    def save_drafter(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        copy = type(self.drafter)(self.drafter.config)
        copy.load_state_dict(state)
        copy.save_pretrained(directory)

    def save(self) -> None:
        state = self.full_drafter_state()
        optimizer = self._optimizer_state()
        if not self.d.main:
            return
        trainer_state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "rng": ckpt.rng_state(),
                         "position": vars(self.position).copy(), "world": self.d.world,
                         "config_hash": config_hash(self.config, exclude=RESUME_IGNORED)}
        ckpt.save_checkpoint(self.checkpoints, self.position.step, state, lambda p: self.save_drafter(p, state),
                             trainer_state, self.config.keep_checkpoints)

    def _optimizer_state(self) -> dict[str, Any]:
        if self.d.world > 1 and self.config.distributed == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.module, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.optimizer.state_dict()


def _amp_dtype(name: str, device: torch.device) -> torch.dtype | None:
    if name == "fp32" or (name == "auto" and device.type != "cuda"):
        return None
    return {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def train(config: TrainConfig, step_callback: Callable[[int, Any], None] | None = None,
          read_drafter: Callable[[str, int], Any] | None = None) -> dict[str, Any]:
    """Run a training stage to completion (see the module docstring). `read_drafter(path, target_layers)` loads
    `init_from` (default: any layout a drafter type reads, `eaglekit.formats.saved.load_drafter`)."""
    from eaglekit.formats.saved import load_drafter
    from eaglekit.manifest import write_errors
    from eaglekit.training.setup import finish, setup

    d = setup_distributed(config.device)
    with write_errors(config.output, "training checkpoints and drafter"), contextlib.ExitStack() as stack:
        drafter, source, identity = setup(config, d, stack, read_drafter or load_drafter)
        trainer = Trainer(config, d, drafter, source, identity, step_callback)
        if d.main:
            save_resolved(config, config.output)
        final_val = trainer.fit()
        state = trainer.full_drafter_state()
        result = {"steps": trainer.position.step, "epochs": trainer.position.epoch,  # epochs finished
                  "passes": trainer.passes(trainer.position.step), "val": final_val,
                  "train_records": len(trainer.train_idx), "val_records": len(trainer.val_idx)}
        if d.main:
            result.update({"after_training": found} if (found := trainer.after_training(state)) else {})
        if d.main:
            finish(config, trainer, state, identity, result)
    return {**result, "output": config.output, "config": to_dict(config)}
