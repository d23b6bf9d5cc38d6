"""Drafter training throughput and model FLOPs utilisation (MFU) for an 8B-shaped target.

    python benchmarks/train_speed.py                          # CUDA: grid of eager/compile x sdpa/flex + online
    python benchmarks/train_speed.py --modes compile --attention flex --batch-size 4 --seq-len 2048
    python benchmarks/train_speed.py --cases offline:compile:flex,online:compile:flex --budget-s 300
    python benchmarks/train_speed.py --smoke                  # CPU, tiny shapes, seconds

Offline-style step (what `eaglekit train shards=...` does per micro-batch, minus reading shards): random
aux states (B, T, 3H) and final states (B, T, H) in bf16 on the device -> soft labels through a random
target lm_head (V x H, restricted to the draft vocabulary) -> K-step TTT forward + backward under bf16
autocast -> grad clip -> fused AdamW. The drafter is the one `eaglekit train` builds for Llama-3.1-8B:
hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocab 128256, draft vocab 32000, K = 7.

Model FLOPs per trained token (forward; training = 3x forward, backward = 2x forward):
    fc                      2 * 3H * H
    per TTT step (x K):     q,k,v   2 * 2H * (nh + 2 nkv) * D
                            o       2 * nh * D * H
                            MLP     2 * 3 * H * I
                            lm_head 2 * H * Vd
                            attention (useful work only) 4 * nh * D * ((T + 1) / 2 + k)
                              (causal over step-0 keys: (T+1)/2 keys per query on average, plus k diagonal keys)
The soft-label matmul through the TARGET lm_head (2 * H * V per token) is not drafter work; it is timed
but reported separately (`mfu_with_labels` counts it too). Masked-out attention that the SDPA path computes
anyway is not counted. MFU = model FLOPs / time / peak, peak = 989 TFLOP/s (H100/H200 dense bf16 datasheet);
`mfu_measured_peak` uses the ~790 TFLOP/s measured on an H200.

Online: the same drafter step with a frozen random target in-process (hooks capture aux + final states).
The target is 8B-shaped but has only --online-layers decoder layers (default 8 of 32) so it fits the time
budget; a full 32-layer target costs ~4x that target forward. Timings: medians after warm-up steps.
Writes JSON (hardware, commit, config, figures) and a markdown table to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

SHAPES = {  # hidden, heads, kv heads, intermediate, vocab, draft vocab, target layers
    "smoke": (64, 4, 2, 128, 512, 128, 8),
    "8b": (4096, 32, 8, 14336, 128256, 32000, 32),
}
PEAK_DATASHEET, PEAK_MEASURED = 989e12, 790e12


def drafter_config(shape: str) -> Any:
    from eaglekit.drafters.eagle3.model import DrafterConfig

    h, nh, nkv, inter, vocab, draft_vocab, layers = SHAPES[shape]
    return DrafterConfig(hidden_size=h, intermediate_size=inter, num_attention_heads=nh, num_key_value_heads=nkv, vocab_size=vocab,
                         draft_vocab_size=draft_vocab, target_hidden_size=h, aux_layer_ids=(2, layers // 2, layers - 3),
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, max_position_embeddings=8192)


def flops_per_token(config: Any, seq_len: int, steps: int) -> dict[str, float]:
    """Training FLOPs per token (3x forward), by the formula in the module docstring."""
    h, d = config.hidden_size, config.resolved_head_dim
    nh, nkv, inter, vd = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.draft_vocab_size
    forward = 2 * 3 * config.target_hidden_size * h
    for k in range(steps):
        forward += 2 * 2 * h * (nh + 2 * nkv) * d + 2 * nh * d * h + 2 * 3 * h * inter + 2 * h * vd
        forward += 4 * nh * d * ((seq_len + 1) / 2 + k)
    return {"model": 3.0 * forward, "labels": 2.0 * config.target_hidden_size * config.vocab_size}


def build(config: Any, device: torch.device) -> Any:
    from eaglekit.drafters.eagle3.model import Eagle3Drafter

    with torch.device(device):
        drafter = Eagle3Drafter(config)
    drafter.set_vocab_mapping(torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values)
    return drafter.to(device)


def make_step(drafter: Any, steps: int, attention: str, compile_model: bool, device: torch.device, amp: torch.dtype | None):
    """A closure doing one offline-style optimizer step on (aux, final, ids, lm_head)."""
    from eaglekit.drafters.eagle3.ttt import TTTModule
    from eaglekit.training.loop import _autocast
    from eaglekit.drafters.eagle3.ttt import step_masks
    from eaglekit.training.objective import soft_labels_from_hidden

    module: Any = TTTModule(drafter, steps, 0.8, attention)
    if compile_model:
        module = torch.compile(module)
    params = [p for p in drafter.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), **fused)

    def step(aux: torch.Tensor, final: torch.Tensor, ids: torch.Tensor, head: torch.Tensor, loss_mask: torch.Tensor) -> float:
        probs, in_vocab = soft_labels_from_hidden(final, head, drafter.t2d)
        train, _ = step_masks(loss_mask, in_vocab, steps)
        denominators = train.sum(dim=(1, 2)).float().clamp(min=1)
        with _autocast(device, amp):
            loss, *_ = module(aux, ids, loss_mask, probs, in_vocab, denominators)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, repeats: int, warmup: int, device: torch.device) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def offline_case(args: Any, device: torch.device, mode: str, attention: str) -> dict[str, Any]:
    config = drafter_config(args.shape)
    amp = torch.bfloat16 if device.type == "cuda" else None
    dtype = amp or torch.float32
    torch.manual_seed(0)
    drafter = build(config, device)
    step = make_step(drafter, args.ttt_steps, attention, mode == "compile", device, amp)
    b, t, h = args.batch_size, args.seq_len, config.hidden_size
    aux = torch.randn(b, t, 3 * h, device=device, dtype=dtype)
    final = torch.randn(b, t, h, device=device, dtype=dtype)
    head = torch.randn(config.vocab_size, h, device=device, dtype=dtype) * h**-0.5
    ids = torch.randint(0, config.vocab_size, (b, t), device=device)
    loss_mask = torch.ones(b, t, dtype=torch.bool, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    step(aux, final, ids, head, loss_mask)  # first call: compile time
    sync(device)
    first = time.perf_counter() - started
    times = timed(lambda: step(aux, final, ids, head, loss_mask), args.repeats, args.warmup, device)
    return summarize(args, config, times, first, device, {"mode": mode, "attention": attention, "kind": "offline"})


def summarize(args: Any, config: Any, times: list[float], first: float, device: torch.device, extra: dict[str, Any]) -> dict[str, Any]:
    tokens = args.batch_size * args.seq_len
    median = statistics.median(times)
    flops = flops_per_token(config, args.seq_len, args.ttt_steps)
    tokens_per_s = tokens / median
    out = {**extra, "batch_size": args.batch_size, "seq_len": args.seq_len, "ttt_steps": args.ttt_steps, "step_s_median": median,
           "step_s_all": times, "first_step_s": first, "tokens_per_s": tokens_per_s, "model_flops_per_token": flops["model"],
           "label_flops_per_token": flops["labels"], "achieved_tflops": tokens_per_s * flops["model"] / 1e12}
    if device.type == "cuda":
        out["mfu"] = tokens_per_s * flops["model"] / PEAK_DATASHEET
        out["mfu_measured_peak"] = tokens_per_s * flops["model"] / PEAK_MEASURED
        out["mfu_with_labels"] = tokens_per_s * (flops["model"] + flops["labels"]) / PEAK_DATASHEET
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


def online_case(args: Any, device: torch.device, mode: str, attention: str) -> dict[str, Any]:
    """Drafter step + frozen random target forward (hooks) per batch; target has --online-layers layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglekit.targets.capture import HiddenStateCapture

    config = drafter_config(args.shape)
    amp = torch.bfloat16 if device.type == "cuda" else None
    layers = args.online_layers
    target_config = LlamaConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_hidden_layers=layers,
                                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                                vocab_size=config.vocab_size, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        target = LlamaForCausalLM(target_config).to(amp or torch.float32).eval().requires_grad_(False)
    aux_layers = (2, layers // 2, layers - 3) if layers >= 4 else (1, 1, 1)
    drafter = build(config, device)
    step = make_step(drafter, args.ttt_steps, attention, mode == "compile", device, amp)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    head = target.get_output_embeddings().weight
    with HiddenStateCapture(target, aux_layers) as capture:
        def one() -> None:
            with torch.no_grad():
                capture.reset()
                target(input_ids=ids, use_cache=False, logits_to_keep=1)
            step(capture.aux(), capture.final(), ids, head, loss_mask)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        one()
        sync(device)
        first = time.perf_counter() - started
        times = timed(one, args.repeats, args.warmup, device)
    return summarize(args, config, times, first, device, {"mode": mode, "attention": attention, "kind": f"online ({layers}-layer random target)"})


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| kind | mode | attention | B x T | K | tokens/s | TFLOP/s | MFU (989) | MFU (790) | peak GB | first step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['kind']} | {r['mode']} | {r['attention']} | | | error: {r['error'][:80]} | | | | | |")
            continue
        pct = lambda key: f"{100 * r[key]:.1f}%" if key in r else "-"  # noqa: E731
        rows.append(f"| {r['kind']} | {r['mode']} | {r['attention']} | {r['batch_size']} x {r['seq_len']} | {r['ttt_steps']} | "
                    f"{r['tokens_per_s']:,.0f} | {r['achieved_tflops']:.1f} | {pct('mfu')} | {pct('mfu_measured_peak')} | "
                    f"{r.get('peak_memory_gb', 0):.1f} | {r['first_step_s']:.1f} |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--attention", default="sdpa,flex")
    parser.add_argument("--online", default="compile:sdpa", help="mode:attention cases for online runs ('' = none)")
    parser.add_argument("--cases", default="", help="explicit kind:mode:attention list, run in this order (overrides the three above)")
    parser.add_argument("--online-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=0, help="skip the cases left once this many seconds have passed (0 = none)")
    parser.add_argument("--out", default="", help="JSON path (default runs/benchmarks/train_speed.json; "
                        "--smoke: train_speed_smoke.json in the temporary directory)")
    args = parser.parse_args(argv)
    args.shape = "smoke" if args.smoke else "8b"
    args.out = args.out or (str(Path(tempfile.gettempdir()) / "train_speed_smoke.json") if args.smoke
                            else "runs/benchmarks/train_speed.json")
    if args.smoke:
        args.batch_size, args.seq_len, args.ttt_steps, args.repeats, args.warmup = 2, 32, 3, 2, 1
        args.modes, args.attention, args.online, args.online_layers = "eager", "sdpa", "eager:sdpa", 4
    return args


def run_case(args: Any, device: torch.device, kind: str, mode: str, attention: str, started: float) -> dict[str, Any]:
    """One configuration's figures, or why it has none (an error, or the time budget spent)."""
    if args.budget_s and time.perf_counter() - started > args.budget_s:
        return {"kind": kind, "mode": mode, "attention": attention, "error": f"skipped: past --budget-s {args.budget_s:.0f}"}
    try:
        return (offline_case if kind == "offline" else online_case)(args, device, mode, attention)
    except Exception as error:  # one failing configuration (e.g. a compile error) must not hide the others
        traceback.print_exc()
        return {"kind": kind, "mode": mode, "attention": attention, "error": f"{type(error).__name__}: {error}"}
    finally:
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from eaglekit.manifest import environment

    args = parse(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    else:
        cases = [("offline", m, a) for m in args.modes.split(",") for a in args.attention.split(",")]
        cases += [("online", *c.split(":")) for c in args.online.split(",") if c]
    bad = [c for c in cases if len(c) != 3 or c[0] not in ("offline", "online") or c[1] not in ("eager", "compile")]
    if bad:
        raise SystemExit(f"bad cases {bad}: write kind:mode:attention, e.g. offline:compile:flex,online:eager:sdpa")
    results, started = [], time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for kind, mode, attention in cases:
        results.append(run_case(args, device, kind, mode, attention, started))
        print(table(results[-1:]).splitlines()[-1], flush=True)
        report = {"benchmark": "train_speed", "environment": environment(), "device": str(device),
                  "config": {k: v for k, v in vars(args).items()}, "results": results}
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")  # after every case: a cut-off run keeps its figures
        out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
