"""Extraction throughput against the bare target forward pass at the same batch shape, in the same run.

    python benchmarks/extract_speed.py                     # CUDA: 8B-shaped Llama (random bf16) and the tiny target
    python benchmarks/extract_speed.py --smoke             # CPU, tiny shapes, seconds
    python benchmarks/extract_speed.py --batch-size 4 --seq-len 4096 --shard-dir /local/nvme/tmp

"bare" is `forward_target` (the call extract makes: no KV cache, logits for the last position only)
on device-resident ids. "extract" is the real extract loop (`eaglekit.targets.extract.extract_batches`:
padding/index build, hooks, hook-count and shape checks, padding strip, dtype conversion or float8
quantisation, async copy on a copy stream into pinned shard buffers, background sha256 + atomic shard
writes on extract's default writer threads, buffers and shard size unless given) timed
until the writer has flushed every shard to disk (fsync included; `ratio_before_final_flush` stops the
clock when the last batch is handed over, i.e. without the tail write a long run amortises). Both see the same (B, T) batches
of random ids; repeats alternate bare/extract; figures are medians after a warm-up. The 8B model is
built on the meta device, materialised with `to_empty` and initialised in place (random weights: the
speed does not depend on their values). Writes JSON (hardware, commit, config, figures) to `--out`
and a markdown table beside it; the goal is extract >= 85% of bare tokens/s on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "smoke": (64, 128, 4, 4, 2, 512),
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "reference": (512, 1536, 24, 8, 4, 8192),  # run_all's reference target (speed does not depend on the weights)
}
GOAL = 0.85


def build_llama(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random Llama of `shape`: built on meta, materialised with to_empty, initialised in place."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hidden, intermediate, layers, heads, kv_heads, vocab = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=8192, rope_theta=500000.0, dtype=dtype)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:  # norm weights
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    model = model.to(dtype)
    with torch.device(device):  # after the cast: inv_freq stays float32, as from_pretrained leaves it
        model.model.rotary_emb = LlamaRotaryEmbedding(config)
    return model.eval().requires_grad_(False)


def load_tiny(device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    from eaglekit.targets.loading import load_target, tiny_target_path

    if not (tiny_target_path() / "config.json").is_file():
        return None
    return load_target("tiny", device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_bare(model: torch.nn.Module, ids: list[torch.Tensor], device: torch.device) -> float:
    """Seconds for one forward per batch in `ids` ((B, T) each, already on `device`)."""
    from eaglekit.targets.capture import forward_target

    masks = [torch.ones_like(x) for x in ids]
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for x, mask in zip(ids, masks):
            forward_target(model, x, mask)
    _sync(device)
    return time.perf_counter() - start


def time_extract(model, ids: list[torch.Tensor], dtype: str, shard_dir: Path, args) -> dict:
    """Seconds, bytes and writer wait for the real extract loop over the same batches, flushed to disk."""
    from eaglekit.targets.extract import Record, extract_batches
    from eaglekit.targets.capture import HiddenStateCapture, default_aux_layers, find_decoder, text_config
    from eaglekit.targets.shard_writer import ShardWriter
    from eaglekit.targets.store import StoreLayout

    device = ids[0].device
    batches = [[Record(f"b{b}r{r}", row.cpu(), torch.ones(len(row), dtype=torch.uint8)) for r, row in enumerate(x)]
               for b, x in enumerate(ids)]
    layout = StoreLayout(text_config(model.config).hidden_size, 3, dtype)
    capacity = max(int(args.shard_mb * 2**20) // layout.bytes_per_token, ids[0].numel())
    out = Path(tempfile.mkdtemp(prefix="extract-bench-", dir=shard_dir))
    writer = ShardWriter(out, layout, capacity, num_buffers=args.buffers, pin_memory=device.type == "cuda",
                         num_threads=args.writer_threads, fsync=not args.no_fsync)
    try:
        with HiddenStateCapture(model, default_aux_layers(find_decoder(model).num_layers)) as capture:
            _sync(device)
            start = time.perf_counter()
            tokens = extract_batches(model, capture, batches, writer, layout, 0, show=False)
            _sync(device)
            loop_seconds = time.perf_counter() - start
            entries = writer.close()
            _sync(device)
            seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "loop_seconds": loop_seconds, "tokens": tokens, "bytes": sum(e["bytes"] for e in entries),
            "writer_wait_s": writer.wait_seconds, "shards": len(entries), "shard_tokens": capacity, "host_buffer_bytes": writer.host_bytes}


def disk_write_speed(shard_dir: str | None, megabytes: int) -> float:
    """GB/s of one large write + fsync into `shard_dir`: the ceiling for extract's writer."""
    block = torch.zeros(megabytes * 2**20, dtype=torch.uint8).numpy()
    with tempfile.NamedTemporaryFile(dir=shard_dir) as handle:
        start = time.perf_counter()
        handle.write(memoryview(block))
        handle.flush()
        os.fsync(handle.fileno())
        return megabytes * 2**20 / (time.perf_counter() - start) / 1e9


def bench_target(name: str, model: torch.nn.Module, device: torch.device, args) -> list[dict]:
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, vocab, (args.batch_size, args.seq_len), generator=generator).to(device) for _ in range(args.steps)]
    tokens = args.steps * args.batch_size * args.seq_len
    time_bare(model, ids[:1], device)  # warm-up (kernels, allocator)
    time_extract(model, ids[:1], "bf16", args.shard_dir, args)
    rows = []
    for dtype in args.dtypes:
        bare, extract = [], []
        for _ in range(args.repeats):
            bare.append(tokens / time_bare(model, ids, device))
            extract.append(time_extract(model, ids, dtype, args.shard_dir, args))
        bare_tps = statistics.median(bare)
        extract_tps = statistics.median(tokens / e["seconds"] for e in extract)
        bytes_per_token = extract[0]["bytes"] / extract[0]["tokens"]
        rows.append({
            "target": name, "storage_dtype": dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "tokens_per_repeat": tokens, "bare_tokens_per_s": round(bare_tps, 1), "extract_tokens_per_s": round(extract_tps, 1),
            "ratio": round(extract_tps / bare_tps, 4),
            "extract_write_GB_per_s": round(statistics.median(e["bytes"] / e["seconds"] for e in extract) / 1e9, 3),
            "bare_hidden_state_GB_per_s": round(bare_tps * bytes_per_token / 1e9, 3),
            "ratio_before_final_flush": round(statistics.median(tokens / e["loop_seconds"] for e in extract) / bare_tps, 4),
            # once per run, not per batch: the last shard is written after the last forward
            "final_flush_s": round(statistics.median(e["seconds"] - e["loop_seconds"] for e in extract), 3),
            "bare_all": [round(x, 1) for x in bare],
            "extract_all": [round(tokens / e["seconds"], 1) for e in extract],
            "writer_wait_s": [round(e["writer_wait_s"], 3) for e in extract], "shards_per_repeat": extract[0]["shards"],
            "shard_tokens": extract[0]["shard_tokens"], "host_buffer_GB": round(extract[0]["host_buffer_bytes"] / 1e9, 3),
            "bytes_per_token": round(bytes_per_token, 1),
            "storage_10k_x_2k_tokens_GB": round(bytes_per_token * 10_000 * 2_048 / 1e9, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def storage_error(device: torch.device, limit: int, shard_dir: str | None) -> dict | None:
    """Extract the tiny target's prompts in fp32, bf16 and float8; report how far the stored states and
    the target's soft labels (softmax of lm_head(final)) move from fp32."""
    from eaglekit.config import load_config
    from eaglekit.stages import extract
    from eaglekit.targets.loading import load_target, tiny_target_path
    from eaglekit.targets.store import HiddenStateDataset

    prompts = tiny_target_path().parent / "tiny_prompts.jsonl"
    if not (tiny_target_path() / "config.json").is_file() or not prompts.is_file():
        return None
    root = Path(tempfile.mkdtemp(prefix="extract-quant-", dir=shard_dir))
    try:
        stores = {}
        for dtype in ("fp32", "bf16", "float8_e4m3fn"):
            options = {"data": [str(prompts)], "output": str(root / dtype), "target": "tiny", "dtype": dtype,
                       "model_dtype": "fp32", "device": str(device), "limit": limit, "max_length": 1024}
            stores[dtype] = HiddenStateDataset(extract.run(load_config(extract.Config, overrides=options)).output)
        head = load_target("tiny", device=device).get_output_embeddings()
        reference = {stores["fp32"][i]["id"]: stores["fp32"][i] for i in range(len(stores["fp32"]))}
        out = {"records": len(reference), "tokens": stores["fp32"].manifest["num_tokens"]}
        for dtype in ("bf16", "float8_e4m3fn"):
            out[dtype] = _errors(stores[dtype], reference, head, device)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _errors(store, reference: dict, head: torch.nn.Module, device: torch.device) -> dict:
    layer_err, final_err, kl, agree, count = [0.0, 0.0, 0.0], 0.0, 0.0, 0, 0
    hidden = store.manifest["hidden_size"]
    with torch.inference_mode():
        for i in range(len(store)):
            got, ref = store[i], reference[store[i]["id"]]
            for g in range(3):
                part = slice(g * hidden, (g + 1) * hidden)
                layer_err[g] += ((got["aux"][:, part].float() - ref["aux"][:, part]).norm() / ref["aux"][:, part].norm()).item()
            final_err += ((got["final"].float() - ref["final"]).norm() / ref["final"].norm()).item()
            p_ref = torch.log_softmax(head(ref["final"].to(device)).float(), -1)  # (T, V)
            p_got = torch.log_softmax(head(got["final"].float().to(device)).float(), -1)
            kl += torch.nn.functional.kl_div(p_got, p_ref, log_target=True, reduction="sum").item()
            agree += (p_ref.argmax(-1) == p_got.argmax(-1)).sum().item()
            count += len(p_ref)
    n = len(store)
    return {"bytes": store.manifest["bytes"], "aux_relative_error_per_layer": [round(e / n, 5) for e in layer_err],
            "final_relative_error": round(final_err / n, 5), "soft_label_kl_per_token": float(f"{kl / count:.3g}"),
            "target_argmax_agreement": round(agree / count, 5)}


def markdown(rows: list[dict]) -> str:
    lines = ["| target | storage | B x T | bare tok/s | extract tok/s | ratio | bytes/token | 10k x 2k tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['storage_dtype']} | {r['batch_size']} x {r['seq_len']} | {r['bare_tokens_per_s']:,.0f} | "
                     f"{r['extract_tokens_per_s']:,.0f} | {r['ratio']:.1%} | {r['bytes_per_token']:,.0f} | {r['storage_10k_x_2k_tokens_GB']} GB |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from eaglekit.stages.extract import Config
    from eaglekit.targets.shard_writer import writer_parallelism

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--target", default="", help="measure this local model directory instead of a random --shape model")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16, help="batches per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="bf16,float8_e4m3fn", help="storage dtypes to measure")
    parser.add_argument("--shard-mb", type=float, default=Config.shard_mb, help="default: extract's shard_mb")
    parser.add_argument("--buffers", type=int, default=Config.buffers, help="0 = auto, as extract's buffers")
    parser.add_argument("--writer-threads", type=int, default=Config.writer_threads, help="0 = auto, as extract's writer_threads")
    parser.add_argument("--no-fsync", action="store_true", help="measure without fsync per shard (extract fsync=false)")
    parser.add_argument("--shard-dir", default=None, help="where shards are written (default: the system temp dir)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the built-in tiny target")
    parser.add_argument("--no-quant", action="store_true", help="skip the bf16/float8 storage-error measurement")
    parser.add_argument("--out", default=None, help="JSON path (default runs/benchmarks/extract_speed.json; "
                        "--smoke: extract_speed_smoke.json in the temporary directory)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.batch_size, args.seq_len, args.steps, args.repeats, args.shard_mb = "smoke", 2, 64, 3, 2, 0.05
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.writer_threads, args.buffers = writer_parallelism(args.writer_threads, args.buffers)  # recorded resolved
    return args


def main(argv: list[str] | None = None) -> dict:
    from eaglekit.manifest import environment
    from eaglekit.targets.shard_writer import cores_per_process

    args = parse_args(argv)
    if args.shard_dir:
        Path(args.shard_dir).mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        sys.exit("no CUDA GPU: run with --smoke for the CPU check")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    if args.target:  # a trained model directory (the reference benchmark's target) instead of the random shape
        from eaglekit.targets.loading import load_target

        rows = bench_target(args.target, load_target(args.target, device=device, dtype=dtype), device, args)
    else:
        rows = bench_target(f"llama-{args.shape}-shape (random)", build_llama(args.shape, device, dtype), device, args)
    tiny = None if args.no_tiny else load_tiny(device, dtype)
    if tiny is not None:
        max_positions = tiny.config.get_text_config().max_position_embeddings
        tiny_args = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size * 8 if not args.smoke else 2,
                                          "seq_len": min(args.seq_len, max_positions)})
        rows += bench_target("tiny (built-in)", tiny, device, tiny_args)
    quant = None if args.no_quant else storage_error(device, 16 if args.smoke else 200, args.shard_dir)
    disk = disk_write_speed(args.shard_dir, 64 if args.smoke else 2048)
    result = {"benchmark": "extract_speed", "disk_write_GB_per_s": round(disk, 3), "storage_error_vs_fp32": quant, "goal": f"extract >= {GOAL:.0%} of bare forward tokens/s",
              "config": {k: v for k, v in vars(args).items()}, "cpu_cores_per_process": cores_per_process(),
              "device": str(device), "environment": environment(),
              "tiny_target": "measured" if tiny is not None else "not measured (--no-tiny)" if args.no_tiny
              else "absent from this checkout (src/eaglekit/assets/tiny_target)",
              "results": rows, "goal_met": all(r["ratio"] >= GOAL for r in rows) if device.type == "cuda" else None}
    out = Path(args.out or (Path(tempfile.gettempdir()) / "extract_speed_smoke.json" if args.smoke
                            else "runs/benchmarks/extract_speed.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    print(f"disk write + fsync: {disk:.2f} GB/s into {args.shard_dir or tempfile.gettempdir()}")
    if quant:
        print("storage error vs fp32 (tiny target):", json.dumps(quant))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
