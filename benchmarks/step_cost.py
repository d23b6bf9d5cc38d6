"""What one decoding step costs at a target's shape: plain steps against the memory-bandwidth bound, and each
speculative step relative to a plain one, split into its parts. Random weights (labelled so in the JSON):
a step's cost does not depend on the weights' values, only on the shapes.

    python benchmarks/step_cost.py --output X.json                                   # GPU, 8B-shaped Llama, bf16
    python benchmarks/step_cost.py --output X.json --reference-bench runs/reference/run/bench/bench.json
    python benchmarks/step_cost.py --shape reference --output X.json --profile       # the reference target's shape
    python benchmarks/step_cost.py --smoke --output /tmp/step_cost.json              # CPU, tiny shapes
    python benchmarks/step_cost.py --shapes= --parts= --dflash 4,7 --dspark 4,7 --output X.json  # block drafters

- `plain`: decode-phase milliseconds per token of eaglekit's plain fast path (static KV cache, compiled,
  CUDA graphs; the prefill excluded), with the target's fused q/k/v and gate/up GEMMs and with the separate
  projections; tokens/s as a fraction of the bound (model bytes / copy bandwidth measured in this run).
- `steps`: per speculative shape (chain k = 3, 4, 7; tree depth 6, top-k 8, 48 and 60 nodes; P-EAGLE parallel
  chains k = 4, 7: one drafter forward a step, the extend's, which also drafts the next chain's mask slots) the
  fused step's milliseconds (`decode/fused.py`: one CUDA graph a step) and its ratio to a plain step. The drafter is a random P-EAGLE one (an EAGLE-3 drafter with
  `mask_hidden`): chains and trees draft with it as with any EAGLE-3 drafter.
- `parts`: for the shapes named by `--parts`, each part of a step compiled and timed on its own at the
  same shapes: draft (the drafter's levels), verify forward (the target over the step's nodes),
  verification (greedy path), KV compaction (the accepted path's entries kept), drafter extend;
  `unattributed` = the fused step minus their sum (what running them as one graph saves, when negative).
- `profile` (with `--profile`): the kernels of plain and of each default speculative step as they run (CUDA
  graph replays under torch.profiler), GPU time per step by kind (GEMM, attention, top-k/sort, copies, other
  inductor kernels), with the GEMMs' achieved bandwidth and the GPU's idle time within a step.
- `mla` (with `--mla`): steps with an MLA drafter (DeepSeek-V3's latent ranks and head dims at this width),
  which decode through the eager drafter loop (no static MLA step), and one draft level of each drafter.
- `dflash` (with `--dflash 4,7,15`): steps with a random DFlash drafter (`--dflash-layers`, 5 by default) drafting
  k tokens a step in one block forward (the fused step: static context buffers, one CUDA graph a step), and that
  block forward alone (compiled, over the static buffers); with `--reference-bench`, its `dflash` rows are projected
  onto the step of their chain length.
- `dspark` (with `--dspark 4,7`): the same with a random DSpark drafter (`--dspark-layers`, 5 by default): DFlash's
  backbone with every block slot drafting, a vanilla Markov head of rank `--dspark-rank` (256) and the calibrated
  confidence head, all inside the fused step; `draft_ms` is the block forward plus the Markov loop, `block_ms` the
  block forward alone (their difference: what DSpark's heads cost); its `dspark` rows are projected likewise
  (benchmarks/step_cost_block.py). The goal: a DSpark step <= 1.15x a plain step (`dspark_step<=1.15x_plain`).
- `projection` (with `--reference-bench`): the speed-up at this shape that a drafter with the reference
  target's measured tau would give, tau x plain step / speculative step, beside the reference target's
  own measured speed-up. A projection, not a measurement: it assumes the same acceptance at this shape.
Timings exclude warm-up and compilation and are medians of repeats. The prefills are not timed, so they run
traced but not compiled here: an 8B-shaped prefill compiled for a symbolic length costs minutes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import SHAPE_8B, SHAPE_REFERENCE, SHAPE_SMOKE, build_model, copy_bandwidth, random_drafter  # noqa: E402
from eaglekit.decode import Decoder, graphs  # noqa: E402
from eaglekit.decode.engine import DecodeOptions, decode_loop, draft_size  # noqa: E402
from eaglekit.registry import speculative_method  # noqa: E402
from eaglekit.config.decode import CHAIN_METHODS  # noqa: E402
from eaglekit.decode.fused import tree_mask  # noqa: E402
from eaglekit.drafters.p_eagle.decode import parallel_logits  # noqa: E402
from eaglekit.decode.static import StaticTarget  # noqa: E402
from eaglekit.drafters.eagle3.static import StaticDrafter  # noqa: E402
from eaglekit.decode.tree import chain_from_logits  # noqa: E402
from eaglekit.decode.verify import greedy_path  # noqa: E402
from eaglekit.manifest import atomic_write_json, environment  # noqa: E402
from step_cost_block import BLOCK_KINDS, MARKOV_RANK, block_figures  # noqa: E402
from step_cost_block import markdown as block_markdown  # noqa: E402

SHAPES = {
    "chain3": dict(method="chain", chain_length=3),
    "chain4": dict(method="chain", chain_length=4),
    "chain7": dict(method="chain", chain_length=7),
    "tree48": dict(method="tree", depth=6, tree_top_k=8, total_tokens=48),
    "tree60": dict(method="tree", depth=6, tree_top_k=8, total_tokens=60),
    "parallel4": dict(method="parallel", chain_length=4),  # P-EAGLE: the chain drafted in one drafter forward
    "parallel7": dict(method="parallel", chain_length=7),
}
# the step / plain goals: chains (one drafter forward a token, or the whole chain in one) and trees
GOALS = {"chain": 1.15, "tree": 1.35, "parallel": 1.15, **{kind: 1.15 for kind in BLOCK_KINDS}}
# the shapes `eaglekit bench` measures by default (parallel: at bench's default chain_length)
DEFAULT_SHAPE = {"chain": "chain4", "tree": "tree48", "parallel": "parallel4"}
MODEL_SHAPES = {"8b": SHAPE_8B, "reference": SHAPE_REFERENCE}
# DeepSeek-V3's MLA ranks and per-head dims (its drafter's too), with the heads of the target the drafter serves
MLA_FIELDS = dict(drafter_arch="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128)
# kernel kinds of `--profile`, first match wins (lower-case substrings of the kernel names)
KERNEL_KINDS = (("attention", ("sdpa", "fmha", "flash", "attention")),
                ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk")),
                ("topk_sort", ("topk", "sort")),
                ("copy_memset", ("memcpy", "memset", "copy_kernel", "index_copy", "index_select")),
                ("inductor_other", ("triton",)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_ms(fn, device: torch.device, repeats: int, calls: int) -> float:
    """Median over `repeats` of the milliseconds per call of `calls` back-to-back calls (after 3 warm-up calls).
    Each call starts a new CUDA-graph step, so replays of one graph may follow each other."""
    def once():
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        fn()
    for _ in range(3):
        once()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            once()
        _sync(device)
        times.append((time.perf_counter() - start) / calls * 1000)
    return statistics.median(times)


def plain_runner(model, prompt: list[int], new_tokens: int, compile_: bool, fuse: bool):
    """A function decoding plainly on a static target built with or without fused projections -> its stats."""
    target = StaticTarget(model, len(prompt) + new_tokens + 8, None, compile=compile_, fuse_projections=fuse)
    options = DecodeOptions(method="plain")
    vocab = model.get_output_embeddings().weight.shape[0]

    def run():
        target.reset()
        return decode_loop(target, None, None, prompt, new_tokens, options, vocab).stats
    return run


def plain_ms(run) -> float:
    """Decode-phase ms per token of one plain `run()` (its stats)."""
    stats = run()
    return 1000 * stats.decode_seconds / max(stats.target_forwards - 1, 1)


def step_ms(decoder: Decoder, prompt: list[int], new_tokens: int, options: dict, repeats: int) -> float:
    """Decode-phase ms per fused speculative step (a random drafter: one token a step, the same shapes)."""
    def run() -> float:
        stats = decoder.generate(prompt, new_tokens, **options).stats
        return 1000 * stats.decode_seconds / max(len(stats.accepted), 1)
    run()
    return statistics.median(run() for _ in range(repeats))


def step_parts(model, drafter, prompt: list[int], shape: dict, compile_: bool, repeats: int, calls: int) -> dict:
    """Each part of one speculative step as its own compiled graph at the fused step's shapes (module docstring)."""
    options = DecodeOptions(**shape)
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    nodes = draft_size(options)
    path_length = min(options.draft_depth, nodes - 1) + 1
    capacity = len(prompt) + 4 * nodes
    aux_layers = tuple(drafter.config.aux_layer_ids)
    target = StaticTarget(model, capacity, aux_layers, compile=compile_)
    slots = options.chain_length if options.method in CHAIN_METHODS else options.depth * options.tree_top_k
    grow = speculative_method(options.method).grow  # EAGLE-3 levels, or P-EAGLE's one forward
    backend = StaticDrafter(drafter, capacity, slots, compile=compile_)
    n = len(prompt)
    ids = torch.tensor(prompt, device=device)
    logits, aux = target.forward(ids, torch.arange(n, device=device), torch.ones(n, n, dtype=torch.bool, device=device).tril(),
                                 last_only=True)
    token = logits[-1].argmax()
    hidden, draft_logits = backend.extend(aux, torch.cat([ids[1:], token.reshape(1)]), torch.arange(n, device=device))
    m = torch.tensor(n, device=device)
    root = (hidden[-1].clone(), draft_logits[-1].clone(), token.clone())
    ahead = nodes - 2 if options.method == "parallel" else 0  # P-EAGLE: mask slots drafted with the extend (fused.py)
    chain = parallel_logits(graphs.GraphSteps(backend, m), drafter, root[1], m, ahead + 1) if ahead else None

    def draft_part():
        if ahead:  # the fused step's draft: the chain from the logits the last extend left
            tree, ancestors = chain_from_logits(drafter, chain, root[2], options, vocab, None)
        else:
            tree, ancestors = grow(graphs.GraphSteps(backend, m), drafter, *root, m, options, vocab, None)
        return tree.tokens, tree.parents, tree.depths, ancestors
    tokens, parents, depths, ancestors = (x.clone() for x in draft_part())
    offsets = torch.arange(nodes, device=device)

    def verify_forward():
        return target.net(tokens, m + depths, m + offsets, tree_mask(target._columns, m, ancestors)[None, None])
    verify_logits, verify_aux = (x.clone() for x in verify_forward())

    def verification():
        return greedy_path(tokens, parents, ancestors, verify_logits.argmax(-1))
    path = torch.arange(path_length, device=device)  # the longest path: what the fused step compacts and extends
    rows = torch.arange(path_length, device=device)

    def compaction():
        target.net.compact(m, path)
        return path

    def extend():
        if ahead:
            return backend.extend_and_draft(verify_aux[path], tokens[path], m + rows, m, m + path_length, ahead)
        return backend._extend(verify_aux[path], tokens[path], m + rows, m)
    parts = {"draft": draft_part, "verify_forward": verify_forward, "verification": verification,
             "kv_compaction": compaction, "drafter_extend": extend}
    return {name: call_ms(graphs.compiled(fn, compile_), device, repeats, calls) for name, fn in parts.items()}


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lower for k in keys)), "other")


def kernel_profile(run, steps_of, device: torch.device, top: int = 12) -> dict:
    """GPU time per step by kernel kind, of one `run()` as it really runs (CUDA graph replays included; the
    prefill's kernels count too, a few percent of 128 steps), and the step's wall time the kernels leave idle."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = run()
        _sync(device)
        wall = time.perf_counter() - start
    steps = max(steps_of(result), 1)
    kinds: dict[str, float] = {}
    names: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kinds[kernel_kind(event.name)] = kinds.get(kernel_kind(event.name), 0.0) + event.device_time / 1000
            names.setdefault(event.name[:100], []).append(event.device_time)
    busy = sum(kinds.values())  # 0 where the profiler does not see the kernels a CUDA graph replays
    top_kernels = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"steps": steps, "wall_ms_per_step": 1000 * wall / steps, "gpu_busy_ms_per_step": busy / steps,
            "kernels_per_step": sum(len(v) for v in names.values()) / steps,
            "ms_per_step_by_kind": {k: v / steps for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n, "per_step": len(t) / steps, "us_per_step": sum(t) / steps} for n, t in top_kernels]}


def mla_figures(model, prompt: list[int], new_tokens: int, compile_: bool, repeats: int, base: float) -> dict:
    """Steps of an MLA drafter (eager drafter loop over the static target) and one draft level of the MLA
    drafter against the Llama-style one (eager; 1 node as a chain drafts, 8 as a tree level does)."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    mla = random_drafter(model, device, dtype, **MLA_FIELDS)
    decoder = Decoder(model, mla, backend="static", compile=compile_, max_length=len(prompt) + new_tokens + 80)
    steps = {}
    for name in (DEFAULT_SHAPE["chain"], DEFAULT_SHAPE["tree"]):  # vLLM's MLA drafter takes no parallel drafting
        ms = step_ms(decoder, prompt, new_tokens, SHAPES[name], repeats)
        steps[name] = {"options": SHAPES[name], "step_ms": ms, "ratio_to_plain": ms / base}
    level = {}
    for arch, drafter in (("mla", mla), ("llama", random_drafter(model, device, dtype))):
        hidden_size = drafter.config.hidden_size
        for width in (1, 8):
            hidden = torch.randn(1, width, hidden_size, device=device, dtype=dtype)
            ids = torch.randint(0, drafter.config.vocab_size, (1, width), device=device)
            positions = torch.arange(len(prompt), len(prompt) + width, device=device)[None]

            def once():
                with torch.inference_mode():
                    drafter(hidden, ids, positions)
            level[f"{arch}_{width}"] = call_ms(once, device, repeats, 10)
    return {"drafter": {**MLA_FIELDS, "hidden_size": mla.config.hidden_size, "heads": mla.config.num_attention_heads},
            "path": "eager drafter loop (the static step covers Llama-style drafters only)", "steps": steps,
            "draft_level_ms_eager": level}


def projection(reference_benches: list[str], plain: float, steps: dict[str, float]) -> list[dict]:
    """tau x plain step / speculative step per (method, temperature) row of reference bench.json files (a run's and
    its variants', benched on the same prompts: the plain rows of any of them give the measured speed-ups)."""
    rows = [{**row, "bench": Path(path).parent.parent.name}  # which drafter's bench: run, variant-dspark, ...
            for path in reference_benches for row in json.loads(Path(path).read_text())["rows"]]
    plain_rows = {r["temperature"]: r for r in rows if r["method"] == "plain"}
    out = []
    for row in rows:
        exact = f"{row['method']}{len(row.get('acceptance_per_position') or [])}"  # chain4, parallel7, dspark8
        # a chain: the step of its length when timed (a DFlash or DSpark chain: only that); else the method's default
        shape = exact if row["method"] in CHAIN_METHODS and exact in steps else DEFAULT_SHAPE.get(row["method"])
        if shape not in steps or row.get("tau") is None:
            continue
        spec = steps[shape]
        measured = plain_rows.get(row["temperature"])
        cut = {"verify_threshold": row["verify_threshold"]} if "verify_threshold" in row else {}
        out.append({"method": row["method"], "bench": row["bench"], "temperature": row["temperature"],
                    "tau": row["tau"], **cut,
                    "shape": shape, "step_ratio": spec / plain,
                    "projected_speedup": row["tau"] * plain / spec,
                    "reference_measured_speedup": row["tokens_per_second"] / measured["tokens_per_second"] if measured else None})
    return out


def counts(text: str) -> tuple[int, ...]:
    """An option's "K,K,..." -> (K, ...) (argparse's type: one usage error for anything but counts >= 0)."""
    try:
        values = tuple(int(k) for k in text.split(","))
    except ValueError:
        values = (-1,)
    if any(k < 0 for k in values):
        raise argparse.ArgumentTypeError(f"'{text}': comma-separated whole numbers >= 0, e.g. 4,7")
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no compile (proves the script runs)")
    parser.add_argument("--output", required=True, help="the JSON written (a .md table beside it)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20, help="parts: back-to-back calls per timed repeat")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="speculative shapes to time (of: " + ", ".join(SHAPES) + ")")
    parser.add_argument("--parts", default="chain4,tree48,parallel4", help="shapes whose step is also split into parts ('' = none)")
    parser.add_argument("--reference-bench", action="append", default=[],
                        help="a reference target's bench.json: project its tau to this shape (repeatable: a run's "
                             "bench and its variants')")
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="8b", help="the target's shape (random weights)")
    parser.add_argument("--profile", action="store_true", help="kernel time by kind of plain and the default steps")
    parser.add_argument("--no-separate", dest="separate", action="store_false",
                        help="leave out plain decoding with separate q/k/v and gate/up projections")
    parser.add_argument("--mla", action="store_true", help="also time steps with an MLA drafter (eager drafter loop)")
    parser.add_argument("--dflash", type=counts, default=(), metavar="K,K,...",
                        help="also time steps with a random DFlash drafter drafting K tokens a step (e.g. 4,7,15)")
    parser.add_argument("--dflash-layers", type=int, default=5, help="--dflash: the drafter's layers (published: 5)")
    parser.add_argument("--dspark", type=counts, default=(), metavar="K,K,...",
                        help="also time steps with a random DSpark drafter (DFlash's backbone, Markov and calibrated "
                             "confidence heads, every block slot drafting) drafting K tokens a step (e.g. 4,7)")
    parser.add_argument("--dspark-layers", type=int, default=5, help="--dspark: the drafter's layers (as --dflash's)")
    parser.add_argument("--dspark-rank", type=int, default=MARKOV_RANK, help="--dspark: the Markov head's rank")
    parser.add_argument("--dspark-topk", type=counts, default=(0,), metavar="K,K,...",
                        help="--dspark: also the Markov bias on each draft's K best base logits alone, a step for "
                             "each K (0 = every draft id; e.g. 0,64 times both in one run)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    compile_ = device.type == "cuda"
    new_tokens = 12 if args.smoke else args.new_tokens
    shape = SHAPE_SMOKE if args.smoke else MODEL_SHAPES[args.shape]
    graphs.PREFILL_OPTIONS = {**graphs.PREFILL_OPTIONS, "backend": "eager"}  # not timed: traced, not compiled
    graphs.PREFILL_OPTIONS.pop("mode", None)
    model = build_model(shape, device, dtype)
    drafter = random_drafter(model, device, dtype, drafter_type="p-eagle", mask_token_id=model.config.vocab_size - 1)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, 64 if args.smoke else 2048, args.repeats)
    bound = bandwidth / model_bytes
    prompt = list(range(1, 33))
    torch.manual_seed(0)

    result = {
        "benchmark": "step_cost", "weights": "random (step cost depends on shapes only)", "complete": False,
        "device": str(device), "dtype": str(dtype), "shape": shape, "smoke": args.smoke, "compile": compile_,
        "prompt_tokens": len(prompt), "new_tokens": new_tokens,
        "model_bytes": model_bytes, "copy_bandwidth_bytes_per_s": bandwidth, "bound_tokens_per_s": bound,
        "plain_step_ms": {}, "plain_tokens_per_s": {}, "plain_fraction_of_bound": {}, "steps": {}, "parts_ms": {},
        "environment": environment(),
    }

    def save() -> None:  # after every figure: a run cut off keeps what it measured ("complete": false)
        atomic_write_json(args.output, result)
        Path(args.output).with_suffix(".md").write_text(markdown(result))

    def plain(name: str, fuse: bool):
        run = plain_runner(model, prompt, new_tokens, compile_, fuse)
        plain_ms(run)  # compile, record the graphs
        ms = statistics.median(plain_ms(run) for _ in range(args.repeats))
        result["plain_step_ms"][name], result["plain_tokens_per_s"][name] = ms, 1000 / ms
        result["plain_fraction_of_bound"][name] = 1000 / ms / bound
        save()
        return run

    plain_run = plain("fused_projections", True)
    base = result["plain_step_ms"]["fused_projections"]
    decoder = Decoder(model, drafter, backend="static", compile=compile_, max_length=len(prompt) + new_tokens + 80)
    # what a run cut short must not lose comes first: the default shapes with their parts, their profile, then
    # the other shapes, the separate projections, the MLA drafter
    names = sorted((s for s in args.shapes.split(",") if s), key=lambda n: n not in DEFAULT_SHAPE.values())
    for name in names:
        ms = step_ms(decoder, prompt, new_tokens, SHAPES[name], args.repeats)
        result["steps"][name] = {"options": SHAPES[name], "step_ms": ms, "ratio_to_plain": ms / base}
        save()
        if name in args.parts.split(","):
            parts = step_parts(model, drafter, prompt, SHAPES[name], compile_, args.repeats, args.calls)
            result["parts_ms"][name] = {**parts, "unattributed": ms - sum(parts.values())}
            save()
        if args.profile and name == names[min(len(DEFAULT_SHAPE), len(names)) - 1]:
            result["profile"] = {"plain": kernel_profile(plain_run, lambda stats: stats.target_forwards - 1, device)}
            for step_name in (n for n in names if n in DEFAULT_SHAPE.values()):
                result["profile"][step_name] = kernel_profile(
                    lambda: decoder.generate(prompt, new_tokens, **SHAPES[step_name]).stats,
                    lambda stats: len(stats.accepted), device)
            gemm = result["profile"]["plain"]["ms_per_step_by_kind"].get("gemm")
            result["profile"]["plain_gemm_bandwidth_fraction"] = model_bytes / (gemm / 1000) / bandwidth if gemm else None
            save()
    if args.separate:
        plain("separate_projections", False)
    if args.mla:
        result["mla"] = mla_figures(model, prompt, new_tokens, compile_, args.repeats, base)
        save()
    for kind in BLOCK_KINDS:  # the block drafters, each at its chain lengths
        lengths = getattr(args, kind)
        if lengths:
            try:
                result[kind] = block_figures(kind, model, prompt, new_tokens, compile_, args.repeats, base,
                                             getattr(args, f"{kind}_layers"), lengths, step_ms, call_ms,
                                             args.dspark_rank, bandwidth, args.dspark_topk)
            except Exception as error:  # noqa: BLE001 - one drafter's failure must not cost the other figures
                traceback.print_exc()
                result[kind] = {"error": f"{type(error).__name__}: {error}"}
            save()
    steps = {name: step["step_ms"] for name, step in result["steps"].items()}
    for kind in (k for k in BLOCK_KINDS if "steps" in result.get(k, {})):
        steps.update({name: step["step_ms"] for name, step in result[kind]["steps"].items()})
    result["goals"] = {"plain>=0.75_of_bound": result["plain_fraction_of_bound"]["fused_projections"] >= 0.75}
    for prefix, limit in GOALS.items():  # a goal for each kind of step timed
        timed = [ms for name, ms in steps.items() if re.match(r"[a-z]+", name).group() == prefix]
        if timed:
            result["goals"][f"{prefix}_step<={limit:.2f}x_plain"] = all(ms / base <= limit for ms in timed)
    if args.reference_bench:
        result["projection"] = projection(args.reference_bench, base, steps)
    result["complete"] = True
    save()
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = [f"# Step cost, {result['shape']['num_hidden_layers']}-layer {result['shape']['hidden_size']}-wide Llama "
             f"({result['weights']}; {result['device']}, {result['dtype']})"
             + ("" if result["complete"] else " -- INCOMPLETE: the run stopped before every figure was measured"), "",
             f"Bound: {result['bound_tokens_per_s']:.1f} tokens/s (copy bandwidth "
             f"{result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, {result['model_bytes'] / 1e9:.2f} GB of weights).", "",
             "| plain | ms/token | tokens/s | of bound |", "|---|---|---|---|"]
    for name, ms in result["plain_step_ms"].items():
        lines.append(f"| {name} | {ms:.3f} | {1000 / ms:.1f} | {result['plain_fraction_of_bound'][name]:.1%} |")
    columns = list(next(iter(result["parts_ms"].values()), {}))
    lines += ["", "| step | ms | / plain | " + "".join(f"{c} ms | " for c in columns), "|---|---|---|" + "---|" * len(columns)]
    for name, step in result["steps"].items():
        parts = result["parts_ms"].get(name, {})
        lines.append(f"| {name} | {step['step_ms']:.3f} | {step['ratio_to_plain']:.3f}x | "
                     + "".join(f"{parts[c]:.3f} | " if c in parts else " | " for c in columns))
    if result.get("projection"):
        lines += ["", "| method | T | reference tau | step / plain | projected speed-up (this shape) | measured (reference target) |",
                  "|---|---|---|---|---|---|"]
        for row in result["projection"]:
            measured = row["reference_measured_speedup"]
            label = ", ".join([row["shape"], *([row["bench"]] if row.get("bench", "").startswith("variant") else []),
                               *([f"verify_threshold {row['verify_threshold']:g}"] if row.get("verify_threshold") else [])])
            lines.append(f"| {row['method']} ({label}) | {row['temperature']:g} | {row['tau']:.2f} | {row['step_ratio']:.3f} | "
                         f"{row['projected_speedup']:.2f}x | {'' if measured is None else f'{measured:.2f}x'} |")
    profile = {k: v for k, v in result.get("profile", {}).items() if isinstance(v, dict)}
    if profile:
        kinds = sorted({k for v in profile.values() for k in v["ms_per_step_by_kind"]})
        lines += ["", "| profiled | wall ms/step | GPU busy ms | kernels/step | " + "".join(f"{k} ms | " for k in kinds),
                  "|---|---|---|---|" + "---|" * len(kinds)]
        for name, v in profile.items():
            lines.append(f"| {name} | {v['wall_ms_per_step']:.3f} | {v['gpu_busy_ms_per_step']:.3f} | {v['kernels_per_step']:.0f} | "
                         + "".join(f"{v['ms_per_step_by_kind'].get(k, 0):.3f} | " for k in kinds))
        fraction = result["profile"].get("plain_gemm_bandwidth_fraction")
        if fraction:
            lines += ["", f"Plain step GEMMs read the weights at {fraction:.1%} of the copy bandwidth."]
    if result.get("mla"):
        mla = result["mla"]
        lines += ["", f"MLA drafter ({mla['path']}): "
                  + ", ".join(f"{n} {v['step_ms']:.3f} ms = {v['ratio_to_plain']:.3f}x plain" for n, v in mla["steps"].items())
                  + "; one draft level (eager, ms): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in mla["draft_level_ms_eager"].items())]
    for kind in (k for k in BLOCK_KINDS if result.get(k)):
        lines += block_markdown(kind, result[kind])  # the figures, or the error that stopped them
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
