"""Block drafters' steps for benchmarks/step_cost.py (`--dflash`, `--dspark`): a random-weight DFlash or DSpark
drafter of the target's width drafting k tokens a step in one block forward over static context buffers (the fused
step: one CUDA graph a step with compile), and the step's drafting part alone, compiled like the step.

- DFlash (`--dflash K,...`): DFlash's fill-in layout, a block of k + 1 queries (the bonus token, then k mask slots);
  `draft_ms` is the block forward with the draft head (`block_logits`).
- DSpark (`--dspark K,...`): DFlash's backbone with DSpark's heads, as a trained DSpark drafter decodes: every block
  slot drafts (`sample_from_anchor`, a block of k queries), a vanilla Markov head of rank `--dspark-rank` (256 by
  default, DeepSpec's: a (V x r) lookup and an (r x Vd) product per draft, left to right) and the confidence head
  reading it, calibrated (one temperature per position), so each step also computes the drafts' survival;
  `--dspark-topk K,...`: also with the Markov bias on each position's K best base logits alone (`draft_topk`;
  0 = every draft id), each a step of its own (dspark7 dense, dspark7_top64), timed in the same run.
  `draft_ms` is the block forward followed by the Markov loop (what the step drafts with, `decode.markov_chain` at
  T = 0), `block_ms` the block forward with the draft head alone (DFlash's `draft_ms`): their difference is what
  DSpark's heads cost.

The floor: the drafter's weights a step reads (all of them but the lookup tables, the embedding and the Markov
head's W1) at the copy bandwidth measured in the run (`draft_floor_ms`); with the rest of the measured step (its
verification and bookkeeping, `step_ms - draft_ms`) it gives the cheapest step these shapes allow
(`floor_ratio_to_plain`): a goal under it cannot be met by faster drafting kernels, only by a smaller drafter.
A _topK step reads K rows of the Markov head's W2 a draft, and its floor still counts W2 whole (16 MB at rank 256
and 32,000 draft ids): a floor a few microseconds high.
"""

from __future__ import annotations

from typing import Callable

import torch

from eaglekit.config.decode import DecodeOptions
from eaglekit.decode import Decoder, graphs
from eaglekit.registry import speculative_method

BLOCK_KINDS = ("dflash", "dspark")  # step_cost's options, and the bench methods whose rows it projects
LABELS = {"dflash": "DFlash", "dspark": "DSpark"}
MARKOV_RANK = 256  # DeepSpec's published drafters


def random_block_drafter(kind: str, model, device: torch.device, dtype: torch.dtype, layers: int, max_drafts: int,
                         markov_rank: int = MARKOV_RANK):
    """A random-weight drafter of `kind` of the target's width: `layers` layers, context from as many target layers,
    a block that drafts `max_drafts` tokens."""
    from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_target_layer_ids

    c = model.config
    fields = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                  num_hidden_layers=layers, vocab_size=c.vocab_size, draft_vocab_size=min(32000, c.vocab_size),
                  target_hidden_size=c.hidden_size, mask_token_id=0,
                  target_layer_ids=default_target_layer_ids(c.num_hidden_layers, layers),
                  head_dim=getattr(c, "head_dim", None), rope_parameters=dict(c.rope_parameters))
    if kind == "dspark":
        from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter

        config = DSparkConfig(**fields, block_size=max_drafts, markov_rank=markov_rank,
                              confidence_temperatures=(1.0,) * max_drafts)  # calibrated, as after training
        drafter = DSparkDrafter(config)
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.02)  # a trained head: not all zeros
    else:
        drafter = DFlashDrafter(DFlashConfig(**fields, block_size=max_drafts + 1))
    drafter = drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)
    drafter.set_vocab_mapping(torch.arange(drafter.config.draft_vocab_size))
    return drafter


LOOKUPS = ("embed_tokens.weight", "markov_w1.weight")  # read a row per token, not whole


def step_name(kind: str, k: int, topk: int = 0) -> str:
    """A block drafter's step at chain length k: dspark7, and dspark7_top64 with the Markov bias on 64 candidates."""
    return f"{kind}{k}" + (f"_top{topk}" if topk else "")


def weights_read(drafter: torch.nn.Module) -> int:
    """Bytes of the drafter's weights one drafting step reads whole (module docstring: the floor)."""
    return sum(p.numel() * p.element_size() for n, p in drafter.named_parameters() if not n.endswith(LOOKUPS))


def block_figures(kind: str, model, prompt: list[int], new_tokens: int, compile_: bool, repeats: int, base: float,
                  layers: int, lengths: tuple[int, ...], step_ms: Callable[..., float], call_ms: Callable[..., float],
                  markov_rank: int = MARKOV_RANK, bandwidth: float | None = None,
                  draft_topks: tuple[int, ...] = (0,)) -> dict:
    """Fused steps of a random `kind` drafter at each chain length k (`step_ms(decoder, prompt, new_tokens, options,
    repeats)`, step_cost.py's timer) and the drafting part alone (`call_ms(fn, device, repeats, calls)`), module
    docstring; `base`: the plain step's milliseconds; `bandwidth`: the copy bandwidth (bytes/s) the floor is read at;
    `draft_topks`: DSpark's Markov candidates per draft, a step for each (0 = every draft id)."""
    from eaglekit.drafters.dspark.decode import markov_chain

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    drafter = random_block_drafter(kind, model, device, dtype, layers, max(lengths), markov_rank)
    vocab = model.get_output_embeddings().weight.shape[0]
    capacity = len(prompt) + new_tokens + 80
    decoder = Decoder(model, drafter, backend="static", compile=compile_, max_length=capacity)
    width = len(drafter.config.target_layer_ids) * model.config.hidden_size
    context = torch.randn(len(prompt) + new_tokens // 2, width, device=device, dtype=dtype)
    length = torch.tensor(context.shape[0], device=device)
    root = torch.ones((), dtype=torch.long, device=device)
    steps, draft, block = {}, {}, {}
    for k in lengths:
        backend = speculative_method(kind).static_backend(drafter, capacity, k, compile_)
        with torch.inference_mode():
            backend.extend(context, torch.zeros(context.shape[0], dtype=torch.long, device=device),
                           torch.arange(context.shape[0], device=device))

        def timed(fn) -> float:
            compiled = graphs.compiled(fn, compile_)

            def once():
                with torch.inference_mode():
                    compiled()
            return call_ms(once, device, repeats, 10)

        forward = (lambda k=k, backend=backend: backend.block_logits(root, length, k))
        for topk in draft_topks if kind == "dspark" else (0,):
            name = step_name(kind, k, topk)
            options = {"method": kind, "chain_length": k, **({"draft_topk": topk} if topk else {})}
            ms = step_ms(decoder, prompt, new_tokens, options, repeats)
            steps[name] = {"options": options, "step_ms": ms, "ratio_to_plain": ms / base}
            if kind == "dspark":
                chain = DecodeOptions(**options)
                draft[name] = timed(lambda k=k, backend=backend, chain=chain: markov_chain(
                    drafter, backend.block_hidden(root, length, k), root, chain, vocab, None))
            else:
                draft[name] = timed(forward)
        if kind == "dspark":
            block[f"{kind}{k}"] = timed(forward)
    floor = {}
    if bandwidth:
        read = weights_read(drafter)
        floor = {"weights_read_bytes": read, "draft_floor_ms": read / bandwidth * 1e3}
        for name, step in steps.items():
            step["floor_ratio_to_plain"] = (step["step_ms"] - draft[name] + floor["draft_floor_ms"]) / base
    shape = {"layers": layers, "target_layer_ids": list(drafter.config.target_layer_ids),
             "block_size": drafter.config.block_size}
    if kind == "dspark":
        shape.update(markov_rank=drafter.config.markov_rank, markov_head_type=drafter.config.markov_head_type,
                     confidence_head=drafter.config.confidence_head,
                     sample_from_anchor=drafter.config.sample_from_anchor, draft_topks=list(draft_topks))
    found = {"drafter": shape, "path": f"fused step over the static target and static {LABELS[kind]} context buffers",
             "steps": steps, "draft_ms": draft, "context_tokens": context.shape[0], **floor}
    return {**found, "block_ms": block} if block else found


def markdown(kind: str, figures: dict) -> list[str]:
    """The lines of step_cost's markdown for one block drafter's figures (or the error that stopped them)."""
    if "error" in figures:
        return ["", f"{LABELS[kind]} drafter: FAILED ({figures['error']})"]
    shape = figures["drafter"]
    topks = [k for k in shape.get("draft_topks", ()) if k]
    heads = (f", Markov head rank {shape['markov_rank']} ({shape['markov_head_type']}"
             + (f"; a _topK step biases K candidates alone: K = {', '.join(map(str, topks))}" if topks else "")
             + ") and confidence head" if kind == "dspark" else "")
    def listed(figures_ms: dict) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in figures_ms.items())

    line = (f"{LABELS[kind]} drafter, {shape['layers']} layers{heads} ({figures['path']}): "
            + ", ".join(f"{n} {v['step_ms']:.3f} ms = {v['ratio_to_plain']:.3f}x plain"
                        for n, v in figures["steps"].items()))
    if kind == "dspark":
        line += (f"; drafting alone, block forward + Markov loop (ms): {listed(figures['draft_ms'])}"
                 f"; the block forward alone (ms): {listed(figures['block_ms'])}")
    else:
        line += f"; the block forward alone (ms): {listed(figures['draft_ms'])}"
    if "draft_floor_ms" in figures:
        line += (f"; floor: {figures['weights_read_bytes'] / 1e9:.2f} GB of drafter weights a step, "
                 f"{figures['draft_floor_ms']:.3f} ms at the copy bandwidth, so a step no cheaper than "
                 + ", ".join(f"{n} {v['floor_ratio_to_plain']:.3f}x" for n, v in figures["steps"].items())
                 + " plain with this verification")
    return ["", line]
